"""Job submissions' short road (apps/jobs/api/submit.py): the view's own answer, or it hands
the request to Django before anything is written."""

import json

import pytest
from django.core.signals import request_finished

from apps.accounts import services as accounts
from apps.accounts.models import AuditEvent
from apps.jobs import services
from apps.jobs.api.submit import submit_fast_path
from apps.jobs.models import Job, JobEvent
from controlplane.observability import REQUESTS
from tests.apps.jobs.conftest import command_spec
from tests.shortroads import call, django_and_road

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
CHANGES_EACH_TIME = {"id", "uuid", "queued_at", "submitted_at"}


@pytest.fixture
def apps():
    with django_and_road(submit_fast_path) as both:
        yield both


@pytest.fixture
def token(researcher):
    return accounts.api_token_create(user=researcher, name="ci", scopes=["submit"], by=None)[1]


def post(app, spec, *, token, **extra):
    return call(app, token=token, path=JOBS, body=json.dumps(spec).encode(), **extra)


def comparable(answer):
    status, headers, body = answer
    fields = {k: v for k, v in json.loads(body).items() if k not in CHANGES_EACH_TIME}
    return status, {k: v for k, v in headers.items() if k != "Content-Length"}, fields


def finished_requests():
    seen = []
    request_finished.connect(receiver := lambda **kw: seen.append(1), weak=False)
    return seen, lambda: request_finished.disconnect(receiver)


def test_a_plain_submit_gets_the_views_answer_without_django(apps, fleet_pool, quota, team, token):
    django_app, fast = apps
    slow = post(django_app, command_spec(team, name="first"), token=token)
    before = REQUESTS.labels("POST", "job-list", "201")._value.get()
    seen, stop = finished_requests()
    try:
        quick = post(fast, command_spec(team, name="second"), token=token)
    finally:
        stop()
    assert quick[0] == 201
    assert not seen  # Django never saw it
    assert REQUESTS.labels("POST", "job-list", "201")._value.get() == before + 1
    slow_answer, quick_answer = comparable(slow), comparable(quick)
    assert quick_answer[:2] == slow_answer[:2]  # status and headers (Allow included)
    assert {**quick_answer[2], "name": "first", "spec": None} == {**slow_answer[2], "spec": None}
    first, second = Job.objects.order_by("id")
    assert second.pk == json.loads(quick[2])["id"] and second.name == "second"
    for job in (first, second):
        assert JobEvent.objects.filter(job=job, to_state="pending").count() == 1
    audits = [
        AuditEvent.objects.get(action="job.submit", object_id=str(job.pk))
        for job in (first, second)
    ]
    assert {(a.channel, a.address, a.actor_id) for a in audits} == {
        ("api", "127.0.0.1", first.submitted_by_id)
    }


@pytest.mark.parametrize(
    ("case", "status"),
    [
        ("no token", 401),
        ("unknown token", 401),
        ("read-only token", 403),
        ("not JSON", 400),
        ("a list", 400),
        ("NaN", 400),
        ("no name", 400),
        ("team not yours", 400),
        ("too many GPUs", 400),
        ("long key", 400),
        ("html only", 406),
        ("text body", 415),
    ],
)
def test_what_the_road_does_not_answer_gets_the_views_answer(
    apps, fleet_pool, quota, team, other_team, researcher, token, case, status
):
    django_app, fast = apps
    spec = command_spec(team)
    request = {"token": token, "path": JOBS, "body": json.dumps(spec).encode()}
    if case == "no token":
        request["token"] = None
    elif case == "unknown token":
        request["token"] = "cp_" + "x" * 40
    elif case == "read-only token":
        request["token"] = accounts.api_token_create(
            user=researcher, name="ro", scopes=["read"], by=None
        )[1]
    elif case == "not JSON":
        request["body"] = b"{nope"
    elif case == "a list":
        request["body"] = b"[1, 2]"
    elif case == "NaN":
        request["body"] = json.dumps({**spec, "max_cost_usd": float("nan")}).encode()
    elif case == "no name":
        request["body"] = json.dumps({k: v for k, v in spec.items() if k != "name"}).encode()
    elif case == "team not yours":
        request["body"] = json.dumps({**spec, "team": other_team.pk}).encode()
    elif case == "too many GPUs":
        too_many = {**spec, "resources": {"gpu_type": "H100", "gpus": 4096}}
        request["body"] = json.dumps(too_many).encode()
    elif case == "long key":
        request["HTTP_IDEMPOTENCY_KEY"] = "k" * 201
    elif case == "html only":
        request["HTTP_ACCEPT"] = "text/html"
    elif case == "text body":
        request["CONTENT_TYPE"] = "text/plain"
    seen, stop = finished_requests()
    try:
        quick = call(fast, **request)
    finally:
        stop()
    slow = call(django_app, **request)
    assert quick == slow
    assert quick[0] == status and "error" in json.loads(quick[2])
    assert seen  # Django answered it
    assert not Job.objects.exists()


