"""The bulk helpers of controlplane/bulk.py: InArray, fetch_rows, insert_rows and the
updates the scheduler's pass writes with.

They run on whichever database the suite has (SQLite, or PostgreSQL in CI): InArray
and fetch_rows must give what Django's own `__in` and `values_list` would.
"""

import datetime as dt
from decimal import Decimal

import pytest
from django.db import DatabaseError, DataError, connection, transaction
from django.utils import timezone

from apps.jobs.models import Job, JobEvent
from apps.jobs.scheduler.read import Epoch
from controlplane.bulk import (
    InArray,
    _binary_copy_types,
    fetch_batches,
    fetch_rows,
    insert_rows,
    int_array,
    update_logged,
    update_rows,
)
from tests import factories
from tests.apps.jobs.conftest import command_spec, fleet_pool, quota  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db


@pytest.fixture
def jobs(fleet_pool, quota, team, researcher):  # noqa: F811 (fixtures)
    from apps.jobs import services

    made = []
    for i in range(5):
        spec = command_spec(team, name=f"bulk-{i}")
        job, _ = services.job_submit(team=team, spec=spec, submitted_by=researcher)
        made.append(job)
    Job.objects.filter(pk__in=[made[1].pk, made[3].pk]).update(max_cost_usd=Decimal("12.50"))
    return made


def test_in_array_selects_updates_and_deletes_what_in_would(jobs):
    ids = [jobs[0].id, jobs[2].id, jobs[4].id, 10**12]  # one id that matches nothing
    assert sorted(Job.objects.filter(InArray("id", ids)).values_list("id", flat=True)) == sorted(
        Job.objects.filter(pk__in=ids).values_list("id", flat=True)
    )
    assert Job.objects.filter(InArray("id", ids)).update(state_reason="picked") == 3
    assert set(Job.objects.filter(state_reason="picked").values_list("id", flat=True)) == {
        jobs[0].id,
        jobs[2].id,
        jobs[4].id,
    }
    # On a foreign key's column, combined with other conditions.
    team_id = jobs[0].team_id
    assert Job.objects.filter(InArray("team_id", {team_id}), state_reason="picked").count() == 3
    assert Job.objects.filter(InArray("id", ids[:1])).delete()[1]["jobs.Job"] == 1
    assert Job.objects.count() == 4


def test_in_array_of_nothing_matches_nothing(jobs):
    assert list(Job.objects.filter(InArray("id", []))) == []
    assert Job.objects.filter(InArray("id", [])).update(state_reason="none") == 0


def test_in_array_sends_one_parameter_on_postgresql(jobs):
    if connection.vendor != "postgresql":
        pytest.skip("the array form is PostgreSQL's")
    sql, params = Job.objects.filter(InArray("id", [j.id for j in jobs])).query.sql_with_params()
    assert "= ANY(%s::bigint[])" in sql
    # The integers as the array's text form: psycopg would dump them one by one.
    assert params == ("{" + ",".join(str(j.id) for j in jobs) + "}",)


def test_int_array_is_the_text_form_and_takes_only_numbers():
    assert int_array([1, 22, 333]) == "{1,22,333}"
    assert int_array([]) == "{}"
    for bad in (["1}"], ["1,2"], [None], [object()]):
        with pytest.raises(TypeError):
            int_array(bad)


def test_update_rows_sets_each_rows_values_nulls_among_integers_included(jobs, fleet_pool):  # noqa: F811
    rows = [
        (jobs[0].id, fleet_pool.id, "first"),
        (jobs[1].id, None, "second"),  # an integer column with a NULL: not the literal form
        (jobs[2].id, fleet_pool.id, "third"),
    ]
    assert update_rows(Job, ("pool", "state_reason"), rows) == 3
    got = {
        job_id: (pool_id, reason)
        for job_id, pool_id, reason in Job.objects.values_list("id", "pool_id", "state_reason")
    }
    for job_id, pool_id, reason in rows:
        assert got[job_id] == (pool_id, reason)
    assert got[jobs[3].id][1] != "first"  # rows not named are left alone


