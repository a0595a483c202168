"""Bulk inserts at PostgreSQL's COPY speed, for the append-only rows a pass writes by the thousand.

Events, audit rows and allocations are inserted with `COPY ... FROM STDIN` on
PostgreSQL (several times faster than a multi-row INSERT, whose parameters psycopg
must format one by one); elsewhere with Django's bulk_create. Rows are plain
tuples in the order of `fields`; model defaults are not applied, so give every
column the table needs.
"""

from collections.abc import Iterable, Sequence

from django.core.exceptions import EmptyResultSet
from django.db import connection, models
from django.db.models import BooleanField, F, Func


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
        with connection.cursor() as cursor:  # noqa: SIM117 (the COPY needs the raw cursor)
            with cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
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
            cursor.execute(sql, [list(column) for column in zip(*rows, strict=True)])
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


def fetch_rows(queryset: models.QuerySet) -> list[tuple]:
    """A values_list queryset's rows (tuples, not flat), read in one fetch on PostgreSQL.

    Django reads 100 rows per fetch and passes each through its converters; for the
    scheduler's 50,000 pending jobs that costs more than the query. psycopg's own types
    (int, str, float, bool, Decimal, aware datetime) are what those converters would
    return on PostgreSQL for these columns (not for JSON ones: keep those on Django's
    path); other databases keep Django's path.
    """
    if connection.vendor != "postgresql":
        return [tuple(row) for row in queryset]
    try:
        sql, params = queryset.query.sql_with_params()
    except EmptyResultSet:  # e.g. filter(pk__in=[]): Django answers [] without a query
        return []
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


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
            return f"{sql} = ANY(%s::{array_type}[])", (*params, self.ids)
        if not self.ids:
            raise EmptyResultSet
        return f"{sql} IN ({', '.join(['%s'] * len(self.ids))})", (*params, *self.ids)
