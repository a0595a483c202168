"""The NCCL environment every rank of a real trainer job started with: a pool's profile and
the job's overrides, rendered at dispatch, reported by each rank under torchrun on a local
node, and read back from the ranks' own /proc/<pid>/environ while they run."""

import contextlib
from pathlib import Path

import pytest

from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, RankEnvironment
from apps.jobs.scheduler.run import scheduling_pass
from apps.jobs.specs import NCCL_ENV_PREFIXES
from apps.tuning.services import nccl_profile_create
from tests import factories
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

PROFILE = {
    "NCCL_DEBUG": "WARN",
    "NCCL_SOCKET_IFNAME": "lo",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # torchrun would set 1 without it
    # The trainer passes this one on under its new name once it runs; the report must say
    # what the process started with.
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
}
OVERRIDES = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}


def ranks_environ(job_uuid: str) -> dict[int, dict[str, str]]:
    """The environment of each of the job's trainer ranks alive now, by rank, from /proc."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone, or not ours to read
            pairs = (proc / "environ").read_bytes().split(b"\0")
            env = dict(p.decode(errors="replace").partition("=")[::2] for p in pairs if p)
            if env.get("CONTROLPLANE_JOB_UUID") == job_uuid and "RANK" in env:
                found[int(env["RANK"])] = env
    return found


def test_every_rank_starts_with_the_profile_and_the_jobs_overrides(local_nodes, e2e_team, api_for):
    pool = factories.make_owned_pool(slug="e2e-nccl")
    local_nodes(pool, count=1, gpus=2)
    nccl_profile_create(by=None, name="e2e-gloo", title="Gloo on local nodes", env=PROFILE)
    api = api_for(factories.make_member(team=e2e_team), scopes=("submit",))
    spec = {
        "name": "nccl-env",
        "team": e2e_team.pk,
        "time_limit_s": 600,
        "trainer": {
            "preset": "tiny",
            "dataset": "synthetic",
            "steps": 3,
            "global_batch": 2,
            "seq_len": 32,
            "precision": "fp32",
        },
        "resources": {"gpu_type": "H100", "nodes": 1, "gpus_per_node": 2},
        "placement": {"where": "owned"},
        "nccl": {"profile": "e2e-gloo", "overrides": OVERRIDES},
    }
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    scheduling_pass()
    job_dispatch(job_id=job.pk)

    seen: dict[int, dict[str, str]] = {}

    def ended():
        seen.update(ranks_environ(str(job.uuid)))
        current = Job.objects.get(pk=job.pk)
        return current.state in ("succeeded", "failed") and current

    job = wait_for("the training run to end", ended, timeout_s=300, every_s=0.2)
    texts = [line["text"] for line in api.get(f"/api/v1/jobs/{job.pk}/logs/").json()["lines"]]
    assert job.state == "succeeded", (job.state_reason, texts[-20:])

    rendered = {**PROFILE, **OVERRIDES}
    (pool_environment,) = api.get(f"/api/v1/jobs/{job.pk}/").json()["nccl_environments"]
    assert {v["name"]: v["value"] for v in pool_environment["variables"]} == rendered
    reports = wait_for(
        "both ranks' reports",
        lambda: (
            (r := list(RankEnvironment.objects.filter(job=job).order_by("rank")))
            and len(r) == 2
            and r
        ),
    )
    assert [(r.rank, r.local_rank, r.node_rank, r.attempt) for r in reports] == [
        (0, 0, 0, 1),
        (1, 1, 0, 1),
    ]
    for report in reports:
        assert report.env == rendered, report.rank

    detail = api.get(f"/api/v1/jobs/{job.pk}/").json()["rank_environments"]
    assert (detail["reported"], detail["world_size"], detail["all_match"]) == (2, 2, True)
    assert detail["rendered"] == rendered
    assert [(r["rank"], r["env"], r["differences"]) for r in detail["ranks"]] == [
        (0, rendered, []),
        (1, rendered, []),
    ]

    # What the kernel kept of each process's start agrees with what it reported.
    assert sorted(seen) == [0, 1], "both ranks are seen running"
    for rank, environ in seen.items():
        started_with = {k: v for k, v in environ.items() if k.startswith(NCCL_ENV_PREFIXES)}
        assert started_with == reports[rank].env, rank
