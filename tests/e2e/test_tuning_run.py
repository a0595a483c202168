"""A tuning run end to end: planned by the control plane, placed by the scheduler on the nodes
it names, dispatched to a real agent, which runs the driver (workers/trainer/tuning.py) and,
per candidate and round, torchrun with the collective benchmark under gloo on the CPU; the
figures the benchmark printed come back through the agent and are judged.

On the CPU the figures mean nothing (gloo reads no NCCL setting, so every candidate measures
alike): what is checked is the plumbing, and the arithmetic against a hand computation from
the lines the benchmark printed. Whether a setting helps is for a GPU fabric, which CI has not.
"""

import json
import math
import statistics

import pytest

from apps.accounts.models import OrgRoleName
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, JobState
from apps.jobs.scheduler.run import scheduling_pass
from apps.jobs.tuning_runs import tuning_run_start
from apps.tuning.models import TuningMeasurement, TuningRun, TuningRunState
from apps.tuning.runs import tuning_run_judge
from tests import factories
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
S = TuningRunState
SIZES = [2**10, 2**12]


def printed(job: Job) -> list[dict]:
    """The benchmark's and the driver's JSON lines, as the agent relayed them."""
    out = []
    for text in (
        job.log_lines.filter(stream="stdout").order_by("at", "seq").values_list("text", flat=True)
    ):
        if text.startswith("{"):
            data = json.loads(text)
            if data.get("event", "").startswith(("collective", "tuning")):
                out.append(data)
    return out


def measure(pool, team, **plan) -> tuple[TuningRun, Job]:
    ops = factories.make_org_user(role=OrgRoleName.OPS)
    run = tuning_run_start(
        pool=pool.slug,
        by=ops,
        team=team.slug,
        limit=1,
        rounds=5,
        ops=["all_reduce"],
        sizes=SIZES,
        warmup=1,
        iters=3,
        **plan,
    )
    scheduling_pass()
    job = Job.objects.get(pk=run.job_id)
    assert job.state == JobState.ADMITTED, job.pending_reason
    job_dispatch(job_id=job.pk)
    job = wait_for(
        "the tuning job to end",
        lambda: (j := Job.objects.get(pk=job.pk)).state in ("succeeded", "failed") and j,
        timeout_s=400,
        every_s=0.5,
    )
    assert job.state == JobState.SUCCEEDED, (job.state_reason, printed(job)[-5:])
    # The agent relays output apart from the exit: wait for the driver's last line.
    wait_for("the driver's end", lambda: any(e["event"] == "tuning_end" for e in printed(job)))
    run.refresh_from_db()
    assert run.state == S.JUDGING, run.state_reason
    return tuning_run_judge(run.pk), job


def test_a_tuning_run_is_pushed_to_the_ssh_node_and_measures_there(ssh_nodes, e2e_team):
    pool = factories.make_owned_pool(slug="e2e-tuning-ssh")
    (node,) = ssh_nodes(pool, count=1)
    run, job = measure(pool, e2e_team)
    assert job.runs.get().node_id == node.pk
    assert TuningMeasurement.objects.filter(run=run).count() == 2 * 5 * len(SIZES)
    (end,) = [e for e in printed(job) if e["event"] == "tuning_end"]
    assert (end["launches"], end["failed"]) == (10, 0)
    assert run.state in (S.NOTHING_ADOPTED, S.AWAITING_APPROVAL), run.state_reason


def test_a_tuning_run_on_two_local_nodes_keeps_what_the_benchmark_printed(local_nodes, e2e_team):
    """Two nodes, one rank each: every launch is a rendezvous of both nodes' torchrun on the
    first node's port, reused launch after launch; the benchmark's rank 0 may land on either
    node, and its figures count from both."""
    pool = factories.make_owned_pool(slug="e2e-tuning")
    nodes = local_nodes(pool, count=2, gpus=1)
    run, job = measure(pool, e2e_team)
    assert sorted(job.node_ids) == sorted(n.pk for n in nodes) and job.runs.count() == 2
    events = printed(job)

    # The driver ran every candidate in every round, in the plan's order, one launch each.
    launches = [e for e in events if e["event"] == "tuning_launch"]
    assert [(e["round"], e["candidate"]) for e in launches] == [
        (r, c) for r, order in enumerate(run.order) for c in order
    ]
    assert [e["done"] for e in launches] == list(range(1, 11)) and {e["rc"] for e in launches} == {
        0
    }
    assert run.launches_done == run.launches_total == 10

    # Every figure stored is one the benchmark printed for that candidate and round, and its
    # bandwidths are what nccl-tests' definitions give from its time (2 ranks: busbw = algbw).
    lines = [e for e in events if e["event"] == "collective"]
    assert len(lines) == 2 * 5 * len(SIZES) and {e["world_size"] for e in lines} == {2}
    stored = {
        (m.candidate, m.round, m.op, m.bytes): m for m in TuningMeasurement.objects.filter(run=run)
    }
    assert len(stored) == len(lines)
    for line in lines:
        figure = stored[line["candidate"], line["round"], line["op"], line["bytes"]]
        assert figure.busbw_gbps == line["busbw_gbps"] and figure.errors == 0 == line["errors"]
        # (It prints the time to 3 decimals of a µs and the bandwidths to 6 of a GB/s.)
        algbw = line["bytes"] / (line["time_us"] * 1e-6) / 1e9
        assert math.isclose(line["algbw_gbps"], algbw, rel_tol=1e-3, abs_tol=1e-6)
        assert math.isclose(line["busbw_gbps"], algbw * 2 * (2 - 1) / 2, rel_tol=1e-3, abs_tol=1e-6)

    # The verdict's changes, by hand: the median over rounds of log(candidate / baseline).
    (verdict,) = run.result["verdicts"].values()
    for change in verdict["changes"]:
        ratios = [
            math.log(
                stored[1, r, "all_reduce", change["bytes"]].busbw_gbps
                / stored[0, r, "all_reduce", change["bytes"]].busbw_gbps
            )
            for r in range(5)
        ]
        by_hand = 100 * math.expm1(statistics.median(ratios))
        assert math.isclose(change["change_pct"], by_hand, abs_tol=1e-3)
        assert change["low_pct"] <= change["change_pct"] <= change["high_pct"]
    assert run.state in (S.NOTHING_ADOPTED, S.AWAITING_APPROVAL), run.state_reason
