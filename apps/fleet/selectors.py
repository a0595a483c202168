"""Reads of the fleet, shaped for the pages, the API and /metrics."""

import datetime as dt
from dataclasses import dataclass, field

from django.conf import settings
from django.db.models import Count, Min, Prefetch, Q, QuerySet, Sum

from apps.fleet.models import (
    GONE_STATES,
    SCHEDULABLE_STATES,
    Gpu,
    GpuHealth,
    InstanceType,
    Node,
    NodeEvent,
    NodePool,
    NodeState,
    PoolKind,
    Rack,
    Site,
)
from apps.fleet.models.nodes import CapacityType
from controlplane.cache import best_effort


def nodes_for_listing() -> QuerySet[Node]:
    return (
        Node.objects.select_related("pool", "rack", "rack__site", "instance_type")
        .annotate(healthy_gpus=Count("gpus", filter=Q(gpus__health=GpuHealth.HEALTHY)))
        .order_by("name")
    )


def racks_for_listing() -> QuerySet[Rack]:
    return (
        Rack.objects.select_related("site")
        .annotate(node_count=Count("nodes"))
        .order_by("site__name", "name")
    )


def pools_for_listing() -> QuerySet[NodePool]:
    return (
        NodePool.objects.select_related("site")
        .prefetch_related("instance_types")
        .annotate(node_count=Count("nodes"))
        .order_by("name")
    )


def pools_visible_to(*, user) -> QuerySet[NodePool]:
    """Every pool, to every user: a pool a form or the API names by id (the fleet's pools are
    listed to all who sign in)."""
    return NodePool.objects.all()


def node_counts_by_state() -> dict[str, int]:
    counts = dict(Node.objects.values_list("state").annotate(n=Count("id")).order_by())
    return {state: counts.get(state, 0) for state in NodeState.values}


def gpu_counts_by_health() -> dict[str, int]:
    counts = dict(Gpu.objects.values_list("health").annotate(n=Count("id")).order_by())
    return {health: counts.get(health, 0) for health in GpuHealth.values}


@dataclass
class RackView:
    rack: Rack
    nodes: list[Node] = field(default_factory=list)

    @property
    def gpu_count(self) -> int:
        return sum(node.gpu_count for node in self.nodes)


@dataclass
class SiteView:
    site: Site
    racks: list[RackView] = field(default_factory=list)


@dataclass
class FleetOverview:
    sites: list[SiteView]
    unracked: list[Node]
    node_states: dict[str, int]
    gpu_health: dict[str, int]
    pools: list[NodePool]

    @property
    def node_total(self) -> int:
        return sum(self.node_states.values())


def fleet_overview() -> FleetOverview:
    """Sites → racks → nodes (with their GPUs), and nodes in no rack (cloud), in five queries."""
    nodes = list(
        Node.objects.select_related("pool", "instance_type")
        .prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))
        .order_by("rack_id", "rack_unit", "name")
    )
    by_rack: dict[int, list[Node]] = {}
    unracked = []
    for node in nodes:
        if node.rack_id is None:
            unracked.append(node)
        else:
            by_rack.setdefault(node.rack_id, []).append(node)
    sites = []
    racks = Rack.objects.select_related("site").order_by("site__name", "name")
    site_views: dict[int, SiteView] = {}
    for site in Site.objects.order_by("name"):
        site_views[site.pk] = SiteView(site=site)
        sites.append(site_views[site.pk])
    for rack in racks:
        site_views[rack.site_id].racks.append(RackView(rack=rack, nodes=by_rack.get(rack.pk, [])))
    states = {state: 0 for state in NodeState.values}
    health = {h: 0 for h in GpuHealth.values}
    for node in nodes:
        states[node.state] += 1
        for gpu in node.gpus.all():
            health[gpu.health] += 1
    return FleetOverview(
        sites=sites,
        unracked=unracked,
        node_states=states,
        gpu_health=health,
        pools=list(pools_for_listing()),
    )


@dataclass(frozen=True)
class PoolCapacity:
    """What a pool could ever hold: for submission's "can this job ever run?" check."""

    pool_id: int
    slug: str
    kind: str
    gpu_type: str
    enabled: bool
    # (GPUs per node, how many nodes of that size) over nodes not failed or gone (owned pools)
    node_sizes: tuple[tuple[int, int], ...]
    burst_node_gpus: int  # GPUs of the largest allowed instance type (cloud pools)
    max_nodes: int

    def can_hold(self, *, nodes: int, gpus_per_node: int) -> bool:
        if not self.enabled:
            return False
        if self.kind == "cloud":
            return self.burst_node_gpus >= gpus_per_node and self.max_nodes >= nodes
        return sum(n for gpus, n in self.node_sizes if gpus >= gpus_per_node) >= nodes


