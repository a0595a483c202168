"""Bulk inserts at PostgreSQL's COPY speed, for the append-only rows a pass writes by the thousand.

Events, audit rows and allocations are inserted with `COPY ... FROM STDIN` on
PostgreSQL (several times faster than a multi-row INSERT, whose parameters psycopg
must format one by one; faster too, on a logged table, than one INSERT from arrays,
which writes the heap row by row), in COPY's binary format where every column has
one; elsewhere with Django's bulk_create. Rows are plain tuples in the order of
`fields`; model defaults are not applied, so give every column the table needs.
"""

import contextlib
import functools
import json
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence

from django.core.exceptions import EmptyResultSet
from django.db import DEFAULT_DB_ALIAS, connection, connections, models, transaction
from django.db.models import BooleanField, F, Func

INTEGER_TYPES = frozenset({"smallint", "integer", "bigint"})


def int_array(values: Sequence[int]) -> str:
    """PostgreSQL's text form of an integer array, `{1,2,3}`, to pass as one parameter
    cast to `bigint[]`: psycopg would dump the list element by element, which for the
    10,000 node ids of a first scheduling pass costs six times as much. `%d` refuses anything
    that is not a number, so a value can never change the literal's shape."""
    return "{%s}" % ",".join(["%d"] * len(values)) % tuple(values)  # noqa: UP031


def array_param(values: Sequence, db_type: str) -> object:
    """One array parameter of `db_type` elements: integers as their literal (int_array),
    unless one is NULL; other types as a list, for psycopg to dump."""
    if db_type in INTEGER_TYPES:
        try:
            return int_array(values)
        except TypeError:  # a NULL among them
            pass
    return list(values)


def insert_rows(model: type[models.Model], fields: Sequence[str], rows: Iterable[tuple]) -> int:
    rows = list(rows)
    if not rows:
        return 0
    meta = model._meta
    if connection.vendor == "postgresql":
        from psycopg.types.json import Jsonb

        json_positions = [
            i for i, name in enumerate(fields) if isinstance(meta.get_field(name), models.JSONField)
        ]
        columns = ", ".join(connection.ops.quote_name(meta.get_field(f).column) for f in fields)
        table = connection.ops.quote_name(meta.db_table)
        types = _binary_copy_types(model, tuple(fields))
        options = " (FORMAT BINARY)" if types else ""
        # COPY goes by the raw cursor: its errors become Django's (DataError...) here.
        with (
            connection.cursor() as cursor,
            connection.wrap_database_errors,
            cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN{options}") as copy,
        ):
            if types:
                copy.set_types(types)
            for row in rows:
                if json_positions:
                    row = list(row)
                    for i in json_positions:
                        row[i] = None if row[i] is None else Jsonb(row[i])
                copy.write_row(row)
        return len(rows)
    attnames = [meta.get_field(f).attname for f in fields]
    model.objects.bulk_create(
        [model(**dict(zip(attnames, row, strict=True))) for row in rows], batch_size=500
    )
    return len(rows)


# Django's column types → the names psycopg dumps in COPY's binary format. Binary rows cost
# PostgreSQL and psycopg about a third of text rows (no timestamps or numbers written out
# and parsed back; bench/RESULTS.md); columns of any other type (inet...) go as text.
BINARY_COPY_TYPES = {
    "bigint": "int8",
    "integer": "int4",
    "smallint": "int2",
    "boolean": "bool",
    "double precision": "float8",
    "varchar": "varchar",
    "text": "text",
    "timestamp with time zone": "timestamptz",
    "date": "date",
    "uuid": "uuid",
    "jsonb": "jsonb",
}


@functools.cache
def _binary_copy_types(model: type[models.Model], fields: tuple[str, ...]) -> list[str] | None:
    """The binary COPY type of each column, or None if one has no binary form here."""
    types = []
    for name in fields:
        db_type = (model._meta.get_field(name).db_type(connection) or "").partition("(")[0]
        if db_type not in BINARY_COPY_TYPES:
            return None
        types.append(BINARY_COPY_TYPES[db_type])
    return types


