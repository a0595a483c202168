"""Services for node agents: node tokens, registration, heartbeats and node health.

A heartbeat is the fleet's most frequent write (10,000 nodes every few seconds),
so it only lands in the cache (`node_heartbeat_land`); the sweep task writes
what landed to the database in batches (`nodes_heartbeats_flush`, GPU readings kept
over time included: apps/fleet/telemetry.py), moves nodes
whose heartbeats resumed back from SUSPECT (and DOWN ones through their health
checks), and drains nodes that fail a health check, but never more than a fifth
of a pool.
"""

import datetime as dt
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from django.db import DatabaseError, transaction
from django.db.models import Count, Q
from django.utils import timezone

from apps.accounts.secrets import decrypt, encrypt
from apps.fleet import fabric, telemetry
from apps.fleet import services as fleet
from apps.fleet.models import GONE_STATES, Gpu, GpuHealth, Node, NodeState
from controlplane.bulk import update_rows
from controlplane.celery import enqueue_on_commit
from controlplane.errors import ApplicationError
from controlplane.exactcache import ExactCache

log = logging.getLogger(__name__)
S = NodeState

NODE_TOKEN_PREFIX = "cpn_"  # noqa: S105 (a prefix, not a secret)
# The share of a pool that automatic health drains may take out of service (Karpenter's
# node repair stops at 20% too): past it, a failing node is reported, not drained.
AUTO_DRAIN_LIMIT = 0.2
# Nodes whose agents report, and whose heartbeats the flush reads.
REPORTING = (S.BOOTSTRAPPING, S.READY, S.BUSY, S.SUSPECT, S.DOWN, S.DRAINING, S.DRAINED)

_tokens = ExactCache("fleet:node-token", max_timeout_s=settings.NODE_TOKEN_CACHE_S)


def _digest(raw: str) -> str:
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def _heartbeat_key(node_id: int) -> str:
    return f"fleet:heartbeat:{node_id}"


# --- tokens ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentIdentity:
    """Who a node token stands for: what the agent endpoints need, no more."""

    node_id: int
    node_uuid: str
    name: str
    bootstrap: bool = False  # the token of a cloud node's user data: registration only


def node_agent_token_issue(*, node: Node) -> str:
    """A new token for the node's agent; the old one stops working. Returns the secret,
    which is stored only as its SHA-256 and handed to bootstrap (agent.env, mode 600)."""
    raw = NODE_TOKEN_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if locked.agent_token_digest:
            _tokens.forget([locked.agent_token_digest])
        locked.agent_token_digest = _digest(raw)
        locked.save(update_fields=["agent_token_digest"])
    node.agent_token_digest = locked.agent_token_digest
    return raw


def node_bootstrap_token(*, node: Node) -> str:
    """The token a cloud node's instance carries in its user data.

    Any process on the instance can read user data from the metadata service, so it is
    good for one thing only: the agent's registration, which answers with a token of the
    node's own (node_agent_register) and retires it once that one is used. It is drawn at
    random the first time and kept encrypted, so a launch re-driven after a lost task
    writes the same user data as the first (EC2's ClientToken needs identical parameters).
    """
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if locked.bootstrap_token_ciphertext:
            return decrypt(locked.bootstrap_token_ciphertext)
        raw = NODE_TOKEN_PREFIX + secrets.token_urlsafe(32)
        if locked.agent_registered_at is not None:
            return raw  # registered already: a launch now gets a token that opens nothing
        locked.bootstrap_token_digest = _digest(raw)
        locked.bootstrap_token_ciphertext = encrypt(raw)
        locked.save(update_fields=["bootstrap_token_digest", "bootstrap_token_ciphertext"])
    return raw


def _bootstrap_token_retire(node_id: int, digest: str) -> None:
    """The node's own token is in use: the one its user data carried opens nothing more."""
    retired = Node.objects.filter(pk=node_id, bootstrap_token_digest=digest).update(
        bootstrap_token_digest="", bootstrap_token_ciphertext=b""
    )
    if retired:
        _tokens.forget([digest])


def node_agent_token_revoke(*, node: Node) -> None:
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(pk=node.pk)
        if locked.agent_token_digest:
            _tokens.forget([locked.agent_token_digest])
            locked.agent_token_digest = ""
            locked.save(update_fields=["agent_token_digest"])