# Submission asks "could any pool ever hold this?" on every request; the answer
# changes only when pools or nodes come and go, which the fleet's services announce
# by deleting this key (capacity_changed). The TTL bounds a lost race.
CAPACITY_CACHE_KEY = "fleet:pools-capacity:v2"


def pools_capacity(*, cached: bool = False) -> list[PoolCapacity]:
    """Every pool with the sizes of its nodes, in three queries (a few rows each).

    `cached=True` answers from Django's cache for up to CAPACITY_CACHE_S seconds.
    """
    if cached:
        hit = best_effort.get(CAPACITY_CACHE_KEY)
        if hit is not None:
            return hit
    sizes: dict[int, list[tuple[int, int]]] = {}
    rows = (
        Node.objects.exclude(state__in=GONE_STATES)
        .values_list("pool_id", "gpu_count")
        .annotate(n=Count("id"))
        .order_by()
    )
    for pool_id, gpus, n in rows:
        sizes.setdefault(pool_id, []).append((gpus, n))
    out = []
    for pool in NodePool.objects.prefetch_related("instance_types").order_by("id"):
        instance_gpus = [t.gpu_count for t in pool.instance_types.all()]
        out.append(
            PoolCapacity(
                pool_id=pool.pk,
                slug=pool.slug,
                kind=pool.kind,
                gpu_type=pool.gpu_type,
                enabled=pool.enabled,
                node_sizes=tuple(sorted(sizes.get(pool.pk, ()))),
                burst_node_gpus=max(instance_gpus, default=0),
                max_nodes=pool.max_nodes,
            )
        )
    if cached:
        best_effort.set(CAPACITY_CACHE_KEY, out, settings.CAPACITY_CACHE_S)
    return out


def nodes_among(*, node_ids, states) -> set[int]:
    """Those of these nodes that are in one of `states`."""
    ids = {i for i in node_ids if i}
    if not ids:
        return set()
    return set(Node.objects.filter(pk__in=ids, state__in=states).values_list("pk", flat=True))


def pool_node_among(*, node_id: int | None, states) -> int | None:
    """The first node (by id) of `node_id`'s pool that is in one of `states`, or None."""
    pool_id = Node.objects.filter(pk=node_id).values_list("pool_id", flat=True).first()
    if pool_id is None:
        return None
    return (
        Node.objects.filter(pool_id=pool_id, state__in=states)
        .order_by("pk")
        .values_list("pk", flat=True)
        .first()
    )


def pool_slugs(*, pool_ids) -> dict[int, str]:
    return dict(NodePool.objects.filter(pk__in=pool_ids).values_list("id", "slug"))


def instance_type_names(*, type_ids) -> dict[int, str]:
    return dict(InstanceType.objects.filter(pk__in=type_ids).values_list("id", "name"))


def node_names(*, node_ids) -> dict[int, str]:
    """Node names by id."""
    return dict(Node.objects.filter(pk__in=node_ids).values_list("pk", "name"))


def nodes_by_rack(*, node_ids) -> list[Node]:
    """The nodes, rack by rack and by name within a rack: the order ranks are given in."""
    return list(Node.objects.filter(pk__in=node_ids).order_by("rack_id", "name"))


def pool_names(*, pool_ids) -> dict[int, str]:
    return dict(NodePool.objects.filter(pk__in=pool_ids).values_list("pk", "name"))


def schedulable_node_gpus(*, pool_ids) -> list[tuple[int, int, int]]:
    """(node id, pool id, GPU count) of the nodes the scheduler may place on in these pools."""
    return list(
        Node.objects.filter(pool_id__in=pool_ids, state__in=SCHEDULABLE_STATES).values_list(
            "id", "pool_id", "gpu_count"
        )
    )


def node_get(*, node_id: int) -> Node:
    """One node, fresh from the database (raises Node.DoesNotExist)."""
    return Node.objects.get(pk=node_id)


def node_for_launch(*, node_id: int) -> Node:
    """A cloud node with what launching it reads: its pool, type and burst job's team."""
    return Node.objects.select_related("pool", "instance_type", "burst_job__team").get(pk=node_id)


def local_nodes_live() -> QuerySet[Node]:
    """The local provider's nodes that are not gone."""
    return Node.objects.filter(provider="local").exclude(state__in=GONE_STATES)


