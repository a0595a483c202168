"""Reads of jobs and the queue, scoped to what the user may see."""

import datetime as dt
import statistics
import time
from dataclasses import dataclass
from decimal import Decimal

from django.core.paginator import Page, Paginator
from django.db.models import (
    Count,
    ExpressionWrapper,
    F,
    FloatField,
    Max,
    Min,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Window,
)
from django.db.models.functions import Coalesce, Floor, RowNumber

from apps.accounts.selectors import quota_limits, roles_of
from apps.costs.selectors import job_cost as cost_of
from apps.costs.selectors import job_costs_so_far, projection_for
from apps.fleet.extensions import GpuHolder
from apps.fleet.models import SCHEDULABLE_STATES
from apps.fleet.selectors import (
    pool_names,
    pools_capacity,
    schedulable_gpus_by_type,
    schedulable_node_gpus,
)
from apps.jobs import specs
from apps.jobs.estimates import Estimate, Queued, estimate_starts
from apps.jobs.models import (
    OPEN_RUN_STATES,
    Allocation,
    EvalMetric,
    Job,
    JobKind,
    JobState,
    LogLine,
    RankEnvironment,
    Reservation,
    Run,
    StepMetric,
    Webhook,
)
from apps.jobs.models.jobs import (
    ACTIVE_STATES,
    FINISHED_STATES,
    HOLDING_STATES,
    PRIORITY_RANK,
    QUEUE_ORDER_KEY,
    last_pass_read_at,
    slots_of,
    waiting_reason,
)
from apps.jobs.scheduler.read import Epoch
from apps.tuning.services import RenderedEnvironment, nccl_environments_render
from controlplane import webhooks
from controlplane.bulk import InArray
from controlplane.cache import best_effort


def jobs_visible_to(*, user) -> QuerySet[Job]:
    """Full rows: the jobs of the user's teams (every team for ops, finance and superusers)."""
    roles = roles_of(user)
    jobs = Job.objects.select_related("team", "submitted_by", "pool", "wait")
    if roles.sees_every_team:
        return jobs
    return jobs.filter(team_id__in=roles.team_ids)


QUEUE_COLUMNS = (
    "id",
    "team_id",
    "team__slug",
    "name",
    "state",
    "state_reason",
    "priority_class",
    "nodes",
    "gpus_per_node",
    "gpu_type",
    "submitted_at",
    "submitted_by_id",
    "state_changed_at",
    "wait__reason",
    "wait__estimated_start",
    "started_at",
)


def _active(jobs: QuerySet[Job] | None) -> QuerySet[Job]:
    """The active ones of these jobs (of every job if none are given), in queue order."""
    jobs = Job.objects.all() if jobs is None else jobs
    return jobs.live().filter(state__in=ACTIVE_STATES).order_by("queued_at", "id")


def _queue_order() -> dict[int, int]:
    """Job id -> its place among the pending jobs, as the last scheduling pass ordered them."""
    return {job_id: i + 1 for i, job_id in enumerate(best_effort.get(QUEUE_ORDER_KEY) or [])}


def _queue_rows(jobs: QuerySet[Job], *, user, position: dict[int, int]) -> dict[int, dict]:
    """Job id -> its queue row, in the query's order, from plain values rather than model
    instances (a queue at design size is 50,000 jobs); other teams' jobs anonymous."""
    roles = roles_of(user)
    last_pass_at = last_pass_read_at()  # once, for every job's reason
    pending = JobState.PENDING
    rows = {}
    for (
        job_id,
        team_id,
        team,
        name,
        state,
        state_reason,
        priority,
        nodes,
        per_node,
        gpu_type,
        submitted_at,
        submitted_by_id,
        changed_at,
        wait_reason,
        wait_start,
        started_at,
    ) in jobs.values_list(*QUEUE_COLUMNS):
        mine = roles.sees_every_team or team_id in roles.team_ids
        row = {
            "id": job_id if mine else None,
            "team": team,
            "gpus": nodes * per_node,
            "gpu_type": gpu_type,
            "state": state,
            "priority": priority,
            "estimated_start": wait_start if state == pending else None,
            "estimate_basis": "",
            "position": position.get(job_id),
            "anonymous": not mine,
            # Since when it runs (its latest start), while it holds GPUs.
            "started_at": started_at if state in HOLDING_STATES else None,
            "nodes": [],
        }
        if mine:
            row.update(
                name=name,
                reason=waiting_reason(wait_reason, changed_at, last_pass_at)
                if state == pending
                else state_reason,
                submitted_at=submitted_at,
                submitted_by_id=submitted_by_id,
            )
        rows[job_id] = row
    return rows


def _in_queue_order(ids, position: dict[int, int]) -> list[int]:
    """Pending jobs by their place in the queue, then the rest (already by age)."""
    return sorted(ids, key=lambda i: (position.get(i) is None, position.get(i, 0)))


def queue_for(*, user, jobs: QuerySet[Job] | None = None) -> list[dict]:
    """Every active job, in queue order, with its nodes and estimated start; other teams'
    jobs as anonymous rows.

    An anonymous row says only team, GPUs, state, priority and estimated start:
    no name, spec, nodes, logs or cost.
    """
    position = _queue_order()
    rows = _queue_rows(_active(jobs), user=user, position=position)
    _with_estimates_and_nodes(rows, position=position)
    return [rows[job_id] for job_id in _in_queue_order(rows, position)]