def update_rows(
    model: type[models.Model],
    fields: Sequence[str],
    rows: Iterable[tuple],
    *,
    keys: Sequence[str] = ("id",),
) -> int:
    """Set `fields` on many rows, each to its own values: rows are (*keys, *values).

    On PostgreSQL one UPDATE joins the table to one array per column (one
    parameter per column, however many rows); elsewhere Django's bulk_update
    (by id, after one query for the ids when the keys are other columns).
    """
    rows = list(rows)
    if not rows:
        return 0
    meta = model._meta
    names = [*keys, *fields]
    columns = [meta.get_field(name) for name in names]
    if connection.vendor == "postgresql":
        quote = connection.ops.quote_name
        table = quote(meta.db_table)
        arrays = ", ".join(f"%s::{c.db_type(connection)}[]" for c in columns)
        aliases = ", ".join(f"c{i}" for i in range(len(columns)))
        assignments = ", ".join(
            f"{quote(c.column)} = v.c{i}" for i, c in enumerate(columns) if i >= len(keys)
        )
        matches = " AND ".join(
            f"{table}.{quote(c.column)} = v.c{i}" for i, c in enumerate(columns[: len(keys)])
        )
        sql = (
            f"UPDATE {table} SET {assignments} "  # noqa: S608 (names from the model)
            f"FROM unnest({arrays}) AS v({aliases}) WHERE {matches}"
        )
        with connection.cursor() as cursor:
            values = zip(*rows, strict=True)
            cursor.execute(
                sql,
                [
                    array_param(v, c.db_type(connection))
                    for v, c in zip(values, columns, strict=True)
                ],
            )
            return cursor.rowcount
    attnames = [c.attname for c in columns]
    n = len(keys)
    if list(keys) != ["id"]:
        # Other keys: find the ids in one query (filtered on the first key), then by id.
        first = {row[0] for row in rows}
        ids = {
            tuple(found[1:]): found[0]
            for found in model.objects.filter(**{f"{attnames[0]}__in": first}).values_list(
                "id", *attnames[:n]
            )
        }
        rows = [(ids[tuple(row[:n])], *row[n:]) for row in rows if tuple(row[:n]) in ids]
        attnames, n = ["id", *attnames[n:]], 1
    objects = [model(**dict(zip(attnames, row, strict=True))) for row in rows]
    model.objects.bulk_update(objects, attnames[n:], batch_size=500)
    return len(objects)


def update_logged(
    queryset: models.QuerySet,
    values: dict,
    *,
    log: type[models.Model],
    log_fields: Sequence[str],
    log_values: Sequence,
) -> int:
    """queryset.update(**values) and, for each row it updated, one row of `log` (an event
    table): (the updated row, *log_values) into (log_fields[0], *log_fields[1:]), where
    log_fields[0] is the log's foreign key to the updated model. Returns the rows updated.

    On PostgreSQL one statement (the UPDATE in a WITH, RETURNING the ids the INSERT
    reads), so the thousands of events of a scheduling pass are neither built in Python
    nor sent. Elsewhere the ids are read first (the caller has locked the rows, so they
    are the ones updated), then updated, then the events inserted.
    """
    if connection.vendor != "postgresql":
        ids = list(queryset.values_list("pk", flat=True))
        updated = queryset.update(**values)
        insert_rows(log, log_fields, ((row_id, *log_values) for row_id in ids))
        return updated
    from django.db.models.sql import UpdateQuery

    query = queryset.query.chain(UpdateQuery)
    query.add_update_values(values)
    try:
        update_sql, update_params = query.get_compiler(queryset.db).as_sql()
    except EmptyResultSet:  # e.g. filter(pk__in=[])
        return 0
    meta = log._meta
    quote = connection.ops.quote_name
    fields = [meta.get_field(name) for name in log_fields]
    columns = ", ".join(quote(f.column) for f in fields)
    placeholders = ", ".join(["%s"] * (len(fields) - 1))
    pk = quote(queryset.model._meta.pk.column)
    sql = (
        f"WITH moved AS ({update_sql} RETURNING {pk}) "  # noqa: S608 (names from the models)
        f"INSERT INTO {quote(meta.db_table)} ({columns}) SELECT {pk}, {placeholders} FROM moved"
    )
    prepared = [
        field.get_db_prep_save(value, connection)
        for field, value in zip(fields[1:], log_values, strict=True)
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, [*update_params, *prepared])
        return cursor.rowcount


