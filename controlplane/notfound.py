"""A page that finds nothing answers with the product's own 404 page, under DEBUG too.

Under DEBUG (`make run`) Django answers a view's Http404 with its technical page, which
lists every URL pattern; for another team's job that page would also differ from the one a
job that does not exist gets. Unknown addresses (no view) keep Django's page for developers.
"""

from django.http import Http404

from controlplane.views import not_found


class NotFoundPageMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if isinstance(exception, Http404):
            return not_found(request, exception)
        return None