def queue_ids(*, jobs: QuerySet[Job] | None = None) -> tuple[list[int], dict[int, int]]:
    """Every active job's id in queue order, and the pending jobs' places: the pages' order,
    read without reading the rows (a queue at design size is 50,000 jobs)."""
    position = _queue_order()
    ids = _active(jobs).values_list("id", flat=True)
    return _in_queue_order(ids, position), position


def queue_rows(ids: list[int], *, user, position: dict[int, int]) -> list[dict]:
    """queue_for's rows of these jobs, in the order given (jobs gone since are left out)."""
    rows = _queue_rows(Job.objects.filter(id__in=ids).order_by(), user=user, position=position)
    _with_estimates_and_nodes(rows, position=position)
    return [rows[job_id] for job_id in ids if job_id in rows]


def queue_page(*, user, jobs: QuerySet[Job] | None = None, page, per_page: int) -> Page:
    """One page of queue_for's rows: every active job's id is ordered, only the page's
    rows are read whole."""
    ids, position = queue_ids(jobs=jobs)
    shown = Paginator(ids, per_page).get_page(page)
    shown.object_list = queue_rows(shown.object_list, user=user, position=position)
    return shown


def _with_estimates_and_nodes(rows: dict[int, dict], *, position: dict[int, int]) -> None:
    """Give these queue rows (by job id) their start estimates (pending jobs) and the
    names of the nodes they hold (the user's own jobs), in five queries at most."""
    pending = [job_id for job_id, row in rows.items() if row["state"] == JobState.PENDING]
    for job_id, estimate in start_estimates(wanted=pending, position=position).items():
        if job_id in rows:
            row = rows[job_id]
            row["estimated_start"] = (
                None
                if estimate.start is None
                else dt.datetime.fromtimestamp(estimate.start, tz=dt.UTC)
            )
            row["estimate_basis"] = estimate.basis
    holding = [
        job_id
        for job_id, row in rows.items()
        if row["state"] in HOLDING_STATES and not row["anonymous"]
    ]
    for job_id, names in nodes_held_by(job_ids=holding).items():
        rows[job_id]["nodes"] = names


def nodes_held_by(*, job_ids: list[int]) -> dict[int, list[str]]:
    """Job id -> the names of the nodes it holds now, by name (one query)."""
    if not job_ids:
        return {}
    held: dict[int, list[str]] = {}
    for job_id, name in (
        Allocation.objects.filter(InArray("job_id", job_ids), ended_at__isnull=True)
        .order_by("job_id", "node__name")
        .values_list("job_id", "node__name")
    ):
        held.setdefault(job_id, []).append(name)
    return held


def nodes_ran_on(*, job_ids: list[int]) -> dict[int, list[str]]:
    """Job id -> the names of the nodes its newest attempt ran on, rank 0 first (one
    query): where a finished job ran."""
    if not job_ids:
        return {}
    ran: dict[int, tuple[int, list[str]]] = {}
    for job_id, attempt, name in (
        Run.objects.filter(InArray("job_id", job_ids))
        .order_by("job_id", "-attempt", "node_rank")
        .values_list("job_id", "attempt", "node__name")
    ):
        newest, names = ran.setdefault(job_id, (attempt, []))
        if attempt == newest:
            names.append(name)
    return {job_id: names for job_id, (_, names) in ran.items()}


def gpu_releases() -> dict[str, list[tuple[float, int]]]:
    """GPU type -> (when, GPUs): when the GPUs held on schedulable nodes come back at the
    latest (their job's admission plus its time limit, to the minute, as the scheduler's
    reserved starts are), in one grouped read of the open allocations."""
    started = Epoch(Coalesce("job__admitted_at", "started_at"))
    back = ExpressionWrapper(
        Floor((started + F("job__time_limit_s")) / 60.0) * 60, output_field=FloatField()
    )
    releases: dict[str, list[tuple[float, int]]] = {}
    for gpu_type, when, gpus in (
        Allocation.objects.filter(
            ended_at__isnull=True, node__state__in=SCHEDULABLE_STATES, node__pool__enabled=True
        )
        .annotate(back=back)
        .values_list("node__pool__gpu_type", "back")
        .annotate(gpus=Sum("gpus"))
        .order_by()
    ):
        releases.setdefault(gpu_type, []).append((when, gpus))
    return releases


def _pending_order(*, wanted: set[int], position: dict[int, int]) -> list[int]:
    """The pending jobs from the queue's head to the last wanted one: in the last pass's
    order (the cache, no query), then those submitted since, by age (one query, only if a
    wanted job is among them)."""
    if all(job_id in position for job_id in wanted):
        return list(position)[: max(position[job_id] for job_id in wanted)]
    missing = wanted - position.keys()
    later = []
    for job_id in (
        Job.objects.live()
        .filter(state=JobState.PENDING)
        .order_by("queued_at", "id")
        .values_list("id", flat=True)
    ):
        if job_id not in position:
            later.append(job_id)
            missing.discard(job_id)
            if not missing:
                break
    return [*position, *later]


