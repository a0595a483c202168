"""Fleet pages: the overview of sites, racks, nodes and GPUs, and its CSV export."""

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from apps.fleet.filtersets import NodeFilterSet
from apps.fleet.selectors import fleet_overview, nodes_for_listing
from controlplane.exports import csv_response

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


@login_required
def overview(request):
    nodes = NodeFilterSet(request.GET, queryset=nodes_for_listing())
    return render(
        request,
        "fleet/overview.html",
        {"fleet": fleet_overview(), "node_filter": nodes, "nodes": nodes.qs},
    )


@login_required
def nodes_csv(request):
    nodes = NodeFilterSet(request.GET, queryset=nodes_for_listing())
    rows = nodes.qs.iterator(chunk_size=2000) if nodes.is_valid() else []
    return csv_response(
        "nodes.csv",
        [name for name, _ in NODE_CSV_COLUMNS],
        ([value(node) for _, value in NODE_CSV_COLUMNS] for node in rows),
    )
