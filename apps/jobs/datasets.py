"""Datasets: registering a team's token shards, naming them in job specs, and what a run
needs to read them (run.json's mixture, and the stage plan that copies S3 ones to the node,
with the job's starting weights when they are on S3).

The index is the one `python -m workers.trainer.prepare` writes beside the shards. It is
read generically: any JSON object in it with a file name (`file` or `path`) and a `sha256`
names a file of the dataset; the totals are the index's own `tokens`/`documents`/`bytes`
when it has them, else the sums over its shards.
"""

import hashlib
import json
import posixpath
import re

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from apps.accounts.selectors import roles_of
from apps.accounts.services import audit_record
from apps.jobs.models import Dataset, Job
from apps.jobs.models.jobs import FINISHED_STATES
from apps.jobs.specs import plain_s3_uri
from controlplane.errors import ApplicationError

STAGE_PLAN_FILE = "stage.json"
_SLUG = re.compile(r"[a-z0-9][a-z0-9_-]{0,99}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
COUNTS = ("tokens", "documents", "bytes", "size")


def _invalid(field: str, message: str) -> ApplicationError:
    return ApplicationError(message, details={field: [message]})


def _deny(message: str) -> ApplicationError:
    return ApplicationError(message, code="permission_denied", status=403)


# --- reads ----------------------------------------------------------------------------------


def datasets_visible_to(*, user) -> QuerySet[Dataset]:
    """Ops (and superusers) see every team's datasets; everyone else their teams'."""
    roles = roles_of(user)
    datasets = Dataset.objects.select_related("team", "created_by")
    if roles.superuser or roles.ops:
        return datasets
    return datasets.filter(team_id__in=roles.team_ids)


def live_jobs_naming(dataset: Dataset) -> list[int]:
    """Ids of the team's jobs, not yet finished, whose mixture names the dataset. Read in
    Python, not as a JSON containment query, so SQLite (make run) answers the same."""
    live = Job.objects.filter(team_id=dataset.team_id).exclude(state__in=FINISHED_STATES)
    return [
        pk
        for pk, spec in live.values_list("pk", "spec").order_by("pk")
        if dataset.name in mixture_names((spec or {}).get("trainer") or {})
    ]


def mixture_names(trainer: dict) -> list[str]:
    mixture = (trainer.get("data") or {}).get("mixture") or []
    return [entry.get("dataset") for entry in mixture if isinstance(entry, dict)]


# --- the index ------------------------------------------------------------------------------


def _count(value, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _invalid(field, f"{field} must be a whole number, 0 or more.")
    return value


def index_summary(index) -> dict:
    """What the registry keeps of an index: its files, tokenizer and totals. A 400 naming
    the field (`index.shards.3.sha256`) for anything that does not hold."""
    if not isinstance(index, dict):
        raise _invalid("index", "The index must be a JSON object (the dataset's index.json).")
    files = []

    def walk(value, path: str) -> None:
        if isinstance(value, dict):
            for key, digest in (("file", "sha256"), ("path", "sha256"), ("docs", "docs_sha256")):
                name = value.get(key)
                if not isinstance(name, str) or digest not in value:
                    continue
                if not isinstance(value[digest], str) or not _SHA256.fullmatch(value[digest]):
                    raise _invalid(f"{path}.{digest}", "A SHA-256: 64 lower-case hex digits.")
                if name.startswith("/") or ".." in name.split("/") or not name.strip("/"):
                    raise _invalid(f"{path}.{key}", "A file name relative to the dataset.")
                if key != "docs":
                    files.append(value)
            for key, child in value.items():
                if key in COUNTS:
                    _count(child, f"{path}.{key}")
                walk(child, f"{path}.{key}")
        elif isinstance(value, list):
            for number, child in enumerate(value):
                walk(child, f"{path}.{number}")

    walk(index, "index")
    if not files:
        raise _invalid("index", "The index names no file with a sha256.")
    tokenizer = index.get("tokenizer")
    if not isinstance(tokenizer, dict):
        raise _invalid("index.tokenizer", "The index must say which tokenizer made it.")
    vocab_size = tokenizer.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise _invalid("index.tokenizer.vocab_size", "A whole number, 1 or more.")
    digest = tokenizer.get("sha256", "")
    if digest and (not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
        raise _invalid("index.tokenizer.sha256", "A SHA-256: 64 lower-case hex digits.")
    # workers/trainer/shards.py's format: {"splits": {"train": {"shards": [...]}, ...},
    # "totals": {...}}; a flatter index may list "shards" and its totals at the top.
    splits = index.get("splits")
    if isinstance(splits, dict):
        shards = [
            s
            for split in splits.values()
            if isinstance(split, dict) and isinstance(split.get("shards"), list)
            for s in split["shards"]
            if isinstance(s, dict)
        ]
    else:
        shards = index.get("shards")
        shards = [s for s in shards if isinstance(s, dict)] if isinstance(shards, list) else files
    totals = index.get("totals") if isinstance(index.get("totals"), dict) else index

    def total(*keys) -> int:
        for key in keys:
            if key in totals:
                return totals[key]
        return sum(next((s[k] for k in keys if k in s), 0) for s in shards)

    name = tokenizer.get("name", tokenizer.get("kind", ""))
    return {
        "tokenizer_name": str(name)[:200],
        "tokenizer_sha256": digest,
        "vocab_size": vocab_size,
        "shards": len(shards),
        "tokens": total("tokens"),
        "documents": total("documents"),
        "bytes": total("bytes", "size"),
    }


def check_uri(uri) -> str:
    """s3://bucket/prefix/ or an absolute shared path, written plainly (no `.`, `..`)."""
    if not isinstance(uri, str) or not uri or len(uri) > 1000:
        raise _invalid("uri", "Give s3://bucket/prefix/ or an absolute shared path.")
    if uri.startswith("s3://"):
        plain = plain_s3_uri(uri)
        if plain is None:
            raise _invalid("uri", "An S3 bucket name, then a plain prefix: s3://bucket/prefix/.")
        return plain
    if not uri.startswith("/") or posixpath.normpath(uri) != uri.rstrip("/") or "\x00" in uri:
        raise _invalid("uri", "An absolute path, written plainly (no ., .. or //), or s3://.")
    return uri.rstrip("/") or "/"


# --- writes ---------------------------------------------------------------------------------


def dataset_register(*, team, name: str, uri: str, index, by) -> Dataset:
    """Register a dataset of the team (its admins and researchers): where it lives and what
    its index says. The files are not read here: the nodes check each one's SHA-256 when
    they stage it, and the trainer when it opens it."""
    if by is not None and not roles_of(by).can_submit_for(team.pk):
        raise _deny(f"Only admins and researchers of {team.slug} register its datasets.")
    if not isinstance(name, str) or not _SLUG.fullmatch(name):
        raise _invalid("name", "A slug: lower-case letters, digits, - and _, up to 100.")
    uri = check_uri(uri)
    summary = index_summary(index)
    canonical = json.dumps(index, sort_keys=True, separators=(",", ":")).encode()
    try:
        with transaction.atomic():
            dataset = Dataset.objects.create(
                team=team,
                name=name,
                uri=uri,
                index=index,
                index_sha256=hashlib.sha256(canonical).hexdigest(),
                created_by=by if by is not None and by.pk else None,
                **summary,
            )
            audit_record(
                actor=by,
                action="dataset.register",
                obj=dataset,
                team=team,
                after={"name": name, "uri": uri, **summary},
            )
    except IntegrityError:
        raise _invalid("name", f"{team.slug} already has a dataset named {name}.") from None
    return dataset


def dataset_delete(*, dataset: Dataset, by) -> None:
    """Forget a dataset (its files stay where they are). Refused (409) while a job that is
    not finished names it: its next attempt would have nothing to read."""
    if by is not None and not roles_of(by).can_submit_for(dataset.team_id):
        raise _deny("Only the team's admins and researchers remove its datasets.")
    with transaction.atomic():
        dataset = Dataset.objects.select_for_update().get(pk=dataset.pk)
        jobs = live_jobs_naming(dataset)
        if jobs:
            listed = ", ".join(str(pk) for pk in jobs[:10])
            raise ApplicationError(
                f"Jobs not yet finished name {dataset.name}: {listed}.",
                code="in_use",
                status=409,
                details={"jobs": jobs[:100]},
            )
        audit_record(
            actor=by,
            action="dataset.delete",
            obj=dataset,
            team=dataset.team,
            before={"name": dataset.name, "uri": dataset.uri},
        )
        dataset.delete()


# --- job specs and runs ---------------------------------------------------------------------


def validation_windows(index: dict, seq_len: int) -> int:
    """How many sequences the trainer can evaluate on in a dataset's validation split: its
    shards' windows of seq_len + 1 tokens (workers/trainer/shards.py ShardedSource, which
    skips a shard shorter than one). 0 for an index without that split."""
    splits = index.get("splits") if isinstance(index, dict) else None
    split = splits.get("validation") if isinstance(splits, dict) else None
    shards = split.get("shards") if isinstance(split, dict) else None
    if not isinstance(shards, list) or seq_len < 1:
        return 0
    counts = (s.get("tokens") for s in shards if isinstance(s, dict))
    return sum((n - 1) // seq_len for n in counts if isinstance(n, int) and n > seq_len)


def check_mixture(*, team, trainer: dict, vocab_size: int | None, errors) -> None:
    """Each `trainer.data.mixture` entry names a dataset of the job's team whose tokenizer's
    ids the model's vocabulary holds (the trainer refuses a token id past it); with
    evaluation on, one of them at least has a validation split to evaluate on (the trainer
    evaluates those that have one and refuses to start when none has)."""
    names = mixture_names(trainer)
    if not names:
        return
    found = {d.name: d for d in Dataset.objects.filter(team=team, name__in=set(names))}
    if (trainer.get("eval") or {}).get("every") and found:
        seq_len = trainer.get("seq_len") or 0
        if not any(validation_windows(d.index, seq_len) for d in found.values()):
            errors.add(
                "trainer.eval.every",
                f"No dataset of the mixture has a validation split of a sequence "
                f"({seq_len + 1} tokens) or more to evaluate on: prepare one with "
                "--validation, or set eval.every to 0.",
            )
    for number, name in enumerate(names):
        field = f"trainer.data.mixture.{number}.dataset"
        dataset = found.get(name)
        if dataset is None:
            errors.add(field, f"{team.slug} has no dataset named {name}.")
        elif vocab_size is not None and dataset.vocab_size > vocab_size:
            errors.add(
                field,
                f"{name}'s tokenizer has {dataset.vocab_size} ids; the model's vocabulary "
                f"has {vocab_size}.",
            )


def node_dir(dataset: Dataset) -> str:
    """Where a node keeps its copy of an S3 dataset: under the node's dataset cache, one
    directory per team and per dataset and index, so a new index is a new copy and every
    job of the team that reads the same one reuses it."""
    return _team_cache_dir(dataset.team.slug, f"{dataset.pk}-{dataset.index_sha256[:16]}")


def _team_cache_dir(team_slug: str, key: str) -> str:
    """A directory of the team's part of the node's cache (the agent makes it the team's
    group's, so every job of the team there shares it)."""
    return posixpath.join(settings.DATASET_CACHE_DIR, team_slug, key)


def _mixture_found(job: Job) -> tuple[list[dict], dict[str, Dataset]]:
    """The spec's mixture and the team's datasets it names: one query per job, kept on the
    job object, as dispatch asks once per node."""
    mixture = (job.spec.get("trainer", {}).get("data") or {}).get("mixture") or []
    found = getattr(job, "_mixture_datasets", None)
    if found is None:
        names = {e["dataset"] for e in mixture}
        found = (
            {
                d.name: d
                for d in Dataset.objects.select_related("team").filter(
                    team_id=job.team_id, name__in=names
                )
            }
            if names
            else {}
        )
        job._mixture_datasets = found
    return mixture, found


def job_datasets(job: Job) -> list[tuple[Dataset, float]]:
    """The job's mixture: each dataset with its weight, in the spec's order."""
    mixture, found = _mixture_found(job)
    return [(found[e["dataset"]], float(e["weight"])) for e in mixture if e["dataset"] in found]


def missing_datasets(job: Job) -> list[str]:
    """Names in the job's mixture that are no longer datasets of its team (deleting one a
    live job names is refused, so this is for a row removed behind the services' back)."""
    mixture, found = _mixture_found(job)
    return [e["dataset"] for e in mixture if e["dataset"] not in found]


def run_mixture(datasets: list[tuple[Dataset, float]]) -> list[dict]:
    """run.json's `data.mixture`: where each dataset is on the node, and its weight."""
    return [
        {"path": node_dir(d) if d.on_s3 else d.uri, "weight": weight, "name": d.name}
        for d, weight in datasets
    ]


def init_hf_staged(job: Job) -> dict | None:
    """The job's starting weights (trainer.init.hf) when they are on S3: what the stage
    copies (`{"name", "uri", "dest"}`) into the team's cache on the node, one directory per
    S3 prefix (the stage keeps it in step with the prefix by ETag); None otherwise."""
    uri = _init_hf(job) or ""
    plain = plain_s3_uri(uri) if uri.startswith("s3://") else None
    if plain is None:
        return None
    key = "hf-" + hashlib.sha256(plain.encode()).hexdigest()[:16]
    return {"name": "init.hf", "uri": plain, "dest": _team_cache_dir(job.team.slug, key)}


def init_hf_path(job: Job) -> str | None:
    """run.json's init.hf: the directory the trainer reads, the node's copy of an S3 one."""
    staged = init_hf_staged(job)
    return staged["dest"] if staged else _init_hf(job)


def _init_hf(job: Job) -> str | None:
    """The spec's trainer.init.hf, as submitted."""
    return ((job.spec.get("trainer") or {}).get("init") or {}).get("hf")


def stage_plan(datasets: list[tuple[Dataset, float]], *, init_hf: dict | None = None) -> str:
    """stage.json for workers.trainer.stage: every dataset of the mixture (shared ones are
    checked in place, S3 ones copied into their cache directory) and the S3 starting weights."""
    entries = [
        {"name": d.name, "uri": d.uri, "dest": node_dir(d) if d.on_s3 else ""} for d, _ in datasets
    ]
    plan = {"datasets": entries, "hf": [init_hf] if init_hf else []}
    return json.dumps(plan, indent=2, sort_keys=True)


# --- lists ----------------------------------------------------------------------------------

CSV_COLUMNS = [
    "id",
    "team",
    "name",
    "uri",
    "tokenizer",
    "tokenizer_sha256",
    "vocab_size",
    "shards",
    "tokens",
    "documents",
    "bytes",
    "created_by",
    "created_at",
]


def csv_rows(datasets: QuerySet[Dataset]):
    """The CSV of the Datasets page and of `GET /api/v1/datasets/?format=csv` alike."""
    for d in datasets.iterator(chunk_size=500):
        yield [
            d.pk,
            d.team.slug,
            d.name,
            d.uri,
            d.tokenizer_name,
            d.tokenizer_sha256,
            d.vocab_size,
            d.shards,
            d.tokens,
            d.documents,
            d.bytes,
            d.created_by.username if d.created_by else "",
            d.created_at.isoformat(),
        ]
