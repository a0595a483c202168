"""Every write to the checkpoint registry: what agents report, verification, deletion, sweeps,
the choice of a checkpoint to resume from, and retention.

Three rules hold throughout. Storage first: a copy is marked deleted only when whoever
reaches it (the agent for node-local and shared copies, the control plane for S3) said
its files are gone, or that nothing was there. Nothing unregistered stays: a sweep lists
a job's directory through an agent and registers every committed checkpoint it finds
without a row, so GC can reach it, and removes the trainer's abandoned temporaries. A job's
output is evidence of its own work, never an instruction: a place it names is recorded,
checked, deleted or resumed from only under that job's own directory or S3 prefix.
"""

import datetime as dt
import json
import logging
import math
import re
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Exists, Max, OuterRef, Q
from django.utils import timezone

from apps.accounts.context import current_origin
from apps.accounts.selectors import roles_of
from apps.accounts.services import audit_record, audited_create, audited_delete, audited_update
from apps.checkpoints import retention
from apps.checkpoints.models import (
    LIVE_STATES,
    ON_STORAGE_COPY_STATES,
    PRESENT_COPY_STATES,
    Checkpoint,
    CheckpointCopy,
    CheckpointEvent,
    CheckpointState,
    CopyKind,
    CopyRequest,
    CopyState,
    S3Destination,
    StorageSweep,
)
from apps.checkpoints.selectors import agent_idle, retention_policy
from apps.fleet.models import Node, NodeState
from apps.jobs.models import Job, JobKind, JobState, Run
from apps.jobs.models.jobs import ACTIVE_STATES, FINISHED_STATES
from apps.jobs.runconfig import checkpoint_dir
from apps.jobs.services import job_can_manage, job_note
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


def _live(node_ids) -> set[int]:
    ids = {i for i in node_ids if i}
    if not ids:
        return set()
    return set(
        Node.objects.filter(pk__in=ids, state__in=READER_STATES).values_list("pk", flat=True)
    )


def _job_nodes(job_id: int) -> list[int]:
    """The nodes the job holds now, in the order dispatch ranks them (rank 0 first)."""
    return list(
        Node.objects.filter(allocations__job_id=job_id, allocations__ended_at__isnull=True)
        .order_by("rack_id", "name")
        .values_list("pk", flat=True)
    )


def _reader(copy: CheckpointCopy, *, prefer: int | None = None) -> int | None:
    """The node whose agent should check or delete this copy (None: the control plane, for S3,
    or nobody reachable now)."""
    if copy.kind == CopyKind.S3:
        return None
    if copy.kind == CopyKind.NODE_LOCAL:
        return copy.node_id
    checkpoint = copy.checkpoint
    order = [prefer, checkpoint.node_id, *_job_nodes(checkpoint.job_id)]
    live = _live(order)
    for node_id in order:
        if node_id in live:
            return node_id
    # Shared storage: any node of the writer's pool mounts it too.
    pool_id = Node.objects.filter(pk=checkpoint.node_id).values_list("pool_id", flat=True).first()
    if pool_id is not None:
        other = (
            Node.objects.filter(pool_id=pool_id, state__in=READER_STATES)
            .order_by("pk")
            .values_list("pk", flat=True)
            .first()
        )
        if other is not None:
            return other
    return None


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


# --- S3 destinations ---------------------------------------------------------------------------


def s3_destination_for(job: Job) -> tuple[str, str] | None:
    """(bucket, prefix) of the job's S3 copies: its team's destination, its pool's, or the
    settings' default; None: no S3 copy."""
    found = S3Destination.objects.filter(Q(team_id=job.team_id) | Q(pool_id=job.pool_id or -1))
    by_team = {d.team_id is not None: d for d in found}
    chosen = by_team.get(True) or by_team.get(False)
    if chosen is not None:
        return chosen.bucket, chosen.prefix
    if settings.CHECKPOINT_S3_BUCKET:
        return settings.CHECKPOINT_S3_BUCKET, settings.CHECKPOINT_S3_PREFIX
    return None


def s3_copy_settings(job: Job) -> dict | None:
    """run.json's checkpoint.s3 for the job: the trainer copies each checkpoint there."""
    destination = s3_destination_for(job)
    if destination is None:
        return None
    bucket, prefix = destination
    parts = [p for p in (prefix.strip("/"), job.team.slug, f"job-{job.pk}") if p]
    return {
        "bucket": bucket,
        "prefix": "/".join(parts),
        "endpoint_url": settings.AWS_ENDPOINT_URL or None,
        "region": settings.AWS_REGION,
    }


