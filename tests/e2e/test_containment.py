"""A job is someone else's code: a real hostile job, run by real agents beside a victim job
on one node, tries to read the victim's secrets and files, its node's token and agent API,
and the control plane's secrets, and to kill the victim. Every attempt must be refused.

On local nodes started by root (CI, and `make run` as root) and on SSH nodes (the agent
runs as root there), each job runs as its own unprivileged user. Isolation needs root:
these tests are skipped, saying so, where the suite does not run as root.
"""

import json
import os
from pathlib import Path

import pytest

from apps.accounts import services as accounts
from apps.fleet.models import Node
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, LogLine
from apps.jobs.runconfig import checkpoint_dir
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.e2e.conftest import wait_for
from workers.agent.isolation import DEFAULT_UID_BASE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as users of their own only as root"),
]

HOSTILE = (Path(__file__).with_name("hostile_job.py")).read_text()
VICTIM_SECRET = "victim-s3cret-9f2c1e"
MARKER = "victim-marker-7d41"


def _submit(api, team, argv, **extra) -> Job:
    spec = {
        "name": extra.pop("name", "containment"),
        "team": team.pk,
        "time_limit_s": 600,
        "command": {"argv": argv, "path": "/tmp"},
        "resources": {"gpu_type": "H100", "gpus": 2},
        "placement": {"where": "owned"},
        **extra,
    }
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    return Job.objects.get(pk=answer.json()["id"])


def _start(job: Job) -> None:
    scheduling_pass()
    job.refresh_from_db()
    assert job.state == "admitted", job.pending_reason
    job_dispatch(job_id=job.pk)


def _hostile_report(job: Job) -> dict:
    def report():
        for text in LogLine.objects.filter(job=job).values_list("text", flat=True):
            if text.startswith('{"hostile"'):
                return json.loads(text)["hostile"]
        return None

    return wait_for("the hostile job's report", report, timeout_s=120)


def _victim_and_attacker(
    api, team, var_dir: Path, live_url: str, *, victims=None
) -> tuple[Job, Job, dict]:
    """A victim holding a secret sleeps; then the attacker runs on the same node. `victims`:
    (team, API client) of the victim's team when it is not the attacker's."""
    victim_team, victim_api = victims or (team, api)
    admin = factories.make_member(team=victim_team, role="admin")
    accounts.team_secret_set(team=victim_team, name="VICTIM_KEY", value=VICTIM_SECRET, by=admin)
    sleeper = f"import time, sys; print('{MARKER}', flush=True); time.sleep(600)"
    victim = _submit(
        victim_api, victim_team, ["python3", "-c", sleeper, MARKER], secrets=["VICTIM_KEY"]
    )
    _start(victim)
    wait_for("the victim to run", lambda: Job.objects.get(pk=victim.pk).state == "running")
    # What `make run` keeps next to the nodes: the control plane's own secrets.
    secret_key = var_dir / "secret_key"
    secret_key.write_text("control-plane-secret-key\n")
    secret_key.chmod(0o600)
    aims = {
        "victim_pid_marker": MARKER,
        "victim_dirs": [checkpoint_dir(victim)],
        "control_plane_files": [str(secret_key)],
    }
    # The victim's checkpoint directory, as a trainer job's agent would have made it.
    victim_dir = Path(checkpoint_dir(victim))
    victim_dir.mkdir(parents=True)
    os.chown(victim_dir, DEFAULT_UID_BASE + victim.pk, DEFAULT_UID_BASE + victim.pk)
    victim_dir.chmod(0o700)
    attacker = _submit(
        api, team, ["python3", "-c", HOSTILE, live_url, json.dumps(aims)], name="hostile"
    )
    _start(attacker)
    results = _hostile_report(attacker)
    return victim, attacker, results


def _finishes(job: Job) -> None:
    """The hostile job itself ran to its end: nothing it tried stopped it."""
    wait_for("the hostile job to end", lambda: Job.objects.get(pk=job.pk).state == "succeeded")