def test_a_retried_submit_returns_the_first_job_on_either_road(
    apps, fleet_pool, quota, team, token
):
    django_app, fast = apps
    spec = command_spec(team)
    first = post(fast, spec, token=token, HTTP_IDEMPOTENCY_KEY="ci-run-7")
    again = post(fast, spec, token=token, HTTP_IDEMPOTENCY_KEY="ci-run-7")
    slow = post(django_app, spec, token=token, HTTP_IDEMPOTENCY_KEY="ci-run-7")
    assert (first[0], again[0], slow[0]) == (201, 200, 200)
    assert {json.loads(a[2])["id"] for a in (first, again, slow)} == {Job.objects.get().pk}


def test_a_failure_once_the_service_may_have_written_is_not_retried(
    apps, fleet_pool, quota, team, token, monkeypatch
):
    """Stands in for a failure after the insert (a lost connection, say): the road answers
    500 in the API's error shape and never hands the request to Django, which would
    submit the job a second time."""
    _, fast = apps
    real = services.job_submit

    def fails_after_writing(**kwargs):
        real(**kwargs)
        raise ConnectionError("lost after the insert")

    monkeypatch.setattr(services, "job_submit", fails_after_writing)
    seen, stop = finished_requests()
    try:
        status, _, body = post(fast, command_spec(team), token=token)
    finally:
        stop()
    assert status == 500 and json.loads(body)["error"]["code"] == "server_error"
    assert not seen
    assert Job.objects.count() == 1


def test_other_requests_go_to_django(apps, fleet_pool, quota, team, token):
    _, fast = apps
    services.job_submit(team=team, spec=command_spec(team), submitted_by=None)
    listed = call(fast, token=token, path=JOBS, method="GET", body=b"")
    assert listed[0] == 200 and json.loads(listed[2])["count"] == 1
    assert post(fast, command_spec(team), token=token, host="evil.example")[0] == 400
    assert post(fast, command_spec(team), token=token, QUERY_STRING="format=json")[0] == 201


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_connection_the_road_just_used_skips_the_health_check_and_an_idle_dead_one_is_replaced(
    fleet_pool, quota, team, token, monkeypatch
):
    """CONN_HEALTH_CHECKS sends `SELECT 1` before a request's first query; within
    ALIVE_BYPASS_S of a submit that the database answered, the next one skips it. Past
    that, a connection that died while idle is found out and replaced, as without the
    road."""
    import psycopg
    from django.core.handlers.wsgi import WSGIHandler
    from django.db import connection

    from controlplane import shortroads

    app = submit_fast_path(WSGIHandler())  # close_old_connections stays connected
    checks = []
    is_usable = connection.is_usable
    monkeypatch.setattr(connection, "is_usable", lambda: checks.append(1) or is_usable())
    assert post(app, command_spec(team, name="first"), token=token)[0] == 201
    checked = len(checks)
    assert post(app, command_spec(team, name="soon-after"), token=token)[0] == 201
    assert len(checks) == checked  # vouched for by the first: no SELECT 1

    monkeypatch.setattr(shortroads, "ALIVE_BYPASS_S", 0.0)  # as if idle past the window
    pid = connection.connection.info.backend_pid
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"]
    ) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    answer = post(app, command_spec(team, name="after-a-restart"), token=token)
    assert answer[0] == 201, answer
    assert len(checks) > checked and connection.connection.info.backend_pid != pid
    assert Job.objects.filter(name="after-a-restart").count() == 1


def test_a_submit_reads_its_token_team_and_pools_from_the_cache_in_one_round_trip(
    apps, fleet_pool, quota, team, token, monkeypatch
):
    from controlplane import exactcache
    from tests.controlplane.test_exactcache import CountingCache

    _, fast = apps
    assert post(fast, command_spec(team, name="fills-the-cache"), token=token)[0] == 201
    counting = CountingCache(exactcache.cache)
    monkeypatch.setattr(exactcache, "cache", counting)
    assert post(fast, command_spec(team, name="cached"), token=token)[0] == 201
    assert (counting.get_manys, counting.gets) == (1, 0)
    assert Job.objects.filter(name="cached").count() == 1
