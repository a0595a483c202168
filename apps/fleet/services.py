"""Writes to the fleet: inventory, the node state machine, host keys, heartbeats, drains."""

import datetime as dt
import logging

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.accounts.services import (
    audit_record,
    audit_record_many,
    audited_create,
    audited_delete,
    audited_update,
    require_fleet_manager,
    snapshot,
)
from apps.fleet.hostkeys import InvalidHostKey, host_key_fingerprint
from apps.fleet.models import (
    Gpu,
    InstanceType,
    Node,
    NodeEvent,
    NodePool,
    NodeState,
    PoolKind,
    Rack,
    Site,
)
from apps.fleet.models.nodes import GONE_STATES, CapacityType, Provider
from apps.fleet.selectors import CAPACITY_CACHE_KEY
from controlplane.bulk import InArray, update_logged
from controlplane.cache import best_effort
from controlplane.celery import enqueue_on_commit
from controlplane.errors import ApplicationError

S = NodeState
log = logging.getLogger(__name__)

# Which moves the node state machine allows (README, "Design": the state machines).
NODE_TRANSITIONS: dict[str, set[str]] = {
    S.REQUESTED: {S.PROVISIONING, S.FAILED, S.TERMINATING},
    S.PROVISIONING: {S.AWAITING_HOST_KEY, S.BOOTSTRAPPING, S.FAILED, S.TERMINATING},
    S.AWAITING_HOST_KEY: {S.BOOTSTRAPPING, S.FAILED, S.TERMINATING},
    S.BOOTSTRAPPING: {S.READY, S.DRAINED, S.FAILED, S.TERMINATING},
    S.READY: {S.BUSY, S.SUSPECT, S.DRAINING, S.TERMINATING},
    S.BUSY: {S.READY, S.SUSPECT, S.DRAINING, S.TERMINATING},
    S.SUSPECT: {S.READY, S.BUSY, S.DOWN, S.DRAINING, S.TERMINATING},
    S.DOWN: {S.BOOTSTRAPPING, S.DRAINED, S.TERMINATING},
    S.DRAINING: {S.DRAINED, S.BUSY, S.SUSPECT, S.TERMINATING},
    S.DRAINED: {S.READY, S.PROVISIONING, S.TERMINATING},
    S.FAILED: {S.PROVISIONING, S.TERMINATING},
    S.TERMINATING: {S.TERMINATED},
    S.TERMINATED: set(),
}

# States in which a node is expected to heartbeat, and goes SUSPECT (then DOWN) when it
# stops: a draining node still runs jobs, which must be requeued if it dies.
HEARTBEATING = {S.READY, S.BUSY, S.DRAINING}


def _actor_label(by) -> str:
    return by.get_username() if by is not None else "system"


# --- inventory ------------------------------------------------------------------------


def site_create(*, by, **fields) -> Site:
    require_fleet_manager(by)
    return audited_create(model=Site, by=by, fields=fields, action="site.create")


def site_update(*, site: Site, by, **changes) -> Site:
    require_fleet_manager(by)
    return audited_update(instance=site, by=by, changes=changes, action="site.update")


def site_delete(*, site: Site, by) -> None:
    require_fleet_manager(by)
    audited_delete(instance=site, by=by, action="site.delete")


def rack_create(*, by, **fields) -> Rack:
    require_fleet_manager(by)
    return audited_create(model=Rack, by=by, fields=fields, action="rack.create")


def rack_update(*, rack: Rack, by, **changes) -> Rack:
    require_fleet_manager(by)
    return audited_update(instance=rack, by=by, changes=changes, action="rack.update")


def rack_delete(*, rack: Rack, by) -> None:
    require_fleet_manager(by)
    audited_delete(instance=rack, by=by, action="rack.delete")


def instance_type_create(*, by, **fields) -> InstanceType:
    require_fleet_manager(by)
    return audited_create(model=InstanceType, by=by, fields=fields, action="instance_type.create")


def instance_type_update(*, instance_type: InstanceType, by, **changes) -> InstanceType:
    require_fleet_manager(by)
    return audited_update(
        instance=instance_type, by=by, changes=changes, action="instance_type.update"
    )


