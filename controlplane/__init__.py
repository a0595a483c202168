"""The Django project: settings, URLs, the Celery app, WSGI and ASGI entry points."""

from controlplane.celery import app as celery_app

__all__ = ["celery_app"]
