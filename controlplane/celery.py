"""The Celery app. Tasks live in workers/tasks and are found by name."""

import logging
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers.tasks"], related_name=None, force=False)
log = logging.getLogger(__name__)


@app.on_after_configure.connect
def _make_filesystem_queue_folders(sender, **kwargs):
    """kombu's filesystem transport needs its folders before the first message."""
    if (sender.conf.broker_url or "").startswith("filesystem://"):
        from pathlib import Path

        for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
            folder = sender.conf.broker_transport_options.get(key)
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)


def enqueue_on_commit(name: str, *args, covered_by: str, **options) -> None:
    """Send task `name` once the current transaction commits (at once outside one), so a
    worker never reads rows that are not there yet. A broker that cannot take it is logged,
    not raised: the request that asked has done its part, and `covered_by` says what takes
    the task up instead (the beat, a sweep), which the log line repeats."""
    from django.db import transaction

    def send():
        try:
            app.send_task(name, args=list(args), **options)
        except Exception:
            log.warning("could not enqueue %s (%s will)", name, covered_by, exc_info=True)

    transaction.on_commit(send)