def insert_with(
    first: models.Model, rest: Callable[[models.Model], Sequence[models.Model]]
) -> list[models.Model]:
    """Insert a new row and the rows that record it (`rest(first)`, built once `first`
    has its id and its insert-time values) as one unit: a job, its first event and its
    audit row.

    On PostgreSQL all of it is one statement, one round trip: the id is drawn from the
    table's sequence inside it (`new`, the first WITH), each INSERT (a WITH of its own)
    reads it from there, and the statement answers with it. Until then `first` carries a
    stand-in id, an 18-digit random number no row has (_stand_in), so `rest` builds its
    rows as usual: a foreign key to `first`, the id in an audit row's text and in its
    JSON snapshot. Wherever a value holds the stand-in, whole, the statement puts the
    drawn id instead (a text cut short through the stand-in would keep its first digits:
    the audit's 200 characters hold a job's repr, whose name is at most 100), and the
    Python objects get it too once the rows are in. Outside a transaction the statement
    commits by itself: no BEGIN and COMMIT either. Ids the database fills for the other
    rows are not read back. The statement is prepared on the server once a connection
    has sent it often enough (_statement_cursor). Elsewhere the rows are saved one by
    one in a transaction.
    """
    if connection.vendor != "postgresql":
        with transaction.atomic():
            first.save(force_insert=True)
            others = list(rest(first))
            for obj in others:
                obj.save(force_insert=True)
        return [first, *others]
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper itself: each use of the proxy costs a look-up
    meta = first._meta
    stand_in = _stand_in()
    first.pk, mark = stand_in, str(stand_in)
    try:
        inserts = [_insert_sql(first, db, stand_in, mark)]  # its auto_now_add values set first
        objects = [first, *rest(first)]
        inserts += [_insert_sql(obj, db, stand_in, mark) for obj in objects[1:]]
        chained = ", ".join(f"w{i} AS ({sql})" for i, (sql, _, _) in enumerate(inserts))
        sql = f"{NEW_ID}, {chained} SELECT id FROM new"  # noqa: S608 (names from the models)
        params = [meta.db_table, meta.pk.column, mark]
        params += [value for _, values, _ in inserts for value in values]
        # Inside a caller's transaction, a savepoint: a failed insert (a lost race on a
        # unique key) must leave the caller's transaction usable.
        unit = transaction.atomic() if db.in_atomic_block else contextlib.nullcontext()
        with unit, _statement_cursor(db) as cursor:
            cursor.execute(sql, params)
            new_id = cursor.fetchone()[0]
    except Exception:
        first.pk = None  # nothing was inserted
        raise
    new = str(new_id)
    for obj, (_, _, marked) in zip(objects, inserts, strict=True):
        for attname, kind, value in marked:
            if kind == ID:
                setattr(obj, attname, new_id)
            elif kind == TEXT_WITH_ID:
                setattr(obj, attname, value.replace(mark, new))
            else:  # JSON: what the row holds, read from the text that was sent
                setattr(obj, attname, json.loads(value.replace(mark, new)))
        obj._state.adding = False
        obj._state.db = db.alias
    return objects


def _statement_cursor(db):
    """A cursor for a statement sent on every submission: psycopg binds its parameters on
    the server and, after the connection's `prepare_threshold` uses (controlplane/env.py),
    prepares it, so PostgreSQL parses and plans it once per connection (about a quarter of
    its CPU for a submission's insert; bench/RESULTS.md). Django's own cursors bind on the
    client and never prepare; with no threshold, this is one of those."""
    if db.settings_dict["OPTIONS"].get("prepare_threshold") is None:
        return db.cursor()
    from django.db.backends.postgresql.base import ServerBindingCursor

    # What db.cursor() does, with the server-binding class in place of the client one:
    # the health check, the connection, Django's error classes and execute wrappers.
    db.close_if_health_check_failed()
    db.ensure_connection()
    with db.wrap_database_errors:
        return db._prepare_cursor(ServerBindingCursor(db.connection))


def _stand_in() -> int:
    """An id no row has (ids count up from 1; this is 18 digits long), random, so no text
    that a user wrote can hold it by design."""
    return 10**17 + secrets.randbelow(9 * 10**17)


# The id drawn from the sequence of the table (its name and column's are parameters), and
# the stand-in's text that marks where it goes.
NEW_ID = "WITH new AS (SELECT nextval(pg_get_serial_sequence(%s, %s)) AS id, %s::text AS stand_in)"

