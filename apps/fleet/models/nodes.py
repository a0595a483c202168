"""Nodes (owned servers or cloud instances), their GPUs, and their state history."""

import uuid

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q

from apps.accounts.models import GPU_TYPES
from apps.fleet.models.catalogue import InstanceType
from apps.fleet.models.pools import NodePool
from apps.fleet.models.sites import Rack
from controlplane.events import StateChange


class NodeState(models.TextChoices):
    REQUESTED = "requested", "Requested"
    PROVISIONING = "provisioning", "Provisioning"
    AWAITING_HOST_KEY = "awaiting_host_key", "Awaiting host key"
    BOOTSTRAPPING = "bootstrapping", "Bootstrapping"
    READY = "ready", "Ready"
    BUSY = "busy", "Busy"
    SUSPECT = "suspect", "Suspect"
    DOWN = "down", "Down"
    DRAINING = "draining", "Draining"
    DRAINED = "drained", "Drained"
    FAILED = "failed", "Failed"
    TERMINATING = "terminating", "Terminating"
    TERMINATED = "terminated", "Terminated"


# Nodes that can take work, and nodes that are gone for good.
SCHEDULABLE_STATES = frozenset({NodeState.READY, NodeState.BUSY})
GONE_STATES = frozenset({NodeState.FAILED, NodeState.TERMINATING, NodeState.TERMINATED})


class Provider(models.TextChoices):
    LOCAL = "local", "Local processes"
    SSH = "ssh", "SSH (owned)"
    AWS = "aws", "AWS"


class CapacityType(models.TextChoices):
    OWNED = "owned", "Owned"
    ON_DEMAND = "on_demand", "On-demand"
    SPOT = "spot", "Spot"


class JobIsolation(models.TextChoices):
    """How the node's agent keeps one job from another, as the agent reports it."""

    UNKNOWN = "", "Not reported yet"
    USER = "user", "Each job runs as its own unprivileged user"
    NONE = "none", "None: jobs run as the agent's user"


