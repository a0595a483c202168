"""In Chromium: ops start an NCCL tuning run from its page, watch its progress, see the chart,
adopt the candidate, and the next job on the pool gets the adopted setting.

There is no GPU fabric here on which NCCL's settings change the speed: with gloo on the CPU
every candidate measures alike, and the adoption rule rightly adopts nothing. So the run's
figures are fed to `apps.tuning.runs.tuning_events_record` as its job's first node would
report them (its own candidate 30% faster, every round, with noise), while the job itself goes
through its states as the real dispatch moves it: the scheduling pass places it, job_dispatch
writes its run plans, and run_report says, per node, that it started and that it exited 0.
The benchmark's node side and a run through real agents are tested in
tests/workers/trainer/test_tuning.py and tests/e2e/."""

import random
import re

import pytest
from playwright.sync_api import expect

from apps.jobs import services as jobs
from apps.jobs.dispatch import job_dispatch, run_report
from apps.jobs.models import Job, JobState, Run
from apps.jobs.scheduler.run import scheduling_pass
from apps.tuning import runs
from apps.tuning.models import NcclProfile, TuningRun, TuningRunState
from tests.apps.jobs.conftest import command_spec
from tests.apps.tuning.conftest import h100_quota, ib_pool  # noqa: F401 (fixtures)
from tests.apps.tuning.test_runs import collective

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]
S = TuningRunState
SCREENSHOT = "/tmp/tpages-tuning-run.png"


def dispatched(job_id: int) -> list[Run]:
    """The scheduling pass places the job, dispatch writes a run plan per node."""
    scheduling_pass()
    job = Job.objects.get(pk=job_id)
    assert job.state == JobState.ADMITTED, job.pending_reason
    job_dispatch(job_id=job_id)
    return list(Run.objects.filter(job_id=job_id).order_by("node_rank"))


def each_reports(plans: list[Run], report: dict) -> None:
    for run in plans:
        run_report(node_id=run.node_id, run_id=run.pk, report=report)


def first_node_reports(run: TuningRun, round_: int, *, faster: int, rng: random.Random) -> None:
    """One round of figures as the first node's benchmark prints them: every candidate in the
    round's order, every operation and size; `faster` 1.3 × the rest; then the launch count."""
    drift = rng.uniform(0.9, 1.1)  # the fabric's mood this round: hits all alike
    events = []
    for candidate in run.order[round_]:
        for op in run.ops:
            for size in run.sizes:
                busbw = 100 * (1.3 if candidate == faster else 1.0) * drift * rng.gauss(1, 0.02)
                events.append(collective(candidate, round_, op, size, busbw))
    done = (round_ + 1) * len(run.candidates)
    events.append({"event": "tuning_launch", "done": done, "round": round_})
    assert runs.tuning_events_record(job_id=run.job_id, events=events, head=True) > 0


