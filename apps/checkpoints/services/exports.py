"""Exports of committed checkpoints as Hugging Face Llama directories: asked of the agent of a
node that reaches the checkpoint's directory, which runs the trainer's exporter as the job's
own user and answers with what it wrote (workers/agent/checkpoints.py)."""

from __future__ import annotations

import datetime as dt

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.selectors import roles_of
from apps.checkpoints.models import (
    Checkpoint,
    CheckpointExport,
    CopyKind,
    ExportDtype,
    ExportState,
)
from apps.checkpoints.services.agent_input import clean_text, invalid_input
from apps.checkpoints.services.ownership import _own, _refusal_record
from apps.checkpoints.services.states import (
    READER_STATES,
    C,
    S,
    _actor,
    _note,
    _reader,
    _user_label,
    _wake,
)
from apps.checkpoints.services.verification import _answerer
from apps.fleet.selectors import nodes_among
from controlplane.errors import ApplicationError

E = ExportState
EXPORTABLE_STATES = frozenset({C.COMMITTED, C.VERIFIED})
EXPORT_SUFFIX = "-hf"  # step-00000060 → step-00000060-hf, beside it in the job's directory


def export_path_of(location: str) -> str:
    """Where an export of the checkpoint at `location` is written: beside it, in the job's own
    directory, under a name the trainer and the sweeps never take for a checkpoint."""
    return location.rstrip("/") + EXPORT_SUFFIX


def checkpoint_export_allowed(*, user, team_id: int) -> bool:
    """The team's researchers and admins (a model of their own team's), ops and superusers."""
    roles = roles_of(user)
    return roles.superuser or roles.ops or roles.can_submit_for(team_id)


def _may_export(by, checkpoint: Checkpoint) -> None:
    if checkpoint_export_allowed(user=by, team_id=checkpoint.team_id):
        return
    raise ApplicationError(
        "Only the team's researchers and admins, and ops, export its checkpoints.",
        code="permission_denied",
        status=403,
    )


@transaction.atomic
def checkpoint_export_request(
    *, checkpoint: Checkpoint, by, dtype: str = ExportDtype.BFLOAT16
) -> CheckpointExport:
    """Ask a node that reaches the checkpoint to write it as a Hugging Face directory."""
    _may_export(by, checkpoint)
    if dtype not in ExportDtype.values:
        raise invalid_input("dtype", f"One of {', '.join(ExportDtype.values)}.")
    locked = (
        Checkpoint.objects.select_for_update(no_key=True, of=("self",))
        .select_related("job__team")
        .get(pk=checkpoint.pk)
    )
    if locked.state not in EXPORTABLE_STATES:
        raise ApplicationError(
            f"Only a committed or verified checkpoint is exported; this one is {locked.state}.",
            code="invalid_transition",
            status=409,
        )
    if locked.exports.filter(state=E.REQUESTED).exists():
        raise ApplicationError(
            "An export of this checkpoint is under way; ask again once it is done.",
            code="export_open",
            status=409,
        )
    usable = sorted(
        locked.copies.filter(state__in=[S.VERIFIED, S.COMMITTED]),
        key=lambda c: (c.state != S.VERIFIED, c.pk),  # a verified copy first
    )
    copies = [c for c in usable if c.kind != CopyKind.S3]
    if not copies:
        if usable:
            raise ApplicationError(
                "This checkpoint is only in S3, which an export does not read yet: resume a "
                "job from it (or copy it to a path nodes mount) and export that one.",
                code="s3_only",
                status=409,
            )
        raise ApplicationError(
            "No usable copy of this checkpoint is left to export.", code="no_copy", status=409
        )
    copy = copies[0]
    job = locked.job
    out = export_path_of(copy.location)
    own = _own([job], s3=False)[job.pk]
    why = own.refuses(copy.location) or own.refuses(out)
    if why:
        _refusal_record(job, why, checkpoint=locked.pk, location=copy.location[:300])
        raise ApplicationError(
            f"Refused: its copy is {why}.",
            code="not_owned",
            details={"checkpoint": [f"Its copy at {copy.location} is {why}."]},
        )
    node_id = _reader(copy)
    if node_id is None or not nodes_among(node_ids=[node_id], states=READER_STATES):
        raise ApplicationError(
            "No node that reaches this checkpoint answers now; ask again when one does.",
            code="unreachable",
            status=409,
        )
    export = CheckpointExport.objects.create(
        checkpoint=locked,
        dtype=dtype,
        source=copy.location,
        path=out,
        node_id=node_id,
        requested_by=by,
        requested_at=timezone.now(),
    )
    _note(locked, f"export to {out} ({dtype}) asked", actor=_user_label(by), copy=copy)
    _wake([node_id])
    return export


