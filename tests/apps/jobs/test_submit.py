"""Submitting jobs through the API: every validation rule, roles, idempotency, the queue."""

import copy

import pytest

from apps.jobs.models import Job, JobEvent, JobState
from tests import factories
from tests.apps.jobs.conftest import command_spec, trainer_spec

pytestmark = pytest.mark.django_db


def submit(client, spec, **headers):
    return client.post("/api/v1/jobs/", spec, format="json", **headers)


def test_a_valid_command_job_is_pending_with_an_event(fleet_pool, quota, team, researcher, api_for):
    response = submit(api_for(researcher, scopes=("submit",)), command_spec(team))
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert job.state == JobState.PENDING
    assert (job.nodes, job.gpus_per_node, job.dp_shard) == (1, 8, 8)
    assert job.submitted_by == researcher
    assert JobEvent.objects.get(job=job).to_state == JobState.PENDING


def test_a_trainer_job_with_fsdp_and_tp(fleet_pool, quota, team, researcher, api_for):
    spec = trainer_spec(team, layout={"dp_shard": 8, "tp": 2})
    response = submit(api_for(researcher), spec)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["nodes"], body["gpus_per_node"], body["tp"], body["dp_shard"]) == (2, 8, 2, 8)


def test_fewer_gpus_than_a_node_means_one_node(fleet_pool, quota, team, researcher, api_for):
    spec = command_spec(team, resources={"gpu_type": "H100", "gpus": 4})
    body = submit(api_for(researcher), spec).json()
    assert (body["nodes"], body["gpus_per_node"]) == (1, 4)