def start_estimates(*, wanted: list[int], position: dict[int, int]) -> dict[int, Estimate]:
    """The start estimate (apps/jobs/estimates.py) of each wanted pending job: the pending
    jobs ahead of it are read in queue order (`position`: the last pass's places), then
    the GPUs on schedulable nodes and when the held ones come back (gpu_supply). One to
    four queries, none if no job is wanted."""
    if not wanted:
        return {}
    ahead = _pending_order(wanted=set(wanted), position=position)
    rows = {
        row[0]: row
        for row in Job.objects.filter(InArray("id", ahead), state=JobState.PENDING)
        .annotate(reserved=Epoch("wait__estimated_start"))
        .values_list("id", "gpu_type", "nodes", "gpus_per_node", "time_limit_s", "reserved")
        .order_by()
    }
    queue = [
        Queued(job_id, gpu_type, nodes * per_node, limit, reserved)
        for job_id in ahead
        if job_id in rows
        for _, gpu_type, nodes, per_node, limit, reserved in (rows[job_id],)
    ]
    capacity, releases = gpu_supply()
    return estimate_starts(queue, now=time.time(), capacity=capacity, releases=releases)


GPU_SUPPLY_KEY = "jobs:gpu-supply:{}"  # per scheduling pass, by when it read
GPU_SUPPLY_CACHE_S = 600  # bounds what a pass's entry costs once the next has replaced it


def gpu_supply() -> tuple[dict[str, int], dict[str, list[tuple[float, int]]]]:
    """The GPUs of each type on schedulable nodes and when the held ones come back
    (schedulable_gpus_by_type, gpu_releases): read once per scheduling pass for every
    page and poll, since only a pass places jobs; a job that ends early is seen at the
    pass that its end asks for."""
    last_pass_at = last_pass_read_at()
    key = GPU_SUPPLY_KEY.format(last_pass_at)
    if last_pass_at is not None:
        supply = best_effort.get(key)
        if supply is not None:
            return supply
    supply = schedulable_gpus_by_type(), gpu_releases()
    if last_pass_at is not None:
        best_effort.set(key, supply, GPU_SUPPLY_CACHE_S)
    return supply


def queue_choices() -> tuple[list[str], list[str]]:
    """The states and the teams among the active jobs, for the Queue's filters."""
    pairs = set(
        Job.objects.live()
        .filter(state__in=ACTIVE_STATES)
        .values_list("state", "team__slug")
        .distinct()
        .order_by()
    )
    return sorted({state for state, _ in pairs}), sorted({team for _, team in pairs})


HISTORY_COLUMNS = (
    "id",
    "team__slug",
    "name",
    "state",
    "state_reason",
    "nodes",
    "gpus_per_node",
    "gpu_type",
    "submitted_by__username",
    "submitted_at",
    "started_at",
    "finished_at",
)


def job_history(*, jobs: QuerySet[Job]) -> QuerySet:
    """The finished ones (succeeded, failed, cancelled) of these jobs (jobs_visible_to a
    user, filtered) as rows, the latest to finish first: what `sacct` shows a Slurm user."""
    return (
        jobs.filter(state__in=FINISHED_STATES)
        .order_by(F("finished_at").desc(nulls_last=True), "-id")
        .values(*HISTORY_COLUMNS)
    )


def history_row(row: dict) -> dict:
    """A history row with its GPU count and how long it ran (None if it never started)."""
    ran = None
    if row["started_at"] and row["finished_at"]:
        ran = row["finished_at"] - row["started_at"]
    return {
        **row,
        "gpus": row["nodes"] * row["gpus_per_node"],
        "ran": ran,
        "ran_text": "" if ran is None else short_duration(ran.total_seconds()),
    }


