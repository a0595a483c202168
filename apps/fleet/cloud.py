"""Cloud nodes: burst requests, idle scale-down, overdue boots and orphan instances.

The rules live here; the AWS calls are made by workers/tasks/cloud.py, which calls
these services around them. A burst node remembers the job it was requested for
(`Node.burst_job`), so a job that keeps waiting while its nodes come up asks once,
not on every scheduling pass.
"""

import datetime as dt
import logging
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from apps.accounts.services import audit_record, audit_record_many, snapshot
from apps.fleet import services as fleet
from apps.fleet.models import (
    GONE_STATES,
    CapacityPreference,
    Node,
    NodeEvent,
    NodePool,
    NodeState,
    OrphanAction,
    OrphanInstance,
    OrphanPolicy,
    PoolKind,
)
from apps.fleet.models.nodes import CapacityType, Provider
from controlplane.bulk import insert_rows

log = logging.getLogger(__name__)
S = NodeState

# A burst node in one of these is on its way: its job does not ask for more.
ON_THE_WAY = (S.REQUESTED, S.PROVISIONING, S.BOOTSTRAPPING)


def placement_group_for(job_id: int) -> str:
    """The cluster placement group of a multi-node job's burst nodes."""
    return f"{settings.CONTROLPLANE_ID}-job-{job_id}"


# --- scale up ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BurstAsk:
    """The scheduler's burst request for one waiting job, checked against its budget."""

    job_id: int
    pool_id: int
    nodes: int
    gpus_per_node: int
    spot: bool


@dataclass
class BurstOutcome:
    node_ids: list[int] = field(default_factory=list)  # the nodes requested now
    skipped: dict[int, str] = field(default_factory=dict)  # job id -> why none were


def burst_instance_type(pool: NodePool, gpus_per_node: int):
    """What a burst node of the pool is: its smallest instance type with enough GPUs per
    node, or None (the costs app prices a burst by it before it is asked for)."""
    fitting = [t for t in pool.instance_types.all() if t.gpu_count >= gpus_per_node]
    return min(fitting, key=lambda t: (t.gpu_count, t.name), default=None)


def _burst_state(job_ids: list[int], now: dt.datetime):
    """Per job: burst nodes on the way, burst nodes ready, and a recent failure."""
    on_the_way: set[int] = set()
    ready: Counter[int] = Counter()
    failed_lately: set[int] = set()
    retry_from = now - dt.timedelta(seconds=settings.CLOUD_BURST_RETRY_S)
    rows = (
        Node.objects.filter(burst_job_id__in=job_ids)
        .exclude(state=S.TERMINATED)
        .values_list("burst_job_id", "state", "state_changed_at")
    )
    for job_id, state, changed_at in rows:
        if state in ON_THE_WAY:
            on_the_way.add(job_id)
        elif state == S.READY:
            ready[job_id] += 1
        elif state == S.FAILED and changed_at >= retry_from:
            failed_lately.add(job_id)
    return on_the_way, ready, failed_lately