def _s3_of(plan: dict | None) -> dict | None:
    """checkpoint.s3 of a run plan's run.json: where the control plane told the run to copy."""
    for item in (plan or {}).get("files") or []:
        if item.get("path") == "run.json":
            try:
                s3 = json.loads(item.get("content") or "{}")["checkpoint"].get("s3")
            except (ValueError, KeyError, TypeError, AttributeError):
                return None
            return s3 if isinstance(s3, dict) else None
    return None


def _s3_wanted_by(run: Run) -> bool:
    """Whether the run's run.json asks the trainer for S3 copies."""
    return _s3_of(run.plan) is not None


# --- what a job owns ------------------------------------------------------------------------------
# A job's output is evidence of its own work, never an instruction: a path or URI that a job
# prints, or that an agent reports about its directory, is recorded, checked, deleted or
# resumed from only if it lies under that job's own directory or S3 prefix.


def _inside(location: str, root: str) -> bool:
    """Whether `location` names something strictly inside `root` (a directory, or an s3://
    bucket and prefix), written plainly: storage could resolve a `.`, `..` or empty part to
    somewhere other than the text says, so none is accepted."""
    if not location.startswith(root + "/"):
        return False
    return all(part not in ("", ".", "..") for part in location[len(root) + 1 :].split("/"))


@dataclass(frozen=True)
class Own:
    """Where one job's checkpoints may be: its directory (runconfig.checkpoint_dir) and the
    S3 prefixes its runs were told to copy to (s3_copy_settings, kept in each run.json)."""

    job_id: int
    directory: str
    prefixes: frozenset[str] = frozenset()

    def refuses(self, location: str) -> str:
        """Why `location` is not this job's ("" when it is)."""
        if location.startswith("s3://"):
            if any(_inside(location, root) for root in self.prefixes):
                return ""
            return f"not under job {self.job_id}'s own S3 prefix"
        if _inside(location, self.directory):
            return ""
        return f"not under job {self.job_id}'s own checkpoint directory"


def _own(jobs, *, s3: bool = True) -> dict[int, Own]:
    """Each job's own places (its team loaded); with `s3`, its runs' prefixes too."""
    prefixes: dict[int, set[str]] = {job.pk: set() for job in jobs}
    if s3 and prefixes:
        for job_id, plan in Run.objects.filter(job_id__in=prefixes).values_list("job_id", "plan"):
            target = _s3_of(plan) or {}
            bucket, prefix = target.get("bucket"), str(target.get("prefix") or "").strip("/")
            if isinstance(bucket, str) and bucket and prefix:
                prefixes[job_id].add(f"s3://{bucket}/{prefix}")
    return {job.pk: Own(job.pk, checkpoint_dir(job), frozenset(prefixes[job.pk])) for job in jobs}


def _refusal_record(job: Job, why: str, **facts) -> None:
    """Kept in the audit log (ops and the team's admins read it) and logged, the place itself
    left out of the log: it may name another team's storage."""
    log.warning(
        "refused checkpoint output of job %s: %s (%s)",
        job.pk,
        why,
        ", ".join(f"{k}={v}" for k, v in facts.items() if k != "location"),
    )
    audit_record(
        actor=None,
        action="checkpoint.output_refused",
        obj=job,
        after={**facts, "why": why},
        team=job.team,
    )


class NotOwned(ApplicationError):
    """A job's output named a place that is not its own: refused, nothing recorded but that."""

    def __init__(self, field: str, location: str, why: str):
        super().__init__(
            f"Refused: {field} is {why}.",
            code="not_owned",
            status=403,
            details={field: [f"{why[0].upper()}{why[1:]}."]},
        )
        self.field, self.location, self.why = field, location, why


def _place(event: dict, name: str, own: Own) -> str:
    value = _text(event, name)
    why = own.refuses(value)
    if why:
        raise NotOwned(f"event.{name}", value, why)
    return value