def short_duration(seconds: float) -> str:
    """2 d 3 h, 4 h 05 m, 12 m 30 s, 45 s."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h"
    if hours:
        return f"{hours} h {minutes:02d} m"
    if minutes:
        return f"{minutes} m {seconds:02d} s"
    return f"{seconds} s"


@dataclass(frozen=True)
class PoolOutlook:
    name: str
    kind: str
    fitting_nodes: int  # nodes with GPUs enough free now (owned pools)
    max_nodes: int  # what a cloud pool may burst to


@dataclass(frozen=True)
class Outlook:
    """What a job would meet if submitted now, for the Submit form: the pools that could
    hold it and how many of their nodes have room now, the team's quota, the pending jobs
    ahead of it, and its cost for its whole time limit. Counts, not a promise: the next
    pass decides."""

    nodes: int
    gpus_per_node: int
    pools: list[PoolOutlook]
    quota_in_use: int | None  # the team's GPUs of this type held now (None: no team/quota)
    quota_limit: int | None  # nominal plus borrowing
    ahead_jobs: int
    ahead_gpus: int
    projection: object | None  # apps.costs.selectors.Projection

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def fits_now(self) -> bool:
        return any(p.kind == "owned" and p.fitting_nodes >= self.nodes for p in self.pools)

    @property
    def over_quota(self) -> bool:
        return self.quota_limit is not None and self.quota_in_use + self.gpus > self.quota_limit


def submission_outlook(
    *,
    team_id: int | None,
    gpu_type: str,
    nodes: int,
    gpus_per_node: int,
    priority: str,
    where: str,
    spot: bool,
    time_limit_s: int,
) -> Outlook:
    capacity = {p.pool_id: p for p in pools_capacity(cached=True)}
    pool_ids = specs.pools_holding(
        list(capacity.values()),
        gpu_type=gpu_type,
        where=where,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
    )
    held = dict(
        Allocation.objects.filter(node__pool_id__in=pool_ids, ended_at__isnull=True)
        .values_list("node_id")
        .annotate(held=Sum("gpus"))
        .order_by()
    )
    fitting: dict[int, int] = dict.fromkeys(pool_ids, 0)
    for node_id, pool_id, gpu_count in schedulable_node_gpus(pool_ids=pool_ids):
        if gpu_count - held.get(node_id, 0) >= gpus_per_node:
            fitting[pool_id] += 1
    names = pool_names(pool_ids=pool_ids)
    pools = [
        PoolOutlook(
            name=names.get(pool_id, capacity[pool_id].slug),
            kind=capacity[pool_id].kind,
            fitting_nodes=fitting[pool_id],
            max_nodes=capacity[pool_id].max_nodes,
        )
        for pool_id in pool_ids
    ]
    in_use = limit = None
    if team_id is not None and gpu_type != specs.ANY_GPU:
        limit = quota_limits(team_id=team_id).get(gpu_type)
        if limit is not None:
            in_use = (
                Allocation.objects.filter(
                    ended_at__isnull=True, job__team_id=team_id, job__gpu_type=gpu_type
                ).aggregate(total=Sum("gpus"))["total"]
                or 0
            )
    at_least = [p for p, rank in PRIORITY_RANK.items() if rank >= PRIORITY_RANK.get(priority, 1)]
    ahead = Job.objects.live().filter(state=JobState.PENDING, priority_class__in=at_least)
    if gpu_type != specs.ANY_GPU:
        ahead = ahead.filter(gpu_type__in=[gpu_type, specs.ANY_GPU])
    ahead = ahead.aggregate(jobs=Count("id"), gpus=Sum(F("nodes") * F("gpus_per_node")))
    return Outlook(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        pools=pools,
        quota_in_use=in_use,
        quota_limit=limit,
        ahead_jobs=ahead["jobs"],
        ahead_gpus=ahead["gpus"] or 0,
        projection=projection_for(
            pool_ids=pool_ids,
            gpus=nodes * gpus_per_node,
            time_limit_s=time_limit_s,
            spot_allowed=spot,
        )
        if pool_ids
        else None,
    )


def reservations_visible() -> QuerySet[Reservation]:
    return Reservation.objects.select_related("team").prefetch_related("nodes")


def webhooks_visible_to(*, user) -> QuerySet[Webhook]:
    roles = roles_of(user)
    hooks = Webhook.objects.select_related("team", "job")
    if roles.superuser or roles.ops:
        return hooks
    return hooks.filter(team_id__in=roles.team_ids)


def webhook_url_seen_by(*, webhook: Webhook, user) -> str:
    """The webhook's URL as `user` may see it: whole for those who manage the team's webhooks
    (its admins, ops) and for whoever made it; for other members, without the credentials
    and tokens a URL may carry in its user information and query."""
    roles = roles_of(user)
    if roles.ops or roles.is_team_admin(webhook.team_id) or webhook.created_by_id == user.pk:
        return webhook.url
    return webhooks.redacted_url(webhook.url)


def job_nccl_environments(*, job: Job) -> list[RenderedEnvironment]:
    """The NCCL environment the job gets: on its pool once placed, before that on each pool
    that could hold it (the profile, then the job's overrides, linted for those nodes)."""
    pool_ids = [job.pool_id] if job.pool_id else _pools_that_could_hold(job)
    return nccl_environments_render(nccl=job.spec.get("nccl"), nodes=job.nodes, pool_ids=pool_ids)


@dataclass(frozen=True)
class NcclDifference:
    name: str
    rendered: str | None  # None: the plan did not set it
    got: str | None  # None: the rank did not have it

    def __str__(self) -> str:
        if self.rendered is None:
            return f"{self.name}: not rendered, the rank had {self.got}"
        if self.got is None:
            return f"{self.name}: rendered {self.rendered}, the rank did not have it"
        return f"{self.name}: rendered {self.rendered}, the rank had {self.got}"


def nccl_differences(*, rendered: dict[str, str], got: dict[str, str]) -> list[NcclDifference]:
    """Each variable where what a rank started with is not what its plan rendered."""
    return [
        NcclDifference(name, rendered.get(name), got.get(name))
        for name in sorted(rendered.keys() | got.keys())
        if rendered.get(name) != got.get(name)
    ]


@dataclass(frozen=True)
class RankReport:
    """What one rank says it started with, against what its node's plan rendered."""

    rank: int
    local_rank: int
    node_rank: int
    node: str  # the node whose run relayed the report
    reported_at: dt.datetime
    env: dict[str, str]
    differences: list[NcclDifference]

    @property
    def matches(self) -> bool:
        return not self.differences

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "node": self.node,
            "reported_at": self.reported_at,
            "matches": self.matches,
            "differences": [
                {"name": d.name, "rendered": d.rendered, "got": d.got} for d in self.differences
            ],
            "env": self.env,
        }


