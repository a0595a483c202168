"""The NCCL environment each rank reports starting with (the trainer's "env" event): stored
per rank through the agent's log endpoint, bad reports ignored, and shown on the Job API
and page against what dispatch rendered."""

import json

import pytest
from rest_framework.test import APIClient

from apps.fleet import agents
from apps.jobs import services as jobs
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, LogLine, RankEnvironment, Run
from apps.jobs.scheduler.run import scheduling_pass
from apps.jobs.selectors import job_rank_environments
from apps.tuning.services import nccl_profile_create
from tests.apps.jobs.conftest import trainer_spec

pytestmark = pytest.mark.django_db

PROFILE_ENV = {
    "NCCL_DEBUG": "WARN",
    "NCCL_SOCKET_IFNAME": "lo",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}
OVERRIDES = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT"}
RENDERED = {**PROFILE_ENV, **OVERRIDES}


def dispatched_job(team, user, *, nodes=2, gpus_per_node=8) -> Job:
    """A trainer job with a named profile and overrides, placed and dispatched (plans written)."""
    nccl_profile_create(
        by=None, name="gloo-test", title="Gloo tests", fabric="any", env=PROFILE_ENV
    )
    spec = trainer_spec(
        team,
        preset="tiny",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        layout={"dp_shard": nodes * gpus_per_node},
        seq_len=256,
    )
    spec["nccl"] = {"profile": "gloo-test", "overrides": OVERRIDES}
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=user)
    scheduling_pass()
    job_dispatch(job_id=job.pk)
    return Job.objects.get(pk=job.pk)


def env_line(rank: int, env, /, **fields) -> str:
    """The trainer's line for `rank` of a job of 8 ranks a node; `fields` replace its own."""
    event = {
        "event": "env",
        "rank": rank,
        "local_rank": rank % 8,
        "node_rank": rank // 8,
        "world_size": 16,
        "env": env,
        **fields,
    }
    return json.dumps(event, separators=(",", ":"))


def relay(run: Run, texts: list[str], *, first_seq: int = 1) -> None:
    """Post the lines as the run's node agent does, through its endpoint and node token."""
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {agents.node_agent_token_issue(node=run.node)}")
    lines = [{"seq": first_seq + i, "text": text} for i, text in enumerate(texts)]
    answer = agent.post(f"/api/v1/agent/runs/{run.pk}/logs", {"lines": lines}, format="json")
    assert answer.status_code == 200, answer.content


def runs_of(job: Job) -> list[Run]:
    return list(Run.objects.filter(job=job).select_related("node").order_by("node_rank"))


def test_dispatch_renders_the_profile_then_the_overrides_into_every_plan(
    fleet_pool, quota, team, researcher
):
    job = dispatched_job(team, researcher)
    for run in runs_of(job):
        nccl = {k: v for k, v in run.plan["env"].items() if k.startswith(("NCCL_", "TORCH_"))}
        assert nccl == RENDERED
    assert job_rank_environments(job=job).as_dict() == {
        "attempt": 1,
        "world_size": 16,
        "reported": 0,
        "all_match": False,
        "rendered": RENDERED,
        "ranks": [],
    }


