"""Reads of the fleet, shaped for the pages, the API and /metrics."""

import datetime as dt
from dataclasses import dataclass, field
from typing import NamedTuple

from django.conf import settings
from django.db.models import (
    Avg,
    Count,
    Exists,
    F,
    Max,
    Min,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce, TruncHour
from django.utils import timezone

from apps.fleet.fabric import MEASURED
from apps.fleet.models import (
    GONE_STATES,
    SCHEDULABLE_STATES,
    Gpu,
    GpuHealth,
    GpuMinute,
    GpuSample,
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
    # Each node's healthy GPUs counted by a subquery, not a join grouped by node: a page of
    # 50 nodes by name then counts 50 nodes' GPUs, not the fleet's 80,000 (bench/pages.py).
    healthy = (
        Gpu.objects.filter(node=OuterRef("pk"), health=GpuHealth.HEALTHY)
        .order_by()
        .values("node")
        .annotate(n=Count("id"))
        .values("n")
    )
    return (
        Node.objects.select_related("pool", "rack", "rack__site", "instance_type")
        .defer("fabric")  # each link's counters: the node's own page shows them
        .annotate(healthy_gpus=Coalesce(Subquery(healthy), 0))
        .order_by("name")
    )


def racks_for_listing() -> QuerySet[Rack]:
    return (
        Rack.objects.select_related("site")
        .annotate(node_count=Count("nodes"))
        .order_by("site__name", "name")
    )


def pools_for_listing() -> QuerySet[NodePool]:
    # Each pool's nodes counted by a subquery (the pool_id index), not a join of the fleet's
    # 10,000 nodes grouped by every pool column: a third of the time (bench/pages.py).
    nodes = (
        Node.objects.filter(pool=OuterRef("pk"))
        .order_by()
        .values("pool")
        .annotate(n=Count("id"))
        .values("n")
    )
    return (
        NodePool.objects.select_related("site")
        .prefetch_related("instance_types")
        .annotate(node_count=Coalesce(Subquery(nodes), 0))
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


class GpuMark(NamedTuple):
    """What a GPU's mark on the Fleet page shows (templatetags/gpus.py): a tuple, not a model
    instance, as the page draws about a thousand."""

    index: int
    health: str
    health_reason: str


@dataclass
class RackView:
    rack: Rack
    nodes: list[Node] = field(default_factory=list)
    gpus: dict[int, list[GpuMark]] = field(default_factory=dict)  # by node id

    @property
    def gpu_count(self) -> int:
        return sum(node.gpu_count for node in self.nodes)

    @property
    def rows(self) -> list[tuple[Node, list[GpuMark]]]:
        return [(node, self.gpus.get(node.pk, [])) for node in self.nodes]


@dataclass
class SiteView:
    site: Site
    racks: list[RackView] = field(default_factory=list)


@dataclass
class FleetOverview:
    sites: list[SiteView]
    unracked: list[Node]
    pools: list[NodePool]
    racks_total: int  # of the racks asked for; at most RACKS_SHOWN are in `sites`
    racks_shown: int
    unracked_total: int  # at most UNRACKED_SHOWN are in `unracked`
    gpus: dict[int, list[GpuMark]] = field(default_factory=dict)  # by node id, of those drawn

    @property
    def unracked_rows(self) -> list[tuple[Node, list[GpuMark]]]:
        return [(node, self.gpus.get(node.pk, [])) for node in self.unracked]


# What the Fleet page draws at most, so that it stays quick at 10,000 nodes: rack
# elevations (with their nodes and GPUs) and cloud nodes; filters narrow to the rest.
RACKS_SHOWN = 8
UNRACKED_SHOWN = 50

# Of a drawn node what the Fleet page shows (its rack elevations and tables).
DRAWN_NODE_FIELDS = (
    "name",
    "pool_id",
    "pool__name",
    "rack_id",
    "rack_unit",
    "capacity_type",
    "instance_type_id",
    "instance_type__name",
    "gpu_count",
    "state",
    "state_reason",
    "fabric_degraded_since",  # the tables' badge
    "fabric_degraded_reason",
)


def gpu_marks_by_node(*, node_ids) -> dict[int, list[GpuMark]]:
    """The marks of these nodes' GPUs by node id, each node's by index: one query."""
    marks: dict[int, list[GpuMark]] = {}
    rows = (
        Gpu.objects.filter(node_id__in=node_ids)
        .order_by("node_id", "index")
        .values_list("node_id", "index", "health", "health_reason")
    )
    for node_id, index, health, reason in rows:
        marks.setdefault(node_id, []).append(GpuMark(index, health, reason))
    return marks


def fleet_overview(*, nodes: QuerySet[Node] | None = None) -> FleetOverview:
    """Sites → racks → nodes (with their GPUs), and nodes in no rack (cloud): the racks
    holding `nodes` (every rack without it), the first RACKS_SHOWN of them, and the first
    UNRACKED_SHOWN nodes in no rack; a bounded number of queries whatever the fleet's size."""
    racks = Rack.objects.select_related("site").order_by("site__name", "name")
    drawn = Node.objects.select_related("pool", "instance_type").only(*DRAWN_NODE_FIELDS)
    unracked = drawn.filter(rack__isnull=True).order_by("name")
    if nodes is not None:
        racks = racks.filter(pk__in=nodes.exclude(rack__isnull=True).values("rack_id"))
        unracked = unracked.filter(pk__in=nodes.values("pk"))
    racks_total = racks.count()
    shown = list(racks[:RACKS_SHOWN])
    racked = list(drawn.filter(rack_id__in=[r.pk for r in shown]).order_by("rack_unit", "name"))
    cloud = list(unracked[:UNRACKED_SHOWN])
    gpus = gpu_marks_by_node(node_ids=[node.pk for node in racked + cloud])
    by_rack: dict[int, list[Node]] = {}
    for node in racked:
        by_rack.setdefault(node.rack_id, []).append(node)
    site_views = {site.pk: SiteView(site=site) for site in Site.objects.order_by("name")}
    for rack in shown:
        site_views[rack.site_id].racks.append(
            RackView(rack=rack, nodes=by_rack.get(rack.pk, []), gpus=gpus)
        )
    return FleetOverview(
        # Every site when every rack is drawn (an empty site says so); else those drawn.
        sites=[
            view
            for view in site_views.values()
            if view.racks or (nodes is None and len(shown) == racks_total)
        ],
        unracked=cloud,
        pools=list(pools_for_listing()),
        racks_total=racks_total,
        racks_shown=len(shown),
        unracked_total=unracked.count(),
        gpus=gpus,
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


# --- one node, and its GPUs over time ----------------------------------------------------------


def node_for_page(*, key: str) -> Node | None:
    """A node by its id or its name, with what its page shows beside it."""
    nodes = Node.objects.select_related("pool", "rack", "rack__site", "instance_type")
    node = nodes.filter(pk=int(key)).first() if key.isdigit() and len(key) < 12 else None
    return node or nodes.filter(name=key).first()


def node_events(*, node: Node, limit: int = 50) -> list:
    return list(node.events.order_by("-at", "-id")[:limit])


def node_fabric_links(*, node: Node) -> list[dict]:
    """The node's links as its last heartbeat read them (apps/fleet/fabric.py): each
    counter's count, rate per minute (None before a second reading or after a reset), limit
    and whether the rate is over it."""
    limits = settings.FABRIC_ERROR_RATE_LIMITS
    links = []
    for name, state in sorted(((node.fabric or {}).get("links") or {}).items()):
        rates, over = state.get("rates") or {}, state.get("over") or {}
        counters = [
            {
                "name": counter,
                "value": value,
                "rate": rates.get(counter),
                "limit": limits.get(counter),
                "over": counter in over,
            }
            for counter, value in sorted((state.get("counters") or {}).items())
        ]
        if counters:
            links.append(
                {
                    "name": name,
                    "counters": counters,
                    "degraded_since": state.get("degraded_since"),
                    "why": state.get("why", ""),
                }
            )
    return links


@dataclass(frozen=True)
class TelemetryWindow:
    """A span of a node's charts: where its points come from and how they are bucketed."""

    name: str
    label: str
    span: dt.timedelta
    source: type  # GpuSample (raw) or GpuMinute
    bucket: str | None  # "hour": the minutes averaged by hour; None: as stored
    x_unit: str  # the x axis: time before now, in these units
    x_seconds: int

    @property
    def resolution(self) -> str:
        """What one point is: "raw" (a heartbeat's reading), "minute" or "hour" (means)."""
        if self.source is GpuSample:
            return "raw"
        return self.bucket or "minute"


TELEMETRY_WINDOWS = {
    w.name: w
    for w in (
        TelemetryWindow("1h", "last hour", dt.timedelta(hours=1), GpuSample, None, "min", 60),
        TelemetryWindow("24h", "last day", dt.timedelta(days=1), GpuMinute, None, "h", 3600),
        TelemetryWindow("7d", "last week", dt.timedelta(days=7), GpuMinute, "hour", "h", 3600),
        TelemetryWindow(
            "30d", "last 30 days", dt.timedelta(days=30), GpuMinute, "hour", "d", 86400
        ),
    )
}
TELEMETRY_METRICS = ("utilization_pct", "memory_used_mib", "temperature_c", "power_w")


def telemetry_window_for(
    *, since: dt.datetime, until: dt.datetime, now: dt.datetime | None = None
) -> TelemetryWindow | None:
    """The Node page's window whose resolution serves `since` to `until`: the shortest that
    spans it, and one of minutes instead of raw samples where those are no longer kept
    (TELEMETRY_RAW_RETENTION_S). None when it is longer than the longest window."""
    now = now or timezone.now()
    raw_kept_since = now - dt.timedelta(seconds=settings.TELEMETRY_RAW_RETENTION_S)
    for window in sorted(TELEMETRY_WINDOWS.values(), key=lambda w: w.span):
        if window.span < until - since:
            continue
        if window.source is GpuSample and since < raw_kept_since:
            continue
        return window
    return None


def _gpu_points(
    *,
    node_id: int,
    window: TelemetryWindow,
    since: dt.datetime,
    until: dt.datetime,
    gpu: int | None = None,
    per_gpu: bool = False,
):
    """A node's GPU readings from `since` to `until` at the window's resolution (as stored,
    or the minutes averaged by hour), in one query: at each point `when`, each metric's mean
    and highest over the GPUs; with `per_gpu`, each GPU's mean at each point instead."""
    rows = window.source.objects.filter(node_id=node_id, at__gte=since, at__lte=until)
    if gpu is not None:
        rows = rows.filter(gpu=gpu)
    when = TruncHour("at", tzinfo=dt.UTC) if window.bucket == "hour" else F("at")
    keys = ("gpu", "when") if per_gpu else ("when",)
    aggregates = {}
    for metric in TELEMETRY_METRICS:
        aggregates[f"{metric}__mean"] = Avg(metric)
        if not per_gpu:
            aggregates[f"{metric}__max"] = Max(metric)
    return rows.annotate(when=when).values(*keys).annotate(**aggregates).order_by(*keys)


def node_gpu_series(
    *, node_id: int, window: TelemetryWindow, now: dt.datetime | None = None
) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """A node's GPU readings over `window` in one query: for each metric, the mean and the
    highest of its GPUs at each point, x being the time before now in the window's unit
    (negative). At most about 1,440 points a series."""
    now = now or timezone.now()
    points = _gpu_points(node_id=node_id, window=window, since=now - window.span, until=now)
    series = {metric: {"mean": [], "highest": []} for metric in TELEMETRY_METRICS}
    for point in points:
        x = (point["when"] - now).total_seconds() / window.x_seconds
        for metric in TELEMETRY_METRICS:
            for name, suffix in (("mean", "mean"), ("highest", "max")):
                value = point[f"{metric}__{suffix}"]
                if value is not None:
                    series[metric][name].append((x, float(value)))
    return series


def node_gpu_telemetry(
    *,
    node_id: int,
    window: TelemetryWindow,
    since: dt.datetime,
    until: dt.datetime,
    gpu: int | None = None,
) -> list[dict]:
    """Each GPU's readings from `since` to `until` at the window's resolution (the Node
    page's, telemetry_window_for), in one query: [{"gpu", "points": [{"at", metrics...}]}],
    GPUs by index, points oldest first; an hour's point is the mean of its minutes."""
    gpus: dict[int, list[dict]] = {}
    for point in _gpu_points(
        node_id=node_id, window=window, since=since, until=until, gpu=gpu, per_gpu=True
    ):
        reading = {"at": point["when"]}
        for metric in TELEMETRY_METRICS:
            value = point[f"{metric}__mean"]
            reading[metric] = None if value is None else round(float(value), 1)
        gpus.setdefault(point["gpu"], []).append(reading)
    return [{"gpu": index, "points": points} for index, points in gpus.items()]


# --- the heat map of GPUs ----------------------------------------------------------------------

HEAT_MAP_MAX_NODES = 500  # 4,000 GPUs; past it the page asks for a narrower filter


class HeatCell(NamedTuple):
    """One GPU of the heat map (a tuple: the map has thousands, made per request)."""

    node_id: int
    node_name: str
    index: int
    health: str
    utilization_pct: float | None
    temperature_c: float | None
    power_w: float | None
    memory_used_mib: int | None
    memory_mib: int
    holder: object | None  # extensions.GpuHolder, or None when free


class HeatNode(NamedTuple):
    """A node of the heat map: its id and name (a tuple, not a model instance: a map has
    hundreds)."""

    pk: int
    name: str


@dataclass
class HeatMap:
    nodes: list[tuple[HeatNode, list[HeatCell]]]
    total_nodes: int

    @property
    def truncated(self) -> bool:
        return self.total_nodes > len(self.nodes)


def gpu_heat_map(*, nodes: QuerySet[Node], limit: int = HEAT_MAP_MAX_NODES) -> HeatMap:
    """Every GPU of these nodes (the first `limit` by name), with its latest reading and
    the job holding it: three queries however many nodes and GPUs."""
    from apps.fleet.extensions import gpu_holders

    shown = [
        HeatNode(*row) for row in nodes.order_by("name").values_list("id", "name")[: limit + 1]
    ]
    total = len(shown) if len(shown) <= limit else nodes.count()
    shown = shown[:limit]
    ids = [node.pk for node in shown]
    holders = gpu_holders(node_ids=ids) if ids else {}
    gpus: dict[int, list[HeatCell]] = {}
    rows = (
        Gpu.objects.filter(node_id__in=ids)
        .order_by("node_id", "index")
        .values_list(
            "node_id",
            "index",
            "health",
            "utilization_pct",
            "temperature_c",
            "power_w",
            "memory_used_mib",
            "memory_mib",
        )
    )
    names = {node.pk: node.name for node in shown}
    free: dict = {}
    for node_id, index, health, util, temp, power, used, total_mib in rows:
        # By position, in HeatCell's order: keywords cost more, 4,000 times.
        gpus.setdefault(node_id, []).append(
            HeatCell(
                node_id,
                names[node_id],
                index,
                health,
                util,
                temp,
                power,
                used,
                total_mib,
                holders.get(node_id, free).get(index),
            )
        )
    return HeatMap(nodes=[(node, gpus.get(node.pk, [])) for node in shown], total_nodes=total)


def gpu_latest_readings():
    """(node name, GPU index, utilisation %, memory used MiB, °C, W) of every GPU that has
    reported, on nodes not gone: one query, streamed (a fleet has 80,000)."""
    return (
        Gpu.objects.filter(reported_at__isnull=False)
        .exclude(node__state__in=GONE_STATES)
        .order_by("node__name", "index")
        .values_list(
            "node__name", "index", "utilization_pct", "memory_used_mib", "temperature_c", "power_w"
        )
        .iterator(chunk_size=5000)
    )


def pool_by_key(key) -> NodePool | None:
    """A pool by id (an int) or slug."""
    lookup = {"pk": key} if isinstance(key, int) else {"slug": str(key)}
    return NodePool.objects.filter(**lookup).first()


def nodes_named(*, names) -> dict[str, Node]:
    """The nodes of these names that are not gone, by name."""
    return {
        n.name: n for n in Node.objects.filter(name__in=list(names)).exclude(state__in=GONE_STATES)
    }


def pool_nodes_in(*, pool_id: int, states) -> list[Node]:
    return list(Node.objects.filter(pool_id=pool_id, state__in=list(states)).order_by("name"))


def nodes_measured_slow(*, pool_id: int) -> dict[int, str]:
    """The pool's nodes a drift check marked slow (apps/fleet/fabric.py MEASURED): id → name."""
    return dict(
        Node.objects.filter(pool_id=pool_id, fabric_degraded_reason__startswith=MEASURED)
        .order_by("name")
        .values_list("pk", "name")
    )


def nodes_back_from_repair(*, pool_id: int) -> list[str]:
    """Names of the pool's ready nodes that a drift check marked slow and that were drained
    after it (for their repair) and are back: each is due a check of its own."""
    drained_since = NodeEvent.objects.filter(
        node=OuterRef("pk"), to_state=NodeState.DRAINED, at__gt=OuterRef("fabric_degraded_since")
    )
    return list(
        Node.objects.filter(
            pool_id=pool_id, state=NodeState.READY, fabric_degraded_reason__startswith=MEASURED
        )
        .filter(Exists(drained_since))
        .order_by("name")
        .values_list("name", flat=True)
    )
