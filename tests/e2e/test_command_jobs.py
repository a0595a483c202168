"""Command jobs end to end: submitted through the API, placed, dispatched, run by real
agents as real processes, reported back, logs masked, outcome classified."""

import sys

import pytest

from apps.accounts import services as accounts
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, JobEvent, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import wait_for

# The live server and the agents write while the test reads: PostgreSQL, as in production.
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _submit(api, team, argv, **extra) -> Job:
    spec = {
        "name": extra.pop("name", "e2e"),
        "team": team.pk,
        "time_limit_s": 600,
        # The code's place on shared storage: on local nodes, this machine's disk.
        "command": {"argv": argv, "path": extra.pop("path", "/tmp")},
        "resources": {"gpu_type": "H100", **extra.pop("resources", {"gpus": 2})},
        "placement": {"where": "owned"},
        **extra,
    }
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(pk=answer.json()["id"])


def _run_to_the_end(job: Job, timeout_s: float = 90) -> Job:
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == "admitted", job.pending_reason
    job_dispatch(job_id=job.pk)
    try:
        return wait_for(
            f"job {job.pk} to finish",
            lambda: (
                (j := Job.objects.get(pk=job.pk)).state in ("succeeded", "failed", "cancelled")
                and j
            ),
            timeout_s=timeout_s,
        )
    except AssertionError:
        # Where it stood, so that a slow machine's timeout says what was slow.
        job.refresh_from_db()
        runs = list(Run.objects.filter(job=job).values("node_id", "state", "pid", "reason"))
        events = list(JobEvent.objects.filter(job=job).values_list("to_state", "reason"))
        raise AssertionError(f"job {job.pk}: {job.state} {events} {runs}") from None


def _log_texts(api, job) -> list[str]:
    answer = api.get(f"/api/v1/jobs/{job.pk}/logs/")
    assert answer.status_code == 200, answer.content
    return [line["text"] for line in answer.json()["lines"]]


def test_a_two_node_command_job_runs_and_succeeds_with_its_secret_masked(
    local_nodes, e2e_team, api_for
):
    pool = factories.make_owned_pool(slug="e2e-local")
    local_nodes(pool, count=2, gpus=2)
    admin = factories.make_member(team=e2e_team, role="admin")
    accounts.team_secret_set(team=e2e_team, name="HF_TOKEN", value="hf_s3cr3t_value", by=admin)
    api = api_for(admin, scopes=("submit",))
    hostile = "; rm -rf / #"
    code = (
        "import os, sys; print('rank', os.environ['CONTROLPLANE_NODE_RANK'], "
        "'of', os.environ['CONTROLPLANE_NNODES']); print('token', os.environ['HF_TOKEN']); "
        "print('arg', sys.argv[1])"
    )
    job = _submit(
        api,
        e2e_team,
        ["python3", "-c", code, hostile],
        resources={"nodes": 2, "gpus_per_node": 2},
        secrets=["HF_TOKEN"],
    )
    job = _run_to_the_end(job)
    assert job.state == "succeeded", job.state_reason
    states = list(JobEvent.objects.filter(job=job).values_list("to_state", flat=True))
    assert states == ["pending", "admitted", "provisioning", "starting", "running", "succeeded"]
    runs = list(Run.objects.filter(job=job).order_by("node_rank"))
    assert [r.exit_code for r in runs] == [0, 0] and {r.node_id for r in runs}.__len__() == 2
    texts = wait_for(
        "the last log lines", lambda: (t := _log_texts(api, job)) and len(t) >= 6 and t
    )
    assert "rank 0 of 2" in texts and "rank 1 of 2" in texts
    assert texts.count(f"arg {hostile}") == 2  # the literal string, never run by a shell
    assert "token ********" in texts
    assert not [t for t in texts if "hf_s3cr3t_value" in t]
    assert "hf_s3cr3t_value" not in str(Run.objects.get(job=job, node_rank=0).plan)
    # Nodes are free again once the job ends.
    assert not job.allocations.filter(ended_at__isnull=True).exists()


def test_a_failing_command_fails_the_job_with_its_exit_code(local_nodes, e2e_team, api_for):
    pool = factories.make_owned_pool(slug="e2e-fail")
    local_nodes(pool, count=1, gpus=2)
    researcher = factories.make_member(team=e2e_team, role="researcher")
    api = api_for(researcher, scopes=("submit",))
    job = _submit(api, e2e_team, [sys.executable, "-c", "import sys; print('oops'); sys.exit(3)"])
    job = _run_to_the_end(job)
    assert job.state == "failed"
    assert "exit code 3" in job.state_reason
    assert job.restarts == 0  # the job's own code: not retried
    wait_for("its output", lambda: "oops" in _log_texts(api, job))  # relayed apart from the exit


def test_a_cancelled_running_job_is_stopped_on_its_node(local_nodes, e2e_team, api_for):
    pool = factories.make_owned_pool(slug="e2e-cancel")
    local_nodes(pool, count=1, gpus=2)
    researcher = factories.make_member(team=e2e_team, role="researcher")
    api = api_for(researcher, scopes=("submit",))
    job = _submit(
        api, e2e_team, ["python3", "-c", "import time; print('up', flush=True); time.sleep(300)"]
    )
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    wait_for("the job to run", lambda: Job.objects.get(pk=job.pk).state == "running")
    assert api.post(f"/api/v1/jobs/{job.pk}/cancel/", {}, format="json").status_code == 200
    job = wait_for(
        "the job to stop",
        lambda: (j := Job.objects.get(pk=job.pk)).state == "cancelled" and j,
    )
    run = Run.objects.get(job=job)
    assert run.state == "exited" and run.signal == 15  # SIGTERM, from the agent


def test_cpctl_logs_follows_a_running_job_to_its_end(local_nodes, e2e_team, api_for, live_server):
    import os
    import subprocess

    pool = factories.make_owned_pool(slug="e2e-follow")
    local_nodes(pool, count=1, gpus=2)
    researcher = factories.make_member(team=e2e_team, role="researcher")
    api = api_for(researcher, scopes=("submit",))
    ticker = (
        "import time\nfor i in range(5):\n    print('tick', i, flush=True)\n    time.sleep(0.4)"
    )
    job = _submit(api, e2e_team, ["python3", "-c", ticker])
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    _, token = accounts.api_token_create(
        user=researcher, name="cli", scopes=["read"], by=researcher
    )
    follow = subprocess.run(
        [
            sys.executable,
            "-m",
            "cpctl",
            "logs",
            str(job.pk),
            "--follow",
            "--poll",
            "0.3",
        ],
        env={**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert follow.returncode == 0, follow.stderr
    assert [line for line in follow.stdout.splitlines() if line.startswith("tick")] == [
        f"tick {i}" for i in range(5)
    ]
