"""Tuning runs: what one measures, what its job's benchmark reports, and what ops adopt.

A tuning run measures a pool's NCCL settings on some of its nodes: the baseline (the profile
the pool's multi-node jobs get now) and candidates (apps/tuning/candidates.py), each as its
own process per round (NCCL reads most settings once per process), interleaved in an order
shuffled per round, so drift on the fabric hits all alike. Its job (kind "tuning",
apps/jobs/tuning_runs.py) runs the driver workers/trainer/tuning.py on every node, which
prints the collective benchmark's figures labelled with candidate and round.

States: QUEUED (its job waits for the nodes) → RUNNING → JUDGING (measured; the adoption
rule runs in a task) → AWAITING_APPROVAL (a candidate passed and ops must approve) →
ADOPTED or DECLINED; or NOTHING_ADOPTED (no candidate beat the noise: a valid result,
and a common one). A drift check (the baseline alone, against the figures its settings
were adopted on) ends STEADY or DRIFTED. A job that fails or is cancelled ends its run
FAILED or CANCELLED; a job requeued (a node lost) sends it back to QUEUED, its figures
dropped, since an interrupted run's rounds are no longer interleaved alike.

What a job prints is data: a figure is kept only for a candidate, round, operation and
size of the run's own plan (once: the first report of it counts), and a progress count
only from its first node's driver and never past the plan's total.
"""

import datetime as dt
import logging
import math
import random
import secrets
from collections import defaultdict

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.selectors import roles_of
from apps.accounts.services import audit_record
from apps.tuning import adoption, linter
from apps.tuning.candidates import (
    DEFAULT_LIMIT,
    MEASURED,
    CandidateRefused,
    with_ops_candidates,
)
from apps.tuning.models import (
    TUNING_FINISHED,
    NcclProfile,
    NcclProfileVersion,
    TuningMeasurement,
    TuningRun,
    TuningRunEvent,
    TuningRunKind,
    TuningRunState,
    VersionSource,
)
from apps.tuning.selectors import PoolNccl, profiles_all
from apps.tuning.services import (
    nccl_environment_render,
    nccl_profile_create,
    nccl_profile_update,
)
from controlplane.celery import enqueue_on_commit
from controlplane.errors import ApplicationError
from workers.trainer.config import Layout
from workers.trainer.presets import PRESETS

log = logging.getLogger(__name__)
S = TuningRunState

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# What the bundled trainer's default layout (FSDP) sends its gradients and parameters with.
MATTERING_OPS = ("all_gather", "reduce_scatter")
DEFAULT_SIZES = tuple(2**k for k in range(10, 31))  # 1 KiB to 1 GiB
MAX_ROUNDS = 50
MAX_LAUNCHES = 2000

TRANSITIONS = {
    S.QUEUED: {S.RUNNING, S.FAILED, S.CANCELLED},
    S.RUNNING: {S.JUDGING, S.QUEUED, S.FAILED, S.CANCELLED},
    S.JUDGING: {S.AWAITING_APPROVAL, S.ADOPTED, S.NOTHING_ADOPTED, S.STEADY, S.DRIFTED, S.FAILED},
    S.AWAITING_APPROVAL: {S.ADOPTED, S.DECLINED},
}


def _require_ops(by) -> None:
    if by is not None and not roles_of(by).manages_fleet:
        raise ApplicationError("Only ops run NCCL tuning.", code="permission_denied", status=403)


def _move(run: TuningRun, to: str, reason: str, *, by=None, **fields) -> TuningRun:
    """The one road of a tuning run's state: checked, written with its event."""
    if to not in TRANSITIONS.get(run.state, set()):
        raise ApplicationError(
            f"Tuning run {run.pk} is {run.get_state_display().lower()}; it cannot become "
            f"{S(to).label.lower()}.",
            code="invalid_transition",
            status=409,
        )
    came_from = run.state
    run.state, run.state_reason = to, reason[:300]
    if to in TUNING_FINISHED:
        run.finished_at = timezone.now()
    for name, value in fields.items():
        setattr(run, name, value)
    run.save()
    person = by if by is not None and by.pk else None
    TuningRunEvent.objects.create(
        run=run,
        from_state=came_from,
        to_state=to,
        reason=reason[:300],
        actor=person,
        actor_label=person.get_username() if person else "control plane",
    )
    return run


