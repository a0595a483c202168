"""The bundled trainer's run.json for one attempt of a job (read by `python -m workers.trainer`).

Plain JSON built from the validated spec: the model (preset or sizes), the data,
the schedule, the parallel layout and where checkpoints go. The trainer owns
the meaning of each field (workers/trainer); this is the control plane's half.
"""

import json
import posixpath

from django.conf import settings

from apps.jobs import datasets
from apps.jobs.models import Job
from apps.jobs.specs import dp_shard_on


def checkpoint_dir(job: Job) -> str:
    """Where the job's checkpoints live: shared storage for multi-node jobs (settings). The one
    place it is computed: run.json names it, and the registry accepts only paths under it."""
    return posixpath.normpath(f"{settings.CHECKPOINT_ROOT}/{job.team.slug}/job-{job.pk}")


def layout_on(job: Job, nodes: int) -> dict[str, int]:
    """The job's parallel layout on `nodes` nodes: as submitted on job.nodes, and with
    dp_shard following the node count on fewer (specs.dp_shard_on says why; the submit
    rules checked it divides on every count of the range)."""
    dp_shard = job.dp_shard
    if nodes != job.nodes:
        dp_shard = dp_shard_on(
            nodes=nodes,
            gpus_per_node=job.gpus_per_node,
            dp_replicate=job.dp_replicate,
            tp=job.tp,
            pp=job.pp,
        )
    return {"dp_replicate": job.dp_replicate, "dp_shard": dp_shard, "tp": job.tp, "pp": job.pp}


def trainer_settings(trainer: dict, layout: dict[str, int]) -> dict:
    """run.json's training settings for a spec's `trainer` section on `layout`: all but the
    job's identity and its checkpoints. The advisor (apps/jobs/advisor.py) estimates a spec
    from the same settings before it is submitted."""
    return {
        "model": {"preset": trainer.get("preset"), "sizes": trainer.get("model")},
        "data": {"dataset": trainer.get("dataset", "synthetic"), "seq_len": trainer["seq_len"]},
        "schedule": {
            "steps": trainer["steps"],
            "global_batch": trainer["global_batch"],
            **{
                key: trainer[key]
                for key in ("micro_batch", "lr", "warmup_steps", "min_lr_ratio", "grad_clip")
                if trainer.get(key) is not None
            },
        },
        "precision": trainer.get("precision", "bf16"),
        "activation_checkpointing": trainer.get("activation_checkpointing", "selective"),
        "compile": trainer.get("compile", False),
        "attention_backend": trainer.get("attention_backend", "auto"),
        "layout": layout,
        # Pipeline schedule: "1f1b" or "interleaved_1f1b" (stages_per_rank stages on each rank).
        "pipeline": trainer.get("pipeline") or {"schedule": "1f1b"},
        # The same seed on every attempt: a resumed run continues the same data order.
        "seed": trainer.get("seed", 0),
        "collective_timeout_s": trainer.get("collective_timeout_s", 600),
        "log_every": trainer.get("log_every", 1),
        # Held-out evaluation (workers/trainer/evaluation.py): of the mixture's validation
        # splits, which the submit rules made sure there are (apps/jobs/datasets.py).
        "eval": {
            "every": (trainer.get("eval") or {}).get("every", 0),
            "batches": (trainer.get("eval") or {}).get("batches", 1),
        },
    }


def trainer_run_config(
    job: Job,
    *,
    attempt: int,
    nodes: int | None = None,
    resume_from: str | None = None,
    s3: dict | None = None,
) -> str:
    """run.json; its fields and defaults are documented in workers/trainer/config.py.

    `nodes` is the attempt's node count (job.nodes unless placed within its node range);
    `resume_from` the checkpoint the control plane chose (apps/checkpoints: the newest
    verified one whose copy the new nodes reach), `s3` where the trainer copies each one.
    """
    # The global batch stays the same on any node count: each data-parallel rank takes a
    # larger share of it on fewer nodes, so a resumed run keeps its schedule.
    trainer = job.spec["trainer"]
    config = trainer_settings(trainer, layout_on(job, job.nodes if nodes is None else nodes))
    mixture = datasets.job_datasets(job)
    if mixture:
        config["data"] = {
            "mixture": datasets.run_mixture(mixture),
            "seq_len": trainer["seq_len"],
        }
    config["job"] = {"id": job.pk, "uuid": str(job.uuid), "attempt": attempt, "name": job.name}
    config["checkpoint"] = {
        "dir": checkpoint_dir(job),
        "every_steps": trainer.get("checkpoint_every_steps"),
        "every_minutes": trainer.get("checkpoint_every_minutes"),
        # The trainer deletes none: retention (checkpoint_keep, checkpoint_keep_every and
        # the final step, apps/checkpoints/retention.py) deletes through the registry, so
        # no registered checkpoint loses its files behind the registry's back.
        "keep": 0,
        # The control plane names the checkpoint to resume from, or none: the trainer does
        # not pick one itself.
        "resume_from": resume_from,
        "resume_newest": False,
        "s3": s3,
    }
    # Starting weights (workers/trainer/hf.py reads them); a checkpoint resumed from wins.
    init_hf = datasets.init_hf_path(job)  # an S3 one: the node's copy the stage makes
    if init_hf:
        config["init"] = {"hf": init_hf}
    return json.dumps(config, indent=2, sort_keys=True)
