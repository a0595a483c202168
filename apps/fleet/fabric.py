"""Fabric health: the error counters node agents read on each heartbeat
(workers/agent/fabric.py), their rates per minute, and the links and nodes they mark
fabric-degraded.

The heartbeat flush (agents.nodes_heartbeats_flush) folds each node's newest reading into
what it keeps on the node (`fabric_update`, no query of its own) and writes it with the
other nodes' in one statement; only a node that becomes degraded or recovers is written on
its own, by `node_fabric_degraded_mark` / `node_fabric_degraded_clear`, with a NodeEvent
and an audit record. Limits per counter: settings.FABRIC_ERROR_RATE_LIMITS (per minute);
a degraded link recovers once all its rates have stayed within them for
settings.FABRIC_CLEAR_AFTER_S.
"""

import datetime as dt
import re

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.services import audit_record
from apps.fleet.models import Node, NodeEvent

MAX_LINKS = 64
MAX_COUNTERS = 32
_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,64}$")
_COUNTER = re.compile(r"^[a-z0-9_]{1,64}$")


def fabric_compact(value) -> dict[str, dict[str, int]]:
    """A heartbeat's `fabric`, checked for type and range (an agent is not trusted)."""
    links: dict[str, dict[str, int]] = {}
    if not isinstance(value, dict):
        return links
    for link, counters in list(value.items())[:MAX_LINKS]:
        if not isinstance(link, str) or not _NAME.match(link) or not isinstance(counters, dict):
            continue
        links[link] = {
            name: count
            for name, count in list(counters.items())[:MAX_COUNTERS]
            if isinstance(name, str)
            and _COUNTER.match(name)
            and isinstance(count, int)
            and not isinstance(count, bool)
            and 0 <= count < 2**63
        }
    return links


def _rates(before: dict, after: dict, elapsed_s: float | None) -> dict[str, float]:
    """Per minute, for counters read both times; a counter that went down (reset: a driver
    reload, a reboot) starts again from its new value and has no rate this time."""
    if not elapsed_s or elapsed_s <= 0:
        return {}
    return {
        name: round((value - before[name]) * 60.0 / elapsed_s, 3)
        for name, value in after.items()
        if name in before and value >= before[name]
    }


def fabric_update(*, previous: dict | None, counters: dict, at: float) -> dict:
    """The node's fabric record after a reading taken at `at` (epoch seconds).

    {"at": at, "links": {link: {"counters", "rates", "over": {counter: [rate, limit]},
    "over_at", "degraded_since", "why"}}}: `over_at` is the last time a rate was over its
    limit, `degraded_since` when the link was marked (None when healthy).
    """
    previous = previous or {}
    before_links = previous.get("links") or {}
    before_at = previous.get("at")
    elapsed = at - before_at if isinstance(before_at, int | float) else None
    limits = settings.FABRIC_ERROR_RATE_LIMITS
    links = {}
    for link, values in counters.items():
        before = before_links.get(link) or {}
        rates = _rates(before.get("counters") or {}, values, elapsed)
        over = {
            name: [rate, limits[name]]
            for name, rate in rates.items()
            if name in limits and rate > limits[name]
        }
        over_at = at if over else before.get("over_at")
        since = before.get("degraded_since")
        why = before.get("why", "")
        if over:
            since = since or at
            why = "; ".join(f"{name} {r:g}/min over {lim:g}/min" for name, (r, lim) in over.items())
        elif since is not None and at - (over_at or 0) >= settings.FABRIC_CLEAR_AFTER_S:
            since, why = None, ""
        links[link] = {
            "counters": values,
            "rates": rates,
            "over": over,
            "over_at": over_at,
            "degraded_since": since,
            "why": why,
        }
    return {"at": at, "links": links}


def degraded_links(record: dict | None) -> dict[str, dict]:
    return {
        link: state
        for link, state in ((record or {}).get("links") or {}).items()
        if state.get("degraded_since") is not None
    }


def degraded_reason(record: dict | None) -> str:
    """Which links and counters, for the node's field and its event."""
    return "; ".join(f"{link}: {state['why']}" for link, state in degraded_links(record).items())


def _when(epoch: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC)


def node_fabric_degraded_mark(*, node_id: int, record: dict) -> Node | None:
    """Mark the node fabric-degraded (its links' record says which and why)."""
    links = degraded_links(record)
    if not links:
        return None
    since = _when(min(state["degraded_since"] for state in links.values()))
    reason = degraded_reason(record)[:300]
    return _set(node_id, since=since, reason=reason, event=f"fabric degraded: {reason}")


def node_fabric_degraded_clear(*, node_id: int) -> Node | None:
    """The node's fabric error rates stayed within their limits long enough: healthy again
    (unless a measurement marked it: only another measurement clears that)."""
    if Node.objects.filter(pk=node_id, fabric_degraded_reason__startswith=MEASURED).exists():
        return None
    minutes = settings.FABRIC_CLEAR_AFTER_S / 60
    return _set(
        node_id,
        since=None,
        reason="",
        event=f"fabric healthy again: error rates within limits for {minutes:g} min",
    )


# How a mark by measurement begins (a drift check's bisection, apps/jobs/tuning_runs.py), so
# that the counters' all-clear leaves it alone.
MEASURED = "measured slow"


def node_fabric_measured_slow(*, node_id: int, reason: str) -> Node | None:
    """A drift check measured the node's links slower than its pool's adopted figures."""
    why = f"{MEASURED}: {reason}"[:300]
    return _set(node_id, since=timezone.now(), reason=why, event=f"fabric degraded: {why}")


def node_fabric_measured_ok(*, node_id: int, reason: str) -> Node | None:
    """A later measurement found the node's links as fast as adopted: a mark by measurement
    is lifted (a mark by the error counters is theirs to lift)."""
    if not Node.objects.filter(pk=node_id, fabric_degraded_reason__startswith=MEASURED).exists():
        return None
    return _set(node_id, since=None, reason="", event=f"fabric healthy again: {reason}"[:300])


@transaction.atomic
def _set(node_id: int, *, since, reason: str, event: str) -> Node | None:
    node = Node.objects.select_for_update().filter(pk=node_id).first()
    if node is None or (node.fabric_degraded_since is None) == (since is None):
        return None  # gone, or another flush got there first
    before = {
        "fabric_degraded_since": str(node.fabric_degraded_since),
        "why": node.fabric_degraded_reason,
    }
    node.fabric_degraded_since = since
    node.fabric_degraded_reason = reason
    node.save(update_fields=["fabric_degraded_since", "fabric_degraded_reason"])
    # Not a state change: the node keeps its state, and its history says what happened.
    NodeEvent.objects.create(
        node=node,
        from_state=node.state,
        to_state=node.state,
        reason=event[:300],
        actor=None,
        actor_label="system",
    )
    audit_record(
        actor=None,
        action="node.fabric_degraded" if since else "node.fabric_healthy",
        obj=node,
        before=before,
        after={"fabric_degraded_since": str(since), "why": reason},
    )
    return node
