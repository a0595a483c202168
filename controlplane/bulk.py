"""Bulk inserts at PostgreSQL's COPY speed, for the append-only rows a pass writes by the thousand.

Events, audit rows and allocations are inserted with `COPY ... FROM STDIN` on
PostgreSQL (several times faster than a multi-row INSERT, whose parameters psycopg
must format one by one); elsewhere with Django's bulk_create. Rows are plain
tuples in the order of `fields`; model defaults are not applied, so give every
column the table needs.
"""

from collections.abc import Iterable, Sequence

from django.db import connection, models


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
