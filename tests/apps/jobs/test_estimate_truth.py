"""Afterwards, the truth beside the estimate: the Job page and the estimates page set the
advisor's predicted peak memory, step time and cost beside what the job measured."""

import csv
import datetime as dt
import io
from decimal import Decimal

import pytest
from django.utils import timezone

from apps.costs.models import JobDailySpend
from apps.jobs import services
from apps.jobs.models import Job, JobState, StepMetric
from tests.apps.costs.conftest import owned_price
from tests.apps.jobs.conftest import trainer_spec
from tests.apps.jobs.test_pages import finish

pytestmark = pytest.mark.django_db


def trained(team, user, *, name="pretrain", steps=(), cost=None, state=JobState.SUCCEEDED, mfu=0.5):
    """A tiny trainer job on 8 H100s, submitted (so it keeps its estimate), finished, with
    these (peak_mem_gib, tokens_per_s) steps and this metered cost; its steps report `mfu`
    (None: the trainer knew no GPU peak where they ran, as on CPU slots)."""
    spec = trainer_spec(team, preset="tiny", nodes=1, gpus_per_node=8, seq_len=128, name=name)
    spec.pop("team")
    job, _ = services.job_submit(team=team, spec={**spec, "name": name}, submitted_by=user)
    now = timezone.now()
    StepMetric.objects.bulk_create(
        StepMetric(
            job=job, attempt=1, step=n + 1, at=now, peak_mem_gib=peak, tokens_per_s=tps, mfu=mfu
        )
        for n, (peak, tps) in enumerate(steps)
    )
    if cost is not None:
        JobDailySpend.objects.create(
            day=now.date(), job_id=job.pk, team_id=team.pk, amount=Decimal(cost)
        )
    finish(job, state, ran_s=600)
    return Job.objects.get(pk=job.pk)


def test_the_job_page_sets_the_measured_beside_the_predicted(
    client, fleet_pool, quota, team, researcher
):
    owned_price(fleet_pool)
    # Tokens per step: 64 × 128 = 8,192; median tokens/s of 1,000, 4,096 and 9,000: 4,096.
    job = trained(team, researcher, steps=[(1.0, 1000), (2.5, 4096), (2.0, 9000)], cost="1.50")
    predicted = job.estimate["by_gpu_type"]["H100"]
    client.force_login(researcher)
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    section = html.split('id="estimate-truth"')[1].split("</section>")[0]
    assert "Estimate beside what happened" in html
    memory = section.split('data-quantity="peak_memory"')[1].split("</tr>")[0]
    assert f"{job.estimate['memory']['allocated_gib']:.1f} GiB" in memory
    assert "2.5 GiB" in memory  # the highest of its steps
    step = section.split('data-quantity="step_time"')[1].split("</tr>")[0]
    assert "2.000 s" in step  # 8,192 / 4,096
    assert f"{predicted['step_time_s']:.3f} s" in step
    cost = section.split('data-quantity="cost"')[1].split("</tr>")[0]
    assert "$1.50" in cost and f"${Decimal(predicted['cost']):,.2f}" in cost


def test_a_job_without_an_estimate_shows_no_such_section(
    client, fleet_pool, quota, team, researcher
):
    job = trained(team, researcher)
    Job.objects.filter(pk=job.pk).update(estimate=None)
    client.force_login(researcher)
    assert 'id="estimate-truth"' not in client.get(f"/jobs/{job.pk}/").content.decode()