def agent_identity(raw: str) -> AgentIdentity | None:
    """The node a token belongs to, or None. Terminated nodes have no agent."""
    if not raw.startswith(NODE_TOKEN_PREFIX):
        return None
    digest = _digest(raw)
    identity = _tokens.recall(digest)
    if identity is not None:
        return identity
    row = (
        Node.objects.filter(Q(agent_token_digest=digest) | Q(bootstrap_token_digest=digest))
        .exclude(state__in=(S.TERMINATING, S.TERMINATED))
        .values_list("id", "uuid", "name", "bootstrap_token_digest")
        .first()
    )
    if row is None:
        return None
    node_id, uuid, name, bootstrap_digest = row
    bootstrap = bootstrap_digest == digest
    if bootstrap_digest and not bootstrap:
        _bootstrap_token_retire(node_id, bootstrap_digest)
    identity = AgentIdentity(node_id=node_id, node_uuid=str(uuid), name=name, bootstrap=bootstrap)
    _tokens.remember(digest, identity)
    return identity


# --- health ------------------------------------------------------------------------------------


def health_problems(*, node_gpus: int, report: dict) -> list[str]:
    """What is wrong with a node, from its agent's report; [] when healthy."""
    problems = []
    found = report.get("metrics") or {}
    source = found.get("source")
    gpus = found.get("gpus") or []
    if node_gpus and source == "none":
        problems.append(found.get("message") or "no GPU driver found")
    elif node_gpus and source == "nvidia-smi" and found.get("message"):
        problems.append(str(found["message"])[:200])
    elif node_gpus and len(gpus) != node_gpus:
        problems.append(f"{len(gpus)} GPUs found, {node_gpus} expected")
    for gpu in gpus:
        index = gpu.get("index")
        errors = gpu.get("ecc_errors")
        if errors:
            problems.append(f"GPU {index}: {errors} uncorrected ECC errors")
        temperature = gpu.get("temperature_c")
        if temperature is not None and temperature > settings.GPU_MAX_TEMPERATURE_C:
            problems.append(
                f"GPU {index}: {temperature:.0f} °C, above {settings.GPU_MAX_TEMPERATURE_C} °C"
            )
    free = report.get("disk_free_bytes")
    need = settings.NODE_MIN_FREE_DISK_GB * 1024**3
    if free is not None and free < need:
        problems.append(
            f"{free / 1024**3:.1f} GiB free for checkpoints, "
            f"{settings.NODE_MIN_FREE_DISK_GB} GiB needed"
        )
    return problems


def _drain_allowed(node: Node) -> bool:
    counts = (
        Node.objects.filter(pool_id=node.pool_id)
        .exclude(state__in=GONE_STATES)
        .aggregate(total=Count("id"), out=Count("id", filter=Q(state__in=(S.DRAINING, S.DRAINED))))
    )
    return (counts["out"] + 1) <= AUTO_DRAIN_LIMIT * counts["total"]


def _auto_drain(node: Node, problems: list[str]) -> str:
    """Drain a failing node if the pool can spare it; returns what happened, for the log."""
    reason = "health: " + "; ".join(problems)
    if node.state not in (S.READY, S.BUSY, S.SUSPECT):
        return "not drained (not in service)"
    if not _drain_allowed(node):
        log.warning("%s fails health checks but its pool is at the drain limit: %s", node, reason)
        return "not drained: pool at the automatic drain limit"
    fleet.node_drain(node=node, reason=reason[:300], by=None)
    return "drained"


# --- registration ------------------------------------------------------------------------------


def _gpu_rows(node: Node, report: dict, *, now) -> None:
    """Create or refresh the node's GPU rows from what the agent found."""
    found = (report.get("metrics") or {}).get("gpus") or []
    existing = {gpu.index: gpu for gpu in node.gpus.all()}
    for item in found:
        index = item.get("index")
        if not isinstance(index, int) or not 0 <= index <= 63:
            continue
        gpu = existing.get(index) or Gpu(node=node, index=index)
        gpu.uuid = str(item.get("uuid") or gpu.uuid)[:64]
        gpu.model = str(item.get("name") or gpu.model)[:100]
        if item.get("memory_total_mib") is not None:
            gpu.memory_mib = int(item["memory_total_mib"])
        gpu.health = GpuHealth.HEALTHY
        gpu.health_reason = ""
        gpu.reported_at = now
        gpu.save()


def isolation_problems(*, provider: str, report: dict) -> list[str]:
    """Owned and cloud nodes must run every job as its own user (workers/agent/isolation.py);
    local nodes are for development and may not (the scheduler keeps one team per node)."""
    found = report.get("isolation") if isinstance(report.get("isolation"), dict) else {}
    if provider == "local" or found.get("mode") == "user":
        return []
    why = str(found.get("reason") or "the agent did not say it can")[:200]
    return [f"jobs cannot run as their own users: {why}"]


