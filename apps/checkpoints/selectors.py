"""Reads of the registry, scoped to what the user may see; the agents' work; the watch on jobs
whose last verified checkpoint is overdue."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from django.conf import settings
from django.db.models import Count, OuterRef, Prefetch, Q, QuerySet, Subquery, Sum
from django.utils import timezone

from apps.accounts.selectors import roles_of, team_slugs
from apps.checkpoints.models import (
    LIVE_STATES,
    ON_STORAGE_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CheckpointExport,
    CheckpointState,
    CopyKind,
    CopyRequest,
    ExportState,
    S3Destination,
    StorageSweep,
)
from apps.checkpoints.retention import policy_for
from apps.jobs.models import JobKind, JobState
from apps.jobs.selectors import jobs_visible_to, step_times
from controlplane.exactcache import ExactCache

if TYPE_CHECKING:
    from apps.jobs.models import Job

C = CheckpointState
# "Nothing for this node": polls answered from the cache until a request is made for it.
agent_idle = ExactCache("checkpoints:agent-idle", max_timeout_s=30)
EMPTY_WORK = {"verify": [], "delete": [], "list": [], "export": []}


def checkpoints_visible_to(*, user) -> QuerySet[Checkpoint]:
    roles = roles_of(user)
    rows = Checkpoint.objects.select_related("job", "team", "node").prefetch_related(
        Prefetch("copies", queryset=CheckpointCopy.objects.select_related("node"))
    )
    if roles.sees_every_team:
        return rows
    return rows.filter(team_id__in=roles.team_ids)


def copies_visible_to(*, user) -> QuerySet[CheckpointCopy]:
    roles = roles_of(user)
    rows = CheckpointCopy.objects.select_related("checkpoint", "checkpoint__job", "node")
    if roles.sees_every_team:
        return rows
    return rows.filter(checkpoint__team_id__in=roles.team_ids)


def trainer_jobs_visible_to(*, user) -> QuerySet[Job]:
    """The jobs the Checkpoints page lists: trainer jobs of the user's teams, with the id of
    each one's newest live checkpoint."""
    newest = (
        Checkpoint.objects.filter(job=OuterRef("pk"), state__in=LIVE_STATES)
        .order_by("-step", "-committed_at")
        .values("state")[:1]
    )
    return (
        jobs_visible_to(user=user)
        .filter(kind=JobKind.TRAINER)
        .annotate(newest_state=Subquery(newest))
        .order_by("-submitted_at", "-id")
    )


def s3_destinations_visible_to(*, user) -> QuerySet[S3Destination]:
    """A team's destination to its members; every one, pools' too, to ops, finance and
    superusers (a bucket and prefix say where another team's checkpoints can be read)."""
    roles = roles_of(user)
    rows = S3Destination.objects.select_related("team", "pool").order_by("id")
    if roles.sees_every_team:
        return rows
    return rows.filter(team_id__in=roles.team_ids)


# --- what agents and the S3 task are asked to do -----------------------------------------------


def agent_checkpoint_work(*, node_id: int, now: dt.datetime | None = None) -> dict:
    """The checks, deletions, listings and exports this node's agent should do now."""
    if agent_idle.recall(str(node_id)) == "idle":
        return EMPTY_WORK
    now = now or timezone.now()
    copies = list(
        CheckpointCopy.objects.filter(request_node_id=node_id)
        .exclude(request=CopyRequest.NONE)
        .filter(Q(retry_after__isnull=True) | Q(retry_after__lte=now))
        .select_related("checkpoint")
        .order_by("requested_at", "id")[:50]
    )
    sweeps = list(
        StorageSweep.objects.filter(node_id=node_id, reported_at__isnull=True).order_by("id")[:10]
    )
    exports = list(
        CheckpointExport.objects.filter(node_id=node_id, state=ExportState.REQUESTED)
        .select_related("checkpoint")
        .order_by("id")[:10]
    )
    if not copies and not sweeps and not exports:
        agent_idle.remember(str(node_id), "idle")
        return EMPTY_WORK

    def item(copy):
        return {
            "copy": copy.pk,
            "path": copy.location,
            "manifest_sha256": copy.checkpoint.manifest_sha256,
            "requested_at": copy.requested_at.isoformat() if copy.requested_at else "",
        }

    return {
        "verify": [item(c) for c in copies if c.request == CopyRequest.VERIFY],
        "delete": [item(c) for c in copies if c.request == CopyRequest.DELETE],
        "list": [{"sweep": s.pk, "path": s.directory, "tidy": s.tidy} for s in sweeps],
        "export": [
            {
                "export": e.pk,
                "job": e.checkpoint.job_id,
                "path": e.source,
                "out": e.path,
                "manifest_sha256": e.checkpoint.manifest_sha256,
                "dtype": e.dtype,
                "timeout_s": settings.CHECKPOINT_EXPORT_TIMEOUT_S,
            }
            for e in exports
        ],
    }