def copies_vet(*, copy_ids) -> set[int]:
    """Of these copies, those that lie under their own job's directory or S3 prefix, checked
    again just before storage is touched (a verification, a deletion). Any other is never
    touched: its request is dropped, it is marked missing (as a copy found elsewhere is) and
    the refusal recorded."""
    copies = list(
        CheckpointCopy.objects.filter(pk__in=list(copy_ids)).select_related("checkpoint__job__team")
    )
    jobs = {c.checkpoint.job_id: c.checkpoint.job for c in copies}
    own = _own(jobs.values(), s3=any(c.kind == CopyKind.S3 for c in copies))
    vetted = set()
    for copy in copies:
        why = own[copy.checkpoint.job_id].refuses(copy.location)
        if not why:
            vetted.add(copy.pk)
            continue
        with transaction.atomic():
            _copy_refuse(copy.pk, why)
        _refusal_record(
            copy.checkpoint.job,
            why,
            copy=copy.pk,
            request=copy.request,
            location=copy.location[:300],
        )
    return vetted


def _copy_refuse(copy_id: int, why: str) -> None:
    copy = _locked_copy(copy_id)
    now, actor = timezone.now(), _actor()
    reason = f"{why}: neither checked nor deleted"
    if S.MISSING in COPY_MOVES[copy.state]:
        _move_copy(copy, S.MISSING, reason, actor=actor, now=now)
    else:
        _note(copy.checkpoint, reason, actor=actor, copy=copy)
    copy.request, copy.request_node_id, copy.requested_at = CopyRequest.NONE, None, None
    copy.error = reason[:500]
    copy.save()
    _settle(copy.checkpoint, reason, actor=actor, now=now)


def agent_work_vet(*, work: dict) -> dict:
    """An agent's work (selectors.agent_checkpoint_work) with every copy checked again."""
    asked = [item["copy"] for kind in ("verify", "delete") for item in work[kind]]
    if not asked:
        return work
    vetted = copies_vet(copy_ids=asked)
    return {
        **work,
        "verify": [item for item in work["verify"] if item["copy"] in vetted],
        "delete": [item for item in work["delete"] if item["copy"] in vetted],
    }


def _manages_fleet(by) -> None:
    if by is not None and not roles_of(by).manages_fleet:
        raise ApplicationError(
            "Only ops set where checkpoints are copied.", code="permission_denied", status=403
        )


def s3_destination_create(*, by, team=None, pool=None, bucket: str, prefix: str = ""):
    _manages_fleet(by)
    if (team is None) == (pool is None):
        raise ApplicationError(
            "Name a team or a pool, not both.", details={"team": ["A team or a pool."]}
        )
    return audited_create(
        model=S3Destination,
        by=by,
        fields={"team": team, "pool": pool, "bucket": bucket, "prefix": prefix.strip("/")},
        action="s3_destination.create",
        team=team,
    )


def s3_destination_update(*, by, destination: S3Destination, **changes):
    _manages_fleet(by)
    changes = {k: v for k, v in changes.items() if k in ("bucket", "prefix")}
    if "prefix" in changes:
        changes["prefix"] = changes["prefix"].strip("/")
    return audited_update(
        instance=destination, by=by, changes=changes, action="s3_destination.update"
    )


def s3_destination_delete(*, by, destination: S3Destination) -> None:
    _manages_fleet(by)
    audited_delete(instance=destination, by=by, action="s3_destination.delete")


# --- what the agents report: the trainer's checkpoint lines ------------------------------------


def invalid_input(field: str, message: str) -> ApplicationError:
    """A 400 naming the field (the agent endpoints use it too)."""
    return ApplicationError(f"Invalid input: {field}.", details={field: [message]})


def _integer(event: dict, name: str, *, default=None, maximum: int = 2**63 - 1) -> int:
    value = event.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise invalid_input(f"event.{name}", f"A whole number from 0 to {maximum}.")
    return value


