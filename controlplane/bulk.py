"""Bulk inserts at PostgreSQL's COPY speed, for the append-only rows a pass writes by the thousand.

Events, audit rows and allocations are inserted with `COPY ... FROM STDIN` on
PostgreSQL (several times faster than a multi-row INSERT, whose parameters psycopg
must format one by one; faster too, on a logged table, than one INSERT from arrays,
which writes the heap row by row), in COPY's binary format where every column has
one; elsewhere with Django's bulk_create. Rows are plain tuples in the order of
`fields`; model defaults are not applied, so give every column the table needs.
"""

import functools
from collections.abc import Iterable, Iterator, Sequence

from django.core.exceptions import EmptyResultSet
from django.db import connection, models
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
    if db_type == "jsonb":
        from psycopg.types.json import Jsonb

        return [None if v is None else Jsonb(v) for v in values]
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