@transaction.atomic
def burst_nodes_request(
    *, asks: Iterable[BurstAsk], now: dt.datetime | None = None
) -> BurstOutcome:
    """Request cloud nodes for waiting jobs: REQUESTED aws nodes sized for each job, in the
    pool the scheduler chose, provisioned by the `fleet.provision` task once this commits.

    A job gets nodes once: not while nodes requested for it are on the way, not again
    within CLOUD_BURST_RETRY_S of one of them failing, and only as many as it lacks
    beyond its burst nodes already READY. The pool rows are locked, so two passes
    cannot both fill the last places under the pool's max_nodes.
    """
    asks = list(asks)
    outcome = BurstOutcome()
    if not asks:
        return outcome
    now = now or timezone.now()
    on_the_way, ready, failed_lately = _burst_state([a.job_id for a in asks], now)
    pool_ids = sorted({a.pool_id for a in asks})
    pools = {
        pool.pk: pool
        for pool in NodePool.objects.select_for_update()
        .filter(pk__in=pool_ids)
        .order_by("pk")
        .prefetch_related("instance_types")
    }
    in_pool = dict(
        Node.objects.filter(pool_id__in=pool_ids)
        .exclude(state__in=GONE_STATES)
        .values_list("pool_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    new: list[Node] = []
    for ask in asks:
        pool = pools.get(ask.pool_id)
        instance_type = None if pool is None else burst_instance_type(pool, ask.gpus_per_node)
        wanted = ask.nodes - ready[ask.job_id]
        if ask.job_id in on_the_way:
            why = "burst nodes on the way"
        elif ask.job_id in failed_lately:
            why = f"burst nodes failed in the last {settings.CLOUD_BURST_RETRY_S}s"
        elif pool is None or pool.kind != PoolKind.CLOUD or not pool.enabled:
            why = "not an enabled cloud pool"
        elif not pool.image_id:
            why = f"cloud pool {pool.slug} has no image_id"
        elif instance_type is None:
            why = f"cloud pool {pool.slug} has no instance type with {ask.gpus_per_node} GPUs"
        elif wanted <= 0:
            why = "its burst nodes are ready"
        elif in_pool.get(pool.pk, 0) + wanted > pool.max_nodes:
            why = f"cloud pool {pool.slug} is at its max_nodes ({pool.max_nodes})"
        else:
            why = ""
        if why:
            outcome.skipped[ask.job_id] = why
            if pool is not None and why.startswith("cloud pool"):
                _warn_once(f"fleet:burst-refused:{pool.pk}", f"burst for job {ask.job_id}: {why}")
            continue
        in_pool[pool.pk] = in_pool.get(pool.pk, 0) + wanted
        spot = ask.spot and pool.capacity_preference == CapacityPreference.SPOT_THEN_ON_DEMAND
        group = placement_group_for(ask.job_id) if ask.nodes > 1 else ""
        for _ in range(wanted):
            node_uuid = uuid.uuid4()
            new.append(
                Node(
                    uuid=node_uuid,
                    name=f"{pool.slug}-j{ask.job_id}-{node_uuid.hex[:8]}",
                    pool=pool,
                    provider=Provider.AWS,
                    capacity_type=CapacityType.SPOT if spot else CapacityType.ON_DEMAND,
                    instance_type=instance_type,
                    gpu_type=pool.gpu_type,
                    gpu_count=instance_type.gpu_count,
                    state=S.REQUESTED,
                    state_reason=f"burst for job {ask.job_id}",
                    state_changed_at=now,
                    burst_job_id=ask.job_id,
                    placement_group=group,
                    provision_step="requested",
                    provision_message=f"requested for job {ask.job_id}",
                )
            )
    if not new:
        return outcome
    Node.objects.bulk_create(new)
    made = list(
        Node.objects.filter(uuid__in=[n.uuid for n in new]).only(
            "id", "name", "burst_job_id", "pool_id", "capacity_type", "instance_type_id"
        )
    )
    insert_rows(
        NodeEvent,
        ("node", "at", "from_state", "to_state", "reason", "actor", "actor_label"),
        (
            (n.pk, now, "", S.REQUESTED, f"burst for job {n.burst_job_id}", None, "scheduler")
            for n in made
        ),
    )
    audit_record_many(
        actor=None,
        action="node.burst",
        changes=[
            (
                n,
                {},
                {
                    "state": S.REQUESTED,
                    "burst_job": n.burst_job_id,
                    "pool": n.pool_id,
                    "capacity_type": n.capacity_type,
                    "instance_type": n.instance_type_id,
                },
            )
            for n in made
        ],
    )
    fleet.capacity_changed()
    outcome.node_ids = sorted(n.pk for n in made)
    for node_id in outcome.node_ids:
        fleet.provision_soon(node_id)
    jobs = sorted({n.burst_job_id for n in made})
    log.info("burst: %d node(s) requested for jobs %s", len(made), jobs)
    return outcome


def _warn_once(key: str, message: str, every_s: int = 600) -> None:
    """A warning about a pool's settings, at most once per period (passes run every 30 s)."""
    if cache.add(key, 1, timeout=every_s):
        log.warning(message)


@transaction.atomic
def cloud_node_launched(
    *,
    node_id: int,
    instance_id: str,
    capacity_type: str | None,
    launched_at: dt.datetime | None,
    address: str = "",
) -> None:
    """Record what the launch made: the instance, whether it is spot (the pool's spot
    interruption rate counts spot nodes by launch time), and its private address."""
    node = Node.objects.select_for_update().get(pk=node_id)
    changes = {"instance_id": instance_id}
    if capacity_type in (CapacityType.SPOT, CapacityType.ON_DEMAND):
        changes["capacity_type"] = capacity_type
    if launched_at is not None:
        changes["launched_at"] = launched_at
    if address:
        changes["address"] = address[:255]
    changed = [name for name, value in changes.items() if getattr(node, name) != value]
    if not changed:
        return
    before = snapshot(node)
    for name in changed:
        setattr(node, name, changes[name])
    node.save(update_fields=changed)
    audit_record(actor=None, action="node.launched", obj=node, before=before, after=snapshot(node))


# --- scale down and overdue nodes --------------------------------------------------------------


def _cloud_nodes(*states: str):
    return Node.objects.filter(provider=Provider.AWS, state__in=states)


def _past(changed_at: dt.datetime, seconds: int, now: dt.datetime) -> bool:
    return changed_at <= now - dt.timedelta(seconds=seconds)


# Cloud nodes out of work that are terminated after their pool's idle timeout: idle ones,
# failed ones (time for ops to look), drained ones (a spot notice drains its node) and down
# ones (an instance AWS took back stops heartbeating). Each still counts against max_nodes.
RETIRABLE = (S.READY, S.FAILED, S.DRAINED, S.DOWN)
_RETIRE_REASON = {
    S.READY: "idle for {timeout}s",
    S.FAILED: "failed {timeout}s ago: {reason}",
    S.DRAINED: "drained for {timeout}s: {reason}",
    S.DOWN: "down for {timeout}s",
}


def cloud_nodes_to_retire(*, now: dt.datetime | None = None) -> list[int]:
    """Cloud nodes due to be terminated: in a RETIRABLE state for their pool's idle timeout."""
    now = now or timezone.now()
    rows = _cloud_nodes(*RETIRABLE).values_list("id", "state_changed_at", "pool__idle_timeout_s")
    return sorted(node_id for node_id, changed, idle in rows if _past(changed, idle, now))


@transaction.atomic
def cloud_node_retire(*, node_id: int, now: dt.datetime | None = None) -> bool:
    """Move one cloud node to TERMINATING if it is still due, checked again under its lock:
    a node that got work since the list was read (BUSY, or holding GPUs) is kept."""
    now = now or timezone.now()
    node = Node.objects.select_for_update().select_related("pool").filter(pk=node_id).first()
    if node is None or node.provider != Provider.AWS or node.state not in RETIRABLE:
        return False
    timeout = node.pool.idle_timeout_s
    if not _past(node.state_changed_at, timeout, now):
        return False
    # The scheduler places work only on nodes it has locked and found READY or BUSY, and
    # marks them BUSY in the same transaction; open allocations are checked as well.
    if node.allocations.filter(ended_at__isnull=True).exists():
        return False
    reason = _RETIRE_REASON[node.state].format(timeout=timeout, reason=node.state_reason)
    fleet.node_transition(node=node, to=S.TERMINATING, reason=reason[:300], by=None)
    return True


def cloud_nodes_terminating() -> list[int]:
    """Cloud nodes on their way out whose instance may still run (retried until gone)."""
    return list(_cloud_nodes(S.TERMINATING).order_by("id").values_list("id", flat=True))


def cloud_nodes_fail_overdue(*, now: dt.datetime | None = None) -> int:
    """Cloud nodes still not READY CLOUD_NODE_BOOT_TIMEOUT_S after they were requested are
    FAILED (then terminated like any failed cloud node); returns how many."""
    now = now or timezone.now()
    limit = settings.CLOUD_NODE_BOOT_TIMEOUT_S
    cutoff = now - dt.timedelta(seconds=limit)
    failed = 0
    for node_id in (
        _cloud_nodes(*ON_THE_WAY).filter(created_at__lt=cutoff).values_list("id", flat=True)
    ):
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=node_id)
            if node.state not in ON_THE_WAY:
                continue
            last = f" (last: {node.provision_message})" if node.provision_message else ""
            reason = f"not ready within {limit}s of its request{last}"
            fleet.node_transition(node=node, to=S.FAILED, reason=reason[:300], by=None)
            failed += 1
    return failed


def cloud_nodes_stalled(*, now: dt.datetime | None = None) -> list[int]:
    """Cloud nodes REQUESTED or PROVISIONING for CLOUD_REDRIVE_AFTER_S: their task may be
    lost (a worker killed, a message dropped); provisioning is safe to run again."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(seconds=settings.CLOUD_REDRIVE_AFTER_S)
    return list(
        _cloud_nodes(S.REQUESTED, S.PROVISIONING)
        .filter(state_changed_at__lt=cutoff)
        .order_by("id")
        .values_list("id", flat=True)
    )


def placement_groups_released(*, since: dt.datetime) -> list[tuple[str, str]]:
    """(region, group) for placement groups whose nodes are all terminated, the last of
    them since `since`: the groups to delete."""
    groups: dict[str, dict] = defaultdict(lambda: {"live": False, "recent": False, "region": ""})
    rows = (
        Node.objects.filter(provider=Provider.AWS)
        .exclude(placement_group="")
        .values_list("placement_group", "state", "state_changed_at", "pool__region")
    )
    for group, state, changed, region in rows:
        entry = groups[group]
        entry["region"] = entry["region"] or region
        if state != S.TERMINATED:
            entry["live"] = True
        elif changed >= since:
            entry["recent"] = True
    return sorted(
        (entry["region"], group)
        for group, entry in groups.items()
        if entry["recent"] and not entry["live"]
    )


# --- orphans -----------------------------------------------------------------------------------


def cloud_regions() -> list[str]:
    """Regions to sweep: those of enabled cloud pools and of pools with cloud nodes left."""
    enabled = NodePool.objects.filter(kind=PoolKind.CLOUD, enabled=True).values_list(
        "region", flat=True
    )
    with_nodes = (
        Node.objects.filter(provider=Provider.AWS)
        .exclude(state=S.TERMINATED)
        .values_list("pool__region", flat=True)
    )
    return sorted({region for region in [*enabled, *with_nodes] if region})


def node_uuids_known(*, among: Iterable[str] | None = None) -> set[str]:
    """The UUIDs (lower-case text) of nodes the database knows and has not terminated;
    `among` limits the look-up to those. A live instance whose node is terminated or
    deleted is an orphan."""
    rows = Node.objects.exclude(state=S.TERMINATED)
    if among is not None:
        wanted = []
        for value in among:
            try:
                wanted.append(uuid.UUID(str(value)))
            except ValueError:
                continue  # a tag that is no UUID names no node of ours
        rows = rows.filter(uuid__in=wanted)
    return {str(value).lower() for value in rows.values_list("uuid", flat=True)}


def orphan_policies(*, pool_slugs: Iterable[str]) -> dict[str, str]:
    """pool slug -> the pool's orphan policy; a slug that names no pool is absent (report)."""
    return dict(
        NodePool.objects.filter(slug__in=[s for s in set(pool_slugs) if s]).values_list(
            "slug", "orphans"
        )
    )


def orphan_should_terminate(*, pool_tag: str, policies: dict[str, str]) -> bool:
    return policies.get(pool_tag) == OrphanPolicy.TERMINATE


@dataclass(frozen=True)
class OrphanSeen:
    """One orphan as the sweep found it (plain data from the provider)."""

    instance_id: str
    node_uuid: str
    pool_tag: str
    instance_type: str
    state: str
    launched_at: dt.datetime | None
    terminated: bool


@transaction.atomic
def orphan_instances_record(
    *, region: str, found: Iterable[OrphanSeen], now: dt.datetime | None = None
) -> dict[str, int]:
    """Keep a row per orphan (admin, API), with an audit record and a log line the first
    time it is seen and when it is terminated; orphans no longer found are marked gone."""
    now = now or timezone.now()
    found = list(found)
    pools = dict(
        NodePool.objects.filter(slug__in={o.pool_tag for o in found if o.pool_tag}).values_list(
            "slug", "id"
        )
    )
    existing = OrphanInstance.objects.select_for_update().in_bulk(
        [o.instance_id for o in found], field_name="instance_id"
    )
    counts = {"reported": 0, "terminated": 0, "new": 0, "gone": 0}
    for seen in found:
        action = OrphanAction.TERMINATED if seen.terminated else OrphanAction.REPORTED
        counts[action] += 1
        row = existing.get(seen.instance_id)
        fields = {
            "region": region,
            "node_uuid": seen.node_uuid[:64],
            "pool_tag": seen.pool_tag[:100],
            "pool_id": pools.get(seen.pool_tag),
            "instance_type": seen.instance_type[:50],
            "instance_state": seen.state[:20],
            "launched_at": seen.launched_at,
            "action": action,
            "last_seen_at": now,
            "gone_at": None,
        }
        if row is None:
            row = OrphanInstance.objects.create(
                instance_id=seen.instance_id, first_seen_at=now, **fields
            )
            counts["new"] += 1
            noted = True
        else:
            noted = row.action != action or row.gone_at is not None
            for name, value in fields.items():
                setattr(row, name, value)
            row.save()
        if noted:
            log.warning(
                "orphan instance %s in %s (node tag %r, pool tag %r, %s, %s): %s",
                seen.instance_id,
                region,
                seen.node_uuid,
                seen.pool_tag,
                seen.instance_type,
                seen.state,
                action,
            )
            audit_record(
                actor=None, action=f"orphan_instance.{action}", obj=row, after=snapshot(row)
            )
    counts["gone"] = (
        OrphanInstance.objects.filter(region=region, gone_at__isnull=True)
        .exclude(instance_id__in=[o.instance_id for o in found])
        .update(gone_at=now)
    )
    return counts