RULES = [
    # (change to a valid trainer spec, the field the 400 names, a phrase of the reason)
    (
        {"resources": {"gpu_type": "H100", "gpus": 12, "nodes": 2, "gpus_per_node": 8}},
        "resources.gpus",
        "nodes × gpus_per_node",
    ),
    (
        {
            "resources": {
                "gpu_type": "H100",
                "nodes": 2,
                "gpus_per_node": 8,
                "layout": {"dp_shard": 4, "tp": 2},
            }
        },
        "resources.layout",
        "not the job's 16 GPUs",
    ),
    (
        {
            "resources": {
                "gpu_type": "H100",
                "nodes": 2,
                "gpus_per_node": 4,
                "layout": {"dp_shard": 1, "tp": 8},
            }
        },
        "resources.layout.tp",
        "never crosses nodes",
    ),
    (
        {
            "trainer": {
                "preset": "tiny",
                "dataset": "synthetic",
                "steps": 1,
                "global_batch": 16,
                "seq_len": 128,
            },
            "resources": {
                "gpu_type": "H100",
                "nodes": 1,
                "gpus_per_node": 8,
                "layout": {"dp_shard": 2, "tp": 4},
            },
        },
        "resources.layout.tp",
        "heads",
    ),
    (
        {
            "resources": {
                "gpu_type": "H100",
                "nodes": 2,
                "gpus_per_node": 8,
                "layout": {"dp_shard": 5, "pp": 3},
            }
        },
        "resources.layout",
        "not the job's 16 GPUs",
    ),
    (
        {
            "trainer": {
                "preset": "8b",
                "dataset": "synthetic",
                "steps": 1,
                "global_batch": 64,
                "seq_len": 2048,
            },
            "resources": {
                "gpu_type": "H100",
                "nodes": 2,
                "gpus_per_node": 8,
                "layout": {"dp_shard": 3, "pp": 5},
            },
        },
        "resources.layout",
        "not the job's 16 GPUs",
    ),
    (
        {
            "resources": {
                "gpu_type": "H100",
                "nodes": 3,
                "gpus_per_node": 8,
                "layout": {"dp_shard": 8, "pp": 3},
            }
        },
        "resources.layout.pp",
        "32 layers",
    ),
    (
        {"resources": {"gpu_type": "H100", "nodes": 8, "gpus_per_node": 8}},
        "resources",
        "can ever hold",
    ),
    (
        {"resources": {"gpu_type": "A100", "nodes": 1, "gpus_per_node": 8}},
        "resources",
        "can ever hold",
    ),
    ({"placement": {"where": "cloud"}}, "resources", "can ever hold"),
    (
        {
            "trainer": {
                "preset": "8b",
                "dataset": "synthetic",
                "steps": 1,
                "global_batch": 60,
                "seq_len": 2048,
            }
        },
        "trainer.global_batch",
        "data-parallel",
    ),
    (
        {"resources": {"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8, "min_nodes": 3}},
        "resources.min_nodes",
        "more than the job's 2 nodes",
    ),
    (
        {"resources": {"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8, "min_nodes": 0}},
        "resources",
        "greater than or equal to 1",
    ),
    (
        # dp_replicate 3 splits 24 GPUs but not the 16 of two nodes.
        {
            "resources": {
                "gpu_type": "H100",
                "nodes": 3,
                "min_nodes": 2,
                "gpus_per_node": 8,
                "layout": {"dp_replicate": 3, "dp_shard": 8},
            }
        },
        "resources.min_nodes",
        "On 2 node(s) the job has 16 GPUs",
    ),
    (
        # 72 sequences split over 24 ranks, not over the 16 of two nodes.
        {
            "trainer": {
                "preset": "8b",
                "dataset": "synthetic",
                "steps": 1,
                "global_batch": 72,
                "seq_len": 2048,
            },
            "resources": {"gpu_type": "H100", "nodes": 3, "min_nodes": 2, "gpus_per_node": 8},
        },
        "trainer.global_batch",
        "16 data-parallel ranks the job has on 2 node(s)",
    ),
    (
        # Each rank's 2 sequences split into micro-batches of 2; on two nodes it has 3.
        {
            "trainer": {
                "preset": "8b",
                "dataset": "synthetic",
                "steps": 1,
                "global_batch": 48,
                "micro_batch": 2,
                "seq_len": 2048,
            },
            "resources": {"gpu_type": "H100", "nodes": 3, "min_nodes": 2, "gpus_per_node": 8},
        },
        "trainer.micro_batch",
        "the 3 sequences each data-parallel rank takes on 2 node(s)",
    ),
    (
        {
            "trainer": {
                "preset": "gpt5",
                "dataset": "x",
                "steps": 1,
                "global_batch": 16,
                "seq_len": 8,
            }
        },
        "trainer",
        "valid choice",
    ),
]


@pytest.mark.parametrize(("change", "field", "phrase"), RULES)
def test_each_rule_is_a_400_naming_the_field(
    change, field, phrase, fleet_pool, quota, team, researcher, api_for
):
    spec = trainer_spec(team)
    spec.update(copy.deepcopy(change))
    client = api_for(researcher)
    response = submit(client, spec)
    assert response.status_code == 400, response.content
    details = response.json()["error"]["details"]
    assert field in details, details
    assert phrase in str(details[field]), details
    assert not Job.objects.exists()


def test_a_node_range_is_stored_and_shown(fleet_pool, quota, team, researcher, api_for):
    spec = trainer_spec(team, nodes=2, layout={"dp_shard": 8, "tp": 2})
    spec["resources"]["min_nodes"] = 1
    body = submit(api_for(researcher), spec).json()
    assert (body["nodes"], body["min_nodes"], body["dp_shard"]) == (2, 1, 8)
    assert Job.objects.get(pk=body["id"]).min_nodes == 1
    # Without a range (or a range of one count) a job has none: min_nodes reads as nodes.
    spec = trainer_spec(team, nodes=2)
    spec["resources"]["min_nodes"] = 2
    body = submit(api_for(researcher), spec).json()
    assert body["min_nodes"] == 2 and Job.objects.get(pk=body["id"]).min_nodes is None


def test_a_command_job_may_have_a_node_range(fleet_pool, quota, team, researcher, api_for):
    resources = {"gpu_type": "H100", "nodes": 3, "min_nodes": 1, "gpus_per_node": 8}
    response = submit(api_for(researcher), command_spec(team, resources=resources))
    assert response.status_code == 201, response.content
    assert Job.objects.get(pk=response.json()["id"]).min_nodes == 1


def test_pp_that_divides_the_layers_is_accepted(fleet_pool, quota, team, researcher, api_for):
    spec = trainer_spec(team, nodes=4, layout={"dp_shard": 8, "pp": 4})
    assert submit(api_for(researcher), spec).status_code == 201


def test_a_shell_string_command_is_refused(fleet_pool, quota, team, researcher, api_for):
    spec = command_spec(team)
    spec["command"]["argv"] = "python train.py && rm -rf /"
    response = submit(api_for(researcher), spec)
    assert response.status_code == 400
    assert "never a shell string" in str(response.json()["error"]["details"])


def test_a_command_needs_a_code_source_and_a_safe_ref(fleet_pool, quota, team, researcher, api_for):
    client = api_for(researcher)
    spec = command_spec(team)
    del spec["command"]["path"]
    assert "command" in submit(client, spec).json()["error"]["details"]
    spec["command"]["git"] = {"repo": "https://git.example/llm.git", "ref": "--upload-pack=x"}
    details = submit(client, spec).json()["error"]["details"]
    assert "ref" in str(details)


def test_a_job_over_the_quota_is_refused_at_submission(fleet_pool, team, researcher, api_for):
    from apps.accounts import services as accounts

    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    response = submit(api_for(researcher), trainer_spec(team))
    assert response.status_code == 400
    assert "quota" in str(response.json()["error"]["details"]["resources.gpus"])


@pytest.mark.parametrize("role", ["viewer"])
def test_viewers_cannot_submit(role, fleet_pool, quota, team, user_for_role, api_for):
    response = submit(api_for(user_for_role(role)), command_spec(team))
    assert response.status_code == 403
    assert not Job.objects.exists()


def test_nobody_submits_to_another_team(fleet_pool, quota, other_team, researcher, api_for):
    response = submit(api_for(researcher), command_spec(other_team))
    assert response.status_code == 400  # the team "does not exist" for them
    assert "team" in response.json()["error"]["details"]


def test_a_read_token_cannot_submit(fleet_pool, quota, team, researcher, api_for):
    response = submit(api_for(researcher, scopes=("read",)), command_spec(team))
    assert response.status_code == 403


def test_the_idempotency_key_returns_the_first_job(fleet_pool, quota, team, researcher, api_for):
    client = api_for(researcher, scopes=("submit",))
    first = submit(client, command_spec(team), HTTP_IDEMPOTENCY_KEY="ci-run-4711")
    again = submit(client, command_spec(team), HTTP_IDEMPOTENCY_KEY="ci-run-4711")
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["id"] == again.json()["id"]
    assert Job.objects.count() == 1
    other = submit(client, command_spec(team, name="other"), HTTP_IDEMPOTENCY_KEY="ci-run-4711")
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_reused"


def test_cancel_hold_release(fleet_pool, quota, team, researcher, viewer, api_for):
    client = api_for(researcher)
    job_id = submit(client, command_spec(team)).json()["id"]
    assert client.post(f"/api/v1/jobs/{job_id}/hold/").json()["state"] == "held"
    assert client.post(f"/api/v1/jobs/{job_id}/release/").json()["state"] == "pending"
    denied = api_for(viewer).post(f"/api/v1/jobs/{job_id}/cancel/", {}, format="json")
    assert denied.status_code == 403
    cancelled = client.post(f"/api/v1/jobs/{job_id}/cancel/", {"reason": "typo"}, format="json")
    assert cancelled.json()["state"] == "cancelled"
    states = list(JobEvent.objects.filter(job_id=job_id).values_list("to_state", flat=True))
    assert states == ["pending", "held", "pending", "cancelled"]


def test_other_teams_jobs_are_404_and_anonymous_in_the_queue(
    fleet_pool, quota, team, other_team, researcher, api_for
):
    stranger = factories.make_member(team=other_team, role="researcher")
    from apps.accounts import services as accounts

    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    theirs = submit(api_for(stranger), command_spec(other_team, name="secret-project")).json()
    mine = submit(api_for(researcher), command_spec(team, name="mine")).json()
    client = api_for(researcher)
    assert client.get(f"/api/v1/jobs/{theirs['id']}/").status_code == 404
    assert [j["id"] for j in client.get("/api/v1/jobs/").json()["results"]] == [mine["id"]]
    rows = client.get("/api/v1/queue/").json()["results"]
    anonymous = [r for r in rows if r["anonymous"]]
    assert len(anonymous) == 1
    assert anonymous[0]["id"] is None and anonymous[0]["team"] == other_team.slug
    assert "name" not in anonymous[0] and "secret-project" not in str(rows)
    own = next(r for r in rows if not r["anonymous"])
    assert own["name"] == "mine" and own["reason"]


def test_the_queue_api_gives_the_whole_queue_a_page_at_a_time_with_filters(
    fleet_pool, quota, team, other_team, researcher, api_for
):
    from apps.accounts import services as accounts
    from apps.jobs.scheduler.run import scheduling_pass
    from apps.jobs.selectors import queue_for

    stranger = factories.make_member(team=other_team, role="researcher")
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    client = api_for(researcher)
    for n in range(5):
        assert submit(client, command_spec(team, name=f"mine-{n}")).status_code == 201
    assert submit(api_for(stranger), command_spec(other_team)).status_code == 201
    scheduling_pass()  # one of mine placed, the rest ordered by the pass

    pages, url = [], "/api/v1/queue/?page_size=2"
    while url:
        answer = client.get(url).json()
        assert answer["count"] == 6
        pages.append(answer["results"])
        url = answer["next"]
    assert [len(p) for p in pages] == [2, 2, 2]
    whole = [(r["id"], r["state"], r["position"]) for p in pages for r in p]
    assert whole == [(r["id"], r["state"], r["position"]) for r in queue_for(user=researcher)]

    placed = client.get("/api/v1/queue/", {"state": "admitted"}).json()["results"]
    assert sorted(r["team"] for r in placed) == sorted([team.slug, other_team.slug])
    mine = client.get("/api/v1/queue/", {"state": "pending", "team": team.slug}).json()
    assert mine["count"] == 4 and [r["position"] for r in mine["results"]] == [1, 2, 3, 4]
    theirs = client.get("/api/v1/queue/", {"team": other_team.slug}).json()["results"]
    assert len(theirs) == 1 and theirs[0]["anonymous"] and theirs[0]["id"] is None
    for bad, field in (({"state": "finished"}, "state"), ({"team": "no such/slug"}, "team")):
        refused = client.get("/api/v1/queue/", bad)
        assert refused.status_code == 400 and field in refused.json()["error"]["details"]
    assert client.get("/api/v1/queue/", {"page": 99}).status_code == 404


def test_reconcile_requeues_a_job_stuck_preempting(
    fleet_pool, quota, team, researcher, api_for, settings
):
    import datetime as dt

    from django.utils import timezone

    from apps.jobs import services

    job_id = submit(api_for(researcher), command_spec(team)).json()["id"]
    job = Job.objects.get(pk=job_id)
    for state in (
        JobState.ADMITTED,
        JobState.PROVISIONING,
        JobState.STARTING,
        JobState.RUNNING,
        JobState.PREEMPTING,
    ):
        job = services.job_transition(job=job, to=state, reason="test", by=None)
    assert services.jobs_reconcile() == {"requeued": 0, "cancelled": 0}  # within the grace
    later = timezone.now() + dt.timedelta(seconds=settings.PREEMPTION_GRACE_S + 1)
    assert services.jobs_reconcile(now=later) == {"requeued": 1, "cancelled": 0}
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert job.queued_at < later  # keeps its place by age


def test_a_failed_job_requeued_is_live_again_and_scheduled(
    fleet_pool, quota, team, researcher, api_for
):
    from django.db import IntegrityError, transaction

    from apps.jobs import services
    from apps.jobs.scheduler.run import scheduling_pass

    client = api_for(researcher)
    job_id = submit(client, command_spec(team)).json()["id"]
    job = Job.objects.get(pk=job_id)
    for state in (JobState.ADMITTED, JobState.PROVISIONING, JobState.STARTING, JobState.RUNNING):
        job = services.job_transition(job=job, to=state, reason="test", by=None)
    job = services.job_transition(job=job, to=JobState.FAILED, reason="test", by=None)
    assert job.finished_at is not None and not Job.objects.live().filter(pk=job_id).exists()

    answer = client.post(f"/api/v1/jobs/{job_id}/requeue/", {}, format="json")
    assert answer.status_code == 200, answer.content
    job.refresh_from_db()
    assert (job.state, job.finished_at) == (JobState.PENDING, None)
    assert client.get("/api/v1/jobs/", {"state": "pending"}).json()["count"] == 1
    assert scheduling_pass().placed == 1  # the scheduler reads live jobs only, and finds it

    # The database itself refuses a job that is not finished but says when it finished:
    # the scheduler, which reads live jobs by their index, would never see it.
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=job_id).update(finished_at=job.queued_at)


@pytest.mark.parametrize(
    ("role", "status"),
    [
        ("superuser", 201),
        ("admin", 201),
        ("researcher", 201),
        ("viewer", 403),
        ("ops", 403),
        ("finance", 403),
    ],
)
def test_who_submits_for_a_team(role, status, fleet_pool, quota, team, user_for_role, api_for):
    response = submit(api_for(user_for_role(role)), command_spec(team))
    assert response.status_code == status, response.content
    assert Job.objects.count() == (1 if status == 201 else 0)


@pytest.mark.parametrize("role", ["ops", "finance", "superuser"])
def test_ops_and_finance_see_every_teams_jobs(
    role, fleet_pool, quota, team, researcher, user_for_role, api_for
):
    job_id = submit(api_for(researcher), command_spec(team)).json()["id"]
    detail = api_for(user_for_role(role)).get(f"/api/v1/jobs/{job_id}/")
    assert detail.status_code == 200
    assert [e["to_state"] for e in detail.json()["events"]] == ["pending"]


def test_the_specs_trainer_choices_are_the_trainers_own():
    from apps.jobs.api import serializers
    from workers.trainer import config

    assert serializers.ATTENTION_BACKENDS == config.ATTENTION_BACKENDS
    assert serializers.PIPELINE_SCHEDULES == config.PIPELINE_SCHEDULES
    assert serializers.PRECISIONS == config.PRECISIONS


def test_a_quota_change_applies_to_the_next_submit_at_once(
    fleet_pool, quota, team, researcher, api_for, django_capture_on_commit_callbacks
):
    """Submission reads the team and its quotas from the cache; a change marks them stale."""
    from apps.accounts import services as accounts

    client = api_for(researcher, scopes=("submit",))
    big = command_spec(team, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    assert submit(client, big).status_code == 201  # 16 GPUs within 32
    with django_capture_on_commit_callbacks(execute=True):  # the change commits
        accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    refused = submit(client, big)
    assert refused.status_code == 400, refused.content
    assert "resources" in str(refused.json()["error"]["details"])


def test_a_retry_that_loses_the_race_answers_with_the_winners_job(
    fleet_pool, quota, team, researcher, monkeypatch
):
    """Two submits with one Idempotency-Key, the second inserting between the first's
    look-up and its insert: the first's insert fails on the key and it answers with the
    winner's job, leaving one job, one event and one audit row."""
    from apps.accounts.models import AuditEvent
    from apps.jobs import services

    real_check = services.specs.check_command
    raced = []

    def check_then_lose_the_race(command, errors):
        real_check(command, errors)
        if not raced:
            raced.append(None)  # the winner's own check passes straight through
            raced[0] = services.job_submit(
                team=team,
                spec=command_spec(team),
                submitted_by=researcher,
                idempotency_key="ci-race",
            )[0]

    monkeypatch.setattr(services.specs, "check_command", check_then_lose_the_race)
    job, created = services.job_submit(
        team=team, spec=command_spec(team), submitted_by=researcher, idempotency_key="ci-race"
    )
    assert not created and job.pk == raced[0].pk
    assert Job.objects.count() == 1
    assert JobEvent.objects.filter(job=job).count() == 1
    assert AuditEvent.objects.filter(action="job.submit").count() == 1
