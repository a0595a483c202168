"""Requests refused before any view reads them, and the request limits of Django answered in
the API's error shape on /api/ paths.

Query parameters with a NUL or a lone surrogate are refused for every page and endpoint at
once: PostgreSQL can neither store nor compare such text, so a filter that passed one on
would fail with a 500. Bodies and forms past Django's limits (DATA_UPLOAD_MAX_MEMORY_SIZE,
DATA_UPLOAD_MAX_NUMBER_FIELDS) are a 413 in the API's JSON shape rather than Django's page.
"""

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent
from django.http import HttpResponseBadRequest, JsonResponse

from controlplane.api import error_body, showable, unstorable_text_problem


def _is_api(request) -> bool:
    return request.path.startswith("/api/")


def _too_large(exc: Exception) -> JsonResponse:
    if isinstance(exc, RequestDataTooBig):
        message = f"The body is over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes."
    else:
        message = f"Over {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} parameters or fields."
    return JsonResponse(error_body("too_large", message), status=413)


def query_problems(query) -> dict[str, list[str]]:
    """Each query parameter whose name or values PostgreSQL could not take, with why."""
    problems = {}
    for name, values in query.lists():
        for text in (name, *values):
            problem = unstorable_text_problem(text)
            if problem is not None:
                problems[showable(name)] = [problem]
                break
    return problems


class BadRequestMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        try:
            problems = query_problems(request.GET)
        except TooManyFieldsSent as exc:
            if not _is_api(request):
                raise  # Django's 400 page
            return _too_large(exc)
        if problems:
            names = ", ".join(problems)
            if _is_api(request):
                message = f"Invalid query parameters: {names}."
                return JsonResponse(error_body("invalid", message, problems), status=400)
            reasons = " ".join(f"{name}: {' '.join(why)}" for name, why in problems.items())
            return HttpResponseBadRequest(
                f"Invalid query parameters. {reasons}", content_type="text/plain; charset=utf-8"
            )
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, RequestDataTooBig | TooManyFieldsSent) and _is_api(request):
            return _too_large(exception)
        return None
