"""A page that finds nothing is the product's own 404 page, under DEBUG (`make run`) too, and
another team's job reads exactly as a job that does not exist."""

import pytest
from django.test import override_settings

from apps.jobs import services
from tests import factories
from tests.apps.jobs import conftest as jobs_fixtures
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db

fleet_pool = jobs_fixtures.fleet_pool
quota = jobs_fixtures.quota


@override_settings(DEBUG=True)
def test_another_teams_job_is_the_products_404_page_even_under_debug(
    client, fleet_pool, quota, team, other_team
):
    owner = factories.make_member(team=team, role="researcher")
    job, _ = services.job_submit(
        team=team, spec=command_spec(team, name="secret-run"), submitted_by=owner
    )
    client.force_login(factories.make_member(team=other_team, role="researcher"))

    theirs = client.get(f"/jobs/{job.pk}/")
    missing = client.get(f"/jobs/{job.pk + 1000}/")

    for answer in (theirs, missing):
        html = answer.content.decode()
        assert answer.status_code == 404
        assert "<h1>Page not found</h1>" in html
        assert "URLconf" not in html and "secret-run" not in html
    assert theirs.content == missing.content  # nothing tells that the job exists
    assert client.get(f"/jobs/{job.pk}/log-tail/").content == missing.content


@override_settings(DEBUG=True)
def test_the_api_still_answers_a_missing_job_in_its_error_shape(api_for, researcher):
    answer = api_for(researcher).get("/api/v1/jobs/987654/")
    assert answer.status_code == 404
    assert answer.json()["error"]["code"] == "not_found"