@transaction.atomic
def node_agent_register(*, identity: AgentIdentity, report: dict) -> dict:
    """The agent started: record what it is and found; a bootstrapping (or DOWN) node
    becomes READY if it passes its health checks, FAILED (with why) if not."""
    node = Node.objects.select_for_update().get(pk=identity.node_id)
    now = timezone.now()
    heard_last = node.last_heartbeat_at
    node.agent_version = str(report.get("version", ""))[:20]
    node.agent_hostname = str(report.get("hostname", ""))[:255]
    node.nccl_version = str(report.get("nccl_version") or "")[:20]
    node.agent_registered_at = now
    node.last_heartbeat_at = now
    isolation = report.get("isolation") if isinstance(report.get("isolation"), dict) else {}
    node.job_isolation = isolation.get("mode") if isolation.get("mode") in ("user", "none") else ""
    node.save(
        update_fields=[
            "agent_version",
            "agent_hostname",
            "nccl_version",
            "agent_registered_at",
            "last_heartbeat_at",
            "job_isolation",
        ]
    )
    _gpu_rows(node, report, now=now)
    problems = health_problems(node_gpus=node.gpu_count, report=report)
    problems += isolation_problems(provider=node.provider, report=report)
    if node.state == S.DOWN:
        _node_back(node, heard_last=heard_last, now=now, problems=problems)
    elif node.state == S.BOOTSTRAPPING:
        if problems:
            fleet.node_transition(
                node=node, to=S.FAILED, reason=("health: " + "; ".join(problems))[:300], by=None
            )
        else:
            node_progress(node=node, step="ready", percent=100, message="agent registered")
            fleet.node_transition(node=node, to=S.READY, reason="agent registered", by=None)
    elif problems:
        _auto_drain(node, problems)
    upgrade = version_older(node.agent_version, settings.AGENT_VERSION)
    if upgrade and node.provider in ("local", "ssh"):
        _upgrade_soon(node.pk)
    answer = {
        "heartbeat_every_s": settings.AGENT_HEARTBEAT_S,
        "latest_version": settings.AGENT_VERSION,
        "upgrade": upgrade,
        "problems": problems,
    }
    if identity.bootstrap:
        # The user data's token is readable on the instance: the agent takes its own, and
        # the first request made with it retires the old one (a lost answer costs nothing:
        # the agent registers again with the old token and gets another).
        answer["token"] = node_agent_token_issue(node=node)
    return answer


def _node_back(node: Node, *, heard_last, now, problems: list[str]) -> Node:
    """A DOWN node's agent answers again. Its jobs were requeued when it went DOWN, so it
    comes back as a fresh node would: checked, then READY, or FAILED (for ops) with why; one
    that ops were draining when it went quiet comes back DRAINED, as they left it."""
    silent = f" after {(now - heard_last).total_seconds():.0f}s" if heard_last else ""
    drained = node.suspect_from in (S.DRAINING, S.DRAINED)
    node = fleet.node_transition(
        node=node, to=S.BOOTSTRAPPING, reason=f"agent back{silent}", by=None
    )
    if problems:
        why = "health checks failed on return: " + "; ".join(problems)
        return fleet.node_transition(node=node, to=S.FAILED, reason=why[:300], by=None)
    if drained:
        return fleet.node_transition(
            node=node,
            to=S.DRAINED,
            reason="health checks passed; drained before it went down, so it stays drained",
            by=None,
        )
    return fleet.node_transition(node=node, to=S.READY, reason="health checks passed", by=None)


def version_older(version: str, than: str) -> bool:
    """Whether agent `version` is older than `than` (numbers compared; unreadable is older)."""

    def parts(text: str) -> tuple[int, ...] | None:
        try:
            return tuple(int(p) for p in text.split("."))
        except ValueError:
            return None

    mine, theirs = parts(version), parts(than)
    return theirs is not None and (mine is None or mine < theirs)


def _upgrade_soon(node_id: int) -> None:
    """Once this commits, ask a worker to put the shipped agent on the node (when idle)."""
    enqueue_on_commit("fleet.agent_upgrade", node_id, covered_by="the next registration")


def node_progress(*, node: Node, step: str, percent: int, message: str) -> None:
    """Provisioning progress, for the Fleet page and the API (no event: it is not a state)."""
    Node.objects.filter(pk=node.pk).update(
        provision_step=step[:50],
        provision_percent=max(0, min(100, int(percent))),
        provision_message=message[:300],
    )


# --- heartbeats --------------------------------------------------------------------------------


def _number(value, *, low=0.0, high=1e9):
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value if low <= value <= high else None


MAX_RUNS_LISTED = 256


