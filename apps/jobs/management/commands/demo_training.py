"""For `make run`, after demo_fleet: a dataset made from this repository's own text and one
small training run on it, so that the Datasets, Job and Checkpoints pages have a loss curve,
evaluations, checkpoints (the best of them marked) and something to export.

The dataset is prepared the way a team prepares one, by `python -m workers.trainer.prepare`
with a held-out split (the same command first learns a tokenizer.json from the corpus). It is
registered as foundation's `demo-docs` and named by the job's mixture. The job is submitted
by bob through the same service as the Submit page's and queues until the local nodes are
up. Safe to run again: once the dataset is registered it does nothing.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from apps.accounts.context import Origin, acting_from
from apps.accounts.models import Team
from apps.jobs import datasets
from apps.jobs import services as jobs
from apps.jobs.models import Dataset

DATASET = "demo-docs"
VOCAB = 2048
EOS = "</s>"
# Where the documents come from: the README by paragraphs, every Python module whole.
SOURCES = ("apps", "controlplane", "workers", "cpctl")
SPEC = {
    "name": "demo-docs-lm",
    "priority": "normal",
    "time_limit_s": 1800,
    "trainer": {
        "model": {
            "layers": 4,
            "dim": 128,
            "heads": 4,
            "kv_heads": 2,
            "ffn_dim": 384,
            "vocab_size": VOCAB,
            "max_seq_len": 256,
        },
        "data": {"mixture": [{"dataset": DATASET, "weight": 1}]},
        "eval": {"every": 50, "batches": 4},
        "steps": 300,
        "global_batch": 8,
        "seq_len": 128,
        "lr": 0.003,
        "precision": "fp32",
        "checkpoint_every_steps": 100,
    },
    "resources": {"gpu_type": "H100", "nodes": 1, "gpus_per_node": 2},
    "placement": {"where": "owned"},
}


def documents(base: Path) -> list[str]:
    readme = (base / "README.md").read_text()
    texts = [p.strip() for p in readme.split("\n\n") if p.strip()]
    for top in SOURCES:
        texts += [path.read_text() for path in sorted((base / top).rglob("*.py"))]
    return [t for t in texts if t]


def prepare(corpus: Path, tokenizer: Path, out: Path) -> None:
    """The trainer's own preparation, as its command (apps do not import workers): it learns
    the tokenizer from the corpus first (--train-tokenizer), then tokenises the corpus."""
    argv = [sys.executable, "-m", "workers.trainer.prepare", "--train-tokenizer", str(VOCAB)]
    argv += ["--tokenizer-file", str(tokenizer), "--tokenizer-name", "demo-docs-bpe-2048"]
    argv += ["--eos", EOS, "--validation", "0.05"]
    argv += ["--out", str(out), str(corpus)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=settings.BASE_DIR)
    if done.returncode != 0:
        raise CommandError(f"preparing the demo dataset failed: {done.stderr.strip()[-2000:]}")


def open_for_jobs(root: Path) -> None:
    """The jobs' own users read the dataset in place, as they would a shared path."""
    for directory, _, files in os.walk(root):
        os.chmod(directory, 0o755)  # noqa: S103 (demo data, read by the jobs' users)
        for name in files:
            os.chmod(Path(directory) / name, 0o644)


class Command(BaseCommand):
    help = "Prepare and register the demo dataset and submit one small training job (once)."

    def handle(self, *args, **options):
        team = Team.objects.filter(slug="foundation").first()
        users = get_user_model().objects.in_bulk(["alice", "bob"], field_name="username")
        if team is None or len(users) != 2:
            raise CommandError("run demo_fleet first: it makes team foundation, alice and bob")
        if Dataset.objects.filter(team=team, name=DATASET).exists():
            self.stdout.write(f"demo training: dataset {DATASET} is registered already")
            return
        root = Path(settings.VAR_DIR) / "datasets"
        work = root / "demo-work"
        out = root / DATASET
        for leftover in (work, out):  # an earlier start cut short before registering
            shutil.rmtree(leftover, ignore_errors=True)
        texts = documents(Path(settings.BASE_DIR))
        corpus = work / "corpus.jsonl"
        corpus.parent.mkdir(parents=True, exist_ok=True)
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        prepare(corpus, work / "tokenizer" / "tokenizer.json", out)
        index = json.loads((out / "index.json").read_text())
        shutil.rmtree(work)
        open_for_jobs(root)
        with acting_from(Origin(channel="cli", label="demo_training")):
            datasets.dataset_register(
                team=team, name=DATASET, uri=str(out), index=index, by=users["alice"]
            )
            job, _ = jobs.job_submit(
                team=team, spec={**SPEC, "team": team.pk}, submitted_by=users["bob"]
            )
        self.stdout.write(
            f"demo training: {len(texts)} documents, {index['totals']['tokens']} tokens in "
            f"{out}; job {job.pk} ({SPEC['name']}) queued by bob"
        )