def test_fetch_rows_gives_the_rows_values_list_gives(jobs):
    factories.make_node()  # a second table, and a datetime that may be NULL
    query = (
        Job.objects.annotate(queued=Epoch("queued_at"))
        .values_list("id", "team_id", "queued", "spot_allowed", "max_cost_usd", "admitted_at")
        .order_by("id")
    )
    rows = fetch_rows(query)
    assert rows == list(query)
    assert [row[4] for row in rows] == [None, Decimal("12.50"), None, Decimal("12.50"), None]
    assert all(isinstance(row[2], float) for row in rows)
    assert abs(rows[0][2] - jobs[0].queued_at.timestamp()) < 1e-3
    assert (
        fetch_rows(
            Job.objects.filter(queued_at__lt=dt.datetime(2000, 1, 1, tzinfo=dt.UTC)).values_list(
                "id"
            )
        )
        == []
    )
    assert fetch_rows(Job.objects.filter(pk__in=[]).values_list("id")) == []


def test_fetch_rows_reads_datetimes_and_text_as_django_does_and_keeps_its_checks(jobs):
    Job.objects.filter(pk=jobs[1].pk).update(admitted_at=timezone.now(), state_reason="tab\there")
    query = Job.objects.values_list("id", "admitted_at", "state_reason", "uuid").order_by("id")
    assert fetch_rows(query) == list(query)
    # As Django's own cursors: no query in a transaction that has failed.
    _refused_in_a_failed_transaction(lambda: fetch_rows(query.all()))  # `query` holds its rows


def _refused_in_a_failed_transaction(read) -> None:
    from django.db.transaction import TransactionManagementError

    with transaction.atomic():
        with (
            pytest.raises(DatabaseError),
            transaction.atomic(savepoint=False),
            connection.cursor() as cursor,
        ):
            cursor.execute("SELECT * FROM no_such_table")
        with pytest.raises(TransactionManagementError):
            read()


def test_fetch_batches_gives_fetch_rows_rows_a_batch_at_a_time(jobs):
    query = Job.objects.order_by("id").values_list("id", "name", "submitted_at", "max_cost_usd")
    batches = list(fetch_batches(query, size=2))
    if connection.vendor == "postgresql":
        assert [len(batch) for batch in batches] == [2, 2, 1]
    assert [row for batch in batches for row in batch] == fetch_rows(query.all())
    assert list(fetch_batches(query.filter(pk__in=[]))) == []
    assert list(fetch_batches(query.filter(name="nobody"))) == []
    assert Job.objects.count() == 5  # the connection is free again once they are used up
    _refused_in_a_failed_transaction(lambda: list(fetch_batches(query.all())))


EVENT_FIELDS = ("job", "at", "from_state", "to_state", "reason", "actor", "actor_label")


def _events(label: str) -> set[tuple]:
    return set(
        JobEvent.objects.filter(actor_label=label).values_list(
            "job_id", "at", "from_state", "to_state", "reason", "actor_id", "actor_label"
        )
    )


def _without_time(rows) -> set[tuple]:
    return {(row[0], *row[2:]) for row in rows}


def test_insert_rows_writes_the_rows_it_is_given_whatever_their_shape(jobs, researcher):
    at = timezone.now().replace(microsecond=123456)
    shapes = {
        # Only the ids vary.
        "ids": [(j.id, at, "pending", "admitted", "placed", None, "ids") for j in jobs],
        # A text column varies too.
        "text": [
            (j.id, at, "pending", "held", f"held {i}", None, "text") for i, j in enumerate(jobs)
        ],
        # One row: every column is the same in every row.
        "one": [(jobs[0].id, at, "pending", "held", "just one", None, "one")],
        # An integer column with a NULL among its values.
        "null": [
            (j.id, at, "held", "pending", "released", researcher.id if i % 2 else None, "null")
            for i, j in enumerate(jobs)
        ],
    }
    for label, rows in shapes.items():
        assert insert_rows(JobEvent, EVENT_FIELDS, rows) == len(rows)
        if connection.vendor == "postgresql":
            assert _events(label) == set(rows), label
        else:  # bulk_create gives `at` (auto_now_add) the time of the insert
            assert _without_time(_events(label)) == _without_time(rows), label