def instance_type_delete(*, instance_type: InstanceType, by) -> None:
    require_fleet_manager(by)
    audited_delete(instance=instance_type, by=by, action="instance_type.delete")


def _check_pool_instance_types(*, gpu_type: str, kind: str, instance_types) -> None:
    if instance_types is None:
        return
    if kind == PoolKind.OWNED and instance_types:
        raise ApplicationError(
            "Owned pools have no cloud instance types.",
            details={"instance_types": ["Leave empty for an owned pool."]},
        )
    wrong = sorted(t.name for t in instance_types if t.gpu_type != gpu_type)
    if wrong:
        raise ApplicationError(
            f"Instance types {', '.join(wrong)} do not carry {gpu_type} GPUs.",
            details={"instance_types": [f"{name} has another GPU type." for name in wrong]},
        )


def provision_soon(node_id: int) -> None:
    """Once this transaction commits, ask a worker to bring the node up (fleet.provision)."""
    enqueue_on_commit("fleet.provision", node_id, covered_by="the provisioning sweeps")


def capacity_changed() -> None:
    """Pools or nodes came or went: forget submission's cached capacity once this commits."""
    transaction.on_commit(lambda: best_effort.delete(CAPACITY_CACHE_KEY))


@transaction.atomic
def pool_create(*, by, instance_types=None, **fields) -> NodePool:
    require_fleet_manager(by)
    _check_pool_instance_types(
        gpu_type=fields.get("gpu_type", ""),
        kind=fields.get("kind", ""),
        instance_types=instance_types,
    )
    pool = audited_create(model=NodePool, by=by, fields=fields, action="pool.create")
    if instance_types:
        pool.instance_types.set(instance_types)
    capacity_changed()
    return pool


@transaction.atomic
def pool_update(*, pool: NodePool, by, instance_types=None, **changes) -> NodePool:
    require_fleet_manager(by)
    if "kind" in changes and changes["kind"] != pool.kind and pool.nodes.exists():
        raise ApplicationError(
            "A pool with nodes cannot change kind.", details={"kind": ["The pool has nodes."]}
        )
    _check_pool_instance_types(
        gpu_type=changes.get("gpu_type", pool.gpu_type),
        kind=changes.get("kind", pool.kind),
        instance_types=instance_types
        if instance_types is not None
        else list(pool.instance_types.all()),
    )
    pool = audited_update(instance=pool, by=by, changes=changes, action="pool.update")
    if instance_types is not None:
        pool.instance_types.set(instance_types)
    capacity_changed()
    return pool


@transaction.atomic
def pool_delete(*, pool: NodePool, by) -> None:
    require_fleet_manager(by)
    audited_delete(instance=pool, by=by, action="pool.delete")
    capacity_changed()


def _check_node_fields(fields: dict) -> None:
    """Rules that tie a node to its pool, provider and hardware."""
    pool: NodePool = fields["pool"]
    provider = fields.get("provider")
    capacity = fields.get("capacity_type")
    errors = {}
    if pool.kind == PoolKind.OWNED:
        if provider not in (Provider.LOCAL, Provider.SSH):
            errors["provider"] = ["Owned pools take local or ssh nodes."]
        if capacity != CapacityType.OWNED:
            errors["capacity_type"] = ["Nodes of an owned pool are owned."]
    else:
        if provider != Provider.AWS:
            errors["provider"] = ["Cloud pools take aws nodes."]
        if capacity not in (CapacityType.ON_DEMAND, CapacityType.SPOT):
            errors["capacity_type"] = ["Cloud nodes are on_demand or spot."]
        if fields.get("rack") is not None:
            errors["rack"] = ["Cloud nodes stand in no rack of ours."]
    if fields.get("gpu_type") != pool.gpu_type:
        errors["gpu_type"] = [f"The pool {pool.slug} holds {pool.gpu_type} GPUs."]
    instance_type = fields.get("instance_type")
    if instance_type is not None:
        if instance_type.gpu_type != pool.gpu_type:
            errors["instance_type"] = [f"{instance_type} does not carry {pool.gpu_type} GPUs."]
        elif fields.get("gpu_count") not in (None, instance_type.gpu_count):
            errors["gpu_count"] = [f"{instance_type} has {instance_type.gpu_count} GPUs."]
    rack = fields.get("rack")
    if rack is not None and pool.site_id and rack.site_id != pool.site_id:
        errors["rack"] = [f"The rack stands in {rack.site}, the pool in another site."]
    if provider == Provider.SSH and not fields.get("address"):
        errors["address"] = ["An ssh node needs an address."]
    if errors:
        raise ApplicationError("Invalid node.", details=errors)


