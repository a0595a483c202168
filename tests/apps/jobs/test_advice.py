"""Before submit: the advisor's answer through POST /api/v1/jobs/estimate/, the Submit page's
advice fragment, and submit refusing a layout that fits no GPU (unless told not to check).

The memory model's constants are being calibrated: these tests lean only on what no
calibration changes (70b's weights alone outgrow one H100; tiny fits anywhere)."""

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.jobs.models import Job
from tests.apps.costs.conftest import owned_price
from tests.apps.jobs.conftest import command_spec, form_data, trainer_spec

pytestmark = pytest.mark.django_db

ESTIMATE = "/api/v1/jobs/estimate/"


def estimate(client, spec):
    return client.post(ESTIMATE, spec, format="json")


def test_70b_on_one_h100_does_not_fit_and_says_by_how_much(
    fleet_pool, quota, team, researcher, api_for
):
    owned_price(fleet_pool)
    spec = trainer_spec(team, preset="70b", nodes=1, gpus_per_node=1)
    response = estimate(api_for(researcher), spec)
    assert response.status_code == 200, response.content
    (h100,) = response.json()
    assert (h100["gpu_type"], h100["gpus"]) == ("H100", 1)
    chosen = h100["chosen"]
    assert chosen["fit"] == "no" and chosen["label"] == "FSDP 1"
    assert chosen["memory_gib"] > chosen["gpu_memory_gib"] > 79
    assert chosen["lines"]["parameters"] > 79  # its weights alone
    assert sum(chosen["lines"].values()) == pytest.approx(chosen["memory_gib"], abs=0.05)
    # One GPU has one layout, and it does not fit: nothing to suggest.
    assert [layout["fit"] for layout in h100["layouts"]] == ["no"]
    assert h100["suggested"] is None
    assert any("MFU" in line for line in h100["basis"])
    assert Job.objects.count() == 0  # nothing submitted


def test_tiny_on_eight_fits_with_a_time_cost_and_suggestion(
    fleet_pool, quota, team, researcher, api_for
):
    owned_price(fleet_pool)
    spec = trainer_spec(team, preset="tiny", nodes=1, gpus_per_node=8, seq_len=128)
    (h100,) = estimate(api_for(researcher), spec).json()
    assert h100["chosen"]["fit"] == "fits" and h100["chosen"]["layout"] == "1x8x1x1"
    assert {layout["fit"] for layout in h100["layouts"]} == {"fits"}
    suggested = h100["suggested"]
    assert suggested is not None and suggested["within_time_limit"]
    assert float(suggested["cost"]) > 0 and suggested["run_time_s"] > 0
    assert float(suggested["cost"]) == min(float(x["cost"]) for x in h100["layouts"])
    assert any("per GPU-hour in" in line for line in h100["basis"])


def test_a_command_spec_is_refused_naming_trainer(fleet_pool, quota, team, researcher, api_for):
    response = estimate(api_for(researcher), command_spec(team))
    assert response.status_code == 400
    assert "trainer" in response.json()["error"]["details"]


def test_another_teams_spec_is_refused_as_if_it_did_not_exist(
    fleet_pool, quota, team, other_member, api_for
):
    spec = trainer_spec(team, preset="tiny", nodes=1, gpus_per_node=8, seq_len=128)
    response = estimate(api_for(other_member), spec)
    assert response.status_code == 400
    assert "team" in response.json()["error"]["details"]


def test_submit_refuses_70b_on_one_gpu_with_the_numbers_unless_told_not_to_check(
    fleet_pool, quota, team, researcher, api_for
):
    client = api_for(researcher)
    spec = trainer_spec(team, preset="70b", nodes=1, gpus_per_node=1)
    refused = client.post("/api/v1/jobs/", spec, format="json")
    assert refused.status_code == 400
    (message,) = refused.json()["error"]["details"]["resources.layout"]
    assert re.search(r"needs [\d.]+ GiB per GPU; an H100 has 80", message), message
    assert "check_memory" in message
    assert Job.objects.count() == 0

    spec["trainer"]["check_memory"] = False
    taken = client.post("/api/v1/jobs/", spec, format="json")
    assert taken.status_code == 201, taken.content
    job = Job.objects.get()
    assert job.estimate["by_gpu_type"]["H100"]["fit"] == "no"
    assert job.estimate["memory"]["allocated_gib"] > 79