def test_update_logged_writes_one_event_per_row_it_updated(jobs, researcher):
    at = timezone.now().replace(microsecond=654321)
    Job.objects.filter(pk=jobs[2].pk).update(state="held")  # no longer matches the filter
    ids = [j.id for j in jobs]
    updated = update_logged(
        Job.objects.filter(InArray("id", ids), state="pending"),
        {"state": "admitted", "state_reason": "placed", "admitted_at": at},
        log=JobEvent,
        log_fields=EVENT_FIELDS,
        log_values=(at, "pending", "admitted", "placed", researcher.id, "logged"),
    )
    assert updated == 4
    moved = {j.id for j in jobs} - {jobs[2].id}
    assert set(Job.objects.filter(state="admitted").values_list("id", flat=True)) == moved
    assert Job.objects.get(pk=jobs[0].pk).admitted_at == at
    rows = {(i, at, "pending", "admitted", "placed", researcher.id, "logged") for i in moved}
    if connection.vendor == "postgresql":
        assert _events("logged") == rows
    else:  # bulk_create gives `at` (auto_now_add) the time of the insert
        assert _without_time(_events("logged")) == _without_time(rows)
    # Nothing to update: nothing logged, no error.
    nothing = Job.objects.filter(InArray("id", []), state="pending")
    assert (
        update_logged(
            nothing,
            {"state": "held"},
            log=JobEvent,
            log_fields=EVENT_FIELDS,
            log_values=(at, "pending", "held", "x", None, "none"),
        )
        == 0
    )
    assert not JobEvent.objects.filter(actor_label="none").exists()


def test_insert_rows_copies_in_binary_only_columns_it_has_a_binary_form_for(jobs):
    """Events and allocations go in COPY's binary format; a table with a column of another
    type (the audit log's inet address) goes as text, and both land the same."""
    if connection.vendor != "postgresql":
        pytest.skip("COPY is PostgreSQL's")
    from apps.accounts.models import AuditEvent
    from apps.accounts.services import AUDIT_BULK_FIELDS, audit_record_many

    assert _binary_copy_types(JobEvent, EVENT_FIELDS) == [
        "int8", "timestamptz", "varchar", "varchar", "varchar", "int4", "varchar",
    ]  # fmt: skip
    assert _binary_copy_types(AuditEvent, AUDIT_BULK_FIELDS) is None
    changes = [(j, {"state": "pending"}, {"state": "held", "n": i}) for i, j in enumerate(jobs)]
    assert audit_record_many(actor=None, action="job.held", changes=changes) == len(jobs)
    stored = AuditEvent.objects.filter(action="job.held").order_by("object_id")
    assert [(e.object_id, e.after) for e in stored] == sorted(
        (str(j.pk), {"state": "held", "n": i}) for i, j in enumerate(jobs)
    )


def test_insert_rows_refuses_a_value_too_long_for_its_column_as_django_would(jobs):
    if connection.vendor != "postgresql":
        pytest.skip("SQLite does not enforce a column's length")
    too_long = "x" * 301  # reason is varchar(300)
    rows = [(j.id, timezone.now(), "pending", "held", too_long, None, "long") for j in jobs]
    with pytest.raises(DataError), transaction.atomic():  # Django's error, not psycopg's
        insert_rows(JobEvent, EVENT_FIELDS, rows)
    assert not _events("long")
