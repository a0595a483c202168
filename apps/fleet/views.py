"""Fleet pages: the overview of sites, racks, nodes and GPUs (with its heat map of every
GPU and its CSV export), and a node's page with the actions ops take on it."""

from operator import attrgetter

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from apps.accounts.selectors import roles_of
from apps.fleet import services
from apps.fleet.extensions import gpu_holders
from apps.fleet.filtersets import NodeFilterSet
from apps.fleet.hostkeys import host_key_fingerprint_or_blank
from apps.fleet.models import Node, NodeState
from apps.fleet.selectors import (
    TELEMETRY_WINDOWS,
    fleet_overview,
    gpu_counts_by_health,
    gpu_heat_map,
    node_counts_by_state,
    node_events,
    node_fabric_links,
    node_for_page,
    node_gpu_series,
    nodes_for_listing,
)
from controlplane import charts
from controlplane.errors import ApplicationError
from controlplane.exports import csv_response

S = NodeState

NODE_CSV_COLUMNS = [
    ("name", lambda n: n.name),
    ("pool", lambda n: n.pool.slug),
    ("site", lambda n: n.rack.site.slug if n.rack else ""),
    ("rack", lambda n: n.rack.name if n.rack else ""),
    ("rack_unit", lambda n: n.rack_unit or ""),
    ("provider", lambda n: n.provider),
    ("capacity_type", lambda n: n.capacity_type),
    ("instance_type", lambda n: n.instance_type.name if n.instance_type else ""),
    ("gpu_type", lambda n: n.gpu_type),
    ("gpu_count", lambda n: n.gpu_count),
    ("healthy_gpus", lambda n: n.healthy_gpus),
    ("state", lambda n: n.state),
    ("state_reason", lambda n: n.state_reason),
    ("job_isolation", lambda n: n.job_isolation),
    ("last_heartbeat_at", lambda n: n.last_heartbeat_at.isoformat() if n.last_heartbeat_at else ""),
]


NODES_PAGE_SIZE = 50

# The page's filters by id stay for links and scripts (`?pool_id=3`), as hidden fields.
ID_FILTERS = ("pool_id", "rack_id", "site_id")


@login_required
def overview(request):
    nodes = NodeFilterSet(request.GET, queryset=nodes_for_listing())
    filtered = any(request.GET.get(name) for name in nodes.filters)
    page = Paginator(nodes.qs, NODES_PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "fleet/overview.html",
        {
            "fleet": fleet_overview(nodes=nodes.qs if filtered and nodes.is_valid() else None),
            "filtered": filtered,
            "node_filter": nodes,
            "nodes": page.object_list,
            "page": page,
            "querystring": query.urlencode(),
            "id_filters": ID_FILTERS,
            **_live_context(request),
        },
    )


@login_required
def overview_live(request):
    """The Fleet page's live region: nodes by state, GPUs by health, and the heat map."""
    return render(request, "fleet/_live.html", _live_context(request))


HEAT_MODES = {"utilization": "Utilisation", "temperature": "Temperature"}


def _bucket(value: float | None, low: float, high: float) -> str:
    if value is None:
        return "heat-none"
    return f"heat-{max(0, min(10, round((value - low) / (high - low) * 10)))}"


def _visible(holder, roles):
    """The holder if the user may see its job (their team's, or every team's), else None."""
    if holder is not None and (roles.sees_every_team or holder.team_id in roles.team_ids):
        return holder
    return None


def _holder_text(holder, roles) -> str:
    if holder is None:
        return "free"
    shown = _visible(holder, roles)
    return f"job {shown.job_id} {shown.job_name}" if shown else "another team's job"


def _cell_label(cell, holder: str) -> str:
    parts = [f"{cell.node_name} GPU {cell.index}", holder]
    if cell.utilization_pct is not None:
        parts.append(f"{cell.utilization_pct:.0f}% busy")
    if cell.temperature_c is not None:
        parts.append(f"{cell.temperature_c:.0f} °C")
    if cell.power_w is not None:
        parts.append(f"{cell.power_w:.0f} W")
    if cell.health not in ("healthy", "unknown"):
        parts.append(cell.health)
    return " · ".join(parts)


def _live_context(request) -> dict:
    mode = request.GET.get("heat", "")
    mode = mode if mode in HEAT_MODES else "utilization"
    filtered = NodeFilterSet(request.GET, queryset=Node.objects.all())
    heat = gpu_heat_map(nodes=filtered.qs if filtered.is_valid() else Node.objects.none())
    roles = roles_of(request.user)
    if mode == "temperature":
        reading, low, high = attrgetter("temperature_c"), 30, 90
    else:
        reading, low, high = attrgetter("utilization_pct"), 0, 100
    groups = []
    for node, cells in heat.nodes:
        href = reverse("fleet:node", args=[node.pk])
        drawn = []
        for cell in cells:
            classes = _bucket(reading(cell), low, high)
            classes += " free" if cell.holder is None else " held"
            if cell.health in ("degraded", "failed"):
                classes += f" health-{cell.health}"
            drawn.append((classes, href, _cell_label(cell, _holder_text(cell.holder, roles))))
        groups.append((node.name, href, drawn))
    query = request.GET.copy()
    query.pop("heat", None)
    states = node_counts_by_state()
    return {
        "node_states": states,
        "node_total": sum(states.values()),
        "gpu_health": gpu_counts_by_health(),
        "heat": heat,
        "heat_map": charts.heat_grid(groups),
        "heat_mode": mode,
        "heat_mode_label": HEAT_MODES[mode],
        "heat_modes": HEAT_MODES,
        "filter_query": query.urlencode(),
        "live_query": request.GET.urlencode(),
    }


