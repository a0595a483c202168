"""Reservations through the API, and the scheduler keeping to them."""

import datetime as dt

import pytest
from django.utils import timezone

from apps.fleet.models import Node
from apps.jobs import services
from apps.jobs.models import Job, JobState, Reservation
from apps.jobs.scheduler.run import scheduling_pass
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


def window(client, nodes, *, team=None, starts_in_min=30, hours=4):
    start = timezone.now() + dt.timedelta(minutes=starts_in_min)
    body = {
        "name": "rack J1 firmware",
        "reason": "BMC and NIC firmware",
        "team": team,
        "nodes": [n.pk for n in nodes],
        "starts_at": start.isoformat(),
        "ends_at": (start + dt.timedelta(hours=hours)).isoformat(),
    }
    return client.post("/api/v1/reservations/", body, format="json")


def test_only_ops_reserve_nodes(fleet_pool, researcher, ops_user, api_for):
    nodes = list(Node.objects.filter(pool=fleet_pool))
    assert window(api_for(researcher), nodes).status_code == 403
    made = window(api_for(ops_user), nodes)
    assert made.status_code == 201, made.content
    assert Reservation.objects.get().nodes.count() == 4


def test_a_window_that_ends_before_it_starts_is_a_400(fleet_pool, ops_user, api_for):
    response = window(api_for(ops_user), list(Node.objects.all()), hours=-1)
    assert response.status_code == 400
    assert "ends_at" in response.json()["error"]["details"]
    assert not Reservation.objects.exists()


def test_nothing_is_placed_that_would_still_run_when_maintenance_starts(
    fleet_pool, quota, team, researcher, ops_user, api_for
):
    nodes = list(Node.objects.filter(pool=fleet_pool))
    window(api_for(ops_user), nodes[:3], starts_in_min=30)
    long_job, _ = services.job_submit(
        team=team,
        submitted_by=researcher,
        spec=command_spec(
            team,
            name="long",
            time_limit_s=3 * 3600,
            resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8},
        ),
    )
    short_job, _ = services.job_submit(
        team=team,
        submitted_by=researcher,
        spec=command_spec(
            team,
            name="short",
            time_limit_s=20 * 60,
            resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8},
        ),
    )
    scheduling_pass()
    long_job.refresh_from_db()
    short_job.refresh_from_db()
    assert long_job.state == JobState.PENDING
    assert long_job.pending_reason
    assert short_job.state == JobState.ADMITTED  # ends before the window opens


def test_a_teams_window_takes_only_that_teams_jobs(
    fleet_pool, quota, team, other_team, researcher, ops_user, api_for
):
    from apps.accounts import services as accounts
    from tests import factories

    nodes = list(Node.objects.filter(pool=fleet_pool))
    window(api_for(ops_user), nodes, team=other_team.pk, starts_in_min=-5, hours=8)
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    services.job_submit(team=team, spec=command_spec(team, name="mine"), submitted_by=researcher)
    stranger = factories.make_member(team=other_team, role="researcher")
    services.job_submit(
        team=other_team, spec=command_spec(other_team, name="theirs"), submitted_by=stranger
    )
    scheduling_pass()
    states = dict(Job.objects.values_list("name", "state"))
    assert states == {"mine": JobState.PENDING, "theirs": JobState.ADMITTED}
