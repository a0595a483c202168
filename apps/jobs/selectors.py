"""Reads of jobs and the queue, scoped to what the user may see."""

from django.core.cache import cache
from django.core.paginator import Page, Paginator
from django.db.models import F, Q, QuerySet

from apps.accounts.models import Team
from apps.accounts.selectors import roles_of
from apps.costs.selectors import job_cost as cost_of
from apps.fleet.selectors import pools_capacity
from apps.jobs import specs
from apps.jobs.models import (
    Allocation,
    Job,
    JobState,
    LogLine,
    Reservation,
    Run,
    StepMetric,
    Webhook,
)
from apps.jobs.models.jobs import (
    ACTIVE_STATES,
    FINISHED_STATES,
    QUEUE_ORDER_KEY,
    last_pass_read_at,
    waiting_reason,
)
from apps.tuning.services import RenderedEnvironment, nccl_environments_render


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
)


def _active(*, state: str = "", team: str = "") -> QuerySet[Job]:
    jobs = Job.objects.filter(state__in=ACTIVE_STATES)
    if state:
        jobs = jobs.filter(state=state)
    if team:
        jobs = jobs.filter(team__slug=team)
    return jobs.order_by("queued_at", "id")


def _queue_order() -> dict[int, int]:
    """Job id -> its place among the pending jobs, as the last scheduling pass ordered them."""
    return {job_id: i + 1 for i, job_id in enumerate(cache.get(QUEUE_ORDER_KEY) or [])}


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
            "position": position.get(job_id),
            "anonymous": not mine,
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


def queue_for(*, user, state: str = "", team: str = "") -> list[dict]:
    """Every active job, in queue order; other teams' jobs as anonymous rows.

    An anonymous row says only team, GPUs, state, priority and estimated start:
    no name, spec, logs or cost.
    """
    position = _queue_order()
    rows = _queue_rows(_active(state=state, team=team), user=user, position=position)
    return [rows[job_id] for job_id in _in_queue_order(rows, position)]


def queue_ids(*, state: str = "", team: str = "") -> tuple[list[int], dict[int, int]]:
    """Every active job's id in queue order, and the pending jobs' places: the pages' order,
    read without reading the rows (a queue at design size is 50,000 jobs)."""
    position = _queue_order()
    ids = _active(state=state, team=team).values_list("id", flat=True)
    return _in_queue_order(ids, position), position


def queue_rows(ids: list[int], *, user, position: dict[int, int]) -> list[dict]:
    """queue_for's rows of these jobs, in the order given (jobs gone since are left out)."""
    rows = _queue_rows(Job.objects.filter(id__in=ids).order_by(), user=user, position=position)
    return [rows[job_id] for job_id in ids if job_id in rows]


def queue_page(*, user, state: str = "", team: str = "", page, per_page: int) -> Page:
    """One page of queue_for's rows: every active job's id is ordered, only the page's
    rows are read whole."""
    ids, position = queue_ids(state=state, team=team)
    shown = Paginator(ids, per_page).get_page(page)
    shown.object_list = queue_rows(shown.object_list, user=user, position=position)
    return shown


def queue_choices() -> tuple[list[str], list[str]]:
    """The states and the teams among the active jobs, for the Queue's filters."""
    pairs = set(
        Job.objects.filter(state__in=ACTIVE_STATES)
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


def job_history(*, user, state: str = "", team: str = "") -> QuerySet:
    """The finished jobs (succeeded, failed, cancelled) of the user's teams as rows, the
    latest to finish first: what `sacct` shows a Slurm user."""
    jobs = jobs_visible_to(user=user).filter(state__in=FINISHED_STATES)
    if state:
        jobs = jobs.filter(state=state)
    if team:
        jobs = jobs.filter(team__slug=team)
    return jobs.order_by(F("finished_at").desc(nulls_last=True), "-id").values(*HISTORY_COLUMNS)


def history_row(row: dict) -> dict:
    """A history row with its GPU count and how long it ran (None if it never started)."""
    ran = None
    if row["started_at"] and row["finished_at"]:
        ran = row["finished_at"] - row["started_at"]
    return {
        **row,
        "gpus": row["nodes"] * row["gpus_per_node"],
        "ran": ran,
        "ran_text": "" if ran is None else _short_duration(ran.total_seconds()),
    }


def _short_duration(seconds: float) -> str:
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


def history_teams(*, user) -> list[str]:
    """The teams whose history the user may read, for the History page's filter."""
    roles = roles_of(user)
    teams = (
        Team.objects.all() if roles.sees_every_team else Team.objects.filter(id__in=roles.team_ids)
    )
    return list(teams.order_by("slug").values_list("slug", flat=True))


def reservations_visible() -> QuerySet[Reservation]:
    return Reservation.objects.select_related("team").prefetch_related("nodes")


def webhooks_visible_to(*, user) -> QuerySet[Webhook]:
    roles = roles_of(user)
    hooks = Webhook.objects.select_related("team", "job")
    if roles.superuser or roles.ops:
        return hooks
    return hooks.filter(team_id__in=roles.team_ids)


def job_nccl_environments(*, job: Job) -> list[RenderedEnvironment]:
    """The NCCL environment the job gets: on its pool once placed, before that on each pool
    that could hold it (the profile, then the job's overrides, linted for those nodes)."""
    pool_ids = [job.pool_id] if job.pool_id else _pools_that_could_hold(job)
    return nccl_environments_render(nccl=job.spec.get("nccl"), nodes=job.nodes, pool_ids=pool_ids)


def _pools_that_could_hold(job: Job) -> list[int]:
    return specs.pools_holding(
        pools_capacity(cached=True),
        gpu_type=job.gpu_type,
        where=job.placement,
        nodes=job.nodes,
        gpus_per_node=job.gpus_per_node,
    )


def job_log_lines(*, job: Job, after: int = 0, limit: int = 500, **_) -> list[dict]:
    """The job's output lines after line id `after`, oldest first."""
    rows = (
        LogLine.objects.filter(job=job, id__gt=after)
        .order_by("id")
        .values_list("id", "at", "run__node_rank", "run__attempt", "stream", "text")[:limit]
    )
    return [
        {"id": i, "at": at, "rank": rank, "attempt": attempt, "stream": stream, "text": text}
        for i, at, rank, attempt, stream, text in rows
    ]


def job_log_tail(*, job: Job, limit: int = 200) -> list[dict]:
    """The job's newest output lines, oldest of them first (the Job page's tail)."""
    newest = list(
        LogLine.objects.filter(job=job)
        .order_by("-id")
        .values_list("id", "at", "run__node_rank", "run__attempt", "stream", "text")[:limit]
    )
    return [
        {"id": i, "at": at, "rank": rank, "attempt": attempt, "stream": stream, "text": text}
        for i, at, rank, attempt, stream, text in reversed(newest)
    ]


def job_runs(*, job: Job) -> list[Run]:
    """Every attempt's runs, newest attempt first, with their nodes."""
    return list(job.runs.select_related("node").order_by("-attempt", "node_rank"))


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