# How _insert_sql writes a value: sent as it is, NULL, the new row's id, text holding the
# id, JSON holding the id, JSON without it.
VALUE, NULL, ID, TEXT_WITH_ID, JSON_WITH_ID, JSON = range(6)
_WITH_ID = "replace(%s, (SELECT stand_in FROM new), (SELECT id::text FROM new))"
VALUE_SQL = {
    VALUE: "%s",
    NULL: "NULL",
    ID: "(SELECT id FROM new)",
    TEXT_WITH_ID: _WITH_ID,
    JSON_WITH_ID: f"{_WITH_ID}::jsonb",
    JSON: "%s::jsonb",
}


def _insert_sql(obj: models.Model, db, stand_in: int, mark: str) -> tuple[str, list, list[tuple]]:
    """INSERT of one new instance, its values as Model.save() would prepare them, the
    stand-in id (`mark` its text) replaced by the one drawn in the statement; with the
    fields whose value held the stand-in, as (attname, kind, the value sent)."""
    from psycopg.types.json import Jsonb

    kinds, params, marked = [], [], []
    for field, plain, adapt in _preparers(type(obj), obj.pk is None, db.alias):
        value = getattr(obj, field.attname) if plain is not None else None
        if plain is not None and type(value) is plain:
            if adapt is not None:
                value = adapt(value)
        elif plain is None or value is not None:  # a NULL stays one on the short way
            value = field.get_db_prep_save(field.pre_save(obj, add=True), db)
        if value is None:
            # NULLs written as such, not sent: a job's three rows then take fewer than the
            # 50 parameters up to which psycopg keeps a statement's parsed form
            # (bench/RESULTS.md).
            kinds.append(NULL)
            continue
        if type(value) is int:
            kind = ID if value == stand_in else VALUE
        elif isinstance(value, str):
            kind = TEXT_WITH_ID if mark in value else VALUE
        elif isinstance(value, Jsonb):
            value = (value.dumps or json.dumps)(value.obj)
            kind = JSON_WITH_ID if mark in value else JSON
        else:
            kind = VALUE
        kinds.append(kind)
        if kind != ID:
            params.append(value)
        if kind in (ID, TEXT_WITH_ID, JSON_WITH_ID):
            marked.append((field.attname, kind, value))
    return _insert_text(type(obj), obj.pk is None, tuple(kinds)), params, marked


@functools.cache
def _insert_fields(model: type[models.Model], pk_from_database: bool) -> tuple:
    return tuple(f for f in model._meta.concrete_fields if not (f.primary_key and pk_from_database))


# Field classes whose save-time preparation of a value of one exact type is known: the
# value as it is (text, a flag), the backend's integer adaptation, or the key of an
# auto-numbered row (what get_db_prep_save does for these, its generic steps skipped).
_TEXT_FIELDS = (models.CharField, models.TextField, models.SlugField)
_INTEGER_FIELDS = (
    models.IntegerField,
    models.SmallIntegerField,
    models.BigIntegerField,
    models.PositiveIntegerField,
    models.PositiveSmallIntegerField,
    models.PositiveBigIntegerField,
)
_AUTO_FIELDS = (models.AutoField, models.BigAutoField, models.SmallAutoField)


@functools.cache
def _preparers(model: type[models.Model], pk_from_database: bool, alias: str) -> tuple:
    """For each field _insert_sql writes: (field, the value's type that has a short
    preparation or None, the adaptation it takes or None). A value of another type, and
    every field of another class (subclasses included: they may prepare differently),
    go through Django's pre_save and get_db_prep_save. test_bulk holds both equal."""
    ops = connections[alias].ops
    preparers = []
    for field in _insert_fields(model, pk_from_database):
        kind, plain, adapt = type(field), None, None
        if kind in _TEXT_FIELDS:
            plain = str
        elif kind is models.BooleanField:
            plain = bool
        elif kind in _INTEGER_FIELDS:
            plain = int
            adapt = functools.partial(
                ops.adapt_integerfield_value, internal_type=field.get_internal_type()
            )
        elif (
            kind in (models.ForeignKey, models.OneToOneField)
            and type(field.target_field) in _AUTO_FIELDS
        ):
            plain, adapt = int, ops.validate_autopk_value
        preparers.append((field, plain, adapt))
    return tuple(preparers)


