"""What the agents report: the trainer's checkpoint lines, recorded once validated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.checkpoints.models import (
    ON_STORAGE_COPY_STATES,
    PRESENT_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    CopyKind,
    CopyRequest,
)
from apps.checkpoints.services.agent_input import (
    clean_text,
)
from apps.checkpoints.services.ownership import (
    NotOwned,
    Own,
    _own,
    _place,
    _refusal_record,
    _s3_wanted_by,
)
from apps.checkpoints.services.states import (
    C,
    S,
    _ask,
    _delete_copy,
    _lock_copies,
    _move_copy,
    _note,
    _placed,
    _present_at,
    _settle,
    storage_kind,
)
from apps.jobs.transitions import job_note

if TYPE_CHECKING:
    from apps.jobs.models import Run


def checkpoint_event_record(*, run: Run, report: dict) -> dict:
    """One of the trainer's checkpoint lines, as the run's node's agent relays it, checked
    (apps/checkpoints/api/reports.py); `report["event"]` says which kind."""
    handler = {
        "checkpoint": _committed,
        "checkpoint_copy": _copied,
        "checkpoint_copy_failed": _copy_failed,
        "checkpoint_rejected": _rejected,
        "checkpoint_fetched": _fetched,
        "resume": _resumed,
    }[report["event"]]
    actor = f"agent:{run.node.name}"
    own = _own([run.job])[run.job_id]
    for tries in range(3):  # two agents racing on one path: the loser reads the winner's row
        try:
            with transaction.atomic():
                return handler(run, report, own=own, actor=actor, now=timezone.now())
        except IntegrityError:
            if tries == 2:
                raise
        except NotOwned as refused:  # recorded once its transaction has rolled back
            _refusal_record(
                run.job,
                refused.why,
                run=run.pk,
                event=report["event"],
                field=refused.field,
                location=refused.location[:300],
            )
            raise
    return {}  # pragma: no cover


def _committed(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    step, digest = event["step"], event["manifest_sha256"]
    path = _place(event, "path", own)
    replaced = event["replaced"] and _place(event, "replaced", own)
    kind = storage_kind()
    place = _placed(kind, run.node_id)
    checkpoint, created = Checkpoint.objects.get_or_create(
        job_id=run.job_id,
        step=step,
        manifest_sha256=digest,
        defaults={
            "team_id": run.job.team_id,
            "attempt": run.attempt,
            "world_size": event["world_size"],
            "layout": event["layout"],
            "size_bytes": event["size_bytes"],
            "files": event["files"],
            "loss": event["loss"],
            **_evaluation_fields(event["eval"]),
            "node_id": run.node_id,
            "s3_expected": _s3_wanted_by(run),
            "committed_at": event["time"] or now,
            "state": C.COMMITTED,
            "state_reason": f"committed by attempt {run.attempt}",
        },
    )
    if created:
        CheckpointEvent.objects.create(
            checkpoint=checkpoint,
            to_state=C.COMMITTED,
            reason=f"committed by attempt {run.attempt} on {run.node.name}",
            actor_label=actor,
        )
    for other in _lock_copies(
        _present_at(run.job_id, kind, place, path).exclude(checkpoint=checkpoint)
    ):
        if replaced:
            other.location = replaced
            other.save(update_fields=["location"])
            _note(
                other.checkpoint,
                f"moved aside to {replaced}: step {step} was saved again",
                actor=actor,
                copy=other,
            )
        else:
            _move_copy(
                other,
                S.MISSING,
                "another checkpoint was committed at its path",
                actor=actor,
                now=now,
            )
            other.save()
            _settle(other.checkpoint, "its copy was replaced", actor=actor, now=now)
    mine = _lock_copies(_present_at(run.job_id, kind, place, path).filter(checkpoint=checkpoint))
    copy = mine[0] if mine else None
    if copy is None:
        copy = CheckpointCopy(
            checkpoint=checkpoint, kind=kind, location=path, node_id=place, state=S.COMMITTED
        )
        _ask(copy, CopyRequest.VERIFY, now=now, prefer=run.node_id)
        copy.save()
    if checkpoint.state in (C.DELETING, C.DELETED) and copy.state in PRESENT_COPY_STATES:
        # Committed again over a row being collected: collected again, storage first.
        _delete_copy(copy, "its checkpoint is being deleted", actor=actor, now=now)
    _settle(checkpoint, "committed", actor=actor, now=now)
    return {"checkpoint": checkpoint.pk, "copy": copy.pk}


def _evaluation_fields(evaluation: dict | None) -> dict:
    if evaluation is None:
        return {}
    return {
        "eval_loss": evaluation["loss"],
        "eval_perplexity": evaluation["perplexity"],
        "eval_step": evaluation["step"],
    }


def _of_step(run: Run, step: int) -> Checkpoint | None:
    """The run's newest commit of `step` (what its S3 copy or fetch is of)."""
    return (
        Checkpoint.objects.filter(job_id=run.job_id, step=step)
        .order_by("-attempt", "-committed_at", "-id")
        .first()
    )