def test_the_estimates_page_lists_errors_with_a_summary_in_bounded_queries(
    client,
    fleet_pool,
    quota,
    team,
    researcher,
    other_team,
    other_member,
    django_assert_max_num_queries,
):
    owned_price(fleet_pool)
    first = trained(team, researcher, name="first", steps=[(1.0, 8192)], cost="0.10")
    trained(team, researcher, name="second", steps=[(1.0, 8192), (3.0, 4096)], cost="0.20")
    trained(team, researcher, name="stopped", steps=[(2.0, 8192)], state=JobState.CANCELLED)
    trained(other_team, other_member, name="theirs", steps=[(9.0, 1)])
    client.force_login(researcher)
    with django_assert_max_num_queries(9):
        response = client.get("/jobs/estimates/")
    html = response.content.decode()
    assert "theirs" not in html
    rows = html.split('id="estimates-table"')[1].split("<tbody>")[1].split("<tr ")[1:]
    assert [row.split("</a>")[0].rsplit(">", 1)[1] for row in rows] == [
        "stopped",
        "second",
        "first",
    ]
    summary = html.split('id="estimate-summary"')[1].split("</p>")[0]
    assert "over 3 jobs" in summary  # memory and step time: every job that ran steps
    assert "over 2 jobs" in summary  # cost: the cancelled one stopped early
    # More jobs, no more queries.
    for n in range(5):
        trained(team, researcher, name=f"more-{n}", steps=[(1.0, 100)], cost="0.01")
    with django_assert_max_num_queries(9):
        client.get("/jobs/estimates/")

    predicted = first.estimate["memory"]["allocated_gib"]
    text = client.get("/jobs/estimates.csv?team=" + team.slug).content.decode()
    table = list(csv.reader(io.StringIO(text)))
    assert table[0][:4] == ["id", "team", "name", "state"]
    by_name = {row[2]: dict(zip(table[0], row, strict=True)) for row in table[1:]}
    assert set(by_name) == {"first", "second", "stopped", *(f"more-{n}" for n in range(5))}
    row = by_name["first"]
    assert float(row["peak_memory_gib_measured"]) == 1.0
    assert float(row["peak_memory_error_pct"]) == pytest.approx((predicted - 1) * 100, abs=0.1)
    assert float(row["step_time_s_measured"]) == 1.0  # 8,192 tokens a step at 8,192 a second
    assert row["cost_measured"] == "0.10"
    assert by_name["stopped"]["cost_measured"] == "" and by_name["stopped"]["cost_error_pct"] == ""
    assert float(by_name["second"]["step_time_s_measured"]) == pytest.approx(8192 / 6144, abs=1e-4)


def test_the_median_tokens_per_second_is_the_middle_of_an_odd_count(
    fleet_pool, quota, team, researcher
):
    from apps.jobs.selectors import estimates_beside_truth

    job = trained(team, researcher, steps=[(1.0, 10), (1.0, 8192), (1.0, 20), (1.0, 9e9), (1.0, 1)])
    (truth,) = estimates_beside_truth(jobs=[job])
    assert truth.step_time_s.measured == pytest.approx(8192 / 20)
    assert truth.gpu_type == "H100"
    assert dt.timedelta(0) < job.finished_at - job.started_at


def test_steps_on_cpu_slots_are_shown_but_not_scored(client, fleet_pool, quota, team, researcher):
    """A job whose steps report no MFU ran where the trainer knew no GPU's peak (the demo's
    local nodes): its H100 prediction is not scored against it, nor counted in the summary."""
    owned_price(fleet_pool)
    on_gpus = trained(team, researcher, name="on-gpus", steps=[(1.0, 8192)], cost="0.10")
    on_cpus = trained(
        team, researcher, name="on-cpus", steps=[(0.4, 50), (0.4, 60)], cost="0.10", mfu=None
    )
    from apps.jobs.selectors import estimate_errors_summary, estimates_beside_truth

    truths = {t.job.name: t for t in estimates_beside_truth(jobs=[on_gpus, on_cpus])}
    cpu = truths["on-cpus"]
    assert not cpu.on_rated_gpus and truths["on-gpus"].on_rated_gpus
    assert cpu.peak_memory_gib.measured == 0.4 and cpu.step_time_s.measured > 0
    assert [cpu.peak_memory_gib.error_pct, cpu.step_time_s.error_pct, cpu.cost.error_pct] == [
        None,
        None,
        None,
    ]
    assert truths["on-gpus"].step_time_s.error_pct is not None
    summary = estimate_errors_summary(list(truths.values()))
    assert {quantity: figures["jobs"] for quantity, figures in summary.items()} == {
        "peak_memory_gib": 1,
        "step_time_s": 1,
        "cost": 1,
    }
    client.force_login(researcher)
    section = client.get(f"/jobs/{on_cpus.pk}/").content.decode().split('id="estimate-truth"')[1]
    assert "Not scored:" in section.split("</section>")[0]
    assert "0.4 GiB" in section.split('data-quantity="peak_memory"')[1].split("</tr>")[0]
    other = client.get(f"/jobs/{on_gpus.pk}/").content.decode().split('id="estimate-truth"')[1]
    assert "Not scored:" not in other.split("</section>")[0]
