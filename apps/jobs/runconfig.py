"""The bundled trainer's run.json for one attempt of a job (read by `python -m workers.trainer`).

Plain JSON built from the validated spec: the model (preset or sizes), the data,
the schedule, the parallel layout and where checkpoints go. The trainer owns
the meaning of each field (workers/trainer); this is the control plane's half.
"""

import json

from django.conf import settings

from apps.jobs.models import Job


def checkpoint_dir(job: Job) -> str:
    """Where the job's checkpoints live: shared storage for multi-node jobs (settings)."""
    root = settings.CHECKPOINT_ROOT.rstrip("/")
    return f"{root}/{job.team.slug}/job-{job.pk}"


def trainer_run_config(job: Job, *, attempt: int) -> str:
    trainer = job.spec["trainer"]
    config = {
        "job": {"id": job.pk, "uuid": str(job.uuid), "attempt": attempt, "name": job.name},
        "model": {"preset": trainer.get("preset"), "sizes": trainer.get("model")},
        "data": {"dataset": trainer["dataset"], "seq_len": trainer["seq_len"]},
        "schedule": {
            "steps": trainer["steps"],
            "global_batch": trainer["global_batch"],
        },
        "precision": trainer.get("precision", "bf16"),
        "activation_checkpointing": trainer.get("activation_checkpointing", "selective"),
        "compile": trainer.get("compile", False),
        "layout": {
            "dp_replicate": job.dp_replicate,
            "dp_shard": job.dp_shard,
            "tp": job.tp,
            "pp": job.pp,
        },
        "checkpoint": {
            "dir": checkpoint_dir(job),
            "every_steps": trainer.get("checkpoint_every_steps"),
            "every_minutes": trainer.get("checkpoint_every_minutes"),
            "resume_from": None,  # the checkpoints issue names the newest verified one
        },
    }
    return json.dumps(config, indent=2, sort_keys=True)