@dataclass(frozen=True)
class RankEnvironments:
    """The newest attempt's ranks: the environment each reported, and whether it is the one
    rendered at dispatch (the profile, then the job's overrides)."""

    attempt: int
    world_size: int
    rendered: dict[str, str]
    ranks: list[RankReport]

    @property
    def differing(self) -> list[RankReport]:
        return [r for r in self.ranks if not r.matches]

    @property
    def all_match(self) -> bool:
        return len(self.ranks) == self.world_size and not self.differing

    def as_dict(self) -> dict:
        return {
            "attempt": self.attempt,
            "world_size": self.world_size,
            "reported": len(self.ranks),
            "all_match": self.all_match,
            "rendered": self.rendered,
            "ranks": [r.as_dict() for r in self.ranks],
        }


def _nccl_part(env: dict) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(specs.NCCL_ENV_PREFIXES)}


def job_rank_environments(*, job: Job) -> RankEnvironments | None:
    """Per rank of the newest attempt, the NCCL environment it reported starting with,
    compared with its run's plan; None before the job has run (two queries)."""
    newest = Run.objects.filter(job=job).order_by("-attempt").values("attempt")[:1]
    runs = {
        run.pk: run
        for run in Run.objects.filter(job=job, attempt=Subquery(newest))
        .select_related("node")
        .order_by("node_rank")
    }
    if not runs:
        return None
    first = next(iter(runs.values()))
    rendered = {pk: _nccl_part(run.plan.get("env") or {}) for pk, run in runs.items()}
    reports = [
        RankReport(
            rank=row.rank,
            local_rank=row.local_rank,
            node_rank=row.node_rank,
            node=runs[row.run_id].node.name,
            reported_at=row.reported_at,
            env=row.env,
            differences=nccl_differences(rendered=rendered[row.run_id], got=row.env),
        )
        for row in RankEnvironment.objects.filter(job=job, attempt=first.attempt).order_by("rank")
    ]
    return RankEnvironments(
        attempt=first.attempt,
        world_size=job.nodes * job.gpus_per_node,
        rendered=rendered[first.pk],
        ranks=reports,
    )


def _pools_that_could_hold(job: Job) -> list[int]:
    return specs.pools_holding(
        pools_capacity(cached=True),
        gpu_type=job.gpu_type,
        where=job.placement,
        nodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
    )


_LOG_FIELDS = ("id", "at", "run__node_rank", "run__attempt", "stream", "text")
LOG_SEARCH_MAX = 200  # characters of a log search, on the Job page and in the API


def _log_dicts(rows) -> list[dict]:
    return [
        {"id": i, "at": at, "rank": rank, "attempt": attempt, "stream": stream, "text": text}
        for i, at, rank, attempt, stream, text in rows
    ]


def _log_filtered(
    *, job: Job, rank: int | None = None, attempt: int | None = None, text: str = ""
) -> QuerySet[LogLine]:
    """The job's lines, of one node rank and one attempt when given, holding `text` (any
    case) when given."""
    lines = LogLine.objects.filter(job=job)
    if rank is not None:
        lines = lines.filter(run__node_rank=rank)
    if attempt is not None:
        lines = lines.filter(run__attempt=attempt)
    if text:
        lines = lines.filter(text__icontains=text)
    return lines


def job_log_lines(
    *,
    job: Job,
    after: int = 0,
    limit: int = 500,
    rank: int | None = None,
    attempt: int | None = None,
    text: str = "",
) -> list[dict]:
    """The job's output lines after line id `after` (through the Job page's filters,
    _log_filtered), at most `limit`, oldest first: the API's and the CLI's road forward."""
    rows = (
        _log_filtered(job=job, rank=rank, attempt=attempt, text=text)
        .filter(id__gt=after)
        .order_by("id")
        .values_list(*_LOG_FIELDS)[:limit]
    )
    return _log_dicts(rows)


def job_log_tail(
    *,
    job: Job,
    limit: int = 200,
    after: int = 0,
    rank: int | None = None,
    attempt: int | None = None,
    text: str = "",
) -> list[dict]:
    """The job's newest output lines (after line id `after`, through the filters of
    _log_filtered), at most `limit`, oldest of them first: the Job page's log viewer."""
    newest = list(
        _log_filtered(job=job, rank=rank, attempt=attempt, text=text)
        .filter(id__gt=after)
        .order_by("-id")
        .values_list(*_LOG_FIELDS)[:limit]
    )
    return _log_dicts(reversed(newest))


def job_log_every_line(*, job: Job, chunk: int = 5000):
    """Every stored line of the job, oldest first, read `chunk` lines a query (by id, so a
    log of millions of lines is never held whole): the whole-log download."""
    after = 0
    while True:
        rows = job_log_lines(job=job, after=after, limit=chunk)
        yield from rows
        if len(rows) < chunk:
            return
        after = rows[-1]["id"]


def run_on_node(*, node_id: int, run_id: int) -> Run | None:
    """The run, if it is on this node (what a node's agent may report on), with its job,
    team and node."""
    return (
        Run.objects.select_related("job__team", "node").filter(pk=run_id, node_id=node_id).first()
    )


def job_with_team(*, job_id: int) -> Job | None:
    """The job, its team loaded; None if there is none."""
    return Job.objects.select_related("team").filter(pk=job_id).first()


def trainer_jobs_finished_since(*, since: dt.datetime) -> QuerySet[Job]:
    """The trainer jobs that finished at or after `since`, with their teams (a job's
    checkpoint directory names its team): for the checkpoint registry to narrow by its own
    rows (those not yet swept)."""
    return Job.objects.select_related("team").filter(
        kind=JobKind.TRAINER, state__in=FINISHED_STATES, finished_at__gte=since
    )