class Node(models.Model):
    uuid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    name = models.CharField(max_length=100, unique=True)
    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="nodes")
    rack = models.ForeignKey(
        Rack, null=True, blank=True, on_delete=models.PROTECT, related_name="nodes"
    )
    rack_unit = models.PositiveSmallIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1), MaxValueValidator(60)]
    )
    provider = models.CharField(max_length=10, choices=Provider.choices)
    capacity_type = models.CharField(max_length=10, choices=CapacityType.choices)
    address = models.CharField(max_length=255, blank=True, help_text="Host name or IP address.")
    ssh_port = models.PositiveIntegerField(
        default=22, validators=[MinValueValidator(1), MaxValueValidator(65535)]
    )
    ssh_user = models.CharField(max_length=32, blank=True)
    host_key = models.TextField(
        blank=True, max_length=4096, help_text="Pinned public host key: 'type base64'."
    )
    host_key_fingerprint = models.CharField(max_length=100, blank=True, editable=False)
    offered_host_key = models.TextField(
        blank=True,
        max_length=4096,
        editable=False,
        help_text="The key the node presented, waiting for ops to accept it.",
    )
    instance_id = models.CharField(max_length=64, blank=True, db_index=True)
    instance_type = models.ForeignKey(
        InstanceType, null=True, blank=True, on_delete=models.PROTECT, related_name="nodes"
    )
    gpu_type = models.CharField(max_length=10, choices=GPU_TYPES)
    gpu_count = models.PositiveSmallIntegerField(
        default=8, validators=[MinValueValidator(0), MaxValueValidator(64)]
    )
    nameplate_power_w = models.PositiveIntegerField(
        null=True, blank=True, validators=[MaxValueValidator(100000)]
    )
    state = models.CharField(
        max_length=20, choices=NodeState.choices, default=NodeState.REQUESTED, editable=False
    )
    state_reason = models.CharField(max_length=300, blank=True, editable=False)
    state_changed_at = models.DateTimeField(auto_now_add=True, editable=False)
    suspect_from = models.CharField(
        max_length=20,
        choices=NodeState.choices,
        blank=True,
        editable=False,
        help_text="The state a SUSPECT node returns to when its heartbeats resume (kept "
        "while DOWN: a node drained before it went down comes back drained).",
    )
    last_heartbeat_at = models.DateTimeField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    # The agent: its token (only a SHA-256 of it), and what it reports.
    agent_token_digest = models.CharField(max_length=64, blank=True, editable=False)
    # Cloud nodes: the token their instance's user data carries (which any process on the
    # instance could read from the metadata service), valid only until the agent registers
    # and takes a token of its own. Kept encrypted so a re-driven launch writes the same.
    bootstrap_token_digest = models.CharField(max_length=64, blank=True, editable=False)
    bootstrap_token_ciphertext = models.BinaryField(blank=True, default=b"", editable=False)
    agent_version = models.CharField(max_length=20, blank=True, editable=False)
    agent_hostname = models.CharField(max_length=255, blank=True, editable=False)
    agent_registered_at = models.DateTimeField(null=True, blank=True, editable=False)
    nccl_version = models.CharField(
        max_length=20, blank=True, editable=False, help_text="As the node's agent reports it."
    )
    disk_free_bytes = models.BigIntegerField(null=True, blank=True, editable=False)
    job_isolation = models.CharField(
        max_length=10,
        choices=JobIsolation.choices,
        blank=True,
        default=JobIsolation.UNKNOWN,
        editable=False,
        help_text="As the node's agent reports it; a shared pool's node holds several teams' "
        "jobs only under user isolation.",
    )
    power_w = models.PositiveIntegerField(
        null=True, blank=True, editable=False, help_text="Measured GPU power draw, summed."
    )
    # Provisioning progress, for the Fleet page and the API.
    provision_step = models.CharField(max_length=50, blank=True, editable=False)
    provision_percent = models.PositiveSmallIntegerField(default=0, editable=False)
    provision_message = models.CharField(max_length=300, blank=True, editable=False)
    # Cloud nodes: when the instance was launched, and when AWS said it would reclaim it.
    launched_at = models.DateTimeField(null=True, blank=True, editable=False)
    interrupted_at = models.DateTimeField(null=True, blank=True, editable=False)
    # Burst nodes: the job whose wait asked for them (so it asks once, not every pass),
    # and the cluster placement group of that job's nodes (multi-node jobs).
    burst_job = models.ForeignKey(
        "jobs.Job",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="burst_nodes",
        editable=False,
        help_text="Cloud nodes: the waiting job they were requested for.",
    )
    placement_group = models.CharField(max_length=255, blank=True, editable=False)
    # Fabric health (apps/fleet/fabric.py): each link's latest error counters and their
    # rates, written by the heartbeat flush; and whether a rate over its limit marked the
    # node degraded, since when, and which link and counter.
    fabric = models.JSONField(default=dict, blank=True, editable=False)
    fabric_degraded_since = models.DateTimeField(null=True, blank=True, editable=False)
    fabric_degraded_reason = models.CharField(max_length=300, blank=True, editable=False)

    class Meta:
        ordering = ["name"]
        # No index on state or last_heartbeat_at, and pages filled to 45% (migration 0006):
        # a node's state and heartbeat change all the time (a pass marks thousands BUSY),
        # and with neither column indexed PostgreSQL rewrites the row in place (a HOT
        # update) instead of adding an entry to each of the table's indexes. A fleet's
        # few thousand rows are scanned whole in about a millisecond.
        constraints = [
            models.UniqueConstraint(
                fields=["agent_token_digest"],
                condition=~models.Q(agent_token_digest=""),
                name="node_agent_token_unique",
            ),
            models.UniqueConstraint(
                fields=["bootstrap_token_digest"],
                condition=~models.Q(bootstrap_token_digest=""),
                name="node_bootstrap_token_unique",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class NodeEvent(StateChange):
    """One state change of a node: append-only."""

    # No foreign-key constraint in the database: the scheduler's first pass over a fleet
    # writes one event per node it starts using (10,000), each checked at commit. Every
    # writer is a service that has just locked the node's row; Django's CASCADE removes a
    # node's events with it.
    node = models.ForeignKey(
        Node, on_delete=models.CASCADE, related_name="events", db_constraint=False
    )
    from_state = models.CharField(max_length=20, choices=NodeState.choices, blank=True)
    to_state = models.CharField(max_length=20, choices=NodeState.choices)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(
                fields=["actor"], condition=Q(actor__isnull=False), name="node_events_by_people"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node}: {self.from_state} → {self.to_state}"


class GpuHealth(models.TextChoices):
    UNKNOWN = "unknown", "Unknown"
    HEALTHY = "healthy", "Healthy"
    DEGRADED = "degraded", "Degraded"
    FAILED = "failed", "Failed"


class Gpu(models.Model):
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(validators=[MaxValueValidator(63)])
    uuid = models.CharField(max_length=64, blank=True)
    model = models.CharField(max_length=100, blank=True)
    memory_mib = models.PositiveIntegerField(default=0, validators=[MaxValueValidator(10_000_000)])
    health = models.CharField(max_length=10, choices=GpuHealth.choices, default=GpuHealth.UNKNOWN)
    health_reason = models.CharField(max_length=300, blank=True)
    # The latest heartbeat's reading (written in batches by the heartbeat flush).
    utilization_pct = models.FloatField(null=True, blank=True, editable=False)
    memory_used_mib = models.PositiveIntegerField(null=True, blank=True, editable=False)
    power_w = models.FloatField(null=True, blank=True, editable=False)
    temperature_c = models.FloatField(null=True, blank=True, editable=False)
    ecc_errors = models.PositiveIntegerField(null=True, blank=True, editable=False)
    reported_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_index_per_node"),
            models.UniqueConstraint(
                fields=["uuid"], condition=~models.Q(uuid=""), name="gpu_uuid_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node}/gpu{self.index}"
