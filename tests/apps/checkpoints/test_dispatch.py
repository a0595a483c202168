"""The jobs.dispatch task asks the registry what a trainer job resumes from, and run.json says
it; retention's rules as a pure function; the agents' idle polls cost no query."""

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.checkpoints.retention import Held, Policy, to_delete
from apps.jobs.models import Job, Run
from apps.jobs.runconfig import checkpoint_dir
from tests.apps.checkpoints.conftest import agent_of, commit_event, report, write_checkpoint
from tests.apps.checkpoints.test_registry import _placed_node, _requeue_and_place
from workers.tasks import jobs as job_tasks


def _run_json(run: Run) -> dict:
    (item,) = [f for f in run.plan["files"] if f["path"] == "run.json"]
    return json.loads(item["content"])


@pytest.mark.django_db
def test_the_first_attempt_starts_fresh_and_the_next_names_the_newest_verified(
    running_job, monkeypatch
):
    first = Run.objects.get(job=running_job)
    checkpoint = _run_json(first)["checkpoint"]
    assert checkpoint["resume_from"] is None and checkpoint["resume_newest"] is False
    assert checkpoint["keep"] == 0 and checkpoint["s3"] is None
    keeper = agent_of(first.node)
    path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), 10, job=running_job)
    report(keeper, first, commit_event(path, digest, 10))
    keeper.poll_once()

    _requeue_and_place(running_job)
    sent = []
    monkeypatch.setattr(job_tasks.dispatch, "apply_async", lambda **kwargs: sent.append(kwargs))
    assert job_tasks.dispatch([running_job.pk]) == {"dispatched": 0, "waiting": 1}
    assert sent == [{"args": [[running_job.pk]], "countdown": job_tasks.DISPATCH_RETRY_S}]
    agent_of(_placed_node(running_job)).poll_once()  # the new node lists the directory
    assert job_tasks.dispatch([running_job.pk]) == {"dispatched": 1, "waiting": 0}

    second = Run.objects.get(job=running_job, attempt=2)
    assert _run_json(second)["checkpoint"]["resume_from"] == str(path.resolve())
    job = Job.objects.get(pk=running_job.pk)
    assert job.state == "starting"
    assert job.events.last().reason.endswith(
        f"checkpoint offered: {path.resolve()}"
    )  # the timeline


@pytest.mark.django_db
def test_the_reconcile_sweep_dispatches_through_the_same_choice(running_job, monkeypatch):
    import datetime as dt

    from django.utils import timezone

    from apps.jobs.dispatch import jobs_stuck_redrive

    _requeue_and_place(running_job)
    Job.objects.filter(pk=running_job.pk).update(
        state_changed_at=timezone.now() - dt.timedelta(minutes=5)
    )
    asked = []
    counts = jobs_stuck_redrive(dispatch=lambda job_id: asked.append(job_id) or False)
    assert asked == [running_job.pk] and counts["dispatched"] == 0


@pytest.mark.django_db
def test_an_idle_agents_poll_is_answered_from_the_cache_until_it_has_work(
    running_job, monkeypatch, django_assert_num_queries, django_capture_on_commit_callbacks
):
    from apps.checkpoints.selectors import agent_checkpoint_work, agent_idle

    monkeypatch.setattr(agent_idle, "max_timeout_s", 30)
    node = Run.objects.get(job=running_job).node
    assert agent_checkpoint_work(node_id=node.pk)["verify"] == []
    with django_assert_num_queries(1 if _database_cache() else 0) as polled:
        assert agent_checkpoint_work(node_id=node.pk)["verify"] == []
    assert not any("checkpoints_" in q["sql"] for q in polled.captured_queries)
    run = Run.objects.get(job=running_job)
    path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), 10, job=running_job)
    with django_capture_on_commit_callbacks(execute=True):
        report(agent_of(node), run, commit_event(path, digest, 10))
    assert len(agent_checkpoint_work(node_id=node.pk)["verify"]) == 1


def _database_cache() -> bool:
    from django.conf import settings

    return settings.CACHES["default"]["BACKEND"].endswith("DatabaseCache")


# --- retention, pure ---------------------------------------------------------------------------


def _held(step, *, usable=True, secured=True, order=None, pinned=False, id_=None):
    return Held(
        id=id_ or step,
        step=step,
        order=order if order is not None else float(step),
        usable=usable,
        secured=secured,
        pinned=pinned,
    )


def test_retention_keeps_the_newest_the_kth_the_final_and_the_pinned():
    held = [_held(s) for s in range(10, 110, 10)]
    held[2] = _held(30, pinned=True)
    gone = to_delete(held, Policy(keep_last=2, keep_every=40, final_step=100))
    assert sorted(gone) == [10, 20, 50, 60, 70]


def test_nothing_goes_until_something_is_secured_and_nothing_after_it():
    unsecured = [_held(s, secured=False) for s in (10, 20, 30)]
    assert to_delete(unsecured, Policy(keep_last=1)) == {}
    mixed = [_held(10), _held(20), _held(30, secured=False), _held(40, secured=False)]
    assert sorted(to_delete(mixed, Policy(keep_last=1))) == [10]


def test_a_step_saved_again_supersedes_and_corrupt_ones_before_the_secured_go():
    held = [
        _held(10, usable=False, id_=1),
        _held(20, order=20.0, id_=2),
        _held(20, order=25.0, id_=3),
        _held(30, id_=4),
    ]
    gone = to_delete(held, Policy(keep_last=5))
    assert gone == {
        1: "corrupt, and a newer checkpoint is secured",
        2: "step 20 was saved again since",
    }


checkpoint_lists = st.lists(
    st.builds(
        _held,
        st.integers(0, 50),
        usable=st.booleans(),
        secured=st.booleans(),
        order=st.floats(0, 100),
        pinned=st.booleans(),
    ),
    max_size=25,
    unique_by=lambda h: h.step,
)


@given(
    checkpoint_lists,
    st.integers(1, 5),
    st.one_of(st.none(), st.integers(1, 20)),
    st.one_of(st.none(), st.integers(0, 50)),
)
def test_retention_never_deletes_what_a_resume_would_need(held, keep_last, keep_every, final):
    gone = to_delete(held, Policy(keep_last=keep_last, keep_every=keep_every, final_step=final))
    kept = [h for h in held if h.id not in gone]
    secured = [h for h in held if h.usable and h.secured]
    if not secured:
        assert gone == {}
        return
    newest_secured = max(secured, key=lambda h: (h.step, h.order))
    assert newest_secured in kept
    assert all(
        (h.step, h.order) < (newest_secured.step, newest_secured.order)
        for h in held
        if h.id in gone
    )
    assert not any(h.pinned for h in held if h.id in gone)
    usable = sorted((h for h in held if h.usable), key=lambda h: (h.step, h.order), reverse=True)
    assert all(h in kept for h in usable[:keep_last])
    if final is not None:
        assert all(h in kept for h in usable if h.step == final)