def _pinned_key_fields(host_key: str) -> dict:
    if not host_key:
        return {"host_key": "", "host_key_fingerprint": ""}
    try:
        fp = host_key_fingerprint(host_key)
    except InvalidHostKey as exc:
        raise ApplicationError(str(exc), details={"host_key": [str(exc)]}) from None
    return {"host_key": host_key.strip(), "host_key_fingerprint": fp}


@transaction.atomic
def node_create(*, by, **fields) -> Node:
    require_fleet_manager(by)
    pool = fields["pool"]
    fields.setdefault("gpu_type", pool.gpu_type)
    if fields.get("instance_type") is not None:
        fields.setdefault("gpu_count", fields["instance_type"].gpu_count)
    _check_node_fields(fields)
    fields.update(_pinned_key_fields(fields.pop("host_key", "")))
    node = audited_create(model=Node, by=by, fields=fields, action="node.create")
    NodeEvent.objects.create(
        node=node,
        from_state="",
        to_state=node.state,
        reason="registered",
        actor=by,
        actor_label=_actor_label(by),
    )
    capacity_changed()
    provision_soon(node.pk)
    return node


@transaction.atomic
def node_update(*, node: Node, by, **changes) -> Node:
    require_fleet_manager(by)
    merged = {
        name: changes.get(name, getattr(node, name))
        for name in (
            "pool",
            "rack",
            "provider",
            "capacity_type",
            "gpu_type",
            "address",
            "instance_type",
        )
    }
    merged["gpu_count"] = changes.get("gpu_count", node.gpu_count)
    _check_node_fields(merged)
    if "host_key" in changes:
        if changes["host_key"].strip() != node.host_key and node.host_key:
            # A pinned key is only replaced by accepting what the node offers.
            raise ApplicationError(
                "A pinned host key is changed by accepting the node's offered key.",
                code="host_key_pinned",
                details={"host_key": ["Already pinned; use accept-host-key."]},
                status=409,
            )
        changes.update(_pinned_key_fields(changes.pop("host_key")))
    capacity_changed()
    return audited_update(instance=node, by=by, changes=changes, action="node.update")


def node_delete(*, node: Node, by) -> None:
    require_fleet_manager(by)
    if node.state not in (S.REQUESTED, S.FAILED, S.DRAINED, S.TERMINATED, S.DOWN):
        raise ApplicationError(
            f"{node} is {node.state}; drain or terminate it before removing it.",
            code="invalid_state",
            status=409,
        )
    with transaction.atomic():
        audited_delete(instance=node, by=by, action="node.delete")
        capacity_changed()


def gpu_create(*, by, **fields) -> Gpu:
    require_fleet_manager(by)
    return audited_create(model=Gpu, by=by, fields=fields, action="gpu.create")


def gpu_update(*, gpu: Gpu, by, **changes) -> Gpu:
    require_fleet_manager(by)
    return audited_update(instance=gpu, by=by, changes=changes, action="gpu.update")


def gpu_delete(*, gpu: Gpu, by) -> None:
    require_fleet_manager(by)
    audited_delete(instance=gpu, by=by, action="gpu.delete")


# --- the node state machine -----------------------------------------------------------


def _refuse_move(node: Node, to: str) -> ApplicationError:
    return ApplicationError(
        f"{node} cannot go from {node.state} to {to}.",
        code="invalid_transition",
        details={"state": [f"{node.state} → {to} is not allowed."]},
        status=409,
    )