def node_ids() -> list[int]:
    """Every node's id, in order."""
    return list(Node.objects.order_by("id").values_list("id", flat=True))


def node_ids_where(condition: Q) -> QuerySet:
    """The ids of the nodes matching `condition` (on a node's fields), as a subquery."""
    return Node.objects.filter(condition).values("id")


def instance_type_ids_by_name() -> dict[str, int]:
    return dict(InstanceType.objects.values_list("name", "id"))


def instance_types_for_listing() -> QuerySet[InstanceType]:
    return InstanceType.objects.order_by("name")


def pools_of_kind(kind: str | None = None) -> QuerySet[NodePool]:
    """The pools (of one kind, owned or cloud, where given) by slug, for a form's choices."""
    pools = NodePool.objects.order_by("slug")
    return pools if kind is None else pools.filter(kind=kind)


# --- what the cost ledger and the price book need of nodes and pools -----------------------


@dataclass(frozen=True)
class NodeBilling:
    """A node's facts that price its time: its pool, type, capacity, size, power, and when it
    began and stopped costing (owned from creation, cloud from launch, to termination)."""

    id: int
    pool_id: int
    instance_type_id: int | None
    capacity_type: str
    gpus: int
    billable_from: dt.datetime | None
    billable_until: dt.datetime | None
    power_w: int | None
    region: str


def nodes_billing(*, node_ids) -> list[NodeBilling]:
    """Two queries for any number of nodes."""
    ends = dict(
        NodeEvent.objects.filter(node_id__in=node_ids, to_state=NodeState.TERMINATED)
        .values_list("node_id")
        .annotate(at=Min("at"))
        .order_by()
    )
    return [
        NodeBilling(
            id=node_id,
            pool_id=pool_id,
            instance_type_id=type_id,
            capacity_type=capacity,
            gpus=gpus,
            billable_from=created_at if capacity == CapacityType.OWNED else launched_at,
            billable_until=ends.get(node_id),
            power_w=measured or nameplate,
            region=region or "",
        )
        for (
            node_id,
            pool_id,
            type_id,
            capacity,
            gpus,
            created_at,
            launched_at,
            measured,
            nameplate,
            region,
        ) in Node.objects.filter(pk__in=node_ids).values_list(
            "id",
            "pool_id",
            "instance_type_id",
            "capacity_type",
            "gpu_count",
            "created_at",
            "launched_at",
            "power_w",
            "nameplate_power_w",
            "pool__region",
        )
    ]


def pools_with_instance_types(*, pool_ids=None) -> dict[int, NodePool]:
    """The pools (every one if no ids are given) by id, their instance types fetched."""
    pools = NodePool.objects.prefetch_related("instance_types").order_by("slug")
    if pool_ids is not None:
        pools = pools.filter(pk__in=list(pool_ids))
    return {pool.pk: pool for pool in pools}


def spot_capable_pools() -> list[NodePool]:
    """Enabled cloud pools that may launch spot, their instance types fetched."""
    return list(
        NodePool.objects.filter(
            kind=PoolKind.CLOUD, enabled=True, capacity_preference="spot_then_on_demand"
        ).prefetch_related("instance_types")
    )


def pool_node_sizes(*, pool_ids, live_only: bool = False) -> list[tuple[int, int, int | None]]:
    """(pool id, GPUs, watts: measured, else nameplate) of each node of these pools; with
    `live_only`, not the terminated or failed ones."""
    nodes = Node.objects.filter(pool_id__in=list(pool_ids))
    if live_only:
        nodes = nodes.exclude(state__in=(NodeState.TERMINATED, NodeState.FAILED))
    return [
        (pool_id, gpus, measured or nameplate)
        for pool_id, gpus, measured, nameplate in nodes.values_list(
            "pool_id", "gpu_count", "power_w", "nameplate_power_w"
        )
    ]


def pools_with_nodes(*, pool_ids) -> set[int]:
    return set(
        Node.objects.filter(pool_id__in=list(pool_ids))
        .order_by()
        .values_list("pool_id", flat=True)
        .distinct()
    )


def schedulable_gpus_by_type() -> dict[str, int]:
    """GPU type -> how many GPUs the schedulable nodes of enabled pools have (one query)."""
    return dict(
        Node.objects.filter(state__in=SCHEDULABLE_STATES, pool__enabled=True)
        .values_list("pool__gpu_type")
        .annotate(gpus=Sum("gpu_count"))
        .order_by()
    )