def _run_ids(value) -> list[int] | None:
    """The runs an agent says it holds; None when it does not say (an older agent), which
    is not the same as an empty list."""
    if not isinstance(value, list) or len(value) > MAX_RUNS_LISTED:
        return None
    return [i for i in value if isinstance(i, int) and not isinstance(i, bool) and 0 < i < 2**63]


def _compact(report: dict) -> dict:
    """Only what the flush writes, checked for type and range (an agent is not trusted)."""
    found = report.get("metrics") if isinstance(report.get("metrics"), dict) else {}
    gpus = []
    for gpu in (found.get("gpus") or [])[:64]:
        if not isinstance(gpu, dict) or not isinstance(gpu.get("index"), int):
            continue
        gpus.append(
            {
                "index": gpu["index"],
                "utilization": _number(gpu.get("utilization"), high=100),
                "memory_used_mib": _number(gpu.get("memory_used_mib"), high=10_000_000),
                "memory_total_mib": _number(gpu.get("memory_total_mib"), high=10_000_000),
                "power_w": _number(gpu.get("power_w"), high=100_000),
                "temperature_c": _number(gpu.get("temperature_c"), low=-50, high=200),
                "ecc_errors": _number(gpu.get("ecc_errors"), high=2**31 - 1),
            }
        )
    return {
        "seq": _number(report.get("seq"), high=2**62),
        "have": _run_ids(report.get("have")),
        "version": str(report.get("version", ""))[:20],
        "nccl_version": str(report.get("nccl_version") or "")[:20],
        "disk_free_bytes": _number(report.get("disk_free_bytes"), high=2**62),
        "metrics": {
            "source": str(found.get("source", ""))[:20],
            "message": str(found.get("message", ""))[:200],
            "gpus": gpus,
        },
        "fabric": fabric.fabric_compact(report.get("fabric")),
    }


def node_heartbeat_land(*, identity: AgentIdentity, report: dict) -> None:
    """Keep the newest heartbeat in the cache; the flush writes it to the database."""
    if not isinstance(report, dict):
        raise ApplicationError(
            "A heartbeat is a JSON object.", details={"body": ["Not an object."]}
        )
    entry = (time.time(), _compact(report))
    cache.set(_heartbeat_key(identity.node_id), entry, timeout=2 * settings.NODE_DOWN_AFTER_S)


def nodes_heartbeats_flush(*, now: dt.datetime | None = None) -> dict[str, int]:
    """Write the heartbeats that landed since the last flush, in bulk; then act on them.

    Returns counts: written, resumed (SUSPECT nodes back), drained (failed health), back
    (DOWN nodes heard from again, checked and returned to service or FAILED).
    """
    now = now or timezone.now()
    nodes = {
        row[0]: row[1:]
        for row in Node.objects.filter(state__in=REPORTING).values_list(
            "id",
            "state",
            "last_heartbeat_at",
            "gpu_count",
            "provider",
            "job_isolation",
            "fabric",
            "fabric_degraded_since",
        )
    }
    if not nodes:
        return {"written": 0, "resumed": 0, "drained": 0, "back": 0}
    landed = cache.get_many([_heartbeat_key(node_id) for node_id in nodes])
    node_rows, gpu_rows, samples, fresh, failing, back = [], [], [], [], [], []
    fabric_rows, degraded, recovered = [], [], []
    for node_id, (state, last, gpu_count, provider, isolation, links, since) in nodes.items():
        entry = landed.get(_heartbeat_key(node_id))
        if entry is None:
            continue
        at = dt.datetime.fromtimestamp(entry[0], tz=dt.UTC)
        if last is not None and at <= last:
            continue  # already written
        report = entry[1]
        gpus = report["metrics"]["gpus"]
        power = [g["power_w"] for g in gpus if g["power_w"] is not None]
        node_rows.append(
            (
                node_id,
                at,
                round(sum(power)) if power else None,
                report["disk_free_bytes"],
                report["nccl_version"],
                report["version"],
            )
        )
        gpu_rows.extend(
            (
                node_id,
                g["index"],
                g["utilization"],
                None if g["memory_used_mib"] is None else int(g["memory_used_mib"]),
                g["power_w"],
                g["temperature_c"],
                None if g["ecc_errors"] is None else int(g["ecc_errors"]),
                at,
            )
            for g in gpus
        )
        samples.extend(telemetry.sample_row(node_id, at, g) for g in gpus)
        if report.get("fabric") or links:
            record = fabric.fabric_update(
                previous=links, counters=report.get("fabric") or {}, at=entry[0]
            )
            fabric_rows.append((node_id, record))
            now_degraded = bool(fabric.degraded_links(record))
            if now_degraded and since is None:
                degraded.append((node_id, record))
            elif since is not None and not now_degraded:
                recovered.append(node_id)
        fresh.append((node_id, state))
        problems = health_problems(node_gpus=gpu_count, report=report)
        if problems and state in (S.READY, S.BUSY, S.SUSPECT):
            failing.append((node_id, problems))
        if state == S.DOWN:
            problems += isolation_problems(
                provider=provider, report={"isolation": {"mode": isolation}}
            )
            back.append((node_id, last, at, problems))
    with transaction.atomic():
        update_rows(
            Node,
            ("last_heartbeat_at", "power_w", "disk_free_bytes", "nccl_version", "agent_version"),
            node_rows,
        )
        update_rows(
            Gpu,
            (
                "utilization_pct",
                "memory_used_mib",
                "power_w",
                "temperature_c",
                "ecc_errors",
                "reported_at",
            ),
            gpu_rows,
            keys=("node", "index"),
        )
        update_rows(Node, ("fabric",), fabric_rows)
        resumed = _resume_suspects([node_id for node_id, state in fresh if state == S.SUSPECT])
    try:
        # Apart from the writes above: a failure here loses readings, not heartbeats.
        with transaction.atomic():
            telemetry.gpu_samples_record(rows=samples)
    except DatabaseError:
        log.warning("GPU samples of %d heartbeats not kept", len(node_rows), exc_info=True)
    returned = 0
    for node_id, last, at, problems in back:
        with transaction.atomic():
            node = Node.objects.select_for_update().get(pk=node_id)
            if node.state == S.DOWN:
                _node_back(node, heard_last=last, now=at, problems=problems)
                returned += 1
    for node_id, record in degraded:
        fabric.node_fabric_degraded_mark(node_id=node_id, record=record)
    for node_id in recovered:
        fabric.node_fabric_degraded_clear(node_id=node_id)
    drained = 0
    for node_id, problems in failing:
        node = Node.objects.get(pk=node_id)
        if _auto_drain(node, problems) == "drained":
            drained += 1
    return {"written": len(node_rows), "resumed": resumed, "drained": drained, "back": returned}


