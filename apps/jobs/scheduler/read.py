"""Read the scheduler's snapshot in a few bulk queries: no query per node or per job."""

import datetime as dt
import time
from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.db.models import BooleanField, CharField, ExpressionWrapper, FloatField, Func, Q

from apps.accounts.models import TeamQuota
from apps.fleet.models import (
    GONE_STATES,
    SCHEDULABLE_STATES,
    JobIsolation,
    Node,
    NodePool,
    Tenancy,
)
from apps.fleet.models.nodes import Provider
from apps.jobs.models import Allocation, Job, JobState, JobWait, Reservation, TeamUsage
from apps.jobs.models.jobs import HOLDING_STATES, PRIORITY_RANK, STOPPING_STATES
from apps.jobs.models.usage import USAGE_EPOCH
from apps.jobs.scheduler import snapshot as plain
from controlplane.bulk import InArray, fetch_batches, fetch_rows


@dataclass
class ReadContext:
    """What the apply step needs besides the decisions: the reasons as they stand now."""

    now: dt.datetime
    # pending job -> (reason, estimated start in epoch seconds, or None), None: no row yet
    reasons: dict[int, tuple[str, float | None] | None]
    held_by_team: dict[int, int]  # GPUs each team holds now (for the decayed usage)


def _epoch(moment: dt.datetime) -> float:
    return moment.timestamp()


class Epoch(Func):
    """A datetime column as seconds since 1970 (a float): 50,000 datetimes cost more to parse."""

    output_field = FloatField()

    def as_postgresql(self, compiler, connection, **extra):
        # date_part gives a double; EXTRACT gives a numeric (since PostgreSQL 14), which
        # costs a fifth of the pending jobs' read to compute and then cast.
        return self.as_sql(
            compiler, connection, template="date_part('epoch', %(expressions)s)", **extra
        )

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(
            compiler,
            connection,
            template="((julianday(%(expressions)s) - 2440587.5) * 86400.0)",
            **extra,
        )


def decay_scale(now: dt.datetime) -> float:
    """2^((now - epoch) / half-life): stored usage ÷ this = usage now."""
    return 2.0 ** ((now - USAGE_EPOCH).total_seconds() / settings.FAIR_SHARE_HALF_LIFE_S)


PENDING_COLUMNS = (
    "id",
    "team_id",
    "priority_class",
    "queued",
    "gpu_type",
    "nodes",
    "gpus_per_node",
    "placement",
    "spot_allowed",
    "time_limit_s",
    "min_nodes",
    "node_ids",
)


class KeptPending:
    """The pending jobs as the last pass read them, kept by this process, each with the
    version of its row (RowVersion: the transaction that wrote it, and where).

    A pass then reads only (id, version) of every pending job, and whole rows only for
    those it has not seen in that version: a queue of 50,000 that moved by a few hundred
    costs a few hundred rows, not 50,000. A changed row is a new version, and a version
    a rolled-back transaction wrote is never seen, so what is kept is never stale; it
    is still dropped after MAX_AGE_S, and whenever the database is another one.
    Elsewhere than PostgreSQL every pass reads every row.
    """

    MAX_AGE_S = 600.0

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.database = None
        self.read_at = 0.0  # when every row was last read
        self.jobs: dict[int, plain.Pending] = {}
        self.versions: dict[int, str] = {}  # job id -> its row's version when read
        self.rows_read = 0  # whole rows the last read fetched

    def read(self, budget_left) -> list[plain.Pending]:
        versioned = connection.vendor == "postgresql"
        database = (connection.alias, connection.settings_dict["NAME"])
        started = time.monotonic()
        if not versioned or database != self.database or started - self.read_at > self.MAX_AGE_S:
            self.clear()
        self.rows_read = 0
        try:
            if self.jobs:
                self._refresh()
            else:
                for rows in fetch_batches(_pending_rows(versioned=versioned)):
                    self._keep(rows, versioned)
                self.database, self.read_at = database, started
        except BaseException:
            self.clear()
            raise
        return self._with_budgets(budget_left)

    def _refresh(self) -> None:
        now = {}
        for rows in fetch_batches(_pending_versions()):
            now.update(rows)
        versions = self.versions
        for gone in versions.keys() - now.keys():
            self._drop(gone)
        unseen = [job_id for job_id, version in now.items() if versions.get(job_id) != version]
        for job_id in unseen:
            self._drop(job_id)  # read again below, unless it has left the queue since
        if unseen:
            self._keep(
                fetch_rows(_pending_rows(versioned=True).filter(InArray("id", unseen))), True
            )

    def _drop(self, job_id: int) -> None:
        self.jobs.pop(job_id, None)
        self.versions.pop(job_id, None)

    def _keep(self, rows, versioned: bool) -> None:
        # Built as the tuple it is, in its field order: Pending._make costs twice as much
        # (a Python call that checks the length this literal fixes), keywords three times
        # as much. Budgets are filled in per pass.
        new, pending = tuple.__new__, plain.Pending
        jobs, versions = self.jobs, self.versions
        for row in rows:
            job_id = row[0]
            pinned = row[11]
            jobs[job_id] = new(
                pending,
                (
                    job_id,
                    row[1],
                    PRIORITY_RANK[row[2]],
                    *row[3:10],
                    True,
                    row[10] or 0,
                    None if pinned is None else frozenset(pinned),
                ),
            )
            if versioned:
                versions[job_id] = row[12]
        self.rows_read += len(rows)

    def _with_budgets(self, budget_left) -> list[plain.Pending]:
        """The kept jobs with this pass's answer to the costs app's budget question (has
        the team budget left to burst at all?), asked once per team. What each burst will
        cost is held against the budget when the pass applies it.
        Unordered: the planner orders the queue itself (class, score, age, then id)."""
        answers = {
            team_id: budget_left(team=team_id)
            for team_id in {j.team_id for j in self.jobs.values()}
        }
        jobs = self.jobs
        for job_id, job in jobs.items():
            if job.budget_ok != answers[job.team_id]:
                jobs[job_id] = job._replace(budget_ok=answers[job.team_id])
        return list(jobs.values())