def _storable(text: str) -> bool:
    """PostgreSQL stores neither NUL nor lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def _clean(text, limit: int = 500) -> str:
    """Free text from an agent, made storable."""
    text = str(text or "").replace("\x00", "")
    return text.encode("utf-8", "replace").decode("utf-8")[:limit]


def _text(event: dict, name: str, *, limit: int = 1024) -> str:
    value = event.get(name)
    if not isinstance(value, str) or not value or len(value) > limit or not _storable(value):
        raise invalid_input(f"event.{name}", f"Text of at most {limit} characters.")
    return value


def _digest(event: dict, name: str = "manifest_sha256") -> str:
    value = event.get(name)
    if not isinstance(value, str) or not SHA256.match(value):
        raise invalid_input(f"event.{name}", "A SHA-256 in lowercase hex.")
    return value


def _instant(value, now):
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 4e9:
        return dt.datetime.fromtimestamp(value, tz=dt.UTC)
    return now


def _finite(value) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def _layout(value) -> dict:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:20]: v for k, v in value.items() if isinstance(v, int) and 0 < v < 2**31}


def _present_at(job_id: int, kind: str, node_id: int | None, location: str):
    return CheckpointCopy.objects.filter(
        checkpoint__job_id=job_id,
        kind=kind,
        node_id=node_id,
        location=location,
        state__in=ON_STORAGE_COPY_STATES,
    )


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


def checkpoint_event_record(*, node_id: int, run_id: int, event: dict) -> dict:
    """One of the trainer's checkpoint lines, as the node's agent relays it."""
    run = Run.objects.select_related("job__team", "node").filter(pk=run_id, node_id=node_id).first()
    if run is None:
        raise ApplicationError("No such run on this node.", code="not_found", status=404)
    if not isinstance(event, dict):
        raise invalid_input("event", "A JSON object.")
    handler = {
        "checkpoint": _committed,
        "checkpoint_copy": _copied,
        "checkpoint_copy_failed": _copy_failed,
        "checkpoint_rejected": _rejected,
        "checkpoint_fetched": _fetched,
        "resume": _resumed,
    }.get(event.get("event"))
    if handler is None:
        return {"ignored": True}
    actor = f"agent:{run.node.name}"
    own = _own([run.job])[run.job_id]
    for tries in range(3):  # two agents racing on one path: the loser reads the winner's row
        try:
            with transaction.atomic():
                return handler(run, event, own=own, actor=actor, now=timezone.now())
        except IntegrityError:
            if tries == 2:
                raise
        except NotOwned as refused:  # recorded once its transaction has rolled back
            _refusal_record(
                run.job,
                refused.why,
                run=run.pk,
                event=event.get("event"),
                field=refused.field,
                location=refused.location[:300],
            )
            raise
    return {}  # pragma: no cover


def _committed(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    step = _integer(event, "step", maximum=2**31 - 1)
    digest = _digest(event)
    path = _place(event, "path", own)
    replaced = event.get("replaced")
    if isinstance(replaced, str) and 0 < len(replaced) <= 1024 and _storable(replaced):
        replaced = _place(event, "replaced", own)
    kind = storage_kind()
    place = _placed(kind, run.node_id)
    checkpoint, created = Checkpoint.objects.get_or_create(
        job_id=run.job_id,
        step=step,
        manifest_sha256=digest,
        defaults={
            "team_id": run.job.team_id,
            "attempt": run.attempt,
            "world_size": _integer(event, "world_size", default=1, maximum=2**31 - 1),
            "layout": _layout(event.get("layout")),
            "size_bytes": _integer(event, "size_bytes", default=0),
            "files": _integer(event, "files", default=0, maximum=2**31 - 1),
            "loss": _finite(event.get("loss")),
            "node_id": run.node_id,
            "s3_expected": _s3_wanted_by(run),
            "committed_at": _instant(event.get("time"), now),
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
        if isinstance(replaced, str) and 0 < len(replaced) <= 1024 and _storable(replaced):
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
    copy.error = _clean(error)
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
    step = _integer(event, "step", maximum=2**31 - 1)
    uri = _text(event, "uri")
    if not uri.startswith("s3://"):
        raise invalid_input("event.uri", "An s3:// URI.")
    uri = _place(event, "uri", own)
    checkpoint = _of_step(run, step)
    if checkpoint is None:
        return {"ignored": True}
    copy = _s3_copy(checkpoint, uri, S.COMMITTED, actor=actor, now=now)
    _settle(checkpoint, "copied to S3", actor=actor, now=now)
    return {"checkpoint": checkpoint.pk, "copy": copy.pk}


def _copy_failed(run: Run, event: dict, *, own: Own, actor: str, now) -> dict:
    step = _integer(event, "step", maximum=2**31 - 1)
    uri = _text(event, "uri")
    if not uri.startswith("s3://"):
        return {"ignored": True}
    uri = _place(event, "uri", own)
    checkpoint = _of_step(run, step)
    if checkpoint is None:
        return {"ignored": True}
    message = _clean(event.get("message") or "the upload failed", 250)
    tries = _integer(event, "attempts", default=1, maximum=1000)
    if tries > 1:
        message = f"{message} (tried {tries} times)"
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
    reason = _clean(event.get("reason") or "it did not verify", 250)
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
    if event.get("uri") is not None:
        _place(event, "uri", own)
    digest = event.get("manifest_sha256")
    checkpoint = (
        Checkpoint.objects.filter(job_id=run.job_id, manifest_sha256=digest)
        .exclude(state=C.DELETED)
        .first()
        if isinstance(digest, str)
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
        _note(
            checkpoint, f"fetched from {event.get('uri', 'S3')} to {path}", actor=actor, copy=copy
        )
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
    step = copy.checkpoint.step if copy else event.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        step = None
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


# --- verification --------------------------------------------------------------------------------


def _locked_copy(copy_id: int) -> CheckpointCopy:
    if not 0 < copy_id < 2**63:
        raise ApplicationError("No such checkpoint copy.", code="not_found", status=404)
    found = _lock_copies(CheckpointCopy.objects.filter(pk=copy_id))
    if not found:
        raise ApplicationError("No such checkpoint copy.", code="not_found", status=404)
    return found[0]


def _answerer(node_id: int | None) -> str:
    """Who answered a request: a node's agent, or (S3) the control plane."""
    return f"agent:{Node.objects.get(pk=node_id).name}" if node_id else _actor()


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
            copy, to, _clean(problem) or "it does not match the manifest", actor=actor, now=now
        )
        copy.error = _clean(problem)
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
    copy.error = _clean(message)
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
        _move_copy(copy, S.MISSING, _clean(message) or "not at its path", actor=actor, now=now)
        copy.error = _clean(message)
    else:
        copy.attempts = min(copy.attempts + 1, 1000)
        copy.error = _clean(message or "the deletion failed")
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
    tidy = not Run.objects.filter(job=job, state__in=["planned", "running"]).exists()
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
    removed = [_clean(x, 200) for x in removed[:1000]]
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
        sweep.result["problem"] = _clean(report["problem"], 300)
    sweep.save(update_fields=["reported_at", "result"])
    if refused:
        _refusal_record(
            job,
            own.refuses(refused[0]),
            sweep=sweep.pk,
            refused=len(refused),
            location=_clean(refused[0], 300),
        )
    return sweep


