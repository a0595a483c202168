"""Benchmarks (not tests): each prints its figures on its last line; see bench/RESULTS.md."""

import timeit


def interpreter_ms() -> float:
    """How quick this machine's Python is right now: the best of five timings of
    `sum(range(10**6))`, in ms. A shared VM's speed drifts by two to three times
    over a day; printed beside a run's figures, it says which runs can be compared."""
    return min(timeit.repeat("sum(range(10**6))", number=10, repeat=5)) * 100


def copy_objects(model, objects) -> int:
    """Write unsaved instances of `model` with PostgreSQL's COPY, their primary keys included
    (set them; `sequences_reset` afterwards): many times quicker than bulk_create for the
    hundreds of thousands of rows a page benchmark needs. Values as Django would save them,
    except that a set auto_now_add field keeps its value (the history is in the past)."""
    from django.db import connection

    fields = [f for f in model._meta.concrete_fields if f.column]  # not a composite key
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    written = 0
    with (
        connection.cursor() as cursor,
        cursor.cursor.copy(f"COPY {model._meta.db_table} ({columns}) FROM STDIN") as copy,
    ):
        for obj in objects:
            copy.write_row(
                [
                    f.get_db_prep_save(
                        value
                        if (value := getattr(obj, f.attname)) is not None
                        else f.pre_save(obj, add=True),
                        connection,
                    )
                    for f in fields
                ]
            )
            written += 1
    return written


def sequences_reset(*models) -> None:
    """Move the id sequences of these models past the ids COPY wrote."""
    from django.core.management.color import no_style
    from django.db import connection

    with connection.cursor() as cursor:
        for statement in connection.ops.sequence_reset_sql(no_style(), models):
            cursor.execute(statement)