# --- what a run measures ---------------------------------------------------------------------


def _sizes(value, field: str, *, within: tuple[int, ...] | None = None) -> list[int]:
    if not isinstance(value, list | tuple) or not value:
        raise ApplicationError(f"Invalid {field}.", details={field: ["A non-empty list of sizes."]})
    sizes = set()
    for size in value:
        ok = isinstance(size, int) and not isinstance(size, bool)
        if not ok or size < adoption.SMALLEST or size > adoption.LARGEST or size & (size - 1):
            raise ApplicationError(
                f"Invalid {field}.",
                details={field: [f"{size!r}: sizes are powers of two from 1 KiB to 1 GiB."]},
            )
        sizes.add(size)
    if within is not None and not sizes <= set(within):
        raise ApplicationError(
            f"Invalid {field}.", details={field: ["Every size that matters must be measured."]}
        )
    return sorted(sizes)


def _ops(value) -> list[str]:
    if not isinstance(value, list | tuple) or not value or not set(value) <= set(OPS):
        raise ApplicationError(
            "Invalid ops.", details={"ops": [f"A non-empty list from {', '.join(OPS)}."]}
        )
    return [op for op in OPS if op in value]


def default_sizes_that_matter(*, gpus: int, measured: list[int]) -> list[int]:
    """The bundled trainer's gradient bucket sizes on this many GPUs under FSDP (the
    TUNING_PRESET model's, settings), among the measured sizes; all of them when none is."""
    shape = PRESETS[settings.TUNING_PRESET]
    buckets = adoption.gradient_bucket_sizes(shape, Layout(dp_shard=max(gpus, 2)))
    return sorted(set(buckets) & set(measured)) or list(measured)


