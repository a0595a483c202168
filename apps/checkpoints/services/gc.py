"""Deletion, sweeps of a job's directory, retention and garbage collection."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, OuterRef, Q
from django.utils import timezone

from apps.checkpoints import retention
from apps.checkpoints.models import (
    LIVE_STATES,
    ON_STORAGE_COPY_STATES,
    PRESENT_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    CopyKind,
    CopyRequest,
    StorageSweep,
)
from apps.checkpoints.selectors import retention_policy
from apps.checkpoints.services.agent_input import (
    clean_text,
    finite_or_none,
    instant_or,
    invalid_input,
    layout_of,
)
from apps.checkpoints.services.exports import exports_expire
from apps.checkpoints.services.ownership import _own, _refusal_record
from apps.checkpoints.services.states import (
    READER_STATES,
    SHA256,
    C,
    S,
    _actor,
    _ask,
    _delete_copy,
    _lock_copies,
    _locked_copy,
    _move_copy,
    _note,
    _placed,
    _settle,
    _user_label,
    _wake,
    storage_kind,
)
from apps.checkpoints.services.verification import _answered_by, _answerer, _backoff, _may_manage
from apps.fleet.selectors import nodes_among
from apps.jobs.models.jobs import ACTIVE_STATES
from apps.jobs.runconfig import checkpoint_dir
from apps.jobs.selectors import (
    first_rank_nodes,
    job_has_open_runs,
    job_newest_attempt,
    job_with_team,
    trainer_jobs_finished_since,
)
from controlplane.errors import ApplicationError

if TYPE_CHECKING:
    from apps.jobs.models import Job

# --- deletion ------------------------------------------------------------------------------


def _collect(checkpoint: Checkpoint, reason: str, *, actor: str, now) -> Checkpoint:
    """Delete a checkpoint: its copies from storage first; the row follows their answers."""
    if checkpoint.state not in (C.DELETING, C.DELETED):
        CheckpointEvent.objects.create(
            checkpoint=checkpoint,
            from_state=checkpoint.state,
            to_state=C.DELETING,
            reason=reason[:300],
            actor_label=actor,
        )
        checkpoint.state, checkpoint.state_reason = C.DELETING, reason[:300]
        checkpoint.state_changed_at = now
        checkpoint.save(update_fields=["state", "state_reason", "state_changed_at"])
    for copy in checkpoint.copies.select_for_update(no_key=True).filter(
        state__in=PRESENT_COPY_STATES | {S.FAILED}
    ):
        _delete_copy(copy, reason, actor=actor, now=now)
    return _settle(checkpoint, reason, actor=actor, now=now)


@transaction.atomic
def checkpoint_delete(*, checkpoint: Checkpoint, by, reason: str = "") -> Checkpoint:
    """Delete a checkpoint by hand; never the one an active job would resume from."""
    _may_manage(by, checkpoint)
    locked = Checkpoint.objects.select_for_update(no_key=True).get(pk=checkpoint.pk)
    if locked.state in (C.DELETING, C.DELETED):
        return locked
    if locked.job.state in ACTIVE_STATES and locked.state == C.VERIFIED:
        newest = (
            Checkpoint.objects.filter(job_id=locked.job_id, state=C.VERIFIED)
            .order_by("-step", "-committed_at")
            .first()
        )
        if newest is not None and newest.pk == locked.pk:
            raise ApplicationError(
                "This is the checkpoint the job resumes from; it stays while the job is active.",
                code="in_use",
                status=409,
            )
    why = reason.strip() or f"deleted by {_user_label(by)}"
    return _collect(locked, why, actor=_user_label(by), now=timezone.now())


@transaction.atomic
def copy_delete(*, copy: CheckpointCopy, by, reason: str = "") -> CheckpointCopy:
    """Delete one copy (a node's disk being freed, say); the checkpoint keeps its others."""
    locked = _locked_copy(copy.pk)
    _may_manage(by, locked.checkpoint)
    if locked.state in (S.DELETING, S.DELETED, S.MISSING):
        return locked
    others = locked.checkpoint.copies.filter(state__in=[S.VERIFIED, S.COMMITTED]).exclude(
        pk=locked.pk
    )
    if locked.state in (S.VERIFIED, S.COMMITTED) and not others.exists():
        raise ApplicationError(
            "It is the checkpoint's last usable copy: delete the checkpoint instead.",
            code="last_copy",
            status=409,
        )
    now = timezone.now()
    why = reason.strip() or f"copy deleted by {_user_label(by)}"
    _delete_copy(locked, why, actor=_user_label(by), now=now)
    _settle(locked.checkpoint, why, actor=_user_label(by), now=now)
    return locked


DELETION_OUTCOMES = ("deleted", "gone", "elsewhere", "failed")


@transaction.atomic
def copy_deletion_record(
    *, copy_id: int, outcome: str, message: str = "", node_id=None
) -> CheckpointCopy:
    """Storage answered a deletion: gone (deleted, or nothing was there), or not."""
    if outcome not in DELETION_OUTCOMES:
        raise invalid_input("outcome", f"One of {', '.join(DELETION_OUTCOMES)}.")
    copy = _locked_copy(copy_id)
    if not _answered_by(copy, node_id, CopyRequest.DELETE) or copy.state != S.DELETING:
        return copy
    now = timezone.now()
    actor = _answerer(node_id)
    if outcome in ("deleted", "gone"):
        why = "deleted from storage" if outcome == "deleted" else "already gone from storage"
        _move_copy(copy, S.DELETED, why, actor=actor, now=now)
        copy.error = ""
    elif outcome == "elsewhere":
        _move_copy(copy, S.MISSING, clean_text(message) or "not at its path", actor=actor, now=now)
        copy.error = clean_text(message)
    else:
        copy.attempts = min(copy.attempts + 1, 1000)
        copy.error = clean_text(message or "the deletion failed")
        copy.retry_after = now + _backoff(copy.attempts)
        copy.requested_at = now
    copy.save()
    _settle(copy.checkpoint, f"{copy.get_kind_display()} copy {outcome}", actor=actor, now=now)
    return copy


# --- sweeps ------------------------------------------------------------------------------------


def _sweep_ask(job: Job, node_id: int, *, why: str, tidy: bool, now) -> StorageSweep:
    sweep = StorageSweep.objects.create(
        job=job,
        node_id=node_id,
        kind=storage_kind(),
        directory=checkpoint_dir(job),
        tidy=tidy,
        why=why[:100],
        requested_at=now,
    )
    _wake([node_id])
    return sweep


def sweep_request(*, job: Job, node_id: int, why: str = "asked", by=None) -> StorageSweep:
    """List the job's checkpoint directory from this node and compare it with the registry."""
    tidy = not job_has_open_runs(job_id=job.pk)
    return _sweep_ask(job, node_id, why=why, tidy=tidy, now=timezone.now())


def _entry_ok(entry) -> bool:
    return (
        isinstance(entry, dict)
        and entry.get("kind") == "committed"
        and isinstance(entry.get("path"), str)
        and 0 < len(entry["path"]) <= 1024
        and isinstance(entry.get("manifest_sha256"), str)
        and SHA256.match(entry["manifest_sha256"]) is not None
    )


@transaction.atomic
def sweep_record(*, node_id: int, sweep_id: int, report: dict) -> StorageSweep:
    """What the agent found in the directory, made to agree with the registry."""
    if not 0 < sweep_id < 2**63:
        raise ApplicationError("No such sweep for this node.", code="not_found", status=404)
    sweep = (
        StorageSweep.objects.select_for_update(of=("self",))
        .select_related("job", "node")
        .filter(pk=sweep_id, node_id=node_id)
        .first()
    )
    if sweep is None:
        raise ApplicationError("No such sweep for this node.", code="not_found", status=404)
    if sweep.reported_at is not None:
        return sweep
    entries = report.get("entries") if isinstance(report.get("entries"), list) else []
    now = timezone.now()
    actor = f"agent:{sweep.node.name}"
    job = sweep.job
    place = _placed(sweep.kind, node_id)
    known = {
        copy.location: copy
        for copy in _lock_copies(
            CheckpointCopy.objects.filter(
                checkpoint__job=job,
                kind=sweep.kind,
                node_id=place,
                state__in=ON_STORAGE_COPY_STATES,
            )
        )
    }
    own = _own([job], s3=False)[job.pk]
    seen, adopted, found_again, refused = set(), 0, 0, []
    for entry in entries[:10_000]:
        if not _entry_ok(entry):
            continue
        if entry.get("job_uuid") not in (None, str(job.uuid)):
            continue  # another job's checkpoint: not ours to register or delete
        path, digest = entry["path"], entry["manifest_sha256"]
        if own.refuses(path):
            refused.append(path)
            continue
        copy = known.get(path)
        if copy is not None and copy.checkpoint.manifest_sha256 == digest:
            seen.add(copy.pk)
            continue
        if copy is not None:  # another checkpoint now at its path; this one is adopted below
            _move_copy(copy, S.MISSING, "another checkpoint is at its path", actor=actor, now=now)
            copy.save()
            _settle(copy.checkpoint, "a copy was replaced", actor=actor, now=now)
            seen.add(copy.pk)
        checkpoint = Checkpoint.objects.filter(job=job, manifest_sha256=digest).first()
        if checkpoint is None:
            checkpoint = _adopt(job, entry, node_id=node_id, actor=actor, now=now)
            adopted += 1
        else:
            found_again += 1
        made = CheckpointCopy(
            checkpoint=checkpoint,
            kind=sweep.kind,
            location=path,
            node_id=place,
            state=S.COMMITTED,
        )
        if checkpoint.state in (C.DELETING, C.DELETED):
            made.state = S.DELETING
            _ask(made, CopyRequest.DELETE, now=now, prefer=node_id)
        else:
            _ask(made, CopyRequest.VERIFY, now=now, prefer=node_id)
        made.save()
        _note(checkpoint, f"found at {path} by a sweep", actor=actor, copy=made)
        _settle(checkpoint, "found by a sweep", actor=actor, now=now)
    lost = 0
    if not report.get("problem"):
        for copy in known.values():
            if copy.pk in seen or copy.created_at > sweep.requested_at:
                continue
            if copy.state == S.DELETING:
                _move_copy(
                    copy, S.DELETED, "gone from storage (seen by a sweep)", actor=actor, now=now
                )
            else:
                _move_copy(copy, S.MISSING, f"not in {sweep.directory}", actor=actor, now=now)
                lost += 1
            copy.save()
            _settle(copy.checkpoint, "a sweep did not find a copy", actor=actor, now=now)
    removed = report.get("removed") if isinstance(report.get("removed"), list) else []
    removed = [clean_text(x, 200) for x in removed[:1000]]
    sweep.reported_at = now
    sweep.result = {
        "entries": len(entries),
        "adopted": adopted,
        "found_again": found_again,
        "missing": lost,
        "removed": removed,
        "directory_missing": bool(report.get("missing")),
        "refused": len(refused),
    }
    if report.get("problem"):
        sweep.result["problem"] = clean_text(report["problem"], 300)
    sweep.save(update_fields=["reported_at", "result"])
    if refused:
        _refusal_record(
            job,
            own.refuses(refused[0]),
            sweep=sweep.pk,
            refused=len(refused),
            location=clean_text(refused[0], 300),
        )
    return sweep


def _adopt(job: Job, entry: dict, *, node_id: int, actor: str, now) -> Checkpoint:
    """Register a committed checkpoint the registry never heard of (its report was lost)."""
    step = entry.get("manifest_step", entry.get("step"))
    step = step if isinstance(step, int) and 0 <= step < 2**31 else 0
    attempt = entry.get("attempt")
    if not (isinstance(attempt, int) and 0 < attempt < 2**15):
        attempt = job_newest_attempt(job_id=job.pk) or 1

    def number(name, maximum):
        value = entry.get(name)
        return value if isinstance(value, int) and 0 <= value <= maximum else 0

    checkpoint = Checkpoint.objects.create(
        job=job,
        team_id=job.team_id,
        attempt=attempt,
        step=step,
        manifest_sha256=entry["manifest_sha256"],
        world_size=number("world_size", 2**31 - 1) or 1,
        layout=layout_of(entry.get("layout")),
        size_bytes=number("size_bytes", 2**63 - 1),
        files=number("files", 2**31 - 1),
        loss=finite_or_none(entry.get("loss")),
        node_id=node_id,
        committed_at=instant_or(entry.get("time"), now),
        state=C.COMMITTED,
        state_reason="found on storage by a sweep: its report never arrived",
    )
    CheckpointEvent.objects.create(
        checkpoint=checkpoint,
        to_state=C.COMMITTED,
        reason="found on storage by a sweep: its report never arrived",
        actor_label=actor,
    )
    return checkpoint


# --- retention and GC ------------------------------------------------------------------------


def retention_apply(*, job_ids=None, now: dt.datetime | None = None) -> dict[str, int]:
    """Collect what each job's retention no longer keeps (a job at a time, locked)."""
    now = now or timezone.now()
    jobs = (
        Checkpoint.objects.filter(state__in=LIVE_STATES)
        .values("job_id")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
    )
    if job_ids is not None:
        jobs = jobs.filter(job_id__in=list(job_ids))
    collected = 0
    for job_id in [row["job_id"] for row in jobs]:
        with transaction.atomic():
            job = job_with_team(job_id=job_id)
            live = list(
                Checkpoint.objects.select_for_update(no_key=True)
                .filter(job_id=job_id, state__in=LIVE_STATES)
                .order_by("pk")
                .prefetch_related("copies")
            )
            active = job.state in ACTIVE_STATES
            newest_offered = max(
                (c for c in live if c.offered_at), key=lambda c: c.offered_at, default=None
            )
            held = [
                retention.Held(
                    id=c.pk,
                    step=c.step,
                    order=c.committed_at.timestamp(),
                    usable=c.state != C.CORRUPT,
                    secured=_secured(c),
                    pinned=active and newest_offered is not None and c.pk == newest_offered.pk,
                )
                for c in live
            ]
            by_id = {c.pk: c for c in live}
            for checkpoint_id, why in retention.to_delete(held, retention_policy(job)).items():
                _collect(by_id[checkpoint_id], why, actor=_actor(), now=now)
                collected += 1
    return {"collected": collected}


def _secured(checkpoint: Checkpoint) -> bool:
    copies = list(checkpoint.copies.all())
    verified = [c for c in copies if c.state == S.VERIFIED]
    if not verified:
        return False
    return not checkpoint.s3_expected or any(c.kind == CopyKind.S3 for c in verified)


def requests_reoffer(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Requests nobody can answer (the agent asked is gone) or nobody did in time: asked of
    another node that reaches the copy, or of the same one again."""
    now = now or timezone.now()
    stale = now - dt.timedelta(seconds=settings.CHECKPOINT_REQUEST_TIMEOUT_S)
    copies = (
        CheckpointCopy.objects.exclude(request=CopyRequest.NONE)
        .exclude(kind=CopyKind.S3)
        .filter(
            Q(request_node__isnull=True)
            | ~Q(request_node__state__in=READER_STATES)
            | Q(requested_at__lt=stale)
        )
        .filter(Q(retry_after__isnull=True) | Q(retry_after__lte=now))
        .values_list("pk", flat=True)[:1000]
    )
    moved = 0
    for copy_id in list(copies):
        with transaction.atomic():
            copy = _locked_copy(copy_id)
            if copy.request == CopyRequest.NONE:
                continue
            before = copy.request_node_id
            _ask(copy, copy.request, now=now)
            copy.save()
            moved += copy.request_node_id != before
    return {"reoffered": moved}


def finished_jobs_sweep(*, now: dt.datetime | None = None, limit: int = 100) -> dict[str, int]:
    """After a trainer job ends, its directory is listed once (leftovers tidied, unreported
    commits registered) from a node that reaches it."""
    now = now or timezone.now()
    swept = 0
    recent = now - dt.timedelta(days=settings.CHECKPOINT_SWEEP_FINISHED_DAYS)
    done = StorageSweep.objects.filter(
        job=OuterRef("pk"), requested_at__gte=OuterRef("finished_at")
    )
    jobs = list(
        trainer_jobs_finished_since(since=recent)
        .annotate(swept=Exists(done))
        .filter(swept=False)
        .order_by("-finished_at")[: limit * 5]
    )
    writers_of = first_rank_nodes(job_ids=[job.pk for job in jobs])
    # Node-local: only the last attempt's writer holds the directory; shared: any writer.
    if storage_kind() == CopyKind.NODE_LOCAL:
        writers_of = {job_id: writers[:1] for job_id, writers in writers_of.items()}
    live = nodes_among(
        node_ids={n for writers in writers_of.values() for n in writers}, states=READER_STATES
    )
    for job in jobs:
        if swept >= limit:
            break
        node_id = next((n for n in writers_of.get(job.pk, []) if n in live), None)
        if node_id is None:
            continue  # it never ran, or nobody reaches it now: asked again on a later pass
        _sweep_ask(job, node_id, why="after the job ended", tidy=True, now=now)
        swept += 1
    return {"swept": swept}


def checkpoints_collect(*, now: dt.datetime | None = None) -> dict[str, int]:
    """GC's pass (task checkpoints.collect): retention, then requests re-offered, then the
    directories of jobs that ended listed, then exports nobody answers failed. S3 deletions
    are the task's, with boto3."""
    return {
        **retention_apply(now=now),
        **requests_reoffer(now=now),
        **finished_jobs_sweep(now=now),
        **exports_expire(now=now),
    }