def _files_of(report) -> list[dict] | None:
    """The files an agent says it wrote: plain names and byte counts, or None if unreadable."""
    files = report.get("files")
    if not isinstance(files, list) or len(files) > 10_000:
        return None
    found = []
    for item in files:
        name = item.get("name") if isinstance(item, dict) else None
        size = item.get("size") if isinstance(item, dict) else None
        if (
            not isinstance(name, str)
            or not 0 < len(name) <= 255
            or "/" in name
            or name in (".", "..")
            or isinstance(size, bool)
            or not isinstance(size, int)
            or not 0 <= size < 2**63
        ):
            return None
        found.append({"name": clean_text(name, 255), "size": size})
    return found


@transaction.atomic
def export_record(*, node_id: int, export_id: int, report: dict) -> CheckpointExport:
    """The agent's answer: done (what it wrote, at the path it was given) or failed (why)."""
    if not 0 < export_id < 2**63:
        raise ApplicationError("No such export for this node.", code="not_found", status=404)
    export = (
        CheckpointExport.objects.select_for_update(of=("self",))
        .select_related("checkpoint")
        .filter(pk=export_id, node_id=node_id)
        .first()
    )
    if export is None:
        raise ApplicationError("No such export for this node.", code="not_found", status=404)
    if export.state != E.REQUESTED:
        return export  # answered already (a retried report)
    ok = report.get("ok")
    if not isinstance(ok, bool):
        raise invalid_input("ok", "true or false.")
    now, actor = timezone.now(), _answerer(node_id)
    files = _files_of(report) if ok else []
    if ok and report.get("path") != export.path:
        ok, problem = False, "the exporter reported another directory than the one asked"
    elif ok and not files:
        ok, problem = False, "the exporter reported no files"
    else:
        problem = clean_text(report.get("problem")) or "the export failed"
    if ok:
        export.state, export.error = E.DONE, ""
        export.files = files
        export.size_bytes = sum(f["size"] for f in files)
        why = f"exported to {export.path} ({export.dtype})"
    else:
        export.state, export.error = E.FAILED, problem
        why = f"export failed: {problem}"
    export.finished_at = now
    export.save(update_fields=["state", "error", "files", "size_bytes", "finished_at"])
    _note(export.checkpoint, why, actor=actor)
    return export


def exports_expire(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Exports whose node stopped answering, or that took past the exporter's time limit
    and then some, fail (the button is offered again): an export is cheap to ask anew."""
    now = now or timezone.now()
    stale = now - dt.timedelta(seconds=settings.CHECKPOINT_EXPORT_TIMEOUT_S * 2)
    open_exports = list(
        CheckpointExport.objects.filter(state=E.REQUESTED).values_list(
            "pk", "node_id", "requested_at"
        )[:1000]
    )
    live = nodes_among(node_ids={n for _, n, _ in open_exports if n}, states=READER_STATES)
    failed = 0
    for pk, node_id, requested_at in open_exports:
        if node_id in live and requested_at >= stale:
            continue
        with transaction.atomic():
            export = CheckpointExport.objects.select_for_update().filter(pk=pk).first()
            if export is None or export.state != E.REQUESTED:
                continue
            gone = node_id not in live
            problem = "its node stopped answering" if gone else "no answer in time"
            export.state, export.error, export.finished_at = E.FAILED, problem, now
            export.save(update_fields=["state", "error", "finished_at"])
            _note(export.checkpoint, f"export failed: {problem}", actor=_actor())
            failed += 1
    return {"exports_expired": failed}