@login_required
def nodes_csv(request):
    nodes = NodeFilterSet(request.GET, queryset=nodes_for_listing())
    rows = nodes.qs.iterator(chunk_size=2000) if nodes.is_valid() else []
    return csv_response(
        "nodes.csv",
        [name for name, _ in NODE_CSV_COLUMNS],
        ([value(node) for _, value in NODE_CSV_COLUMNS] for node in rows),
    )


# --- a node's page --------------------------------------------------------------------


def _node_or_404(key: str):
    node = node_for_page(key=key)
    if node is None:
        raise Http404("No such node.")
    return node


def _chart_set(node, window) -> list:
    series = node_gpu_series(node_id=node.pk, window=window)

    def x_format(value: float) -> str:
        return f"{value:g} {window.x_unit}" if value else "now"

    specs = (
        ("utilization_pct", "GPU utilisation (%)", lambda v: f"{v:g}%"),
        ("memory_used_mib", "GPU memory used (GiB)", None),
        ("temperature_c", "GPU temperature (°C)", lambda v: f"{v:g}"),
        ("power_w", "GPU power (W)", lambda v: f"{v:g}"),
    )
    drawn = []
    for metric, title, y_format in specs:
        lines = series[metric]
        if metric == "memory_used_mib":
            lines = {name: [(x, y / 1024) for x, y in values] for name, values in lines.items()}
        drawn.append(
            charts.line_chart(
                lines,
                title=f"{title} · {window.label}",
                y_format=y_format or charts.compact_number,
                x_format=x_format,
            )
        )
    return drawn


def _node_context(request, node) -> dict:
    window = TELEMETRY_WINDOWS.get(request.GET.get("window", ""), TELEMETRY_WINDOWS["1h"])
    roles = roles_of(request.user)
    holders = gpu_holders(node_ids=[node.pk]).get(node.pk, {})
    gpus = [
        (gpu, holders.get(gpu.index), _visible(holders.get(gpu.index), roles))
        for gpu in node.gpus.order_by("index")
    ]
    return {
        "node": node,
        "gpus": gpus,
        "events": node_events(node=node),
        "fabric_links": node_fabric_links(node=node),
        "charts": _chart_set(node, window),
        "window": window,
        "windows": TELEMETRY_WINDOWS.values(),
        "gone": node.state == S.TERMINATED,
    }


@login_required
def node_detail(request, key: str):
    node = _node_or_404(key)
    state = node.state
    return render(
        request,
        "fleet/node.html",
        {
            **_node_context(request, node),
            "manages_fleet": roles_of(request.user).manages_fleet,
            "can_drain": state in (S.READY, S.BUSY, S.SUSPECT, S.DOWN),
            "can_undrain": state in (S.DRAINING, S.DRAINED),
            "can_accept_host_key": state == S.AWAITING_HOST_KEY and bool(node.offered_host_key),
            "can_provision": state
            in (S.REQUESTED, S.FAILED, S.DRAINED, S.BOOTSTRAPPING, S.PROVISIONING),
            "can_terminate": state not in (S.BUSY, S.DRAINING, S.TERMINATED),
            "offered_fingerprint": host_key_fingerprint_or_blank(node.offered_host_key),
        },
    )


@login_required
def node_live(request, key: str):
    """The node page's live region: state, GPUs and their holders, charts and events."""
    return render(request, "fleet/_node_live.html", _node_context(request, _node_or_404(key)))


def _drain(request, node):
    services.node_drain(node=node, reason=request.POST.get("reason", ""), by=request.user)
    return f"{node.name} drained (or draining until its jobs end)."


def _undrain(request, node):
    services.node_undrain(node=node, by=request.user)
    return f"{node.name} is back in service."


def _accept_host_key(request, node):
    services.node_host_key_accept(
        node=node, fingerprint=request.POST.get("fingerprint", ""), by=request.user
    )
    return f"Host key of {node.name} accepted; it is being bootstrapped."


def _provision(request, node):
    services.node_provision(node=node, by=request.user)
    return f"{node.name} will be provisioned by a worker."


def _terminate(request, node):
    if request.POST.get("confirm", "").strip() != node.name:
        raise ApplicationError(f"Type the node's name, {node.name}, to terminate it.")
    services.node_terminate(node=node, reason=request.POST.get("reason", ""), by=request.user)
    return f"{node.name} is terminating."


NODE_ACTIONS = {
    "drain": _drain,
    "undrain": _undrain,
    "accept-host-key": _accept_host_key,
    "provision": _provision,
    "terminate": _terminate,
}


@login_required
@require_POST
def node_operate(request, key: str, action: str):
    """One of ops' actions on a node, through the fleet's services; back to its page."""
    node = _node_or_404(key)
    if action not in NODE_ACTIONS:
        raise Http404("No such action.")
    if not roles_of(request.user).manages_fleet:
        raise PermissionDenied("Only ops may change the fleet.")
    try:
        messages.success(request, NODE_ACTIONS[action](request, node))
    except ApplicationError as exc:
        messages.error(request, exc.message)
    return redirect("fleet:node", key=node.pk)
