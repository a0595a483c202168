"""Writes for jobs: submit, cancel, hold, release, requeue, reservations and webhooks; the
state changes themselves go through apps/jobs/transitions.py."""

import datetime as dt
import hashlib
import json
import logging
import secrets
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from apps.accounts.secrets import encrypt
from apps.accounts.selectors import quota_limits, roles_of, team_secret_names
from apps.accounts.services import audit_record, snapshot
from apps.costs import selectors as costs
from apps.costs.money import money_text
from apps.fleet.selectors import pools_capacity
from apps.jobs import advisor, datasets, specs
from apps.jobs.models import (
    Job,
    JobEvent,
    JobKind,
    JobState,
    Reservation,
    Webhook,
)
from apps.jobs.models.jobs import FINISHED_STATES, NOT_STARTED_STATES
from apps.jobs.transitions import (
    JOB_TRANSITIONS,
    actor_label,
    job_transition,
    schedule_soon,
    webhook_source,
)
from apps.outbox import services as outbox
from apps.tuning import services as tuning
from controlplane import webhooks
from controlplane.errors import ApplicationError

log = logging.getLogger(__name__)
J = JobState


def _deny(message: str) -> ApplicationError:
    return ApplicationError(message, code="permission_denied", status=403)


def budget_left(*, team) -> bool:
    """Whether the team may still burst to the cloud at all: not once its spend this month
    has reached its budget (apps/costs). The scheduler asks before planning, for every
    team with pending jobs; the answer is read for all teams at once and kept a few
    seconds."""
    return costs.team_within_budget(team_id=getattr(team, "pk", team))


def budget_allows(*, bursts: list[costs.BurstCost]) -> dict[int, costs.BurstVerdict]:
    """Which of a pass's bursts their teams' budgets allow, by job id: each team's spend
    this month plus what its bursts allowed so far in the pass will cost stays within its
    budget (apps/costs: the burst's GPUs × time limit × price, or its max_cost_usd if
    lower). The scheduler's apply step asks once per pass, before it asks the fleet."""
    return costs.bursts_within_budget(bursts=bursts)


# --- submit ---------------------------------------------------------------------------


def _quota_limit(team, gpu_type: str) -> int | None:
    """Nominal plus borrowing for the GPU type (the largest for ANY); None: no quota."""
    limits = getattr(team, "quota_limits", None)  # read with the team for submissions
    if limits is None:
        limits = quota_limits(team_id=team.pk)
    if gpu_type == specs.ANY_GPU:
        return max(limits.values(), default=None)
    return limits.get(gpu_type)


