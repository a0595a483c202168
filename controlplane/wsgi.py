"""WSGI entry point (gunicorn controlplane.wsgi)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()

# Node agents' heartbeats skip the middleware stack (apps/fleet/api/shortroad.py says why);
# every other request, and any heartbeat the view would refuse, goes to Django as before.
from apps.fleet.api.agent import heartbeat_fast_path  # noqa: E402 (needs Django set up)

application = heartbeat_fast_path(application)