def _remembered(came_from: str, to: str, remembered: str) -> str:
    """What a node remembers of the state it left when its agent went quiet: set on the
    move to SUSPECT, kept through DOWN (a drained node that comes back stays drained),
    forgotten on any other move."""
    if to == S.SUSPECT:
        return came_from
    return remembered if to == S.DOWN else ""


@transaction.atomic
def node_transition(*, node: Node, to: str, reason: str, by, **fields) -> Node:
    """Move one node to `to`, if the state machine allows it from where it is now."""
    locked = Node.objects.select_for_update().get(pk=node.pk)
    if to not in NODE_TRANSITIONS[locked.state]:
        raise _refuse_move(locked, to)
    before = snapshot(locked)
    came_from = locked.state
    locked.state = to
    locked.state_reason = reason[:300]
    locked.state_changed_at = timezone.now()
    locked.suspect_from = _remembered(came_from, to, locked.suspect_from)
    for name, value in fields.items():
        setattr(locked, name, value)
    locked.save()
    NodeEvent.objects.create(
        node=locked,
        from_state=came_from,
        to_state=to,
        reason=reason[:300],
        actor=by,
        actor_label=_actor_label(by),
    )
    audit_record(actor=by, action=f"node.{to}", obj=locked, before=before, after=snapshot(locked))
    if to in GONE_STATES or came_from in GONE_STATES:
        capacity_changed()
    return locked


def node_drain(*, node: Node, reason: str, by) -> Node:
    """Take a node out of scheduling. An idle node is DRAINED at once; a busy one drains."""
    require_fleet_manager(by)
    if not reason.strip():
        raise ApplicationError("Say why the node is drained.", details={"reason": ["Required."]})
    with transaction.atomic():
        state = Node.objects.select_for_update().get(pk=node.pk).state
        if state == S.DOWN:
            # Its jobs were requeued when it went DOWN: nothing is left to drain.
            return node_transition(node=node, to=S.DRAINED, reason=reason, by=by)
        was_idle = state == S.READY
        node = node_transition(node=node, to=S.DRAINING, reason=reason, by=by)
        if was_idle:
            # The drain's reason stays on the node: it is what ops look for.
            node = node_transition(node=node, to=S.DRAINED, reason=reason, by=by)
    return node


def node_undrain(*, node: Node, by) -> Node:
    """Back into scheduling. A DRAINING node still holds jobs (the last one to end makes it
    DRAINED), so it goes back to BUSY; a DRAINED one is idle and goes to READY."""
    require_fleet_manager(by)
    with transaction.atomic():
        state = Node.objects.select_for_update().get(pk=node.pk).state
        to = S.BUSY if state == S.DRAINING else S.READY
        return node_transition(node=node, to=to, reason="undrained", by=by)


@transaction.atomic
def node_host_key_offer(*, node: Node, offered_key: str, by=None) -> Node:
    """A node presented a host key we have not pinned: hold it until ops accept it."""
    try:
        host_key_fingerprint(offered_key)
    except InvalidHostKey as exc:
        raise ApplicationError(str(exc), details={"offered_key": [str(exc)]}) from None
    return node_transition(
        node=node,
        to=S.AWAITING_HOST_KEY,
        reason="host key not yet accepted",
        by=by,
        offered_host_key=offered_key.strip(),
    )


@transaction.atomic
def node_host_key_accept(*, node: Node, fingerprint: str, by) -> Node:
    """Ops confirm the fingerprint they expect; only then is the offered key pinned."""
    require_fleet_manager(by)
    locked = Node.objects.select_for_update().get(pk=node.pk)
    if locked.state != S.AWAITING_HOST_KEY or not locked.offered_host_key:
        raise ApplicationError(
            f"{locked} is not waiting for a host key.", code="invalid_state", status=409
        )
    offered_fp = host_key_fingerprint(locked.offered_host_key)
    if fingerprint.strip() != offered_fp:
        raise ApplicationError(
            "The fingerprint does not match the key the node offered.",
            code="fingerprint_mismatch",
            details={"fingerprint": [f"The node offered {offered_fp}."]},
        )
    node = node_transition(
        node=locked,
        to=S.BOOTSTRAPPING,
        reason=f"host key {offered_fp} accepted",
        by=by,
        host_key=locked.offered_host_key,
        host_key_fingerprint=offered_fp,
        offered_host_key="",
    )
    provision_soon(node.pk)
    return node