def agent_runs_held(*, node_ids: list[int]) -> dict[int, tuple[dt.datetime, list[int]]]:
    """The runs each node's agent said it holds in its newest heartbeat, and when that
    heartbeat landed; nodes whose agents did not say are left out."""
    landed = cache.get_many([_heartbeat_key(node_id) for node_id in node_ids])
    held = {}
    for node_id in node_ids:
        entry = landed.get(_heartbeat_key(node_id))
        if entry is not None and entry[1].get("have") is not None:
            held[node_id] = (dt.datetime.fromtimestamp(entry[0], tz=dt.UTC), entry[1]["have"])
    return held


def _resume_suspects(node_ids: list[int]) -> int:
    """SUSPECT nodes heard from again go back to the state they left."""
    moved = 0
    for node in Node.objects.select_for_update().filter(pk__in=node_ids, state=S.SUSPECT):
        back = node.suspect_from or S.READY
        fleet.node_transition(node=node, to=back, reason="heartbeats resumed", by=None)
        moved += 1
    return moved


# --- spot ----------------------------------------------------------------------------------------


def node_spot_interruption_record(*, node_id: int, notice: dict) -> None:
    """AWS said it will reclaim this spot node; the pool's interruption rate counts it."""
    now = timezone.now()
    updated = Node.objects.filter(pk=node_id, interrupted_at__isnull=True).update(
        interrupted_at=now
    )
    if not updated:
        return  # told twice
    log.warning("spot interruption notice for node %s: %s", node_id, notice)
    node = Node.objects.get(pk=node_id)
    if node.state in (S.READY, S.BUSY):  # no new work on a node about to go away
        when = str((notice or {}).get("time", ""))[:40]
        fleet.node_drain(node=node, reason=f"spot interruption notice ({when})", by=None)


def pool_spot_interruption_rate(*, pool_id: int, now: dt.datetime | None = None) -> float | None:
    """The share of the pool's spot nodes launched in the last 7 days that AWS interrupted
    (None before any was launched): above the pool's limit, bursts go on-demand."""
    since = (now or timezone.now()) - dt.timedelta(days=7)
    counts = Node.objects.filter(pool_id=pool_id, capacity_type="spot", launched_at__gte=since)
    totals = counts.aggregate(
        launched=Count("id"), interrupted=Count("id", filter=Q(interrupted_at__isnull=False))
    )
    if not totals["launched"]:
        return None
    return totals["interrupted"] / totals["launched"]
