"""A researcher submits a job from the Submit page, sees it pending, and finds it in the Queue."""

import re

import pytest
from playwright.sync_api import expect

from apps.accounts import services as accounts
from tests import factories
from tests.apps.fleet.test_services import ready_node

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def fleet(team):
    """One owned pool of four 8-GPU H100 nodes, and 32 H100s of quota for the team."""
    site = factories.make_site(slug="jobs-site")
    rack = factories.make_rack(site=site, name="J1")
    pool = factories.make_owned_pool(site=site, slug="h100-owned")
    for unit in range(4):
        ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4, gpu_count=8)
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=32, by=None)
    return pool


def layout_labels(page) -> list[str]:
    return [text.strip() for text in page.locator("#id_layout option").all_text_contents()]


def test_submit_a_tiny_trainer_job_and_find_it_in_the_queue(
    page, browser_login, fleet, team, researcher
):
    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/submit/")
    expect(page.locator("h1")).to_have_text("Submit a job")

    page.fill("#id_name", "tiny-browser-run")
    page.select_option("#id_team", value=str(team.pk))
    expect(page.locator("#id_kind")).to_have_value("trainer")
    expect(page.locator("#id_preset")).to_have_value("tiny")
    page.select_option("#id_gpus", value="8")

    labels = layout_labels(page)
    assert labels[0] == "FSDP over all GPUs (default)"
    assert "FSDP 8" in labels
    assert "FSDP 4 × TP 2" in labels
    # tiny has 4 heads and 2 KV heads: tensor parallelism must divide both.
    assert not [label for label in labels if re.search(r"TP [48]\b", label)]

    # The outlook follows the form: where it would run, the jobs ahead, what it would cost.
    outlook = page.locator("#outlook")
    expect(outlook).to_contain_text("h100-owned: 4 nodes with 8 GPUs free now")
    expect(outlook).to_contain_text("the team holds 0 of its 32 H100 GPUs")
    page.select_option("#id_gpus", value="64")
    expect(outlook).to_contain_text("none can ever hold 8 × 8 H100")
    page.select_option("#id_gpus", value="8")
    expect(outlook).to_contain_text("there is room for it now")

    page.get_by_role("button", name="Submit", exact=True).click()

    expect(page).to_have_url(re.compile(r"/jobs/\d+/$"))
    job_id = re.search(r"/jobs/(\d+)/$", page.url).group(1)
    expect(page.locator("h1")).to_have_text("tiny-browser-run")
    expect(page.locator(".page-head .badge")).to_have_text("Pending")
    expect(page.locator(".callout")).to_contain_text("waiting for the next scheduling pass")
    expect(page.locator(".timeline li")).to_have_count(1)

    page.goto(f"{base}/jobs/")
    expect(page.locator("h1")).to_have_text("Queue")
    row = page.locator(f'#queue-table tr[data-job="{job_id}"]')
    expect(row).to_contain_text("tiny-browser-run")
    expect(row).to_contain_text("Pending")
    expect(row).to_contain_text("8 × H100")
    expect(row.locator("td.reason")).to_have_text("waiting for the next scheduling pass")


def test_more_gpus_bring_new_layout_choices(page, browser_login, fleet, researcher):
    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/submit/")
    assert not [label for label in layout_labels(page) if "replicate" in label]

    page.select_option("#id_gpus", value="16")

    # htmx swaps in the layouts for 2 nodes × 8 GPUs: HSDP (replicate over nodes) appears.
    expect(page.locator("#id_layout option", has_text="replicate 2").first).to_be_attached()
    assert "FSDP 16" in layout_labels(page)
    assert "replicate 2 × FSDP 8" in layout_labels(page)


def test_fp8_takes_the_tensor_parallel_layouts_away_and_bf16_brings_them_back(
    page, browser_login, fleet, researcher
):
    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/submit/")
    page.select_option("#id_gpus", value="8")
    expect(page.locator("#id_layout option", has_text="TP 2").first).to_be_attached()

    page.locator("summary", has_text="More training settings").click()
    page.select_option("#id_precision", value="fp8")

    expect(page.locator("#id_layout option", has_text="TP 2")).to_have_count(0)
    assert "FSDP 8" in layout_labels(page)
    page.select_option("#id_gpus", value="16")  # every control asks with the precision
    expect(page.locator("#id_layout option", has_text="FSDP 16")).to_be_attached()
    expect(page.locator("#id_layout option", has_text="TP 2")).to_have_count(0)
    page.select_option("#id_precision", value="bf16")
    expect(page.locator("#id_layout option", has_text="TP 2").first).to_be_attached()


