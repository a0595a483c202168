"""The registry's state moves, and which agent reaches a copy to check or delete it."""

import logging
import re

from django.conf import settings

from apps.accounts.context import current_origin
from apps.checkpoints.models import (
    ON_STORAGE_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    CheckpointState,
    CopyKind,
    CopyRequest,
    CopyState,
)
from apps.checkpoints.selectors import agent_idle
from apps.fleet.models import NodeState
from apps.fleet.selectors import nodes_among, pool_node_among
from apps.jobs.selectors import job_nodes_held
from controlplane.celery import enqueue_on_commit
from controlplane.errors import ApplicationError

log = logging.getLogger(__name__)
C = CheckpointState
S = CopyState

# Nodes whose agents answer requests (their heartbeats are current, or they are draining).
READER_STATES = frozenset({NodeState.READY, NodeState.BUSY, NodeState.DRAINING, NodeState.DRAINED})
SHA256 = re.compile(r"[0-9a-f]{64}\Z")

COPY_MOVES = {
    S.COMMITTED: {S.VERIFIED, S.CORRUPT, S.MISSING, S.DELETING},
    S.VERIFIED: {S.CORRUPT, S.MISSING, S.DELETING},
    S.CORRUPT: {S.VERIFIED, S.MISSING, S.DELETING},
    S.FAILED: {S.DELETING},  # an upload that failed may have left objects behind
    S.DELETING: {S.DELETED, S.MISSING},
    S.MISSING: set(),
    S.DELETED: set(),
}
CHECKPOINT_MOVES = {
    C.WRITING: {C.COMMITTED, C.DELETING},
    C.COMMITTED: {C.VERIFIED, C.CORRUPT, C.DELETING},
    C.VERIFIED: {C.COMMITTED, C.CORRUPT, C.DELETING},
    C.CORRUPT: {C.VERIFIED, C.COMMITTED, C.DELETING},
    C.DELETING: {C.DELETED},
    C.DELETED: {C.DELETING},  # files found again by a sweep: deleted again
}


def _actor() -> str:
    return (current_origin().label or "system")[:150]


def _user_label(by) -> str:
    return by.get_username() if by is not None else _actor()


# --- states ------------------------------------------------------------------------------------


def _move_copy(copy: CheckpointCopy, to: str, reason: str, *, actor: str, now) -> None:
    """Record one copy's move (the caller saves the copy)."""
    if copy.state == to:
        return
    if to not in COPY_MOVES[copy.state]:
        raise ApplicationError(
            f"A {copy.state} copy cannot become {to}.", code="invalid_transition", status=409
        )
    CheckpointEvent.objects.create(
        checkpoint_id=copy.checkpoint_id,
        copy=copy,
        from_state=copy.state,
        to_state=to,
        reason=reason[:300],
        actor_label=actor[:150],
    )
    copy.state, copy.state_changed_at = to, now
    if to == S.VERIFIED:
        copy.verified_at = now
    if to in (S.DELETED, S.MISSING):
        copy.deleted_at = now
    if to in (S.DELETED, S.MISSING, S.VERIFIED, S.CORRUPT):
        copy.request, copy.request_node_id, copy.requested_at = CopyRequest.NONE, None, None


def _settle(checkpoint: Checkpoint, reason: str, *, actor: str, now) -> Checkpoint:
    """The checkpoint's state, from its copies'."""
    states = {state for (state,) in checkpoint.copies.values_list("state")}
    if checkpoint.state in (C.DELETING, C.DELETED):
        target = C.DELETING if states & ON_STORAGE_COPY_STATES else C.DELETED
    elif S.VERIFIED in states:
        target = C.VERIFIED
    elif S.COMMITTED in states:
        target = C.COMMITTED
    else:
        target = C.CORRUPT
    if target == checkpoint.state:
        return checkpoint
    if target not in CHECKPOINT_MOVES[checkpoint.state]:
        raise ApplicationError(
            f"A {checkpoint.state} checkpoint cannot become {target}.",
            code="invalid_transition",
            status=409,
        )
    CheckpointEvent.objects.create(
        checkpoint=checkpoint,
        from_state=checkpoint.state,
        to_state=target,
        reason=reason[:300],
        actor_label=actor[:150],
    )
    checkpoint.state, checkpoint.state_changed_at = target, now
    checkpoint.state_reason = reason[:300]  # a copy's problem can be longer than the column
    if target == C.VERIFIED:
        checkpoint.verified_at = now
    if target == C.DELETED:
        checkpoint.deleted_at = now
    checkpoint.save(
        update_fields=["state", "state_reason", "state_changed_at", "verified_at", "deleted_at"]
    )
    return checkpoint