def tuning_run_create(
    *,
    kind: str,
    pool: PoolNccl,
    nodes: list[tuple[int, str]],
    gpus_per_node: int,
    by,
    candidates: list | None = None,
    limit: int = DEFAULT_LIMIT,
    rounds: int = adoption.MIN_ROUNDS,
    ops: list | None = None,
    sizes: list | None = None,
    sizes_that_matter: list | None = None,
    approval_required: bool = True,
    warmup: int = 5,
    iters: int = 20,
    seed: int | None = None,
    reference: TuningRun | None = None,
    parent: TuningRun | None = None,
    step: int = 0,
) -> TuningRun:
    """A run's plan, checked: baseline and candidates (each through the linter for the
    pool's fabric and NCCL), the launch order per round. Its job is made by the caller
    (apps/jobs/tuning_runs.py) in the same transaction."""
    _require_ops(by)
    if kind not in TuningRunKind.values:
        raise ApplicationError("Invalid kind.", details={"kind": ["tuning or drift."]})
    if not isinstance(rounds, int) or not adoption.MIN_ROUNDS <= rounds <= MAX_ROUNDS:
        raise ApplicationError(
            "Invalid rounds.",
            details={
                "rounds": [
                    f"From {adoption.MIN_ROUNDS} (fewer cannot tell a change from the noise) "
                    f"to {MAX_ROUNDS}."
                ]
            },
        )
    for name, value, top in (("warmup", warmup, 100), ("iters", iters, 1000)):
        if (
            not isinstance(value, int)
            or not (name == "warmup" or value >= 1)
            or not 0 <= value <= top
        ):
            raise ApplicationError(f"Invalid {name}.", details={name: [f"From 1 to {top}."]})
    ops = _ops(list(ops) if ops is not None else list(OPS))
    sizes = _sizes(list(sizes) if sizes is not None else list(DEFAULT_SIZES), "sizes")
    gpus = len(nodes) * gpus_per_node
    matter = (
        _sizes(list(sizes_that_matter), "sizes_that_matter", within=tuple(sizes))
        if sizes_that_matter
        else default_sizes_that_matter(gpus=gpus, measured=sizes)
    )
    rendered = nccl_environment_render(
        nccl=None, nodes=len(nodes), pool=pool, profiles=profiles_all()
    )
    if not rendered.ok:
        problems = rendered.problems + [
            f"{v.name}: {v.reason}" for v in rendered.verdicts if v.blocking
        ]
        raise ApplicationError(
            f"Pool {pool.slug}'s NCCL settings do not pass the linter: fix its profile first.",
            details={"pool": problems},
        )
    baseline = rendered.env
    context = linter.Context(
        fabric=pool.fabric, nccl_version=pool.nccl_version, single_node=len(nodes) == 1
    )
    chosen = []
    if kind == TuningRunKind.TUNING:
        try:
            chosen = with_ops_candidates(
                candidates or [], baseline=baseline, context=context, limit=limit
            )
        except CandidateRefused as exc:
            raise ApplicationError(
                f"A candidate does not pass the linter: {exc.name}.",
                details={f"candidates.{exc.name}": [exc.reason]},
            ) from None
        if not chosen:
            raise ApplicationError(
                "Nothing to measure.",
                details={"candidates": ["The linter left no candidate for this pool's fabric."]},
            )
    plan = [
        {"index": 0, "label": "baseline", "changes": {}, "env": baseline, "origin": "baseline"}
    ] + [
        {
            "index": i,
            "label": c.label,
            "changes": dict(c.changes),
            "env": c.environment,
            "origin": c.origin,
        }
        for i, c in enumerate(chosen, start=1)
    ]
    if rounds * len(plan) > MAX_LAUNCHES:
        raise ApplicationError(
            "Too many launches.",
            details={"rounds": [f"{rounds} rounds × {len(plan)} settings is over {MAX_LAUNCHES}."]},
        )
    rng = random.Random(seed if seed is not None else secrets.randbits(32))  # noqa: S311
    order = []
    for _ in range(rounds):
        indices = list(range(len(plan)))
        rng.shuffle(indices)
        order.append(indices)
    profile = (
        NcclProfile.objects.filter(name=rendered.profile).first() if rendered.profile else None
    )
    version = (
        NcclProfileVersion.objects.filter(profile=profile, number=profile.version).first()
        if profile
        else None
    )
    run = TuningRun.objects.create(
        kind=kind,
        pool_id=pool.pool_id,
        node_ids=[node_id for node_id, _ in nodes],
        node_names=[name for _, name in nodes],
        profile=profile,
        baseline_version=version,
        candidates=plan,
        ops=ops,
        sizes=sizes,
        sizes_that_matter=matter,
        rounds=rounds,
        order=order,
        warmup=warmup,
        iters=iters,
        approval_required=approval_required,
        reference=reference,
        parent=parent,
        step=step,
        created_by=by if by is not None and by.pk else None,
        state_reason="waiting for its nodes",
    )
    TuningRunEvent.objects.create(
        run=run,
        from_state="",
        to_state=S.QUEUED,
        reason=f"{len(plan) - 1} candidate(s) × {rounds} rounds on {len(nodes)} node(s)",
        actor=run.created_by,
        actor_label=run.created_by.get_username() if run.created_by else "control plane",
    )
    audit_record(actor=by, action=f"tuning_run.{kind}", obj=run, after={"pool": pool.slug})
    return run


def driver_plan(run: TuningRun) -> dict:
    """What the driver on each node reads (workers/trainer/tuning.py): JSON, no secrets."""
    return {
        "rounds": run.rounds,
        "order": run.order,
        "candidates": [{"index": c["index"], "env": c["env"]} for c in run.candidates],
        "ops": run.ops,
        "sizes": run.sizes,
        "warmup": run.warmup,
        "iters": run.iters,
    }


def time_limit_s(run: TuningRun) -> int:
    """A generous bound for its job: a launch's start-up and every measurement's iterations
    at the slowest bus the catalogue expects (1 GB/s), twice over, at least 10 minutes."""
    per_launch = 30 + sum(
        (run.warmup + run.iters) * size / 1e9 * (3 if op != "all_reduce" else 2)
        for op in run.ops
        for size in run.sizes
    )
    return int(max(600, 2 * per_launch * run.launches_total))


# --- what the job reports -----------------------------------------------------------------------


def _whole(value, low: int, high: int) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    return value if ok else None


def _positive(value) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) and value >= 0 else None


