"""The Celery app. Tasks live in workers/tasks and are found by name."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers.tasks"], related_name=None, force=False)


@app.on_after_configure.connect
def _make_filesystem_queue_folders(sender, **kwargs):
    """kombu's filesystem transport needs its folders before the first message."""
    if (sender.conf.broker_url or "").startswith("filesystem://"):
        from pathlib import Path

        for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
            folder = sender.conf.broker_transport_options.get(key)
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