# --- the Submit page ----------------------------------------------------------------------------


def advice_page(client, user, **fields):
    client.force_login(user)
    data = {k: v for k, v in form_data(user.memberships.first().team, **fields).items()}
    return client.get("/jobs/submit/advice/", data)


def test_the_submit_pages_advice_says_70b_on_one_gpu_does_not_fit_with_the_numbers(
    client, fleet_pool, quota, team, researcher
):
    owned_price(fleet_pool)
    response = advice_page(client, researcher, preset="70b", gpus=1, gpus_per_node=1)
    assert response.status_code == 200
    html = response.content.decode()
    assert "does not fit" in html
    assert re.search(r"needs [\d.]+ GiB per GPU; an H100 has 80", html)
    assert "No layout of 1 GPUs fits" in html
    for line in ("parameters", "gradients", "optimizer", "activations", "runtime"):
        assert f'class="mem-{line}"' in html
    assert "MFU" in html  # the basis, in small print


def test_the_submit_pages_advice_marks_the_suggested_layout_among_those_that_fit(
    client, fleet_pool, quota, team, researcher
):
    owned_price(fleet_pool)
    client.force_login(researcher)
    client.get("/jobs/submit/advice/", form_data(team))  # the pools' capacity, cached
    with CaptureQueriesContext(connection) as few:
        client.get("/jobs/submit/advice/", form_data(team, preset="70b", gpus=8, gpus_per_node=8))
    with CaptureQueriesContext(connection) as many:
        response = client.get(
            "/jobs/submit/advice/", form_data(team, preset="70b", gpus=32, gpus_per_node=8)
        )
    # The session, the user, teams, the pools and their prices: none a layout at a time.
    assert len(many) == len(few) <= 16
    html = response.content.decode()
    rows = re.findall(r'<tr data-layout="([\dx]+)" class="fit-row-(\w+)( is-suggested)?"', html)
    assert len(rows) > 3
    suggested = [layout for layout, _, mark in rows if mark]
    assert len(suggested) == 1
    assert dict((layout, fit) for layout, fit, _ in rows)[suggested[0]] in ("fits", "tight")
    assert "Suggested:" in html or "It is the suggested layout." in html


def test_the_advice_waits_for_valid_fields_and_is_for_the_trainer_alone(
    client, fleet_pool, quota, team, researcher
):
    client.force_login(researcher)
    bad = client.get("/jobs/submit/advice/", form_data(team, global_batch="lots"))
    assert "Global batch" in bad.content.decode() or "whole number" in bad.content.decode()
    command = client.get("/jobs/submit/advice/", form_data(team, kind="command"))
    assert "Estimates are for the bundled trainer" in command.content.decode()
    unnamed = client.get("/jobs/submit/advice/", form_data(team, name=""))
    assert 'class="badge fit-fits"' in unnamed.content.decode()  # no name needed yet


def test_a_submit_refused_by_the_memory_check_shows_on_the_layout_field(
    client, fleet_pool, quota, team, researcher
):
    from tests.apps.jobs.test_submit_form import field_errors_of, post

    response = post(client, researcher, form_data(team, preset="70b", gpus=1, gpus_per_node=1))
    assert response.status_code == 200
    errors = field_errors_of(response.content.decode())
    (message,) = errors["layout"]
    assert "GiB per GPU; an H100 has 80" in message
    assert Job.objects.count() == 0

    unchecked = form_data(team, preset="70b", gpus=1, gpus_per_node=1)
    del unchecked["check_memory"]  # the box unticked
    response = post(client, researcher, unchecked)
    assert response.status_code == 302
    assert Job.objects.get().spec["trainer"]["check_memory"] is False
