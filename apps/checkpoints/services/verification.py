"""Checking that copies are whole: requests to agents and to S3, and their answers."""

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.checkpoints.models import (
    LIVE_STATES,
    PRESENT_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CopyKind,
    CopyRequest,
)
from apps.checkpoints.services.agent_input import clean_text
from apps.checkpoints.services.states import (
    S,
    _actor,
    _ask,
    _locked_copy,
    _move_copy,
    _note,
    _settle,
    _user_label,
)
from apps.fleet.selectors import node_names
from apps.jobs.services import job_can_manage
from controlplane.errors import ApplicationError


def _answerer(node_id: int | None) -> str:
    """Who answered a request: a node's agent, or (S3) the control plane."""
    return f"agent:{node_names(node_ids=[node_id])[node_id]}" if node_id else _actor()


def _answered_by(copy: CheckpointCopy, node_id: int | None, request: str) -> bool:
    """Whether this answer is to the request outstanding (a late or foreign one is not)."""
    if copy.request != request:
        return False
    if node_id is None:
        return copy.kind == CopyKind.S3
    if copy.request_node_id != node_id:
        raise ApplicationError(
            "This node was not asked about this copy.", code="not_asked", status=409
        )
    return True


@transaction.atomic
def copy_verification_record(
    *, copy_id: int, ok: bool, problem: str = "", missing: bool = False, node_id=None
) -> CheckpointCopy:
    """A copy was checked against its manifest: by a node's agent, or (S3) the control plane."""
    copy = _locked_copy(copy_id)
    if not _answered_by(copy, node_id, CopyRequest.VERIFY):
        return copy
    now = timezone.now()
    actor = _answerer(node_id)
    if copy.state not in PRESENT_COPY_STATES:
        copy.request, copy.request_node_id, copy.requested_at = CopyRequest.NONE, None, None
        copy.save()
        return copy
    if ok:
        _move_copy(copy, S.VERIFIED, "every file matches the manifest", actor=actor, now=now)
        copy.verified_at, copy.error = now, ""
    else:
        to = S.MISSING if missing else S.CORRUPT
        _move_copy(
            copy, to, clean_text(problem) or "it does not match the manifest", actor=actor, now=now
        )
        copy.error = clean_text(problem)
    copy.request, copy.request_node_id, copy.requested_at = CopyRequest.NONE, None, None
    copy.attempts, copy.retry_after = 0, None
    copy.save()
    word = "verified" if ok else ("missing" if missing else f"corrupt: {problem}")
    _settle(copy.checkpoint, f"{copy.get_kind_display()} copy {word}", actor=actor, now=now)
    return copy


@transaction.atomic
def copy_request_retry(*, copy_id: int, message: str) -> None:
    """The control plane could not reach an S3 copy now: tried again after a while."""
    copy = _locked_copy(copy_id)
    copy.attempts = min(copy.attempts + 1, 1000)
    copy.error = clean_text(message)
    copy.retry_after = timezone.now() + _backoff(copy.attempts)
    copy.save(update_fields=["attempts", "error", "retry_after"])


def _backoff(attempts: int) -> dt.timedelta:
    return dt.timedelta(seconds=min(settings.CHECKPOINT_RETRY_S * 2 ** max(attempts - 1, 0), 3600))


def _may_manage(by, checkpoint: Checkpoint) -> None:
    job = checkpoint.job
    if by is not None and not job_can_manage(
        user=by, team_id=job.team_id, submitted_by_id=job.submitted_by_id
    ):
        raise ApplicationError(
            "Only the submitter, the team's admins and ops manage a job's checkpoints.",
            code="permission_denied",
            status=403,
        )


@transaction.atomic
def checkpoint_verify_request(*, checkpoint: Checkpoint, by) -> Checkpoint:
    """Check every copy of the checkpoint again (its state holds until the answers come)."""
    _may_manage(by, checkpoint)
    locked = Checkpoint.objects.select_for_update(no_key=True).get(pk=checkpoint.pk)
    if locked.state not in LIVE_STATES:
        raise ApplicationError(
            f"A {locked.state} checkpoint is not checked.", code="invalid_transition", status=409
        )
    now = timezone.now()
    for copy in locked.copies.select_for_update(no_key=True).filter(state__in=PRESENT_COPY_STATES):
        _ask(copy, CopyRequest.VERIFY, now=now)
        copy.save()
    _note(locked, f"verification asked by {_user_label(by)}", actor=_user_label(by))
    return locked