def _adopt(job: Job, entry: dict, *, node_id: int, actor: str, now) -> Checkpoint:
    """Register a committed checkpoint the registry never heard of (its report was lost)."""
    step = entry.get("manifest_step", entry.get("step"))
    step = step if isinstance(step, int) and 0 <= step < 2**31 else 0
    attempt = entry.get("attempt")
    if not (isinstance(attempt, int) and 0 < attempt < 2**15):
        attempt = Run.objects.filter(job=job).aggregate(n=Max("attempt"))["n"] or 1

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
        layout=_layout(entry.get("layout")),
        size_bytes=number("size_bytes", 2**63 - 1),
        files=number("files", 2**31 - 1),
        loss=_finite(entry.get("loss")),
        node_id=node_id,
        committed_at=_instant(entry.get("time"), now),
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


# --- resume ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePlan:
    """What a job's next attempt resumes from; `wait`: ask again in a moment (the new nodes are
    still checking newer checkpoints or listing the directory)."""

    wait: bool = False
    resume_from: str | None = None
    checkpoint_id: int | None = None
    step: int | None = None
    s3: dict | None = None
    reason: str = ""


def _reachable(copy: CheckpointCopy, nodes: list[int]) -> bool:
    """Can the job's new nodes read this copy? Node-local copies only on the one node that
    holds them; shared and S3 copies from anywhere."""
    if copy.kind == CopyKind.NODE_LOCAL:
        return len(nodes) == 1 and copy.node_id == nodes[0]
    return True


PREFERENCE = {CopyKind.NODE_LOCAL: 0, CopyKind.SHARED: 1, CopyKind.S3: 2}


