"""The choice of a checkpoint to resume a job from."""

import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.checkpoints.models import (
    Checkpoint,
    CheckpointCopy,
    CopyKind,
    CopyRequest,
    StorageSweep,
)
from apps.checkpoints.services.gc import _sweep_ask
from apps.checkpoints.services.ownership import _own, s3_copy_settings
from apps.checkpoints.services.states import C, S, _actor, _ask, _locked_copy, _note
from apps.jobs.models import JobKind, JobState
from apps.jobs.selectors import job_last_run_ended_at, job_nodes_held, job_with_team


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
    job = job_with_team(job_id=job_id)
    if job is None or job.kind != JobKind.TRAINER:
        return ResumePlan()
    s3 = s3_copy_settings(job)
    nodes = job_nodes_held(job_id=job.pk)
    if job.state != JobState.ADMITTED or not nodes:
        return ResumePlan(s3=s3)
    head = nodes[0]
    last_ended = job_last_run_ended_at(job_id=job.pk)
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