@transaction.atomic
def node_provision(*, node: Node, by) -> Node:
    """Ops ask again for a node that failed, was drained, or never came up."""
    require_fleet_manager(by)
    locked = Node.objects.select_for_update().get(pk=node.pk)
    if locked.state not in (S.REQUESTED, S.FAILED, S.DRAINED, S.BOOTSTRAPPING, S.PROVISIONING):
        raise ApplicationError(
            f"{locked} is {locked.state}; only a requested, failed or drained node is provisioned.",
            code="invalid_state",
            status=409,
        )
    audit_record(actor=by, action="node.provision", obj=locked, team=None)
    provision_soon(locked.pk)
    return locked


@transaction.atomic
def node_terminate(*, node: Node, reason: str, by) -> Node:
    """Ops retire a node for good: TERMINATING now, and a worker stops its agent and
    removes what bootstrap put there (a cloud node's instance is terminated) before it is
    TERMINATED (fleet.terminate). A node still running jobs is drained first."""
    require_fleet_manager(by)
    locked = Node.objects.select_for_update().get(pk=node.pk)
    if locked.state in (S.BUSY, S.DRAINING):
        raise ApplicationError(
            f"{locked} still runs jobs: drain it, and terminate it once it is drained.",
            code="invalid_state",
            status=409,
        )
    if locked.state != S.TERMINATING:  # asked again: the worker is asked again
        locked = node_transition(
            node=locked, to=S.TERMINATING, reason=reason or "terminated by ops", by=by
        )
    enqueue_on_commit(
        "fleet.terminate", locked.pk, covered_by="ops asking again, or the cloud sweep"
    )
    return locked


# --- heartbeats -----------------------------------------------------------------------


@transaction.atomic
def node_heartbeat_record(*, node: Node, at: dt.datetime | None = None) -> Node:
    """A heartbeat arrived; a SUSPECT node goes back to the state it left."""
    at = at or timezone.now()
    locked = Node.objects.select_for_update().get(pk=node.pk)
    locked.last_heartbeat_at = at
    locked.save(update_fields=["last_heartbeat_at"])
    if locked.state == S.SUSPECT and locked.suspect_from:
        return node_transition(
            node=locked, to=locked.suspect_from, reason="heartbeats resumed", by=None
        )
    return locked


def _bulk_move(
    *, candidates: list[tuple[int, str]], to: str, reason: str, now, extra=None, audit=True
):
    """Move many nodes in one UPDATE per source state, which also writes their events
    (bulk.update_logged), and their audit rows.

    `audit=False` for READY ⇄ BUSY, which follow from a job's placement or end: the
    job's own events and audit rows record that decision, and the node's events its effect.
    """
    if not candidates:
        return 0
    by_state: dict[str, list[int]] = {}
    for node_id, state in candidates:
        by_state.setdefault(state, []).append(node_id)
    moved = 0
    for state, ids in by_state.items():
        values = {"state": to, "state_reason": reason, "state_changed_at": now}
        if to != S.DOWN:  # DOWN keeps what the node left when it went SUSPECT
            values["suspect_from"] = _remembered(state, to, "")
        values.update(extra or {})
        moved += update_logged(
            Node.objects.filter(InArray("id", ids), state=state),
            values,
            log=NodeEvent,
            log_fields=("node", "at", "from_state", "to_state", "reason", "actor", "actor_label"),
            log_values=(now, state, to, reason, None, "system"),
        )
    if not audit:
        return moved
    nodes = Node.objects.only("id", "name").in_bulk([node_id for node_id, _ in candidates])
    audit_record_many(
        actor=None,
        action=f"node.{to}",
        changes=[
            (nodes[node_id], {"state": state}, {"state": to, "state_reason": reason})
            for node_id, state in candidates
        ],
    )
    return moved