def test_start_watch_adopt_and_the_next_job_gets_the_setting(
    page,
    browser_login,
    ib_pool,  # noqa: F811
    h100_quota,  # noqa: F811
    team,
    ops_user,
    researcher,
):
    reported = []
    page.on("console", lambda message: reported.append(message.text))
    page.on("pageerror", lambda error: reported.append(str(error)))
    base = browser_login(page, ops_user)
    page.goto(f"{base}/nccl/profiles/")
    page.get_by_role("link", name="NCCL tuning").click()
    expect(page.locator("h1")).to_have_text("NCCL tuning runs")

    # A bad plan is refused on its field, and nothing is started.
    page.select_option("#id_pool", value=ib_pool.slug)
    page.select_option("#id_team", value=team.slug)
    page.fill("#id_rounds", "5")
    page.fill("#id_limit", "2")
    page.fill("#id_candidates", "NCCL_ALGO=Bogus\n")
    page.get_by_role("button", name="Start the tuning run").click()
    expect(page.locator(".form-errors")).to_contain_text("The tuning run was not started")
    expect(page.locator(".field.has-errors")).to_contain_text("NCCL_ALGO:")
    assert not TuningRun.objects.exists()

    page.fill("#id_candidates", "NCCL_ALGO=Ring\n")
    expect(page.locator("#id_approval_required")).to_be_checked()
    page.get_by_role("button", name="Start the tuning run").click()
    expect(page).to_have_url(re.compile(r"/nccl/tuning/\d+/$"))
    run = TuningRun.objects.get()
    total = run.launches_total
    assert run.candidates[1]["changes"] == {"NCCL_ALGO": "Ring"}
    assert total == 5 * len(run.candidates) and len(run.candidates) <= 3
    expect(page.locator("#run-state")).to_have_text("Queued")
    expect(page.locator("#run-progress-text")).to_contain_text(f"0 of {total} launches")
    expect(page.locator("#run-job")).to_contain_text(f"#{run.job_id}")

    # Its job is placed, dispatched and started on both nodes, as the agents would say.
    plans = dispatched(run.job_id)
    assert len(plans) == 4 and all(p.plan["files"][0]["path"] == "tuning.json" for p in plans)
    each_reports(plans, {"state": "running", "pid": 4242})
    expect(page.locator("#run-state")).to_have_text("Running")

    rng = random.Random(11)  # noqa: S311 (made-up figures)
    for round_ in range(run.rounds):
        first_node_reports(run, round_, faster=1, rng=rng)
        if round_ == 1:
            expect(page.locator("#run-progress-text")).to_contain_text(
                f"{2 * len(run.candidates)} of {total} launches"
            )
            expect(page.locator("#run-progress-text")).to_contain_text("min left")
    expect(page.locator("#run-progress-text")).to_contain_text(f"{total} of {total} launches")
    expect(page.locator("#run-charts svg.chart")).to_have_count(len(run.ops))

    each_reports(plans, {"state": "exited", "exit_code": 0})
    assert Job.objects.get(pk=run.job_id).state == JobState.SUCCEEDED
    run.refresh_from_db()
    assert run.state == S.JUDGING
    runs.tuning_run_judge(run.pk)  # the tuning.judge task's work

    expect(page.locator("#run-state")).to_have_text("Awaiting approval")
    page.wait_for_selector("#run-live:not([data-live])")  # the live region stops asking
    adopted_row = page.locator('#candidates-table tr[data-candidate="1"]')
    expect(adopted_row).to_contain_text("NCCL_ALGO=Ring")
    expect(adopted_row).to_contain_text("faster by")
    expect(page.locator("#run-charts polyline.bold")).to_have_count(len(run.ops))
    page.screenshot(path=SCREENSHOT, full_page=True)

    page.get_by_role("button", name="Adopt").click()
    expect(page.locator(".messages")).to_contain_text(f"Tuning run #{run.pk} adopted.")
    expect(page.locator("#run-state")).to_have_text("Adopted")
    tuned = NcclProfile.objects.get(pool=ib_pool)
    expect(page.locator("#run-adopted")).to_contain_text(f"{tuned.name} v1")
    expect(page.locator('#candidates-table tr[data-candidate="1"]')).to_contain_text("adopted")

    page.locator("#run-adopted a").click()
    expect(page).to_have_url(re.compile(rf"/nccl/profiles/{tuned.name}/$"))
    version = page.locator('#versions-table tr[data-version="1"]')
    expect(version).to_have_attribute("data-source", "adopted")
    expect(version).to_contain_text(f"#{run.pk}")
    expect(version).to_contain_text(ops_user.get_username())
    expect(page.locator('#lint-results tr[data-variable="NCCL_ALGO"]')).to_contain_text("Ring")

    assert not [text for text in reported if "Content Security Policy" in text], reported

    # The next multi-node job on the pool gets the adopted setting, and says which version.
    spec = command_spec(team, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=researcher)
    for plan in dispatched(job.pk):
        assert plan.plan["env"]["NCCL_ALGO"] == "Ring"
        assert (plan.nccl_profile, plan.nccl_profile_version) == (tuned.name, 1)