def node_has_open_runs(*, node_id: int) -> bool:
    return Run.objects.filter(node_id=node_id, state__in=OPEN_RUN_STATES).exists()


def job_has_open_runs(*, job_id: int) -> bool:
    """Whether any of the job's runs is planned or running (it may still write)."""
    return Run.objects.filter(job_id=job_id, state__in=OPEN_RUN_STATES).exists()


def job_newest_attempt(*, job_id: int) -> int | None:
    """The job's newest attempt number among its runs; None before its first."""
    return Run.objects.filter(job_id=job_id).aggregate(n=Max("attempt"))["n"]


def job_last_run_ended_at(*, job_id: int) -> dt.datetime | None:
    """When the last of the job's runs to end ended; None if none has."""
    return Run.objects.filter(job_id=job_id).aggregate(at=Max("ended_at"))["at"]


def first_rank_nodes(*, job_ids) -> dict[int, list[int | None]]:
    """Per job, the node of each attempt's rank 0 (the one that writes its checkpoints),
    newest attempt first, in one query; jobs with no runs are left out."""
    nodes: dict[int, list[int | None]] = {}
    for job_id, node_id in (
        Run.objects.filter(job_id__in=list(job_ids), node_rank=0)
        .order_by("job_id", "-attempt")
        .values_list("job_id", "node_id")
    ):
        nodes.setdefault(job_id, []).append(node_id)
    return nodes


def run_plans(*, job_ids) -> list[tuple[int, dict]]:
    """(job id, plan) of every run of these jobs: what each run was told (its run.json)."""
    return list(Run.objects.filter(job_id__in=list(job_ids)).values_list("job_id", "plan"))


def job_runs(*, job: Job) -> list[Run]:
    """Every attempt's runs, newest attempt first, with their nodes."""
    return list(job.runs.select_related("node").order_by("-attempt", "node_rank"))


def job_attempts_ranks(*, job: Job) -> list[tuple[int, int]]:
    """(attempt, node rank) of each of the job's runs: the log viewer's filter choices."""
    return list(job.runs.order_by().values_list("attempt", "node_rank"))


def attempt_nodes(runs: list[Run]) -> int | None:
    """How many nodes the newest attempt of `runs` (job_runs' order) has: the job's nodes,
    or fewer within its node range. None before its first attempt."""
    return sum(1 for run in runs if run.attempt == runs[0].attempt) if runs else None


def job_attempt_nodes(*, job: Job) -> int | None:
    """attempt_nodes of the job, in one query."""
    newest = job.runs.values("attempt").annotate(nodes=Count("id")).order_by("-attempt").first()
    return newest["nodes"] if newest else None


CHART_POINTS = 500  # per series: longer runs are thinned to every k-th step


