"""Celery tasks: thin, each one calls a service in apps/ (README, "Design").

Imported by the Celery app on start; every module here registers its tasks by name.
"""

from workers.tasks import (  # noqa: F401
    checkpoints,
    cloud,
    costs,
    fleet,
    jobs,
    outbox,
    provisioning,
    tuning,
)
