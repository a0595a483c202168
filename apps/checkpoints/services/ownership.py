"""What a job owns (its directory, its S3 prefix), and refusing what it does not."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.accounts.selectors import roles_of
from apps.accounts.services import audit_record, audited_create, audited_delete, audited_update
from apps.checkpoints.models import (
    CheckpointCopy,
    CheckpointExport,
    CopyKind,
    CopyRequest,
    S3Destination,
)
from apps.checkpoints.services.states import (
    COPY_MOVES,
    S,
    _actor,
    _locked_copy,
    _move_copy,
    _note,
    _settle,
)
from apps.jobs.runconfig import checkpoint_dir
from apps.jobs.selectors import run_plans
from controlplane.errors import ApplicationError

if TYPE_CHECKING:
    from apps.jobs.models import Job, Run

log = logging.getLogger(__name__)


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
        for job_id, plan in run_plans(job_ids=prefixes):
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
    """The place the checked line names in `name`, if the job owns it; refused otherwise."""
    value = event[name]
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
    """An agent's work (selectors.agent_checkpoint_work) with every copy checked again, and
    every export's directories (read and written) checked to lie in its job's own."""
    asked = [item["copy"] for kind in ("verify", "delete") for item in work[kind]]
    if asked:
        vetted = copies_vet(copy_ids=asked)
        work = {
            **work,
            "verify": [item for item in work["verify"] if item["copy"] in vetted],
            "delete": [item for item in work["delete"] if item["copy"] in vetted],
        }
    if work.get("export"):
        exports = CheckpointExport.objects.filter(
            pk__in=[item["export"] for item in work["export"]]
        ).select_related("checkpoint__job__team")
        own = _own({e.checkpoint.job for e in exports}, s3=False)
        vetted = {
            e.pk
            for e in exports
            if not (
                own[e.checkpoint.job_id].refuses(e.source)
                or own[e.checkpoint.job_id].refuses(e.path)
            )
        }
        work = {**work, "export": [item for item in work["export"] if item["export"] in vetted]}
    return work


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
