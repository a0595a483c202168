"""Celery tasks: thin, each one calls a service in apps/ (README, "Design").

Imported by the Celery app on start; every module here registers its tasks by name.
"""

from workers.tasks import checkpoints, cloud, costs, fleet, jobs, outbox, provisioning  # noqa: F401