_kept = KeptPending()


class RowVersion(Func):
    """Which version of the queried row this is, on PostgreSQL: the transaction that
    wrote it (xmin) and where it lies (ctid), as text. Every UPDATE writes a new version
    under a new transaction id or, within one transaction, at another place."""

    output_field = CharField()

    def as_sql(self, compiler, connection, **extra):
        table = compiler.quote_name_unless_alias(compiler.query.get_initial_alias())
        return f"{table}.xmin::text || {table}.ctid::text", []


def _pending(*columns: str):
    """The pending jobs' `columns` (queued: queued_at as an epoch; version: RowVersion),
    unordered."""
    return (
        Job.objects.live()
        .filter(state=JobState.PENDING)
        .annotate(queued=Epoch("queued_at"), version=RowVersion())
        .values_list(*columns)
        .order_by()
    )


def _pending_rows(*, versioned: bool):
    """Pending jobs in Pending's field order (the priority as its class; budget_ok, filled
    in per pass, left out), then the row's version on PostgreSQL."""
    return _pending(*PENDING_COLUMNS, "version") if versioned else _pending(*PENDING_COLUMNS)


def _pending_versions():
    return _pending("id", "version")


def read_snapshot(*, now: dt.datetime, budget_left) -> tuple[plain.Snapshot, ReadContext]:
    # Current allocations, once: what each running job holds, and so what each node has left.
    node_gpus: dict[int, list[tuple[int, int]]] = defaultdict(list)
    held_per_node: dict[int, int] = defaultdict(int)
    for job_id, node_id, gpus in fetch_rows(
        Allocation.objects.filter(ended_at__isnull=True)
        .values_list("job_id", "node_id", "gpus")
        .order_by("job_id", "node_id")
    ):
        node_gpus[job_id].append((node_id, gpus))
        held_per_node[node_id] += gpus

    burst_gpus: dict[int, int] = defaultdict(int)
    for pool_id, gpus in NodePool.instance_types.through.objects.values_list(
        "nodepool_id", "instancetype__gpu_count"
    ):
        burst_gpus[pool_id] = max(burst_gpus[pool_id], gpus)
    pools: dict[int, plain.PoolInfo] = {}
    shared_pools: set[int] = set()  # pools whose tenancy is shared
    for (
        pool_id,
        kind,
        gpu_type,
        preference,
        enabled,
        burst_delay,
        max_nodes,
        tenancy,
    ) in NodePool.objects.values_list(
        "id",
        "kind",
        "gpu_type",
        "capacity_preference",
        "enabled",
        "burst_delay_s",
        "max_nodes",
        "tenancy",
    ):
        pools[pool_id] = plain.PoolInfo(
            id=pool_id,
            kind=kind,
            gpu_type=gpu_type,
            spot=preference == "spot_then_on_demand",
            enabled=enabled,
            burst_delay_s=burst_delay,
            max_nodes=max_nodes,
            gpus_per_node=burst_gpus.get(pool_id, 8),
        )
        if tenancy == Tenancy.SHARED:
            shared_pools.add(pool_id)

    # Jobs are untrusted code: an owned or cloud node takes work only while its agent runs
    # each job as a user of its own (local nodes are for development: they say how they
    # run jobs, and do). A node holds several teams' jobs at once only where its pool
    # allows it and its agent isolates them, or on local nodes whose jobs the settings let
    # read each other.
    local_shared = settings.LOCAL_JOBS_CAN_READ_EACH_OTHER
    # A node that missed a heartbeat takes no new work until it answers, long before the
    # sweep calls it SUSPECT. Decided in the query: true, false, or NULL (never heard from:
    # its agent has not started, and the sweep leaves it alone too).
    quiet_since = ExpressionWrapper(
        Q(last_heartbeat_at__lt=now - dt.timedelta(seconds=settings.NODE_QUIET_AFTER_S)),
        output_field=BooleanField(),
    )
    degraded = ExpressionWrapper(
        Q(fabric_degraded_since__isnull=False), output_field=BooleanField()
    )
    user, local = JobIsolation.USER.value, Provider.LOCAL.value
    new, slot = tuple.__new__, plain.NodeSlot  # as Pending in KeptPending._keep
    nodes = tuple(
        new(
            slot,
            (
                node_id,
                pool_id,
                rack_id,
                gpus,
                max(gpus - held_per_node.get(node_id, 0), 0),
                state in SCHEDULABLE_STATES
                and not quiet
                and (isolation == user or provider == local),
                (isolation == user and pool_id in shared_pools)
                or (local_shared and provider == local),
                fabric_degraded,
            ),
        )
        for (
            node_id,
            pool_id,
            rack_id,
            gpus,
            state,
            isolation,
            provider,
            quiet,
            fabric_degraded,
        ) in fetch_rows(
            Node.objects.exclude(state__in=GONE_STATES)
            .annotate(quiet=quiet_since, fabric_degraded=degraded)
            .values_list(
                "id",
                "pool_id",
                "rack_id",
                "gpu_count",
                "state",
                "job_isolation",
                "provider",
                "quiet",
                "fabric_degraded",
            )
            .order_by("id")
        )
    )

    running = []
    held_by_team: dict[int, int] = defaultdict(int)
    for job_id, team_id, priority, pool_id, admitted_at, limit, state in fetch_rows(
        Job.objects.live()
        .filter(state__in=HOLDING_STATES)
        .annotate(admitted=Epoch("admitted_at"))
        .values_list(
            "id", "team_id", "priority_class", "pool_id", "admitted", "time_limit_s", "state"
        )
        .order_by("id")
    ):
        if pool_id is None or pool_id not in pools:
            continue
        held = tuple(node_gpus.get(job_id, ()))
        started = _epoch(now) if admitted_at is None else admitted_at
        running.append(
            plain.Running(
                job_id=job_id,
                team_id=team_id,
                gpu_type=pools[pool_id].gpu_type,
                priority=PRIORITY_RANK[priority],
                pool_id=pool_id,
                node_gpus=held,
                expected_end=started + limit,
                preemptible=state not in STOPPING_STATES,
            )
        )
        held_by_team[team_id] += sum(g for _, g in held)

    pending = _kept.read(budget_left)
    # None: no wait row yet, unless JobWait has one. (The kept jobs' ids are the pending.)
    reasons: dict[int, tuple[str, float | None] | None] = dict.fromkeys(_kept.jobs)
    # Only pending jobs have wait rows (they go when a job leaves PENDING): no join needed.
    for job_id, reason, estimated in fetch_rows(
        JobWait.objects.annotate(estimated=Epoch("estimated_start")).values_list(
            "job_id", "reason", "estimated"
        )
    ):
        if job_id in reasons:
            reasons[job_id] = (reason, estimated)

    quotas = {}
    shares: dict[int, float] = defaultdict(float)
    for team_id, gpu_type, nominal, borrow in TeamQuota.objects.values_list(
        "team_id", "gpu_type", "max_gpus", "borrow_gpus"
    ):
        quotas[(team_id, gpu_type)] = plain.Quota(nominal=nominal, borrow=borrow)
        shares[team_id] += nominal
    scale = decay_scale(now)
    usage = {
        team_id: value / scale
        for team_id, value in TeamUsage.objects.values_list("team_id", "scaled_gpu_seconds")
    }

    window_nodes: dict[int, set[int]] = defaultdict(set)
    for reservation_id, node_id in Reservation.nodes.through.objects.filter(
        reservation__ends_at__gt=now
    ).values_list("reservation_id", "node_id"):
        window_nodes[reservation_id].add(node_id)
    windows = tuple(
        plain.Window(
            id=rid,
            node_ids=frozenset(window_nodes.get(rid, ())),
            team_id=team_id,
            start=_epoch(start),
            end=_epoch(end),
        )
        for rid, team_id, start, end in Reservation.objects.filter(ends_at__gt=now)
        .values_list("id", "team_id", "starts_at", "ends_at")
        .order_by("id")
    )

    snap = plain.Snapshot(
        now=_epoch(now),
        nodes=nodes,
        pools=pools,
        running=tuple(running),
        pending=tuple(pending),
        quotas=quotas,
        usage=usage,
        shares={team: share or 1.0 for team, share in shares.items()},
        windows=windows,
        settings=plain.PlanSettings(backfill_depth=settings.BACKFILL_DEPTH),
    )
    return snap, ReadContext(now=now, reasons=reasons, held_by_team=dict(held_by_team))