def _s3_copy(checkpoint: Checkpoint, uri: str, state: str, *, actor: str, now, error=""):
    """The checkpoint's S3 copy at `uri`, made or updated; a copy of another checkpoint of the
    job that was at the same keys has been overwritten (another job's never is: `uri` lies
    under this job's own prefix)."""
    for other in _lock_copies(
        CheckpointCopy.objects.filter(
            checkpoint__job_id=checkpoint.job_id,
            kind=CopyKind.S3,
            location=uri,
            state__in=ON_STORAGE_COPY_STATES,
        ).exclude(checkpoint=checkpoint)
    ):
        _move_copy(
            other, S.MISSING, "overwritten by a later copy to the same keys", actor=actor, now=now
        )
        other.save()
        _settle(other.checkpoint, "its S3 copy was overwritten", actor=actor, now=now)
    mine = _lock_copies(
        CheckpointCopy.objects.filter(
            checkpoint=checkpoint, kind=CopyKind.S3, location=uri
        ).exclude(state__in=[S.DELETED, S.MISSING])
    )
    copy = mine[0] if mine else None
    made = copy is None
    if made:
        copy = CheckpointCopy(checkpoint=checkpoint, kind=CopyKind.S3, location=uri, state=state)
    elif state == S.FAILED and copy.state == S.COMMITTED:
        copy.state = S.FAILED
    copy.error = clean_text(error)
    if state == S.COMMITTED:
        _ask(copy, CopyRequest.VERIFY, now=now)
    copy.save()
    if made:
        CheckpointEvent.objects.create(
            checkpoint=checkpoint,
            copy=copy,
            to_state=state,
            reason=(f"copied to {uri}" if state == S.COMMITTED else f"S3 copy failed: {error}")[
                :300
            ],
            actor_label=actor,
        )
    if checkpoint.state in (C.DELETING, C.DELETED):
        _delete_copy(copy, "its checkpoint is being deleted", actor=actor, now=now)
    return copy


def _copied(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    uri = _place(event, "uri", own)
    checkpoint = _of_step(run, event["step"])
    if checkpoint is None:
        return {"ignored": True}
    copy = _s3_copy(checkpoint, uri, S.COMMITTED, actor=actor, now=now)
    _settle(checkpoint, "copied to S3", actor=actor, now=now)
    return {"checkpoint": checkpoint.pk, "copy": copy.pk}


def _copy_failed(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    if not event["uri"].startswith("s3://"):
        return {"ignored": True}
    uri = _place(event, "uri", own)
    checkpoint = _of_step(run, event["step"])
    if checkpoint is None:
        return {"ignored": True}
    message = event["message"]
    if event["attempts"] > 1:
        message = f"{message} (tried {event['attempts']} times)"
    copy = _s3_copy(checkpoint, uri, S.FAILED, actor=actor, now=now, error=message)
    _settle(checkpoint, "its S3 copy failed", actor=actor, now=now)
    return {"checkpoint": checkpoint.pk, "copy": copy.pk}


def _copy_at(run: Run, path: str):
    if path.startswith("s3://"):
        found = CheckpointCopy.objects.filter(kind=CopyKind.S3, location=path)
        return found.filter(checkpoint__job_id=run.job_id, state__in=PRESENT_COPY_STATES)
    kind = storage_kind()
    return _present_at(run.job_id, kind, _placed(kind, run.node_id), path).filter(
        state__in=PRESENT_COPY_STATES
    )


def _rejected(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    path = _place(event, "path", own)
    reason = event["reason"]
    job_note(
        job_id=run.job_id,
        reason=f"attempt {run.attempt} rejected the checkpoint at {_tail(path)}: {reason}",
    )
    found = _lock_copies(_copy_at(run, path))
    copy = found[0] if found else None
    if copy is None:
        return {"ignored": True}
    _move_copy(copy, S.CORRUPT, f"the trainer refused it: {reason}", actor=actor, now=now)
    copy.error = reason[:500]
    copy.save()
    _settle(copy.checkpoint, f"a copy did not verify: {reason}", actor=actor, now=now)
    return {"checkpoint": copy.checkpoint_id, "copy": copy.pk}


def _tail(path: str) -> str:
    """The end of a long path, which tells checkpoints apart, within a JobEvent's reason."""
    return path if len(path) <= 150 else "…" + path[-150:]


def _fetched(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    path = _place(event, "path", own)
    if event["uri"] is not None:
        _place(event, "uri", own)
    digest = event["manifest_sha256"]
    checkpoint = (
        Checkpoint.objects.filter(job_id=run.job_id, manifest_sha256=digest)
        .exclude(state=C.DELETED)
        .first()
        if digest is not None
        else None
    )
    if checkpoint is None:
        return {"ignored": True}
    kind = storage_kind()
    place = _placed(kind, run.node_id)
    copy = _present_at(run.job_id, kind, place, path).first()
    if copy is None:
        copy = CheckpointCopy(
            checkpoint=checkpoint, kind=kind, location=path, node_id=place, state=S.COMMITTED
        )
        _ask(copy, CopyRequest.VERIFY, now=now, prefer=run.node_id)
        copy.save()
        _note(checkpoint, f"fetched from {event['uri'] or 'S3'} to {path}", actor=actor, copy=copy)
        if checkpoint.state == C.DELETING:
            _delete_copy(copy, "its checkpoint is being deleted", actor=actor, now=now)
    _settle(checkpoint, "fetched", actor=actor, now=now)
    return {"checkpoint": checkpoint.pk, "copy": copy.pk}


def _resumed(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    path = _place(event, "path", own)
    copy = (
        CheckpointCopy.objects.filter(checkpoint__job_id=run.job_id, location=path)
        .select_related("checkpoint")
        .order_by("-id")
        .first()
    )
    # The registry's step where it knows the copy; the trainer's word only where it does not.
    step = copy.checkpoint.step if copy else event["step"]
    at_step = f" step {step}" if step is not None else ""
    job_note(
        job_id=run.job_id, reason=f"attempt {run.attempt} resumed from{at_step} ({_tail(path)})"
    )
    if copy is None:
        return {"ignored": True}
    _note(
        copy.checkpoint,
        f"attempt {run.attempt} resumed from it (step {copy.checkpoint.step})",
        actor=actor,
        copy=copy,
    )
    return {"checkpoint": copy.checkpoint_id, "copy": copy.pk}