def tuning_events_record(*, job_id: int, events: list[dict], head: bool) -> int:
    """Keep what a tuning job's nodes printed: figures, and progress from the first node's
    driver (`head`). Returns how many figures were kept. The benchmark's figures come from
    its global rank 0, which c10d's rendezvous may place on any node of the job, so they are
    taken from any node of it (each figure once: its candidate, round, operation and size
    are its key); the launch count only from the driver of node rank 0."""
    if not events:
        return 0
    with transaction.atomic():
        run = TuningRun.objects.select_for_update().filter(job_id=job_id).first()
        # JUDGING too: the agent relays output apart from the exit, so the last launch's
        # lines may come after the job ended (the judge waits for them).
        if run is None or run.state not in (S.QUEUED, S.RUNNING, S.JUDGING):
            return 0
        sizes, ops = set(run.sizes), set(run.ops)
        count, rounds = len(run.candidates), run.rounds
        rows, done = [], run.launches_done
        for event in events:
            kind = event.get("event")
            candidate = _whole(event.get("candidate"), 0, count - 1)
            round_ = _whole(event.get("round"), 0, rounds - 1)
            if kind == "tuning_launch":
                if head:
                    done = max(done, _whole(event.get("done"), 0, run.launches_total) or 0)
                continue
            if kind != "collective" or candidate is None or round_ is None:
                continue
            if event.get("op") not in ops:
                continue
            reported = _whole(event.get("bytes"), 1, adoption.LARGEST)
            busbw, algbw = _positive(event.get("busbw_gbps")), _positive(event.get("algbw_gbps"))
            time_us = _positive(event.get("time_us"))
            errors = _whole(event.get("errors"), 0, 2**62)
            if None in (reported, busbw, algbw, time_us, errors):
                continue
            # The benchmark rounds a size down to whole elements (and a multiple of the
            # ranks for the chunked operations): the figure is the requested size's.
            size = adoption.power_of_two(reported)
            if size not in sizes:
                continue
            rows.append(
                TuningMeasurement(
                    run=run,
                    candidate=candidate,
                    round=round_,
                    op=event["op"],
                    bytes=size,
                    busbw_gbps=busbw,
                    algbw_gbps=algbw,
                    time_us=time_us,
                    errors=errors,
                )
            )
        TuningMeasurement.objects.bulk_create(rows, ignore_conflicts=True)
        if done != run.launches_done:
            run.launches_done = done
            run.save(update_fields=["launches_done"])
        return len(rows)


# --- following its job ----------------------------------------------------------------------------


def tuning_runs_follow_jobs(*, job_ids: list[int], to: str, reason: str = "") -> None:
    """Its job moved (apps/jobs/transitions.jobs_move calls this for every move of a tuning
    job): the run follows. `to` is the job's new state."""
    runs = list(TuningRun.objects.select_for_update().filter(job_id__in=job_ids))
    for run in runs:
        if run.finished or run.state == S.JUDGING:
            continue
        if to == "running" and run.state == S.QUEUED:
            _move(run, S.RUNNING, "its job started on every node", started_at=timezone.now())
        elif to == "pending" and run.state == S.RUNNING:
            TuningMeasurement.objects.filter(run=run).delete()
            _move(
                run,
                S.QUEUED,
                f"its job was requeued ({reason[:200]}): measuring again",
                launches_done=0,
            )
        elif to == "succeeded" and run.state in (S.QUEUED, S.RUNNING):
            if run.state == S.QUEUED:
                _move(run, S.RUNNING, "its job ran", started_at=timezone.now())
            _move(
                run, S.JUDGING, "measured: applying the adoption rule", measured_at=timezone.now()
            )
            enqueue_on_commit("tuning.judge", run.pk, covered_by="the tuning sweep")
        elif to == "failed":
            _move(run, S.FAILED, f"its job failed: {reason}"[:300])
        elif to == "cancelled":
            _move(run, S.CANCELLED, f"its job was cancelled: {reason}"[:300])


# --- judging ---------------------------------------------------------------------------------