def _note(checkpoint: Checkpoint, reason: str, *, actor: str, copy=None) -> None:
    """An event that is not a move (a resume from it, a copy moved aside)."""
    CheckpointEvent.objects.create(
        checkpoint=checkpoint,
        copy=copy,
        from_state=checkpoint.state,
        to_state=checkpoint.state,
        reason=reason[:300],
        actor_label=actor[:150],
    )


# --- who can reach a copy --------------------------------------------------------------------


def _reader(copy: CheckpointCopy, *, prefer: int | None = None) -> int | None:
    """The node whose agent should check or delete this copy (None: the control plane, for S3,
    or nobody reachable now)."""
    if copy.kind == CopyKind.S3:
        return None
    if copy.kind == CopyKind.NODE_LOCAL:
        return copy.node_id
    checkpoint = copy.checkpoint
    order = [prefer, checkpoint.node_id, *job_nodes_held(job_id=checkpoint.job_id)]
    live = nodes_among(node_ids=order, states=READER_STATES)
    for node_id in order:
        if node_id in live:
            return node_id
    # Shared storage: any node of the writer's pool mounts it too.
    return pool_node_among(node_id=checkpoint.node_id, states=READER_STATES)


def _wake(node_ids) -> None:
    """The nodes' agents have something to do: their next poll reads the database."""
    agent_idle.forget([str(i) for i in node_ids if i])


def _s3_soon() -> None:
    enqueue_on_commit("checkpoints.verify_s3", covered_by="the beat")


def _ask(copy: CheckpointCopy, request: str, *, now, prefer: int | None = None) -> None:
    """Ask for a check or a deletion of the copy (the caller saves it)."""
    copy.request = request
    copy.request_node_id = _reader(copy, prefer=prefer)
    copy.requested_at = now
    copy.retry_after = None
    if copy.kind == CopyKind.S3:
        if request == CopyRequest.VERIFY:
            _s3_soon()
    elif copy.request_node_id:
        _wake([copy.request_node_id])


def _delete_copy(copy: CheckpointCopy, reason: str, *, actor: str, now) -> None:
    """Move the copy to deleting and ask whoever reaches it to delete its files (saved)."""
    _move_copy(copy, S.DELETING, reason, actor=actor, now=now)
    _ask(copy, CopyRequest.DELETE, now=now)
    copy.save()


def storage_kind() -> str:
    """Where the trainer's own checkpoint directory lives (settings.CHECKPOINT_ROOT_SHARED)."""
    return CopyKind.SHARED if settings.CHECKPOINT_ROOT_SHARED else CopyKind.NODE_LOCAL


def _placed(kind: str, node_id: int | None) -> int | None:
    return node_id if kind == CopyKind.NODE_LOCAL else None


def _locked_copy(copy_id: int) -> CheckpointCopy:
    if not 0 < copy_id < 2**63:
        raise ApplicationError("No such checkpoint copy.", code="not_found", status=404)
    found = _lock_copies(CheckpointCopy.objects.filter(pk=copy_id))
    if not found:
        raise ApplicationError("No such checkpoint copy.", code="not_found", status=404)
    return found[0]


def _lock_copies(copies) -> list[CheckpointCopy]:
    """Lock these copies, their checkpoints first: every writer takes a checkpoint before its
    copies (and rows in id order), so no two writers wait on each other."""
    pairs = list(copies.values_list("checkpoint_id", "pk"))
    if not pairs:
        return []
    list(
        Checkpoint.objects.select_for_update(no_key=True)
        .filter(pk__in={c for c, _ in pairs})
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    return list(
        CheckpointCopy.objects.select_for_update(no_key=True, of=("self",))
        .select_related("checkpoint")
        .filter(pk__in={pk for _, pk in pairs})
        .order_by("pk")
    )


def _present_at(job_id: int, kind: str, node_id: int | None, location: str):
    return CheckpointCopy.objects.filter(
        checkpoint__job_id=job_id,
        kind=kind,
        node_id=node_id,
        location=location,
        state__in=ON_STORAGE_COPY_STATES,
    )