@transaction.atomic
def nodes_heartbeat_sweep(
    *, now: dt.datetime | None = None, down_allowed: bool = True
) -> dict[str, int]:
    """Mark silent nodes SUSPECT, and long-silent SUSPECT nodes DOWN, in bulk.

    Nodes that never sent a heartbeat are left alone (their agent has not started).
    `down_allowed` False (the control plane has just come back from not hearing anyone:
    workers.tasks.fleet) marks nodes SUSPECT but none DOWN, since part of their silence
    is the control plane's own.
    """
    now = now or timezone.now()
    suspect_before = now - dt.timedelta(seconds=settings.NODE_SUSPECT_AFTER_S)
    down_before = now - dt.timedelta(seconds=settings.NODE_DOWN_AFTER_S)
    silent = list(
        Node.objects.select_for_update(skip_locked=True)
        .filter(state__in=HEARTBEATING, last_heartbeat_at__lt=suspect_before)
        .values_list("id", "state")
    )
    lost = list(
        Node.objects.select_for_update(skip_locked=True)
        .filter(state=S.SUSPECT, last_heartbeat_at__lt=down_before)
        .values_list("id", "state")
    )
    suspect = _bulk_move(
        candidates=silent,
        to=S.SUSPECT,
        reason=f"no heartbeat for {settings.NODE_SUSPECT_AFTER_S}s",
        now=now,
    )
    down = _bulk_move(
        candidates=lost if down_allowed else [],
        to=S.DOWN,
        reason=f"no heartbeat for {settings.NODE_DOWN_AFTER_S}s",
        now=now,
    )
    return {"suspect": suspect, "down": down}


# --- work arriving and leaving -------------------------------------------------------------


@transaction.atomic
def nodes_work_started(
    *, node_ids: list[int] | None = None, ready: list[tuple[int, str]] | None = None
) -> int:
    """Nodes that took a job's GPUs: READY ones become BUSY (one UPDATE).

    `ready`: (id, state) of nodes the caller has locked in this transaction and found
    READY, so they are not read and locked a second time.
    """
    if ready is None:
        ready = list(
            Node.objects.select_for_update()
            .filter(pk__in=node_ids or [], state=S.READY)
            .values_list("id", "state")
        )
    return _bulk_move(
        candidates=ready, to=S.BUSY, reason="job placed", now=timezone.now(), audit=False
    )


@transaction.atomic
def nodes_work_ended(*, node_ids: list[int], still_busy: set[int]) -> dict[str, int]:
    """Nodes whose jobs released their GPUs: BUSY → READY, DRAINING → DRAINED.

    `still_busy` are the nodes that still hold another job's GPUs; they stay as they are.
    """
    idle = [node_id for node_id in node_ids if node_id not in still_busy]
    rows = list(
        Node.objects.select_for_update()
        .filter(pk__in=idle, state__in=(S.BUSY, S.DRAINING))
        .values_list("id", "state")
    )
    now = timezone.now()
    busy = [(i, s) for i, s in rows if s == S.BUSY]
    draining = [(i, s) for i, s in rows if s == S.DRAINING]
    return {
        "ready": _bulk_move(
            candidates=busy, to=S.READY, reason="jobs finished", now=now, audit=False
        ),
        "drained": _bulk_move(candidates=draining, to=S.DRAINED, reason="jobs finished", now=now),
    }


def owned_nodes_stalled(*, now: dt.datetime | None = None) -> list[int]:
    """Owned (local and SSH) nodes PROVISIONING or BOOTSTRAPPING for
    OWNED_REDRIVE_AFTER_S: the task taking them up was lost (a worker killed mid-bootstrap,
    a message dropped) or is stuck. Provisioning is safe to run again, and the provision
    task holds a lock per node, so one still under way is not run twice."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(seconds=settings.OWNED_REDRIVE_AFTER_S)
    return list(
        Node.objects.filter(
            provider__in=(Provider.LOCAL, Provider.SSH),
            state__in=(S.PROVISIONING, S.BOOTSTRAPPING),
            state_changed_at__lt=cutoff,
        )
        .order_by("id")
        .values_list("id", flat=True)
    )
