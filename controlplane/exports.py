"""CSV exports of the pages' tables, safe to open in a spreadsheet."""

import csv
from collections.abc import Iterable, Iterator
from decimal import Decimal

from django.http import HttpResponse, StreamingHttpResponse

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def spreadsheet_safe(value) -> str:
    """A cell a spreadsheet will not run as a formula (CSV injection). Numbers are written
    as they are, so a negative one stays a number a spreadsheet can add up."""
    if isinstance(value, int | float | Decimal):
        return str(value)
    text = "" if value is None else str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def csv_response(filename: str, header: list[str], rows: Iterable[list]) -> HttpResponse:
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    writer = csv.writer(response)
    writer.writerow(header)
    for row in rows:
        writer.writerow([spreadsheet_safe(cell) for cell in row])
    return response


class _Line:
    """A file-like object whose write returns what it was given (for csv.writer)."""

    def write(self, text: str) -> str:
        return text


def csv_stream(filename: str, header: list[str], rows: Iterable[list]) -> StreamingHttpResponse:
    """A CSV export streamed as it is read, for tables of millions of rows. Cells must
    already be safe: free text through spreadsheet_safe (ids, numbers and times are)."""
    writer = csv.writer(_Line())

    def lines() -> Iterator[str]:
        yield writer.writerow(header)
        batch = []
        for row in rows:
            batch.append(writer.writerow(row))
            if len(batch) >= 2000:
                yield "".join(batch)
                batch = []
        if batch:
            yield "".join(batch)

    return csv_stream_text(filename, lines())


def csv_stream_text(filename: str, chunks: Iterable) -> StreamingHttpResponse:
    """Stream CSV text (or bytes) already formatted, e.g. by PostgreSQL's COPY."""
    response = StreamingHttpResponse(chunks, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response