def _spec_fingerprint(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def job_submit(*, team, spec: dict, submitted_by, idempotency_key: str = "") -> tuple[Job, bool]:
    """Check the spec and queue the job as PENDING. Returns (job, created).

    With an idempotency key, a retried submit returns the job the first one made.
    """
    if submitted_by is not None and not roles_of(submitted_by).can_submit_for(team.pk):
        raise _deny(f"Only admins and researchers of {team.slug} submit its jobs.")
    if idempotency_key:
        existing = Job.objects.filter(team=team, idempotency_key=idempotency_key).first()
        if existing is not None:
            return _same_request(existing, spec), False

    errors = specs.SpecErrors()
    pools = pools_capacity(cached=True)
    resources = specs.resources_from_spec(spec, pools=pools, errors=errors)
    kind = JobKind.TRAINER if spec.get("trainer") else JobKind.COMMAND
    if spec.get("trainer") and spec.get("command"):
        errors.add("command", "Give trainer or command, not both.")
    elif not spec.get("trainer") and not spec.get("command"):
        errors.add("trainer", "Give trainer (the bundled trainer) or command.")
    pool_ids = []  # the pools the job may run in: what its NCCL and cost are checked on
    estimate = None  # the advisor's, for a trainer job whose spec holds together
    if resources is not None:
        if spec.get("trainer"):
            specs.check_trainer(spec["trainer"], resources, errors)
            shape = specs.model_shape(spec["trainer"])
            datasets.check_mixture(
                team=team,
                trainer=spec["trainer"],
                vocab_size=shape.vocab_size if shape else None,
                errors=errors,
            )
        where = spec.get("placement", {}).get("where", "owned_then_cloud")
        specs.check_capacity(
            resources,
            where=where,
            pools=pools,
            quota_limit=_quota_limit(team, resources.gpu_type),
            errors=errors,
        )
        pool_ids = specs.pools_holding(
            pools,
            gpu_type=resources.gpu_type,
            where=where,
            nodes=resources.nodes,
            gpus_per_node=resources.gpus_per_node,
        )
        if spec.get("trainer") and not errors.details:
            advice = advisor.advise_spec(spec, resources=resources, pools=pools, pool_ids=pool_ids)
            if spec["trainer"].get("check_memory", True):
                advisor.check_fit(advice, errors)
            estimate = advisor.stored(advice)
    if spec.get("command"):
        specs.check_command(spec["command"], errors)
    specs.check_env(spec, errors)
    _check_nccl(spec, resources, pool_ids, errors)
    _check_cost(spec, team, resources, pool_ids, errors)
    wanted_secrets = set(spec.get("secrets") or [])
    if wanted_secrets:
        known = team_secret_names(team_id=team.pk, names=wanted_secrets)
        for name in sorted(wanted_secrets - known):
            errors.add("secrets", f"{team.slug} has no secret named {name}.")
    errors.raise_if_any()

    placement = spec.get("placement", {})
    now = timezone.now()
    stored = {**spec, "fingerprint": _spec_fingerprint(spec)}
    job = Job(
        name=spec["name"],
        team=team,
        submitted_by=submitted_by if submitted_by is not None and submitted_by.pk else None,
        priority_class=spec.get("priority", "normal"),
        kind=kind,
        spec=stored,
        gpu_type=resources.gpu_type,
        nodes=resources.nodes,
        min_nodes=resources.min_nodes if resources.min_nodes < resources.nodes else None,
        gpus_per_node=resources.gpus_per_node,
        dp_replicate=resources.dp_replicate,
        dp_shard=resources.dp_shard,
        tp=resources.tp,
        pp=resources.pp,
        placement=placement.get("where", "owned_then_cloud"),
        spot_allowed=placement.get("spot", False),
        time_limit_s=spec["time_limit_s"],
        max_cost_usd=spec.get("max_cost_usd"),
        restart_limit=spec.get("restart_limit", 3),
        estimate=estimate,
        idempotency_key=idempotency_key,
        queued_at=now,
    )

    try:
        with transaction.atomic():  # a savepoint: a lost race leaves a caller's transaction usable
            job.save(force_insert=True)
            JobEvent.objects.create(
                job=job,
                from_state="",
                to_state=J.PENDING,
                reason="submitted",
                actor=job.submitted_by,
                actor_label=actor_label(submitted_by),
            )
            audit_record(
                actor=submitted_by, action="job.submit", obj=job, after=snapshot(job), team=team
            )
    except IntegrityError:
        # A concurrent retry with the same key won the race: answer with its job.
        existing = Job.objects.filter(team=team, idempotency_key=idempotency_key).first()
        if idempotency_key and existing is not None:
            return _same_request(existing, spec), False
        raise
    Job.wait.related.set_cached_value(job, None)  # a new job waits for its first pass
    job.last_pass_at = None  # which no pass has read yet: its reason needs no look-up
    schedule_soon()  # after the commit
    return job, True


def job_estimate(*, spec: dict) -> list[advisor.Advice]:
    """The advisor's answer for a trainer spec, per GPU type it may land on, without
    submitting: the same resource and trainer checks as job_submit, nothing written."""
    if not spec.get("trainer"):
        raise ApplicationError(
            "Estimates are for the bundled trainer.",
            details={"trainer": ["Give trainer: a command job's memory and speed are its own."]},
        )
    errors = specs.SpecErrors()
    pools = pools_capacity(cached=True)
    resources = specs.resources_from_spec(spec, pools=pools, errors=errors)
    if resources is not None:
        specs.check_trainer(spec["trainer"], resources, errors)
    errors.raise_if_any()
    pool_ids = specs.pools_holding(
        pools,
        gpu_type=resources.gpu_type,
        where=spec.get("placement", {}).get("where", "owned_then_cloud"),
        nodes=resources.nodes,
        gpus_per_node=resources.gpus_per_node,
    )
    return advisor.advise_spec(spec, resources=resources, pools=pools, pool_ids=pool_ids)


def _check_nccl(spec: dict, resources, pool_ids: list[int], errors: specs.SpecErrors) -> None:
    """NCCL overrides, linted alone and on top of the profile of every pool the job may run
    in (so one that would break it after a burst is refused now); no query without them."""
    nodes = resources.nodes if resources is not None else 1
    counts = [nodes]
    if nodes > 1 and resources.min_nodes == 1:
        # An attempt on one node gets the single-node profile and lint: check that one too.
        counts.append(1)
    for count in counts:
        problems = tuning.nccl_spec_problems(nccl=spec.get("nccl"), nodes=count, pool_ids=pool_ids)
        for path, messages in problems.items():
            for message in messages:
                if message not in errors.details.get(path, ()):
                    errors.add(path, message)


def _check_cost(spec: dict, team, resources, pool_ids: list[int], errors: specs.SpecErrors):
    """A team whose budget is spent and set to refuse new jobs is refused; a job whose
    projected cost (its GPUs × time limit at the cheapest pool it may run in) is above its
    max_cost_usd is refused, with the projection."""
    refused = costs.submissions_refused(team_id=team.pk)
    if refused is not None:
        errors.add(
            "team",
            f"{team.slug} has spent {money_text(refused.spent)} of its "
            f"{money_text(refused.monthly_limit)} budget this month; new jobs are refused "
            "until it is raised or the month ends.",
        )
    limit = spec.get("max_cost_usd")
    if limit is None or resources is None:
        return
    projection = costs.projection_for(
        pool_ids=pool_ids,
        gpus=resources.gpus,
        time_limit_s=spec["time_limit_s"],
        spot_allowed=spec.get("placement", {}).get("spot", False),
    )
    if projection is not None and projection.low > Decimal(str(limit)):
        errors.add(
            "max_cost_usd",
            f"The projected cost is {money_text(projection.low)} "
            f"({projection.gpu_hours.normalize():f} GPU-hours at "
            f"{money_text(projection.per_gpu_hour, places=4)} per GPU-hour on "
            f"{projection.cheapest_pool}, the cheapest pool it may run in; up to "
            f"{money_text(projection.high)}), above max_cost_usd "
            f"{money_text(Decimal(str(limit)))}.",
        )


def _same_request(existing: Job, spec: dict) -> Job:
    if existing.spec.get("fingerprint") != _spec_fingerprint(spec):
        raise ApplicationError(
            "This Idempotency-Key was used for a different job spec.",
            code="idempotency_key_reused",
            details={"Idempotency-Key": [f"Already used for job {existing.pk}."]},
            status=409,
        )
    return existing


# --- state changes --------------------------------------------------------------------


def job_can_manage(*, user, team_id: int, submitted_by_id: int | None) -> bool:
    """Cancel, hold, release, requeue: the submitter, the team's admins, and ops."""
    roles = roles_of(user)
    if roles.superuser or roles.ops or roles.is_team_admin(team_id):
        return True
    return roles.can_submit_for(team_id) and submitted_by_id == user.pk


def _can_manage(by, job: Job) -> bool:
    return job_can_manage(user=by, team_id=job.team_id, submitted_by_id=job.submitted_by_id)


def job_actions(*, state: str) -> list[str]:
    """The operations (cancel, hold, release, requeue) that a job in `state` can take, as
    the services below would accept them: what a page offers as buttons."""
    moves = JOB_TRANSITIONS[state]
    actions = []
    waiting = state in (J.PENDING, J.HELD) or state in NOT_STARTED_STATES
    if (J.CANCELLED if waiting else J.STOPPING) in moves:  # as job_cancel moves it
        actions.append("cancel")
    if J.HELD in moves:
        actions.append("hold")
    if state == J.HELD:
        actions.append("release")
    if state in (J.STARTING, J.RUNNING) or (state in FINISHED_STATES and J.PENDING in moves):
        actions.append("requeue")
    return actions


def job_cancel(*, job: Job, by, reason: str = "") -> Job:
    """Cancel: a waiting or not yet started job at once; a running one stops keeping its work."""
    if by is not None and not _can_manage(by, job):
        raise _deny("Only the submitter, the team's admins and ops cancel a job.")
    why = reason.strip() or f"cancelled by {actor_label(by)}"
    current = Job.objects.get(pk=job.pk).state
    if current in (J.PENDING, J.HELD) or current in NOT_STARTED_STATES:
        return job_transition(job=job, to=J.CANCELLED, reason=why, by=by)
    return job_transition(job=job, to=J.STOPPING, reason=why, by=by)


def job_hold(*, job: Job, by) -> Job:
    if by is not None and not _can_manage(by, job):
        raise _deny("Only the submitter, the team's admins and ops hold a job.")
    return job_transition(job=job, to=J.HELD, reason=f"held by {actor_label(by)}", by=by)


def job_release(*, job: Job, by) -> Job:
    if by is not None and not _can_manage(by, job):
        raise _deny("Only the submitter, the team's admins and ops release a job.")
    return job_transition(job=job, to=J.PENDING, reason=f"released by {actor_label(by)}", by=by)


def job_requeue(*, job: Job, by, reason: str = "") -> Job:
    """Send a job back to the queue: a finished one runs again; a running one checkpoints first."""
    if by is not None and not _can_manage(by, job):
        raise _deny("Only the submitter, the team's admins and ops requeue a job.")
    why = reason.strip() or f"requeued by {actor_label(by)}"
    current = Job.objects.get(pk=job.pk).state
    if current in (J.STARTING, J.RUNNING):
        return job_transition(job=job, to=J.PREEMPTING, reason=why, by=by)
    return job_transition(job=job, to=J.PENDING, reason=why, by=by)


# --- reservations ---------------------------------------------------------------------


@transaction.atomic
def reservation_create(*, name: str, team, reason: str, nodes, starts_at, ends_at, by):
    if by is not None and not roles_of(by).manages_fleet:
        raise _deny("Only ops reserve nodes.")
    if ends_at <= starts_at:
        raise ApplicationError(
            "The window ends before it starts.", details={"ends_at": ["Must be after starts_at."]}
        )
    if not nodes:
        raise ApplicationError("Name at least one node.", details={"nodes": ["Required."]})
    reservation = Reservation.objects.create(
        name=name,
        team=team,
        reason=reason,
        starts_at=starts_at,
        ends_at=ends_at,
        created_by=by if by is not None and by.pk else None,
    )
    reservation.nodes.set(nodes)
    audit_record(
        actor=by,
        action="reservation.create",
        obj=reservation,
        after={**snapshot(reservation), "nodes": sorted(n.pk for n in nodes)},
        team=team,
    )
    schedule_soon()
    return reservation


@transaction.atomic
def reservation_delete(*, reservation: Reservation, by) -> None:
    if by is not None and not roles_of(by).manages_fleet:
        raise _deny("Only ops cancel reservations.")
    audit_record(
        actor=by,
        action="reservation.delete",
        obj=reservation,
        before=snapshot(reservation),
        team=reservation.team,
    )
    reservation.delete()
    schedule_soon()


# --- reconcile ---------------------------------------------------------------------------


def jobs_reconcile(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Re-drive jobs stuck in a transitional state past the grace period.

    A preempted job whose checkpoint never came back within PREEMPTION_GRACE_S is
    requeued (its last committed checkpoint still stands); a stopping one is
    cancelled. Broker redelivery alone would not do this (README, "Design").
    """
    now = now or timezone.now()
    cutoff = now - dt.timedelta(seconds=settings.PREEMPTION_GRACE_S)
    counts = {"requeued": 0, "cancelled": 0}
    stuck = (
        Job.objects.live()
        .filter(state__in=(J.PREEMPTING, J.STOPPING), state_changed_at__lt=cutoff)
        .values_list("id", "state")
    )
    for job_id, state in stuck:
        job = Job(pk=job_id)
        try:
            if state == J.PREEMPTING:
                job_transition(
                    job=job,
                    to=J.PENDING,
                    by=None,
                    reason="no checkpoint within the grace period; requeued",
                )
                counts["requeued"] += 1
            else:
                job_transition(
                    job=job,
                    to=J.CANCELLED,
                    by=None,
                    reason="did not stop within the grace period; cancelled",
                )
                counts["cancelled"] += 1
        except ApplicationError:
            continue  # it moved on by itself meanwhile
    return counts


def jobs_cost_limit_stop() -> list[int]:
    """Stop, with a checkpoint, the running jobs whose metered cost reached max_cost_usd
    (STOPPING, then FAILED with the reason). Called by the metering task after each run."""
    limits = dict(
        Job.objects.live()
        .filter(state__in=(J.STARTING, J.RUNNING), max_cost_usd__isnull=False)
        .values_list("id", "max_cost_usd")
    )
    spent = costs.job_costs_so_far(job_ids=list(limits))
    stopped = []
    for job_id, limit in limits.items():
        cost = spent.get(job_id)
        if cost is None or cost < limit:
            continue
        with transaction.atomic():
            locked = Job.objects.select_for_update().get(pk=job_id)
            if locked.state not in (J.STARTING, J.RUNNING):
                continue
            job_transition(
                job=locked,
                to=J.STOPPING,
                by=None,
                reason=f"cost limit of ${limit} reached: ${cost.quantize(Decimal('0.01'))} spent",
            )
        stopped.append(job_id)
    return stopped


# --- webhooks --------------------------------------------------------------------------------


def webhook_create(*, team, url: str, by, job: Job | None = None) -> tuple[Webhook, str]:
    """A webhook for the team's jobs (or one job). Returns it and its signing key, shown once."""
    if job is not None:
        if job.team_id != team.pk:
            raise ApplicationError(
                "The job belongs to another team.", details={"job": ["Not a job of this team."]}
            )
        if by is not None and not _can_manage(by, job):
            raise _deny("Only the submitter, the team's admins and ops add a job's webhook.")
    elif by is not None and not roles_of(by).is_team_admin(team.pk):
        raise _deny(f"Only admins of {team.slug} add team webhooks.")
    try:
        webhooks.check_destination(url)
    except webhooks.RefusedAddress as exc:
        raise ApplicationError(str(exc), details={"url": [str(exc)]}) from None
    key = secrets.token_urlsafe(32)
    with transaction.atomic():
        hook = Webhook.objects.create(
            team=team,
            job=job,
            url=url,
            signing_key=encrypt(key),
            created_by=by if by is not None and by.pk else None,
        )
        audit_record(
            actor=by,
            action="webhook.create",
            obj=hook,
            team=team,
            after={"url": url, "job": job.pk if job else None},
        )
    return hook, key


def webhook_delete(*, webhook: Webhook, by) -> None:
    if (
        by is not None
        and not roles_of(by).is_team_admin(webhook.team_id)
        and not (webhook.job is not None and _can_manage(by, webhook.job))
    ):
        raise _deny("Only the team's admins remove its webhooks.")
    with transaction.atomic():
        audit_record(
            actor=by,
            action="webhook.delete",
            obj=webhook,
            team=webhook.team,
            before={"url": webhook.url},
        )
        outbox.calls_drop(source=webhook_source(webhook.pk))
        webhook.delete()