def figures(run: TuningRun) -> dict[int, dict[str, dict[int, list[float]]]]:
    """{candidate: {op: {size: busbw per round, in round order}}} (one query)."""
    out: dict[int, dict[str, dict[int, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for candidate, op, size, busbw in (
        TuningMeasurement.objects.filter(run=run)
        .order_by("candidate", "op", "bytes", "round")
        .values_list("candidate", "op", "bytes", "busbw_gbps")
    ):
        out[candidate][op][size].append(busbw)
    return out


def _wrong(run: TuningRun) -> set[int]:
    return set(
        TuningMeasurement.objects.filter(run=run, errors__gt=0).values_list("candidate", flat=True)
    )


def _verdict_dict(verdict: adoption.Verdict) -> dict:
    return {
        "adopt": verdict.adopt,
        "summary": verdict.summary,
        "confidence": verdict.confidence,
        "changes": [
            {
                "op": c.op,
                "bytes": c.size,
                "change_pct": round(c.change, 3),
                "low_pct": round(c.low, 3),
                "high_pct": round(c.high, 3),
                "matters": c.matters,
            }
            for c in verdict.changes
        ],
    }


def _mattering(run: TuningRun) -> dict[str, list[int]]:
    ops = [op for op in MATTERING_OPS if op in run.ops] or list(run.ops)
    return {op: list(run.sizes_that_matter) for op in ops}


def tuning_run_judge(run_id: int, *, now: dt.datetime | None = None) -> TuningRun | None:
    """Apply the adoption rule (a tuning run) or the drift test (a drift check) to a measured
    run. Safe to run twice: only a JUDGING run is judged. Until its last launch's output has
    come (the agent relays it apart from the exit) it waits, up to TUNING_OUTPUT_WAIT_S after
    the job ended; then it judges what came, and a candidate short of rounds is not judged.
    A run left JUDGING is returned as it is (the task asks again)."""
    now = now or timezone.now()
    with transaction.atomic():
        run = TuningRun.objects.select_for_update().filter(pk=run_id, state=S.JUDGING).first()
        if run is None:
            return None
        waited = (now - run.measured_at).total_seconds() if run.measured_at else math.inf
        if run.launches_done < run.launches_total and waited < settings.TUNING_OUTPUT_WAIT_S:
            return run
        if run.kind == TuningRunKind.DRIFT:
            return _judge_drift(run)
        return _judge_tuning(run)


def _judge_tuning(run: TuningRun) -> TuningRun:
    data, wrong = figures(run), _wrong(run)
    matter = _mattering(run)
    if 0 in wrong or 0 not in data:
        why = "gave wrong results" if 0 in wrong else "has no figures"
        return _move(run, S.FAILED, f"the baseline {why}: nothing can be judged against it")
    labels = {c["index"]: c["label"] for c in run.candidates}
    each = 1 - (1 - settings.TUNING_CONFIDENCE) / max(len(labels) - 1, 1)
    verdicts, notes = [], {}
    for index in sorted(labels):
        if index == 0:
            continue
        if index in wrong:
            notes[labels[index]] = "gave wrong results: disqualified"
            continue
        try:
            verdicts.append(
                adoption.judge_ops(
                    data[0],
                    data.get(index, {}),
                    matter=matter,
                    confidence=each,
                    name=labels[index],
                    seed=run.pk,
                )
            )
        except adoption.MeasurementError as exc:
            notes[labels[index]] = f"not judged: {exc}"
    choice = adoption.choose(verdicts)
    chosen = next(
        (c for c in run.candidates if choice.best and c["label"] == choice.best.candidate), None
    )
    run.result = {
        "chosen": chosen["index"] if chosen else None,
        "reason": choice.reason,
        "confidence_each": each,
        "sizes_that_matter": matter,
        "verdicts": {v.candidate: _verdict_dict(v) for v in verdicts},
        "not_judged": notes,
    }
    if chosen is None:
        return _move(run, S.NOTHING_ADOPTED, choice.reason)
    if run.approval_required:
        return _move(run, S.AWAITING_APPROVAL, f"{choice.reason}; waiting for ops to approve")
    _move(run, S.AWAITING_APPROVAL, choice.reason)
    return _adopt(run, by=None)


def _judge_drift(run: TuningRun) -> TuningRun:
    data, reference = figures(run), run.reference
    if reference is None or 0 not in data:
        return _move(
            run, S.FAILED, "no reference figures to compare with" if 0 in data else "no figures"
        )
    ref_data = figures(reference)
    which = (reference.result or {}).get("chosen") or 0
    if reference.kind == TuningRunKind.DRIFT:
        which = 0
    try:
        verdict = adoption.judge_drift(
            ref_data.get(which, {}),
            data[0],
            matter=_mattering(run),
            confidence=settings.TUNING_CONFIDENCE,
            seed=run.pk,
        )
    except adoption.MeasurementError as exc:
        return _move(run, S.FAILED, f"not judged: {exc}")
    run.result = {
        "drifted": verdict.adopt,
        "verdict": _verdict_dict(verdict),
        "reference": reference.pk,
    }
    if verdict.adopt:
        return _move(run, S.DRIFTED, "slower than when adopted: " + "; ".join(verdict.reasons))
    return _move(run, S.STEADY, verdict.reasons[0])


# --- adopting -----------------------------------------------------------------------------------


def _adopt(run: TuningRun, *, by) -> TuningRun:
    chosen = next(c for c in run.candidates if c["index"] == run.result["chosen"])
    env = dict(chosen["env"])
    reason = f"{MEASURED}: tuning run #{run.pk}"
    profile = NcclProfile.objects.select_for_update().filter(pool_id=run.pool_id).first()
    base = run.profile
    reasons = dict((profile or base).reasons or {}) if (profile or base) else {}
    reasons = {k: v for k, v in reasons.items() if k in env}
    for name in chosen["changes"]:
        reasons[name] = reason
    note = f"tuning run #{run.pk}: {chosen['label']}"
    if profile is not None:
        nccl_profile_update(
            profile=profile,
            by=by,
            env=env,
            reasons=reasons,
            source=VersionSource.ADOPTED,
            note=note,
            tuning_run=run,
        )
    else:
        pool = run.pool
        profile = nccl_profile_create(
            by=by,
            name=f"{pool.slug}-tuned"[:50],
            title=f"Tuned for pool {pool.name}"[:200],
            description=(
                f"Measured on {pool.name}'s nodes by tuning run #{run.pk}; starts from "
                f"{base.name if base else 'no profile'}. Its multi-node jobs get it first."
            ),
            fabric=pool.fabric or "any",
            single_node=False,
            min_nccl_version=pool.nccl_version,
            env=env,
            reasons=reasons,
            pool=pool,
            note=note,
            tuning_run=run,
        )
    version = NcclProfileVersion.objects.get(profile=profile, number=profile.version)
    who = by.get_username() if by is not None and by.pk else "the adoption rule (no approval asked)"
    return _move(
        run,
        S.ADOPTED,
        f"{chosen['label']} adopted as {profile.name} v{version.number} by {who}",
        by=by,
        decided_by=by if by is not None and by.pk else None,
        adopted_version=version,
    )


@transaction.atomic
def tuning_run_adopt(*, run: TuningRun, by) -> TuningRun:
    """Ops approve what the adoption rule chose: the pool's profile gets it as a new version."""
    _require_ops(by)
    run = TuningRun.objects.select_for_update().get(pk=run.pk)
    if run.state != S.AWAITING_APPROVAL:
        raise ApplicationError(
            f"Tuning run {run.pk} is {run.get_state_display().lower()}: nothing awaits approval.",
            code="invalid_transition",
            status=409,
        )
    return _adopt(run, by=by)


@transaction.atomic
def tuning_run_decline(*, run: TuningRun, by, reason: str = "") -> TuningRun:
    _require_ops(by)
    run = TuningRun.objects.select_for_update().get(pk=run.pk)
    why = f"declined by {by.get_username()}" + (f": {reason}" if reason else "")
    return _move(run, S.DECLINED, why, by=by, decided_by=by)


def tuning_runs_redrive(*, now=None) -> list[int]:
    """Judge again the runs left JUDGING past TUNING_JUDGE_REDRIVE_S (their task was lost);
    the ids of those judged now."""
    now = now or timezone.now()
    stale = now - dt.timedelta(seconds=settings.TUNING_JUDGE_REDRIVE_S)
    ids = list(
        TuningRun.objects.filter(state=S.JUDGING, measured_at__lt=stale).values_list(
            "pk", flat=True
        )
    )
    judged = []
    for pk in ids:
        run = tuning_run_judge(pk, now=now)
        if run is not None and run.state != S.JUDGING:
            judged.append(pk)
    return judged