def checkpoint_resume_prepare(*, job_id: int, now: dt.datetime | None = None) -> ResumePlan:
    """The checkpoint an ADMITTED trainer job resumes from: the newest verified one with a
    copy its new nodes reach. Before choosing, the job's directory is listed from its new
    first node (committed checkpoints whose reports were lost are registered) and newer
    committed copies they reach are checked, for at most CHECKPOINT_RESUME_WAIT_S."""
    now = now or timezone.now()
    job = Job.objects.select_related("team").filter(pk=job_id).first()
    if job is None or job.kind != JobKind.TRAINER:
        return ResumePlan()
    s3 = s3_copy_settings(job)
    nodes = _job_nodes(job.pk)
    if job.state != JobState.ADMITTED or not nodes:
        return ResumePlan(s3=s3)
    head = nodes[0]
    last_ended = Run.objects.filter(job=job).aggregate(at=Max("ended_at"))["at"]
    if last_ended is None and not Checkpoint.objects.filter(job=job).exists():
        return ResumePlan(s3=s3)  # its first attempt
    deadline = (job.admitted_at or now) + dt.timedelta(seconds=settings.CHECKPOINT_RESUME_WAIT_S)
    own = _own([job])[job.pk]
    waiting = []
    with transaction.atomic():
        if last_ended is not None:
            sweep = (
                StorageSweep.objects.filter(job=job, node_id=head, requested_at__gte=last_ended)
                .order_by("-requested_at")
                .first()
            )
            if sweep is None:
                sweep = _sweep_ask(job, head, why="before resuming", tidy=True, now=now)
            if sweep.reported_at is None:
                waiting.append("the directory listed from the new nodes")
        chosen, chosen_copy = None, None
        candidates = (
            Checkpoint.objects.filter(job=job, state__in=[C.COMMITTED, C.VERIFIED])
            .prefetch_related("copies")
            .order_by("-step", "-committed_at")
        )
        for checkpoint in candidates:
            copies = [
                c
                for c in checkpoint.copies.all()
                if c.state in (S.COMMITTED, S.VERIFIED) and not own.refuses(c.location)
            ]
            verified = sorted(
                (c for c in copies if c.state == S.VERIFIED and _reachable(c, nodes)),
                key=lambda c: PREFERENCE[c.kind],
            )
            if verified:
                chosen, chosen_copy = checkpoint, verified[0]
                break
            for copy in copies:  # newer than any verified one: check it from the new nodes
                if not _reachable(copy, nodes):
                    continue
                if copy.request != CopyRequest.VERIFY or copy.request_node_id not in (
                    (None, head) if copy.kind == CopyKind.S3 else (head,)
                ):
                    copy = _locked_copy(copy.pk)
                    _ask(copy, CopyRequest.VERIFY, now=now, prefer=head)
                    copy.save()
                waiting.append(f"step {checkpoint.step}'s {copy.get_kind_display()} copy checked")
        if waiting and now < deadline:
            return ResumePlan(wait=True, s3=s3, reason="waiting for " + "; ".join(waiting))
        if chosen is None:
            return ResumePlan(
                s3=s3, reason="no verified checkpoint its nodes reach: from the start"
            )
        Checkpoint.objects.filter(pk=chosen.pk).update(offered_at=now)
        _note(
            chosen,
            f"named in attempt plans to resume from ({chosen_copy.get_kind_display()} copy)",
            actor=_actor(),
            copy=chosen_copy,
        )
    return ResumePlan(
        resume_from=chosen_copy.location,
        checkpoint_id=chosen.pk,
        step=chosen.step,
        s3=s3,
        reason=f"step {chosen.step} ({chosen_copy.get_kind_display()} copy)",
    )


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
            job = Job.objects.get(pk=job_id)
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
    jobs = (
        Job.objects.filter(kind=JobKind.TRAINER, state__in=FINISHED_STATES, finished_at__gte=recent)
        .annotate(swept=Exists(done))
        .filter(swept=False)
        .order_by("-finished_at")[: limit * 5]
    )
    for job in jobs:
        if swept >= limit:
            break
        writers = list(
            Run.objects.filter(job=job, node_rank=0)
            .order_by("-attempt")
            .values_list("node_id", flat=True)
        )
        if not writers:
            continue
        # Node-local: only the last attempt's writer holds the directory; shared: any writer.
        if storage_kind() == CopyKind.NODE_LOCAL:
            writers = writers[:1]
        live = _live(writers)
        node_id = next((n for n in writers if n in live), None)
        if node_id is None:
            continue  # nobody reaches it now: asked again on a later pass
        _sweep_ask(job, node_id, why="after the job ended", tidy=True, now=now)
        swept += 1
    return {"swept": swept}


def checkpoints_collect(*, now: dt.datetime | None = None) -> dict[str, int]:
    """GC's pass (task checkpoints.collect): retention, then requests re-offered, then the
    directories of jobs that ended listed. S3 deletions are the task's, with boto3."""
    return {**retention_apply(now=now), **requests_reoffer(now=now), **finished_jobs_sweep(now=now)}