def test_submit_a_trainer_job_with_environment_checkpoints_and_a_cost_cap(
    page, browser_login, fleet, team, researcher
):
    from apps.jobs.models import Job

    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/submit/")
    expect(page.locator("#id_team")).to_have_value(str(team.pk))  # the only team, chosen

    page.fill("#id_name", "checkpointed-run")
    page.fill("#id_checkpoint_every_steps", "50")
    page.fill("#id_max_cost_usd", "250")
    page.fill("#id_env", "WANDB_PROJECT=pretrain\nJUSTANAME")
    expect(page.locator("#id_git_repo")).to_be_hidden()  # a command job's field
    expect(page.locator("#id_nccl_overrides")).to_be_hidden()  # folded until asked for
    page.get_by_role("button", name="Submit", exact=True).click()

    # A line without a value is refused on its field, and what was typed stays.
    env = page.locator(".field", has=page.locator("#id_env"))
    expect(env.locator(".field-error")).to_have_text("Line 2: write NAME=value.")
    expect(page.locator("#id_checkpoint_every_steps")).to_have_value("50")
    page.fill("#id_env", "WANDB_PROJECT=pretrain\nLOG_LEVEL=debug")
    page.locator("summary", has_text="NCCL").click()
    page.fill("#id_nccl_overrides", "NCCL_ALGO=Ring")
    page.get_by_role("button", name="Submit", exact=True).click()

    overrides = page.locator(".field", has=page.locator("#id_nccl_overrides"))
    expect(overrides.locator(".field-error")).to_contain_text("Give nccl.reasons.NCCL_ALGO")
    expect(page.locator("#id_nccl_overrides")).to_be_visible()  # its part opens on an error
    page.fill("#id_nccl_reasons", "NCCL_ALGO=Tree hangs on 2.26 here")
    page.get_by_role("button", name="Submit", exact=True).click()

    expect(page).to_have_url(re.compile(r"/jobs/\d+/$"))
    expect(page.locator("h1")).to_have_text("checkpointed-run")
    job = Job.objects.get(pk=re.search(r"/jobs/(\d+)/$", page.url).group(1))
    assert job.spec["trainer"]["checkpoint_every_steps"] == 50
    assert job.spec["env"] == {"WANDB_PROJECT": "pretrain", "LOG_LEVEL": "debug"}
    assert job.spec["nccl"]["overrides"] == {"NCCL_ALGO": "Ring"}
    assert str(job.max_cost_usd) == "250.00"


def test_70b_on_one_gpu_does_not_fit_and_the_suggested_layout_submits_and_is_placed(
    page, browser_login, fleet, team, researcher
):
    from apps.jobs.models import Job
    from apps.jobs.scheduler.run import scheduling_pass
    from tests.apps.costs.conftest import owned_price

    owned_price(fleet)
    base = browser_login(page, researcher)
    page.goto(f"{base}/jobs/submit/")
    page.fill("#id_name", "seventy-b")
    page.select_option("#id_preset", value="70b")
    page.select_option("#id_gpus", value="1")

    advice = page.locator("#advice")
    verdict = advice.locator(".advice-verdict")
    expect(verdict).to_contain_text("FSDP 1: does not fit")
    expect(verdict).to_contain_text(re.compile(r"needs [\d.]+ GiB per GPU; an H100 has 80"))
    expect(verdict).to_contain_text("No layout of 1 GPUs fits")
    expect(advice.locator(".memory-lines")).to_contain_text("parameters")
    expect(advice.locator(".advice-basis")).to_contain_text("MFU")
    expect(page.locator("#id_check_memory")).to_be_checked()

    # Submitted as it stands, it is refused on the layout, with the numbers.
    page.get_by_role("button", name="Submit", exact=True).click()
    layout_field = page.locator(".field", has=page.locator("#id_layout"))
    expect(layout_field.locator(".field-error")).to_contain_text("GiB per GPU; an H100 has 80")

    # Four nodes of eight, a sequence at a time with full recomputation: layouts fit, and
    # the cheapest that ends in time is suggested.
    page.select_option("#id_gpus", value="32")
    page.locator("summary", has_text="More training settings").click()
    page.select_option("#id_activation_checkpointing", value="full")
    page.fill("#id_micro_batch", "1")
    page.locator("#id_micro_batch").dispatch_event("change")
    suggested = advice.locator("tr.is-suggested")
    expect(suggested).to_have_count(1)
    expect(suggested.locator(".badge.suggested")).to_have_text("suggested")
    expect(suggested).not_to_contain_text("does not fit")
    chosen = suggested.get_attribute("data-layout")
    page.select_option("#id_layout", value=chosen)
    expect(advice.locator(".advice-verdict")).to_contain_text("It is the suggested layout.")

    page.get_by_role("button", name="Submit", exact=True).click()
    expect(page).to_have_url(re.compile(r"/jobs/\d+/$"))
    job = Job.objects.get(pk=re.search(r"/jobs/(\d+)/$", page.url).group(1))
    assert (job.nodes, job.gpus_per_node) == (4, 8)
    assert "x".join(str(n) for n in (job.dp_replicate, job.dp_shard, job.tp, job.pp)) == chosen
    assert job.estimate["by_gpu_type"]["H100"]["fit"] != "no"
    expect(page.locator("#estimate-truth")).to_contain_text("Peak memory per GPU")

    scheduling_pass()  # the four nodes are free: it is placed
    expect(page.locator(".page-head .badge")).to_have_text("Admitted", timeout=15_000)