def _assert_contained(results: dict, attacker: Job, victim: Job) -> None:
    holes = {k: v for k, v in results.items() if v.startswith("READ")}
    assert not holes, holes
    assert int(results["other users' processes seen"]) > 0  # the attempts had targets
    assert results["kill the victim"] == "refused (PermissionError)", results
    assert results["agent.env"] == "refused (PermissionError)", results
    assert results[f"list {checkpoint_dir(victim)}"] == "refused (PermissionError)", results
    assert results["agent API (no token)"] == "refused (401)"
    assert results["agent API (cpn_guess)"] == "refused (401)"
    assert Job.objects.get(pk=victim.pk).state == "running"  # still alive and untouched
    logs = " ".join(LogLine.objects.filter(job=attacker).values_list("text", flat=True))
    assert VICTIM_SECRET not in logs


def test_a_hostile_job_on_a_local_node_reaches_nothing_of_its_neighbour(
    local_nodes, e2e_team, api_for, live_server, settings
):
    pool = factories.make_owned_pool(slug="contain-local")
    (node,) = local_nodes(pool, count=1, gpus=4)
    assert Node.objects.get(pk=node.pk).job_isolation == "user"
    api = api_for(factories.make_member(team=e2e_team, role="researcher"), scopes=("submit",))
    victim, attacker, results = _victim_and_attacker(
        api, e2e_team, Path(settings.VAR_DIR), live_server.url
    )
    assert victim.allocations.get().node_id == attacker.allocations.get().node_id
    _assert_contained(results, attacker, victim)
    _finishes(attacker)


def test_a_hostile_job_of_another_team_on_a_shared_node_reaches_nothing(
    local_nodes, e2e_team, api_for, live_server, settings
):
    """A pool whose tenancy is shared lets two teams' jobs onto one node, since each runs
    as its own user: the attacker's team is not the victim's."""
    pool = factories.make_owned_pool(slug="contain-shared", tenancy="shared")
    (node,) = local_nodes(pool, count=1, gpus=4)
    other = factories.make_team(slug="e2e-victims")
    accounts.team_quota_set(team=other, gpu_type="H100", max_gpus=64, by=None)
    victims_api = api_for(factories.make_member(team=other, role="researcher"), scopes=("submit",))
    api = api_for(factories.make_member(team=e2e_team, role="researcher"), scopes=("submit",))
    victim, attacker, results = _victim_and_attacker(
        api, e2e_team, Path(settings.VAR_DIR), live_server.url, victims=(other, victims_api)
    )
    assert victim.team_id != attacker.team_id
    assert victim.allocations.get().node_id == node.pk == attacker.allocations.get().node_id
    _assert_contained(results, attacker, victim)


def test_a_hostile_job_on_an_ssh_node_reaches_nothing_of_its_neighbour(
    ssh_nodes, e2e_team, api_for, live_server, settings
):
    pool = factories.make_owned_pool(slug="contain-ssh")
    (node,) = ssh_nodes(pool, count=1)
    assert Node.objects.get(pk=node.pk).job_isolation == "user"
    api = api_for(factories.make_member(team=e2e_team, role="researcher"), scopes=("submit",))
    victim, attacker, results = _victim_and_attacker(
        api, e2e_team, Path(settings.VAR_DIR), live_server.url
    )
    assert victim.allocations.get().node_id == node.pk == attacker.allocations.get().node_id
    _assert_contained(results, attacker, victim)
    _finishes(attacker)


def test_a_jobs_user_imports_the_bundled_trainer_from_its_node(
    local_nodes, e2e_team, api_for, settings
):
    """The trainer a job runs is the one its node was given, found through the node's
    listable import directory; the node directory itself is closed to listing, and Python
    imports nothing from a directory it cannot list (so without the import directory a
    job's user would find the trainer only where a development install happens to be)."""
    pool = factories.make_owned_pool(slug="contain-import")
    local_nodes(pool, count=1, gpus=2)
    api = api_for(factories.make_member(team=e2e_team, role="researcher"), scopes=("submit",))
    where = "import os, workers.trainer as t; print('TRAINER_AT', os.path.realpath(t.__file__))"
    job = _submit(api, e2e_team, ["python3", "-c", where])
    _start(job)
    wait_for("the job to end", lambda: Job.objects.get(pk=job.pk).state == "succeeded")
    line = wait_for(
        "the job's answer",
        lambda: LogLine.objects.filter(job=job, text__startswith="TRAINER_AT").first(),
    )
    path = Path(line.text.split(" ", 1)[1])
    node_dir = path.parents[2]  # <node>/workers/trainer/__init__.py
    assert (node_dir / "agent.env").is_file(), path
    assert not path.is_relative_to(settings.BASE_DIR), path