@dataclass(frozen=True)
class S3Work:
    copy_id: int
    uri: str
    manifest_sha256: str


def _s3_requests(request: str, now: dt.datetime | None, limit: int) -> list[S3Work]:
    now = now or timezone.now()
    rows = (
        CheckpointCopy.objects.filter(kind=CopyKind.S3, request=request)
        .filter(Q(retry_after__isnull=True) | Q(retry_after__lte=now))
        .order_by("requested_at", "id")
        .values_list("pk", "location", "checkpoint__manifest_sha256")[:limit]
    )
    return [S3Work(pk, uri, digest) for pk, uri, digest in rows]


def s3_verifications_due(*, now=None, limit: int = 200) -> list[S3Work]:
    return _s3_requests(CopyRequest.VERIFY, now, limit)


def s3_deletions_due(*, now=None, limit: int = 200) -> list[S3Work]:
    return _s3_requests(CopyRequest.DELETE, now, limit)


# --- the watch -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Watch:
    overdue: bool
    reason: str
    since: dt.datetime | None = None  # the newest verified checkpoint's commit, or the start
    age_s: float | None = None
    expected_interval_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def watch_of(job: Job, *, newest_verified_at, step_time_s: float | None, now: dt.datetime) -> Watch:
    """Overdue: running, and its last verified checkpoint (or its start, if later) is older
    than twice the time it should take between checkpoints."""
    if job.state != JobState.RUNNING:
        return Watch(False, "not running")
    trainer = (job.spec or {}).get("trainer") or {}
    every_steps, every_minutes = (
        trainer.get("checkpoint_every_steps"),
        trainer.get("checkpoint_every_minutes"),
    )
    expected = []
    if every_steps and step_time_s:
        expected.append(every_steps * step_time_s)
    if every_minutes:
        expected.append(every_minutes * 60.0)
    since = max(t for t in (newest_verified_at, job.started_at) if t) if job.started_at else None
    if not expected or since is None:
        why = "no checkpoint interval" if not (every_steps or every_minutes) else "no step time yet"
        return Watch(False, why, since=since)
    interval = min(expected)
    age = (now - since).total_seconds()
    overdue = age > 2 * interval
    what = (
        "the last verified checkpoint"
        if newest_verified_at and newest_verified_at >= (job.started_at or newest_verified_at)
        else "the start of this attempt, with no verified checkpoint since"
    )
    reason = f"{what} was {age / 60:.1f} min ago; one is expected every {interval / 60:.1f} min"
    return Watch(overdue, reason, since=since, age_s=round(age, 1), expected_interval_s=interval)


# --- a job's checkpoints ------------------------------------------------------------------------

# Which checkpoints may be a job's best: those kept and usable (a corrupt one cannot be used).
BEST_STATES = (C.COMMITTED, C.VERIFIED)
BEST_ORDER = ("eval_loss", "step", "id")  # the lowest held-out loss; on a tie, the earlier


def best_of(checkpoints) -> Checkpoint | None:
    """The job's best checkpoint among these (all of one job): the lowest held-out loss of
    its committed or verified ones; None when none was evaluated."""
    candidates = [c for c in checkpoints if c.state in BEST_STATES and c.eval_loss is not None]
    return min(candidates, key=lambda c: (c.eval_loss, c.step, c.pk), default=None)


def with_best(rows: QuerySet[Checkpoint]) -> QuerySet[Checkpoint]:
    """Each row with `best_id`, its job's best checkpoint (best_of's rule, in SQL)."""
    best = Checkpoint.objects.filter(
        job_id=OuterRef("job_id"), state__in=BEST_STATES, eval_loss__isnull=False
    ).order_by(*BEST_ORDER)
    return rows.annotate(best_id=Subquery(best.values("id")[:1]))


@dataclass
class JobCheckpoints:
    """One row of the Checkpoints page, or the head of a Job page's checkpoint panel."""

    job: Job
    newest: Checkpoint | None
    newest_verified: Checkpoint | None
    live_count: int
    size_bytes: int
    watch: Watch
    best: Checkpoint | None = None  # the lowest held-out loss (best_of)


