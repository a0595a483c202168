"""The bulk helpers of controlplane/bulk.py: InArray and fetch_rows (the scheduler's
pass), insert_with (a job submit's three rows in one statement).

They run on whichever database the suite has (SQLite, or PostgreSQL in CI): InArray
and fetch_rows must give what Django's own `__in` and `values_list` would, and
insert_with what saving each row in one transaction would.
"""

import datetime as dt
from decimal import Decimal

import pytest
from django.apps import apps
from django.db import DatabaseError, DataError, IntegrityError, connection, transaction
from django.utils import timezone
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.jobs.models import Job, JobEvent
from apps.jobs.scheduler.read import Epoch
from controlplane.bulk import (
    InArray,
    _binary_copy_types,
    _preparers,
    fetch_batches,
    fetch_rows,
    insert_rows,
    insert_with,
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


def _job_records(job):
    from apps.accounts.services import audit_event, snapshot
    from apps.jobs.models import JobEvent

    return [
        JobEvent(job=job, from_state="", to_state="pending", reason="submitted"),
        audit_event(actor=None, action="job.submit", obj=job, after=snapshot(job)),
    ]


def _unsaved_job(team, name="together", key=""):
    return Job(
        name=name,
        team=team,
        kind="command",
        spec={"argv": ["true"]},
        gpu_type="H100",
        nodes=1,
        gpus_per_node=8,
        dp_shard=8,
        placement="owned",
        time_limit_s=600,
        idempotency_key=key,
        queued_at=dt.datetime(2026, 12, 1, tzinfo=dt.UTC),
    )


def _inserted_as_one_unit(team, name="together"):
    from apps.accounts.models import AuditEvent
    from apps.jobs.models import JobEvent

    job = _unsaved_job(team, name=name)
    objects = insert_with(job, _job_records)
    assert objects[0] is job and job.pk is not None and not job._state.adding
    stored = Job.objects.get(pk=job.pk)
    assert stored.name == name and stored.spec == {"argv": ["true"]}
    assert stored.submitted_at is not None  # auto_now_add, as save() would set it
    assert stored.pool_id is None and stored.admitted_at is None  # NULLs stay NULL
    event = JobEvent.objects.get(job=job)
    assert (event.to_state, event.reason) == ("pending", "submitted") and event.at is not None
    audit = AuditEvent.objects.get(action="job.submit", object_id=str(job.pk))
    assert audit.object_repr == f"{name} (#{job.pk})"
    # The audit row's snapshot was taken with the job's id and insert-time values.
    assert audit.after["id"] == job.pk and audit.after["submitted_at"] is not None
    # The objects handed back hold the id the database drew, as the rows do.
    _, event_object, audit_object = objects
    assert event_object.job_id == job.pk and audit_object.object_id == str(job.pk)
    assert audit_object.object_repr == audit.object_repr and audit_object.after == audit.after
    return job


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


# Values of each type a short preparation takes, edge cases included: integers past
# every column's range (Django does not check them either), text with NUL and surrogates.
_SHORT = {
    int: st.integers(min_value=-(2**70), max_value=2**70),
    str: st.text(),
    bool: st.booleans(),
}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_short_preparation_gives_what_djangos_get_db_prep_save_gives(data):
    """insert_with prepares a value of a known field class and type without Django's
    generic steps: for every field of every model, the same value of the same type."""
    shortened = 0
    for model in apps.get_models():
        for field, plain, adapt in _preparers(model, True, connection.alias):
            if plain is None:
                continue
            shortened += 1
            value = data.draw(_SHORT[plain], label=f"{model.__name__}.{field.name}")
            expected = field.get_db_prep_save(
                field.pre_save(_with(model, field, value), True), connection
            )
            got = adapt(value) if adapt is not None else value
            assert (got, type(got)) == (expected, type(expected)), field
    assert shortened > 20  # the job's own integers, texts, flags and keys among them


def test_fields_of_other_classes_keep_djangos_preparation():
    """Datetimes (auto_now_add), JSON, UUIDs, decimals and any subclass of a known class
    are prepared by Django, whatever their value."""
    from apps.accounts.models import AuditEvent
    from apps.costs.models import UsageEntry

    prepared = {
        field.name: plain
        for model in (Job, JobEvent, AuditEvent)
        for field, plain, _ in _preparers(model, True, connection.alias)
    }
    assert prepared["queued_at"] is prepared["spec"] is prepared["uuid"] is None
    assert prepared["max_cost_usd"] is prepared["at"] is None
    assert (prepared["name"], prepared["nodes"], prepared["spot_allowed"]) == (str, int, bool)
    assert prepared["team"] is int  # a key to an auto-numbered row
    assert "id" not in prepared  # drawn by the database
    # A subclass (costs' MoneyField stores dollars as integer micro-dollars) keeps its own.
    usage = {f.name: plain for f, plain, _ in _preparers(UsageEntry, True, connection.alias)}
    assert usage["amount"] is usage["rate_per_hour"] is None


def _with(model, field, value):
    obj = model()
    setattr(obj, field.attname, value)
    return obj


def test_insert_with_writes_a_row_and_its_records_together(team):
    _inserted_as_one_unit(team)


def test_insert_with_sends_a_job_in_few_enough_parameters_for_psycopg_to_keep(team):
    if connection.vendor != "postgresql":
        pytest.skip("one statement on PostgreSQL only")
    sent = []

    def record(execute, sql, params, many, context):
        sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        _inserted_as_one_unit(team)
    insert = [params for sql, params in sent if sql.startswith("WITH new AS")]
    assert len(insert) == 1
    # The id is drawn inside that statement, not asked for before it.
    assert [sql for sql, _ in sent if "nextval" in sql] == [
        sql for sql, _ in sent if sql.startswith("WITH new AS")
    ]
    # psycopg keeps the parsed form of statements of up to 50 parameters; NULLs go as
    # literals, never as parameters.
    assert len(insert[0]) <= 50 and None not in insert[0]


def test_insert_with_writes_each_rows_own_nulls_and_values_one_after_another(team, researcher):
    """The statement's text is kept per pattern of NULLs: rows alternating between
    patterns must each get their own values in their own columns."""
    made = []
    for n in range(4):
        job = _unsaved_job(team, name=f"pattern-{n}")
        if n % 2:
            job.submitted_by, job.max_cost_usd = researcher, Decimal("12.50")
        insert_with(job, _job_records)
        made.append(job.pk)
    stored = Job.objects.filter(pk__in=made).order_by("pk")
    assert [(j.name, j.submitted_by_id, j.max_cost_usd) for j in stored] == [
        ("pattern-0", None, None),
        ("pattern-1", researcher.pk, Decimal("12.50")),
        ("pattern-2", None, None),
        ("pattern-3", researcher.pk, Decimal("12.50")),
    ]


def test_a_failed_insert_with_leaves_nothing_and_the_transaction_usable(team):
    from apps.jobs.models import JobEvent

    insert_with(_unsaved_job(team, name="first", key="k-1"), _job_records)
    clash = _unsaved_job(team, name="second", key="k-1")  # the same idempotency key
    with pytest.raises(IntegrityError):
        insert_with(clash, _job_records)
    assert clash.pk is None
    # The caller's transaction goes on: the clash left no job, event or audit row.
    assert list(Job.objects.values_list("name", flat=True)) == ["first"]
    assert JobEvent.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_insert_with_commits_by_itself_outside_a_transaction(team):
    assert not connection.in_atomic_block
    job = _inserted_as_one_unit(team)
    if connection.vendor == "postgresql":
        # Seen from a second connection: committed, with no BEGIN or COMMIT of ours.
        import psycopg

        settings = connection.settings_dict
        with psycopg.connect(
            host=settings["HOST"],
            port=settings["PORT"] or 5432,
            user=settings["USER"],
            dbname=settings["NAME"],
        ) as other:
            count = other.execute("SELECT count(*) FROM jobs_job WHERE id = %s", [job.pk])
            assert count.fetchone()[0] == 1


def _prepared_inserts() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall() if row[0].startswith("WITH new AS")]


def test_insert_with_is_prepared_on_the_server_after_the_connections_threshold(team):
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    connection.ensure_connection()
    threshold = connection.settings_dict["OPTIONS"].get("prepare_threshold")
    if threshold is None or connection.connection.prepare_threshold is None:
        pytest.skip("DATABASE_URL turns prepared statements off (prepare_threshold=none)")
    before = len(_prepared_inserts())
    for n in range(threshold + 1):
        _inserted_as_one_unit(team, f"prepared-{n}")
    assert len(_prepared_inserts()) == before + 1  # one statement, prepared once
    assert Job.objects.filter(name__startswith="prepared-").count() == threshold + 1


def test_without_a_threshold_insert_with_binds_on_the_client_and_prepares_nothing(
    team, monkeypatch
):
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "prepare_threshold", None)
    before = _prepared_inserts()
    for n in range(5):
        _inserted_as_one_unit(team, f"client-{n}")
    assert _prepared_inserts() == before
    assert Job.objects.filter(name__startswith="client-").count() == 5
