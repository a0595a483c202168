"""CSV exports of the pages' tables, safe to open in a spreadsheet.

Every export writes its cells through spreadsheet_safe here (csv_response, csv_stream); the
one exception, the ledger's COPY in apps/costs/selectors.py, neutralises text alike in SQL.
"""

import csv
import re
from collections.abc import Iterable, Iterator
from decimal import Decimal

from django.http import HttpResponse, StreamingHttpResponse
from rest_framework.renderers import BaseRenderer, JSONRenderer

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# A number already written as text (-3.5, 1e-07): a spreadsheet reads it as a number, not a
# formula, and should still be able to add it up.
PLAIN_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def spreadsheet_safe(value) -> str:
    """A cell a spreadsheet will not run as a formula (CSV injection): text starting with one
    of FORMULA_STARTS gets a leading quote, as OWASP advises. Numbers, and text that is just a
    number, are written as they are, so a negative one stays a number."""
    if isinstance(value, int | float | Decimal):
        return str(value)
    text = "" if value is None else str(value)
    if text.startswith(FORMULA_STARTS) and not PLAIN_NUMBER.fullmatch(text):
        return "'" + text
    return text


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
    """A CSV export streamed as it is read, for tables of millions of rows."""
    writer = csv.writer(_Line())

    def lines() -> Iterator[str]:
        yield writer.writerow(header)
        batch = []
        for row in rows:
            batch.append(writer.writerow([spreadsheet_safe(cell) for cell in row]))
            if len(batch) >= 2000:
                yield "".join(batch)
                batch = []
        if batch:
            yield "".join(batch)

    return csv_stream_text(filename, lines())


def csv_stream_text(filename: str, chunks: Iterable) -> StreamingHttpResponse:
    """Stream CSV text (or bytes) already formatted, e.g. by PostgreSQL's COPY; its text cells
    must already be neutralised as spreadsheet_safe does."""
    response = StreamingHttpResponse(chunks, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


class CsvRenderer(BaseRenderer):
    """Lets an API view answer `?format=csv`: the view returns the CSV itself (csv_response
    or csv_stream), and answers an error in JSON (see csv_errors_as_json), so this renders
    nothing of its own."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        raise TypeError("A CSV answer is made by its view (csv_response), not rendered.")


def csv_errors_as_json(request, response) -> None:
    """An error asked for as CSV answered in the API's one error shape, as JSON: call from a
    view's finalize_response."""
    renderer = getattr(request, "accepted_renderer", None)
    if response.status_code >= 400 and isinstance(renderer, CsvRenderer):
        request.accepted_renderer = JSONRenderer()
        request.accepted_media_type = JSONRenderer.media_type