@functools.cache
def _insert_text(model: type[models.Model], pk_from_database: bool, kinds: tuple) -> str:
    """The INSERT's text for these fields, each value written as its kind says (made once
    per model and pattern of kinds: a few per model)."""
    quote = connections[DEFAULT_DB_ALIAS].ops.quote_name
    fields = _insert_fields(model, pk_from_database)
    columns = ", ".join(quote(f.column) for f in fields)
    values = ", ".join(VALUE_SQL[kind] for kind in kinds)
    table = quote(model._meta.db_table)
    return f"INSERT INTO {table} ({columns}) VALUES ({values})"  # noqa: S608


def fetch_rows(queryset: models.QuerySet) -> list[tuple]:
    """A values_list queryset's rows (tuples, not flat), read in one fetch on PostgreSQL.

    Django reads 100 rows per fetch and passes each through its converters; for the
    scheduler's 50,000 pending jobs that costs more than the query. psycopg's own types
    (int, str, float, bool, Decimal, aware datetime) are what those converters would
    return on PostgreSQL for these columns (not for JSON or inet ones: keep those on
    Django's path); other databases keep Django's path. Rows come in PostgreSQL's binary
    format: numbers are not written out as text and parsed back (the scheduler's read
    takes about a tenth less CPU; bench/RESULTS.md).
    """
    if connection.vendor != "postgresql":
        return list(queryset)  # values_list rows are tuples already
    query = _raw_query(queryset)
    if query is None:
        return []
    import psycopg

    # Django's cursors bind parameters client-side, which gives text results only: this
    # one binds them on the server (never preparing the statement, for poolers' sake).
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(*query, binary=True, prepare=False)
        return cursor.fetchall()


def _raw_query(queryset: models.QuerySet) -> tuple[str, tuple] | None:
    """The queryset's SQL and parameters, for a psycopg cursor of the connection's own,
    after the checks Django's cursor() makes; None when Django knows it matches nothing
    (e.g. filter(pk__in=[]), which Django answers without a query)."""
    try:
        sql, params = queryset.query.sql_with_params()
    except EmptyResultSet:
        return None
    connection.ensure_connection()
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    return sql, params


STREAM_BATCH = 2000  # rows fetch_batches hands over at a time


def fetch_batches(queryset: models.QuerySet, size: int = STREAM_BATCH) -> Iterator[list[tuple]]:
    """fetch_rows' rows in batches of up to `size`, while PostgreSQL is still sending the
    rest (libpq's chunked-rows mode, libpq 17 and later): the caller turns one batch
    into its own objects while the server produces the next, rather than waiting for all
    of them first: the scheduler's whole read of 50,000 pending jobs is about a fifth
    shorter (bench/RESULTS.md). Use up the iterator before the next query on the
    connection. Elsewhere (another database, an older libpq) one batch of everything.
    """
    import psycopg

    if connection.vendor != "postgresql" or psycopg.pq.version() < 170000:
        rows = fetch_rows(queryset)
        if rows:
            yield rows
        return
    query = _raw_query(queryset)
    if query is None:
        return
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        batch: list[tuple] = []
        for row in cursor.stream(*query, binary=True, size=size):
            batch.append(row)
            if len(batch) == size:
                yield batch
                batch = []
        if batch:
            yield batch


class InArray(Func):
    """`filter(InArray("node_id", ids))`: the column is one of `ids`, for thousands of ids.

    On PostgreSQL `column = ANY(%s)` with the ids as one array parameter; `__in` would
    send one placeholder per id, and formatting and parsing 9,000 of them costs more
    than the query. Elsewhere a plain IN list.
    """

    conditional = True
    output_field = BooleanField()

    def __init__(self, column: str, ids: Iterable[int]):
        super().__init__(F(column))
        self.ids = list(ids)

    def as_sql(self, compiler, connection, **extra):
        column = self.get_source_expressions()[0]
        sql, params = compiler.compile(column)
        if connection.vendor == "postgresql":
            array_type = column.output_field.db_type(connection)
            return f"{sql} = ANY(%s::{array_type}[])", (*params, array_param(self.ids, array_type))
        if not self.ids:
            raise EmptyResultSet
        return f"{sql} IN ({', '.join(['%s'] * len(self.ids))})", (*params, *self.ids)
