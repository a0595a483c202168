"""Read the scheduler's snapshot in a few bulk queries: no query per node or per job."""

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db.models import FloatField, Func, Sum

from apps.accounts.models import TeamQuota
from apps.fleet.models import GONE_STATES, SCHEDULABLE_STATES, Node, NodePool
from apps.jobs.models import Allocation, Job, JobState, JobWait, Reservation, TeamUsage
from apps.jobs.models.jobs import HOLDING_STATES, PRIORITY_RANK, STOPPING_STATES
from apps.jobs.models.usage import USAGE_EPOCH
from apps.jobs.scheduler import snapshot as plain
from controlplane.bulk import fetch_rows


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
        return self.as_sql(
            compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8", **extra
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


def read_snapshot(*, now: dt.datetime, budget_allows) -> tuple[plain.Snapshot, ReadContext]:
    held_per_node = dict(
        Allocation.objects.filter(ended_at__isnull=True)
        .values_list("node_id")
        .annotate(held=Sum("gpus"))
        .order_by()
    )
    nodes = tuple(
        plain.NodeSlot(
            id=node_id,
            pool_id=pool_id,
            rack_id=rack_id,
            gpus_total=gpus,
            gpus_free=max(gpus - held_per_node.get(node_id, 0), 0),
            schedulable=state in SCHEDULABLE_STATES,
        )
        for node_id, pool_id, rack_id, gpus, state in fetch_rows(
            Node.objects.exclude(state__in=GONE_STATES)
            .values_list("id", "pool_id", "rack_id", "gpu_count", "state")
            .order_by("id")
        )
    )

    burst_gpus: dict[int, int] = defaultdict(int)
    for pool_id, gpus in NodePool.instance_types.through.objects.values_list(
        "nodepool_id", "instancetype__gpu_count"
    ):
        burst_gpus[pool_id] = max(burst_gpus[pool_id], gpus)
    pools = {
        pool_id: plain.PoolInfo(
            id=pool_id,
            kind=kind,
            gpu_type=gpu_type,
            spot=preference == "spot_then_on_demand",
            enabled=enabled,
            burst_delay_s=burst_delay,
            max_nodes=max_nodes,
            gpus_per_node=burst_gpus.get(pool_id, 8),
        )
        for pool_id, kind, gpu_type, preference, enabled, burst_delay, max_nodes in (
            NodePool.objects.values_list(
                "id",
                "kind",
                "gpu_type",
                "capacity_preference",
                "enabled",
                "burst_delay_s",
                "max_nodes",
            )
        )
    }

    node_gpus: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for job_id, node_id, gpus in fetch_rows(
        Allocation.objects.filter(ended_at__isnull=True)
        .values_list("job_id", "node_id", "gpus")
        .order_by("job_id", "node_id")
    ):
        node_gpus[job_id].append((node_id, gpus))
    running = []
    held_by_team: dict[int, int] = defaultdict(int)
    for job_id, team_id, priority, pool_id, admitted_at, limit, state in fetch_rows(
        Job.objects.filter(state__in=HOLDING_STATES)
        .values_list(
            "id", "team_id", "priority_class", "pool_id", "admitted_at", "time_limit_s", "state"
        )
        .order_by("id")
    ):
        if pool_id is None or pool_id not in pools:
            continue
        held = tuple(node_gpus.get(job_id, ()))
        started = admitted_at or now
        running.append(
            plain.Running(
                job_id=job_id,
                team_id=team_id,
                gpu_type=pools[pool_id].gpu_type,
                priority=PRIORITY_RANK[priority],
                pool_id=pool_id,
                node_gpus=held,
                expected_end=_epoch(started) + limit,
                preemptible=state not in STOPPING_STATES,
            )
        )
        held_by_team[team_id] += sum(g for _, g in held)

    # Built positionally (Pending._make) from rows in its field order: 50,000 keyword
    # constructions cost three times as much. Unordered: the planner orders the queue
    # itself (class, score, age, then id), so a sort here would be work thrown away.
    make = plain.Pending._make
    pending = []
    budget_by_team: dict[int, bool] = {}
    # Rows in Pending's field order, but for the priority's rank and the budget's answer.
    for row in fetch_rows(
        Job.objects.filter(state=JobState.PENDING)
        .annotate(queued=Epoch("queued_at"))
        .values_list(
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
            "max_cost_usd",
        )
        .order_by()
    ):
        team_id = row[1]
        budget_ok = budget_by_team.get(team_id)
        if budget_ok is None:
            budget_ok = budget_by_team[team_id] = budget_allows(
                team=team_id, gpus=row[5] * row[6], time_limit_s=row[9], max_cost_usd=row[10]
            )
        pending.append(make((row[0], team_id, PRIORITY_RANK[row[2]], *row[3:10], budget_ok)))
    # None: no wait row yet, unless JobWait has one.
    reasons: dict[int, tuple[str, float | None] | None] = dict.fromkeys(p[0] for p in pending)
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