def job_training_series(*, job: Job) -> dict:
    """Loss, tokens/s and MFU by step, one series per attempt (thinned for charts), and the
    newest step's figures."""
    from django.db.models.functions import Mod

    rows = StepMetric.objects.filter(job=job)
    count = rows.count()
    if not count:
        return {"latest": None, "loss": {}, "tokens_per_s": {}, "mfu": {}}
    every = max(1, -(-count // CHART_POINTS))
    if every > 1:
        rows = rows.annotate(slot=Mod("step", every)).filter(slot=0)
    series: dict[str, dict[str, list]] = {"loss": {}, "tokens_per_s": {}, "mfu": {}}
    for attempt, step, loss, tokens, mfu in rows.order_by("attempt", "step").values_list(
        "attempt", "step", "loss", "tokens_per_s", "mfu"
    ):
        name = f"attempt {attempt}"
        for key, value in (("loss", loss), ("tokens_per_s", tokens), ("mfu", mfu)):
            if value is not None:
                series[key].setdefault(name, []).append((step, value))
    latest = StepMetric.objects.filter(job=job).order_by("-attempt", "-step").first()
    return {"latest": latest, **series}


def job_evaluations(*, job: Job) -> list[EvalMetric]:
    """The job's held-out evaluations, each attempt's in step order (the API and its CSV)."""
    return list(EvalMetric.objects.filter(job=job).order_by("attempt", "step"))


def job_eval_series(*, job: Job) -> list[EvalMetric]:
    """The evaluations the Job page draws beside the training loss: by step, the newest
    attempt's where a resume evaluated a step again, thinned to CHART_POINTS."""
    by_step = {e.step: e for e in job_evaluations(job=job)}
    drawn = [by_step[step] for step in sorted(by_step)]
    every = max(1, -(-len(drawn) // CHART_POINTS))
    # Thinned from the newest back, so the newest evaluation is always drawn.
    return drawn[::-1][::every][::-1]


def step_times(*, job_ids) -> dict[int, float]:
    """Wall-clock seconds per step of each job's newest attempt, from its step metrics
    (the checkpoints' own time included), in one query; jobs without two steps left out."""
    rows = (
        StepMetric.objects.filter(job_id__in=list(job_ids))
        .values("job_id", "attempt")
        .annotate(first=Min("step"), last=Max("step"), since=Min("at"), until=Max("at"))
    )
    newest: dict[int, dict] = {}
    for row in rows:
        if row["job_id"] not in newest or row["attempt"] > newest[row["job_id"]]["attempt"]:
            newest[row["job_id"]] = row
    times = {}
    for job_id, row in newest.items():
        steps = row["last"] - row["first"]
        if steps > 0:
            times[job_id] = (row["until"] - row["since"]).total_seconds() / steps
    return times


def jobs_compared_series(*, job_ids: list[int]) -> dict[int, dict]:
    """Loss and tokens/s by step for each of these jobs, to overlay them: per job, the
    newest attempt's value where attempts overlap, thinned to CHART_POINTS steps. Two
    queries whatever the number of jobs (their step counts, then the steps drawn)."""
    from django.db.models.functions import Mod

    counts = dict(
        StepMetric.objects.filter(job_id__in=job_ids)
        .order_by()
        .values_list("job_id")
        .annotate(n=Count("id"))
        .values_list("job_id", "n")
    )
    series = {job_id: {"loss": {}, "tokens_per_s": {}, "steps": 0} for job_id in job_ids}
    if not counts:
        return series
    # Each job thinned to every k-th step, its own k: one Mod(step, k) column per k.
    every = {job_id: max(1, -(-count // CHART_POINTS)) for job_id, count in counts.items()}
    wanted = Q()
    for job_id, k in every.items():
        wanted |= Q(job_id=job_id, **({f"slot_{k}": 0} if k > 1 else {}))
    rows = StepMetric.objects.filter(job_id__in=list(counts)).annotate(
        **{f"slot_{k}": Mod("step", k) for k in set(every.values()) if k > 1}
    )
    for job_id, step, loss, tokens in (
        rows.filter(wanted)
        .order_by("job_id", "attempt", "step")
        .values_list("job_id", "step", "loss", "tokens_per_s")
    ):
        drawn = series[job_id]
        drawn["steps"] = max(drawn["steps"], step)
        # A later attempt's step replaces an earlier one's (a resume ran it again).
        if loss is not None:
            drawn["loss"][step] = loss
        if tokens is not None:
            drawn["tokens_per_s"][step] = tokens
    for drawn in series.values():
        drawn["loss"] = sorted(drawn["loss"].items())
        drawn["tokens_per_s"] = sorted(drawn["tokens_per_s"].items())
    return series


# --- cost ----------------------------------------------------------------------------------


def allocations_overlapping(*, node_ids, since, until) -> list[tuple]:
    """(node, job, team, GPUs, started, ended) of the allocations on these nodes that overlap
    [since, until): what the metering task hands to the cost ledger."""
    return list(
        Allocation.objects.filter(node_id__in=list(node_ids), started_at__lt=until)
        .filter(Q(ended_at__isnull=True) | Q(ended_at__gt=since))
        .values_list("node_id", "job_id", "job__team_id", "gpus", "started_at", "ended_at")
        .order_by("node_id", "started_at", "id")
    )


def job_cost(*, job: Job):
    """The job's cost so far and projected (apps/costs/selectors.py's JobCost): on the GPUs
    it holds once placed; before that, the range over the pools that could hold it."""
    held = list(
        Allocation.objects.filter(job=job, ended_at__isnull=True).values_list("node_id", "gpus")
    )
    pool_ids = []
    if not held and job.state not in FINISHED_STATES:
        pool_ids = _pools_that_could_hold(job)
    return cost_of(
        job_id=job.pk,
        gpus=job.gpus,
        time_limit_s=job.time_limit_s,
        started_at=job.started_at or job.admitted_at,
        held=held,
        candidate_pool_ids=pool_ids,
        spot_allowed=job.spot_allowed,
    )


def job_nodes_held(*, job_id: int) -> list[int]:
    """The nodes the job holds now, in the order dispatch ranks them (rank 0 first)."""
    return list(
        Allocation.objects.filter(job_id=job_id, ended_at__isnull=True)
        .order_by("node__rack_id", "node__name")
        .values_list("node_id", flat=True)
    )


def gpu_holders(node_ids) -> dict[int, dict[int, GpuHolder]]:
    """Which job holds each GPU of these nodes (their open allocations), in one query."""
    holders: dict[int, dict[int, GpuHolder]] = {}
    rows = Allocation.objects.filter(node_id__in=list(node_ids), ended_at__isnull=True).values_list(
        "node_id", "gpu_slots", "job_id", "job__name", "job__team_id"
    )
    for node_id, mask, job_id, name, team_id in rows.order_by():
        holder = GpuHolder(job_id=job_id, job_name=name, team_id=team_id)
        for index in slots_of(mask):
            holders.setdefault(node_id, {})[index] = holder
    return holders


@dataclass(frozen=True)
class QueueDepth:
    state: str  # pending or held
    priority_class: str
    jobs: int
    oldest_queued_at: dt.datetime


def queue_depth() -> list[QueueDepth]:
    """Jobs waiting in the queue (pending or held) by priority class, and how long the
    oldest of each has waited: one query over the live jobs (Job.objects.live())."""
    rows = (
        Job.objects.live()
        .filter(state__in=(JobState.PENDING, JobState.HELD))
        .values("state", "priority_class")
        .annotate(jobs=Count("id"), oldest=Min("queued_at"))
        .order_by("priority_class", "state")
    )
    return [
        QueueDepth(
            state=row["state"],
            priority_class=row["priority_class"],
            jobs=row["jobs"],
            oldest_queued_at=row["oldest"],
        )
        for row in rows
    ]


# --- the advisor's estimates beside what happened ---------------------------------------------

ESTIMATES_RECENT = 100  # jobs on the estimates page, and in its summary


@dataclass(frozen=True)
class Compared:
    """One quantity, as the advisor predicted it at submit and as the job measured it."""

    predicted: float | Decimal | None
    measured: float | Decimal | None
    like_for_like: bool = True  # measured on the hardware the prediction is for

    @property
    def error_pct(self) -> float | None:
        """(predicted − measured) / measured: above 0, the advisor over-estimated."""
        if self.predicted is None or not self.measured or not self.like_for_like:
            return None
        return float((self.predicted - self.measured) / self.measured * 100)


@dataclass(frozen=True)
class EstimateTruth:
    job: Job
    gpu_type: str  # the type it ran on, whose prediction is set beside it
    # Whether its steps ran on a GPU whose peak the trainer knows (they report an MFU). Not on
    # local nodes' CPU slots or an unknown part: their memory and speed are shown, not scored.
    on_rated_gpus: bool
    peak_memory_gib: Compared  # torch's max_memory_allocated, the trainer's peak_mem_gib
    step_time_s: Compared  # tokens per step / the median tokens per second
    cost: Compared  # metered; compared only for a job that ran all its steps


def estimates_beside_truth(*, jobs) -> list[EstimateTruth]:
    """For each trainer job with an estimate (Job.estimate), its predicted peak memory per
    GPU, step time and cost beside what its steps and the meter measured; two queries for
    any number of jobs (the median tokens/s is found by the database, not by reading every
    step)."""
    jobs = [job for job in jobs if job.kind == JobKind.TRAINER and job.estimate]
    ids = [job.pk for job in jobs]
    if not ids:
        return []
    steps = StepMetric.objects.filter(job_id__in=ids)
    peaks, rated = {}, set()
    for job_id, peak, with_mfu in (
        steps.values("job_id")
        .annotate(peak=Max("peak_mem_gib"), with_mfu=Count("mfu"))
        .values_list("job_id", "peak", "with_mfu")
    ):
        peaks[job_id] = peak
        if with_mfu:
            rated.add(job_id)
    middles: dict[int, list[float]] = {}
    ranked = (
        steps.filter(tokens_per_s__gt=0)
        .annotate(
            position=Window(RowNumber(), partition_by=[F("job_id")], order_by="tokens_per_s"),
            count=Window(Count("id"), partition_by=[F("job_id")]),
        )
        # The middle row, or the middle two of an even count (whole-number division).
        .filter(position__gte=(F("count") + 1) / 2, position__lte=(F("count") + 2) / 2)
        .values_list("job_id", "tokens_per_s")
    )
    for job_id, tokens_per_s in ranked:
        middles.setdefault(job_id, []).append(tokens_per_s)
    costs = job_costs_so_far(job_ids=ids)
    found = []
    for job in jobs:
        estimate = job.estimate
        by_type = estimate.get("by_gpu_type") or {}
        ran_on = job.pool.gpu_type if job.pool_id else job.gpu_type
        if ran_on not in by_type and by_type:
            ran_on = next(iter(by_type))
        predicted = by_type.get(ran_on, {})
        trainer = job.spec.get("trainer", {})
        tokens_per_step = trainer.get("global_batch", 0) * trainer.get("seq_len", 0)
        middle = middles.get(job.pk)
        measured_step = tokens_per_step / (sum(middle) / len(middle)) if middle else None
        predicted_cost = predicted.get("cost")
        on_gpus = job.pk in rated or job.pk not in peaks  # no steps yet: nothing to judge by
        found.append(
            EstimateTruth(
                job=job,
                gpu_type=ran_on,
                on_rated_gpus=on_gpus,
                peak_memory_gib=Compared(
                    (estimate.get("memory") or {}).get("allocated_gib"), peaks.get(job.pk), on_gpus
                ),
                step_time_s=Compared(predicted.get("step_time_s"), measured_step, on_gpus),
                cost=Compared(  # its predicted hours are the predicted step time's
                    Decimal(predicted_cost) if predicted_cost is not None else None,
                    costs.get(job.pk) if job.state == JobState.SUCCEEDED else None,
                    on_gpus,
                ),
            )
        )
    return found


def estimate_errors_summary(truths: list[EstimateTruth]) -> dict[str, dict]:
    """Per quantity: how many jobs measured it, and the median and worst absolute error %."""
    summary = {}
    for quantity in ("peak_memory_gib", "step_time_s", "cost"):
        errors = sorted(
            abs(error)
            for truth in truths
            if (error := getattr(truth, quantity).error_pct) is not None
        )
        summary[quantity] = {
            "jobs": len(errors),
            "median": statistics.median(errors) if errors else None,
            "worst": errors[-1] if errors else None,
        }
    return summary


def finished_jobs_with_estimates(*, jobs: QuerySet[Job]) -> QuerySet[Job]:
    """These jobs' finished trainer jobs that kept an estimate, the latest to finish first."""
    return (
        jobs.filter(kind=JobKind.TRAINER, state__in=FINISHED_STATES, estimate__isnull=False)
        .select_related("team", "pool")
        .order_by(F("finished_at").desc(nulls_last=True), "-id")
    )