def job_rows(
    jobs: list[Job], *, now: dt.datetime | None = None, overdue_only: bool = False
) -> list[JobCheckpoints]:
    """Each job's newest and newest verified checkpoint, storage used and watch, in a fixed
    number of queries; with overdue_only, only the jobs whose checkpoint is overdue."""
    now = now or timezone.now()
    ids = [job.pk for job in jobs]
    live = list(
        Checkpoint.objects.filter(job_id__in=ids, state__in=LIVE_STATES)
        .prefetch_related(
            Prefetch("copies", queryset=CheckpointCopy.objects.select_related("node"))
        )
        .order_by("job_id", "-step", "-committed_at")
    )
    by_job: dict[int, list[Checkpoint]] = {}
    for checkpoint in live:
        by_job.setdefault(checkpoint.job_id, []).append(checkpoint)
    used = dict(
        CheckpointCopy.objects.filter(checkpoint__job_id__in=ids, state__in=ON_STORAGE_COPY_STATES)
        .values("checkpoint__job_id")
        .annotate(total=Sum("checkpoint__size_bytes"))
        .values_list("checkpoint__job_id", "total")
    )
    running = [job.pk for job in jobs if job.state == JobState.RUNNING]
    times = step_times(job_ids=running) if running else {}
    rows = []
    for job in jobs:
        held = by_job.get(job.pk, [])
        newest = held[0] if held else None
        verified = next((c for c in held if c.state == C.VERIFIED), None)
        rows.append(
            JobCheckpoints(
                job=job,
                newest=newest,
                newest_verified=verified,
                live_count=len(held),
                size_bytes=used.get(job.pk) or 0,
                best=best_of(held),
                watch=watch_of(
                    job,
                    newest_verified_at=verified.committed_at if verified else None,
                    step_time_s=times.get(job.pk),
                    now=now,
                ),
            )
        )
    return [row for row in rows if row.watch.overdue] if overdue_only else rows


def _brief(checkpoint: Checkpoint | None) -> dict | None:
    if checkpoint is None:
        return None
    return {
        "id": checkpoint.pk,
        "step": checkpoint.step,
        "state": checkpoint.state,
        "attempt": checkpoint.attempt,
        "committed_at": checkpoint.committed_at.isoformat(),
        "size_bytes": checkpoint.size_bytes,
        "eval_loss": checkpoint.eval_loss,
        "eval_perplexity": checkpoint.eval_perplexity,
        "eval_step": checkpoint.eval_step,
        "copies": [
            {"kind": c.kind, "state": c.state, "location": c.location}
            for c in checkpoint.copies.all()
            if c.state in ON_STORAGE_COPY_STATES
        ],
    }


def retention_policy(job: Job):
    trainer = (job.spec or {}).get("trainer") or {}
    return policy_for(trainer, default_keep_last=settings.CHECKPOINT_KEEP_LAST)


def job_summary(row: JobCheckpoints) -> dict:
    policy = retention_policy(row.job)
    return {
        "newest": _brief(row.newest),
        "newest_verified": _brief(row.newest_verified),
        "best": _brief(row.best),
        "checkpoints": row.live_count,
        "size_bytes": row.size_bytes,
        "watch": row.watch.as_dict(),
        "retention": {
            "keep_last": policy.keep_last,
            "keep_every": policy.keep_every,
            "final_step": policy.final_step,
        },
    }


def job_checkpoint_summary(job: Job) -> dict | None:
    """The `checkpoints` part of a job's detail in the API (apps/jobs/extensions.py)."""
    if job.kind != JobKind.TRAINER:
        return None
    summary = job_summary(job_rows([job])[0])
    summary["watch"] = {
        k: (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in summary["watch"].items()
    }
    return summary


def job_checkpoints(*, job: Job) -> list[Checkpoint]:
    """Every checkpoint of the job, newest first, deleted ones too (the Job page's list), with
    its exports, newest first."""
    return list(
        Checkpoint.objects.filter(job=job)
        .prefetch_related(
            Prefetch("copies", queryset=CheckpointCopy.objects.select_related("node")),
            "exports",
        )
        .order_by("-step", "-committed_at")
    )


# --- storage ---------------------------------------------------------------------------------


def storage_by_team(*, user) -> list[dict]:
    """Bytes on storage per team and kind of copy (copies being deleted still count)."""
    copies = copies_visible_to(user=user).filter(state__in=ON_STORAGE_COPY_STATES)
    sums = list(
        copies.values_list("checkpoint__team_id", "kind")
        .annotate(size=Sum("checkpoint__size_bytes"), n=Count("id"))
        .order_by()
    )
    # The teams' slugs apart: joining the team to every copy doubled the sum's time.
    slugs = team_slugs(team_ids={team_id for team_id, *_ in sums})
    totals: dict[int, dict] = {}
    for team_id, kind, size, count in sums:
        row = totals.setdefault(
            team_id,
            {
                "team": team_id,
                "team_slug": slugs.get(team_id, ""),
                CopyKind.NODE_LOCAL.value: 0,
                CopyKind.SHARED.value: 0,
                CopyKind.S3.value: 0,
                "copies": 0,
            },
        )
        row[kind] += size or 0
        row["copies"] += count or 0
    rows = []
    for row in totals.values():
        row["total"] = row["node_local"] + row["shared"] + row["s3"]
        rows.append(row)
    return sorted(rows, key=lambda r: (-r["total"], r["team_slug"]))
