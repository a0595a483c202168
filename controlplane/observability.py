"""Liveness (/healthz) and Prometheus metrics (/metrics): fleet state and request counts."""

import hmac
import os
import time

from django.conf import settings
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

REQUESTS = Counter(
    "controlplane_http_requests_total",
    "HTTP requests answered, by method, route and status.",
    ["method", "route", "status"],
)
LATENCY = Histogram(
    "controlplane_http_request_seconds",
    "Time to answer an HTTP request, by route.",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


class RequestMetricsMiddleware:
    """Counts requests by route name (not raw path, which would explode the label set)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        route = (match.view_name if match else "") or "unmatched"
        REQUESTS.labels(request.method, route, str(response.status_code)).inc()
        LATENCY.labels(route).observe(time.perf_counter() - started)
        return response


class FleetCollector:
    """Reads node and GPU counts from the database at scrape time."""

    def collect(self):
        from apps.fleet.selectors import gpu_counts_by_health, node_counts_by_state

        nodes = GaugeMetricFamily(
            "controlplane_nodes", "Nodes in the fleet, by state.", labels=["state"]
        )
        for state, count in node_counts_by_state().items():
            nodes.add_metric([state], count)
        yield nodes
        gpus = GaugeMetricFamily(
            "controlplane_gpus", "GPUs in the fleet, by health.", labels=["health"]
        )
        for health, count in gpu_counts_by_health().items():
            gpus.add_metric([health], count)
        yield gpus


# Each GPU's latest reading (written by the heartbeat flush): name, help, unit scale.
GPU_GAUGES = (
    ("controlplane_gpu_utilization_percent", "GPU utilisation, latest reading.", 1),
    ("controlplane_gpu_memory_used_bytes", "GPU memory in use, latest reading.", 1024 * 1024),
    ("controlplane_gpu_temperature_celsius", "GPU temperature, latest reading.", 1),
    ("controlplane_gpu_power_watts", "GPU power draw, latest reading.", 1),
)


class GpuTelemetryCollector:
    """Each GPU's latest utilisation, memory, temperature and power (one query), the
    series the node page draws over time."""

    def collect(self):
        from apps.fleet.selectors import gpu_latest_readings

        families = [
            GaugeMetricFamily(name, text, labels=["node", "gpu"]) for name, text, _ in GPU_GAUGES
        ]
        for node, index, *readings in gpu_latest_readings():
            labels = [node, str(index)]
            for family, (_, _, scale), value in zip(families, GPU_GAUGES, readings, strict=True):
                if value is not None:
                    family.add_metric(labels, value * scale)
        yield from families


class QueueCollector:
    """Jobs waiting by state and priority class, the longest wait of each class (one
    query), and every team's spend so far (one query and the teams' names)."""

    def collect(self):
        from django.utils import timezone

        from apps.accounts.models import Team
        from apps.costs.selectors import spend_by_team_total
        from apps.jobs.models import PriorityClass
        from apps.jobs.selectors import queue_depth

        depth = GaugeMetricFamily(
            "controlplane_queue_jobs",
            "Jobs waiting in the queue, by state (pending, held) and priority class.",
            labels=["state", "priority"],
        )
        wait = GaugeMetricFamily(
            "controlplane_queue_longest_wait_seconds",
            "How long the longest-waiting pending job of each priority class has waited.",
            labels=["priority"],
        )
        now = timezone.now()
        waits = dict.fromkeys(PriorityClass.values, 0.0)
        for row in queue_depth():
            depth.add_metric([row.state, row.priority_class], row.jobs)
            if row.state == "pending":
                waits[row.priority_class] = (now - row.oldest_queued_at).total_seconds()
        for priority, seconds in waits.items():
            wait.add_metric([priority], max(seconds, 0.0))
        yield depth
        yield wait
        spend = CounterMetricFamily(
            "controlplane_team_spend_dollars",
            'What each team\'s jobs have cost since the ledger began; team "(idle)" is '
            "capacity nobody used.",
            labels=["team"],
        )
        totals = spend_by_team_total()
        slugs = dict(Team.objects.filter(pk__in=list(totals)).values_list("pk", "slug"))
        for team_id, amount in sorted(totals.items()):
            spend.add_metric(
                [slugs.get(team_id, "(idle)" if team_id == 0 else str(team_id))], float(amount)
            )
        yield spend


_registry_cache: CollectorRegistry | None = None


def _registry() -> CollectorRegistry:
    global _registry_cache
    if _registry_cache is None:
        registry = CollectorRegistry()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            # Several gunicorn workers: add up what each process counted.
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(registry)
        else:
            registry.register(REQUESTS)
            registry.register(LATENCY)
        registry.register(FleetCollector())
        registry.register(GpuTelemetryCollector())
        registry.register(QueueCollector())
        _registry_cache = registry
    return _registry_cache


@require_GET
def metrics(request):
    """For Prometheus with METRICS_TOKEN as its bearer token; without one set, for a signed-in
    ops user or superuser only (the fleet's size and every route's traffic are not public)."""
    expected = getattr(settings, "METRICS_TOKEN", "")
    if expected:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return HttpResponse("metrics token required\n", status=401, content_type="text/plain")
    else:
        from apps.accounts.selectors import roles_of

        if not request.user.is_authenticated:
            return HttpResponse("sign in first\n", status=401, content_type="text/plain")
        if not roles_of(request.user).manages_fleet:
            return HttpResponse("ops only\n", status=403, content_type="text/plain")
    return HttpResponse(generate_latest(_registry()), content_type=CONTENT_TYPE_LATEST)


def _database_ok() -> str:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:
        return f"error: {type(exc).__name__}"
    return "ok"


def _broker_ok() -> str:
    from controlplane.celery import app

    url = app.conf.broker_url or ""
    if url.startswith("filesystem://"):
        folder = app.conf.broker_transport_options.get("data_folder_in", "")
        return "ok" if folder and os.access(folder, os.W_OK) else "error: queue folder not writable"
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:
        return f"error: {type(exc).__name__}"
    return "ok"


@require_GET
def healthz(request):
    checks = {"database": _database_ok(), "broker": _broker_ok()}
    healthy = all(value == "ok" for value in checks.values())
    return JsonResponse(
        {"status": "ok" if healthy else "unavailable", **checks}, status=200 if healthy else 503
    )