def test_each_rank_is_stored_and_compared_with_its_plan_naming_the_differences(
    fleet_pool, quota, team, researcher
):
    job = dispatched_job(team, researcher)
    first, second = runs_of(job)
    # Rank 9 started with another NCCL_DEBUG, without NCCL_SOCKET_IFNAME and with a variable
    # nobody rendered; names outside NCCL's are not kept.
    odd = {
        **RENDERED,
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "HOME": "/home/job",
        "nccl_debug": "lowercase is not NCCL's",
    }
    del odd["NCCL_SOCKET_IFNAME"]
    relay(first, ["starting", *(env_line(r, RENDERED) for r in range(8))])
    relay(second, [env_line(r, odd if r == 9 else RENDERED) for r in range(8, 16)])

    stored = {e.rank: e for e in RankEnvironment.objects.filter(job=job)}
    assert sorted(stored) == list(range(16))
    assert stored[9].env == {
        "NCCL_DEBUG": "WARN",
        "NCCL_DEBUG_SUBSYS": "INIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert (stored[9].run_id, stored[9].local_rank, stored[9].node_rank) == (second.pk, 1, 1)
    assert LogLine.objects.filter(job=job).count() == 17  # every line is still output

    environments = job_rank_environments(job=job)
    assert not environments.all_match
    assert [r.rank for r in environments.differing] == [9]
    (report,) = environments.differing
    assert [str(d) for d in report.differences] == [
        "NCCL_DEBUG: rendered INFO, the rank had WARN",
        "NCCL_SOCKET_IFNAME: rendered lo, the rank did not have it",
        "TORCH_NCCL_DUMP_ON_TIMEOUT: not rendered, the rank had 1",
    ]
    assert report.node == second.node.name


def test_the_job_api_and_page_show_each_ranks_environment(
    client, fleet_pool, quota, team, researcher, api_for
):
    job = dispatched_job(team, researcher, nodes=1)
    (run,) = runs_of(job)
    relay(
        run, [env_line(r, RENDERED if r else {**RENDERED, "NCCL_ALGO": "Ring"}) for r in range(8)]
    )

    answer = api_for(researcher, scopes=("read",)).get(f"/api/v1/jobs/{job.pk}/").json()
    ranks = answer["rank_environments"]
    assert (ranks["attempt"], ranks["world_size"], ranks["reported"]) == (1, 8, 8)
    assert ranks["rendered"] == RENDERED and ranks["all_match"] is False
    assert [r["rank"] for r in ranks["ranks"]] == list(range(8))
    assert all(r["env"] == RENDERED and r["matches"] for r in ranks["ranks"][1:])
    assert ranks["ranks"][0]["differences"] == [
        {"name": "NCCL_ALGO", "rendered": None, "got": "Ring"}
    ]
    assert ranks["ranks"][0]["node"] == run.node.name

    client.force_login(researcher)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "8 of 8 ranks reported." in page
    assert '<tr data-rank="0" data-matches="no">' in page
    assert page.count('data-matches="yes"') == 7
    assert "NCCL_ALGO: not rendered, the rank had Ring" in page


def test_a_job_that_has_not_run_has_no_rank_environments(
    fleet_pool, quota, team, researcher, api_for
):
    spec = trainer_spec(team, preset="tiny", nodes=1, layout={"dp_shard": 8}, seq_len=256)
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=researcher)
    assert job_rank_environments(job=job) is None
    answer = api_for(researcher, scopes=("read",)).get(f"/api/v1/jobs/{job.pk}/").json()
    assert answer["rank_environments"] is None


BAD_REPORTS = {
    "rank past the world": env_line(16, RENDERED, node_rank=1),
    "negative rank": env_line(-1, RENDERED, local_rank=0, node_rank=0),
    "rank as text": env_line(0, RENDERED, rank="0"),
    "rank as a boolean": env_line(1, RENDERED, rank=True),
    "local rank past the node": env_line(2, RENDERED, local_rank=8),
    "node rank past the job": env_line(3, RENDERED, node_rank=2),
    "no node rank": json.dumps({"event": "env", "rank": 4, "local_rank": 4, "env": RENDERED}),
    "env as a list": env_line(5, [["NCCL_DEBUG", "INFO"]]),
    "a value not text": env_line(6, {**RENDERED, "NCCL_IB_TIMEOUT": 22}),
    "a NUL in a value": env_line(7, {**RENDERED, "NCCL_DEBUG": "IN\u0000FO"}),
    "a lone surrogate": env_line(8, {"NCCL_DEBUG": "\ud800"}),
    "too many variables": env_line(9, {f"NCCL_X{i}": "1" for i in range(257)}),
    "cut short": env_line(10, RENDERED)[:-3],
    "not JSON": '{"event":"env", rank: 11}',
    "another event": env_line(12, RENDERED, event="envy"),
    "nested past the parser": '{"event":"env","rank":13,"env":' + "[" * 5000,
}


def test_bad_reports_are_output_and_nothing_more(fleet_pool, quota, team, researcher):
    job = dispatched_job(team, researcher)
    first, _ = runs_of(job)
    relay(first, list(BAD_REPORTS.values()))
    assert LogLine.objects.filter(run=first).count() == len(BAD_REPORTS)
    assert not RankEnvironment.objects.exists()
    assert job_rank_environments(job=job).ranks == []


def test_the_first_report_of_a_rank_counts(fleet_pool, quota, team, researcher):
    job = dispatched_job(team, researcher)
    first, second = runs_of(job)
    relay(first, [env_line(0, RENDERED)])
    relay(second, [env_line(0, {"NCCL_DEBUG": "TRACE"})], first_seq=1)
    relay(first, [env_line(0, {})], first_seq=2)
    (stored,) = RankEnvironment.objects.filter(job=job)
    assert (stored.run_id, stored.env) == (first.pk, RENDERED)


def test_a_requeued_job_shows_its_newest_attempt(fleet_pool, quota, team, researcher):
    job = dispatched_job(team, researcher)
    first, _ = runs_of(job)
    relay(first, [env_line(0, RENDERED)])
    newer = Run.objects.create(
        job=job, node=first.node, attempt=2, node_rank=0, plan={"env": {"NCCL_DEBUG": "WARN"}}
    )
    relay(newer, [env_line(0, {"NCCL_DEBUG": "WARN"})])
    environments = job_rank_environments(job=job)
    assert environments.attempt == 2
    assert environments.rendered == {"NCCL_DEBUG": "WARN"}
    assert [(r.rank, r.matches) for r in environments.ranks] == [(0, True)]
