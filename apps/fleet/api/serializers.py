"""JSON shapes of the fleet's inventory."""

import datetime as dt

from django.utils import timezone
from rest_framework import serializers

from apps.accounts.models import GPU_TYPES
from apps.fleet.hostkeys import host_key_fingerprint_or_blank
from apps.fleet.models import (
    Gpu,
    InstanceType,
    Node,
    NodeEvent,
    NodePool,
    OrphanInstance,
    Rack,
    Site,
)
from apps.fleet.models.pools import SECURITY_GROUP_PATTERN
from apps.fleet.selectors import TELEMETRY_WINDOWS
from controlplane.api import StrictModelSerializer, StrictSerializer, Text


class SiteSerializer(StrictModelSerializer):
    class Meta:
        model = Site
        fields = ["id", "name", "slug", "location", "created_at"]


class RackSerializer(StrictModelSerializer):
    site_name = serializers.CharField(source="site.name", read_only=True)

    class Meta:
        model = Rack
        fields = [
            "id",
            "site",
            "site_name",
            "name",
            "position",
            "height_units",
            "power_budget_kw",
            "created_at",
        ]
        validators = []  # the service's full_clean names the field on a duplicate


class InstanceTypeSerializer(StrictModelSerializer):
    class Meta:
        model = InstanceType
        fields = [
            "id",
            "name",
            "gpu_type",
            "gpu_count",
            "gpu_memory_gib",
            "vcpus",
            "memory_gib",
            "network_gbps",
            "local_nvme_tb",
            "source",
        ]


class NodePoolSerializer(StrictModelSerializer):
    instance_types = serializers.PrimaryKeyRelatedField(
        many=True, queryset=InstanceType.objects.all(), required=False
    )
    security_group_ids = serializers.ListField(
        child=serializers.RegexField(
            r"\A" + SECURITY_GROUP_PATTERN.pattern + r"\Z", max_length=30, allow_blank=False
        ),
        max_length=16,
        required=False,
        help_text="Cloud pools: security group ids (sg-…); empty: the VPC's default group.",
    )

    class Meta:
        model = NodePool
        fields = [
            "id",
            "name",
            "slug",
            "kind",
            "gpu_type",
            "site",
            "region",
            "instance_types",
            "capacity_preference",
            "min_nodes",
            "max_nodes",
            "burst_delay_s",
            "idle_timeout_s",
            "enabled",
            "tenancy",
            "fabric",
            "nccl_version",
            "spot_interruption_limit",
            "orphans",
            "image_id",
            "subnet_id",
            "security_group_ids",
            "key_name",
            "instance_profile",
            "created_at",
        ]


# What the node's agent and its provisioning report (read-only).
AGENT_REPORTED = [
    "provision_step",
    "provision_percent",
    "provision_message",
    "agent_version",
    "agent_registered_at",
    "nccl_version",
    "power_w",
    "disk_free_bytes",
    "job_isolation",
    "launched_at",
    "interrupted_at",
    "burst_job",
    "placement_group",
]


# The latest heartbeat's reading of each GPU (read-only).
GPU_REPORTED = [
    "utilization_pct",
    "memory_used_mib",
    "power_w",
    "temperature_c",
    "ecc_errors",
    "reported_at",
]


class NodeSerializer(StrictModelSerializer):
    offered_host_key_fingerprint = serializers.SerializerMethodField()
    suspect_from = serializers.CharField(
        read_only=True, help_text="The state a SUSPECT node returns to; empty otherwise."
    )
    gpu_type = serializers.ChoiceField(choices=GPU_TYPES, required=False)

    class Meta:
        model = Node
        fields = [
            "id",
            "uuid",
            "name",
            "pool",
            "rack",
            "rack_unit",
            "provider",
            "capacity_type",
            "address",
            "ssh_port",
            "ssh_user",
            "host_key",
            "host_key_fingerprint",
            "offered_host_key",
            "offered_host_key_fingerprint",
            "instance_id",
            "instance_type",
            "gpu_type",
            "gpu_count",
            "nameplate_power_w",
            "state",
            "state_reason",
            "state_changed_at",
            "suspect_from",
            "last_heartbeat_at",
            "created_at",
            *AGENT_REPORTED,
        ]
        read_only_fields = [
            "uuid",
            "host_key_fingerprint",
            "offered_host_key",
            "state",
            "state_reason",
            "state_changed_at",
            "suspect_from",
            "last_heartbeat_at",
            *AGENT_REPORTED,
            "created_at",
        ]

    def get_offered_host_key_fingerprint(self, node) -> str:
        return host_key_fingerprint_or_blank(node.offered_host_key)


class NodeUpdateSerializer(NodeSerializer):
    class Meta(NodeSerializer.Meta):
        read_only_fields = [*NodeSerializer.Meta.read_only_fields, "pool", "provider"]


class NodeEventSerializer(StrictModelSerializer):
    from_state = serializers.CharField(
        read_only=True, help_text="Empty for the event that registered the node."
    )

    class Meta:
        model = NodeEvent
        fields = ["id", "node", "at", "from_state", "to_state", "reason", "actor_label"]
        read_only_fields = fields


class GpuSerializer(StrictModelSerializer):
    class Meta:
        model = Gpu
        fields = [
            "id",
            "node",
            "index",
            "uuid",
            "model",
            "memory_mib",
            "health",
            "health_reason",
            *GPU_REPORTED,
        ]
        read_only_fields = GPU_REPORTED
        validators = []


class DrainSerializer(StrictSerializer):
    reason = Text(max_length=300)


class AcceptHostKeySerializer(StrictSerializer):
    fingerprint = Text(
        max_length=100,
        help_text="The SHA256 fingerprint you expect (as `ssh-keygen -lf` prints it); it must "
        "match the key the node offered.",
    )


class OrphanInstanceSerializer(StrictModelSerializer):
    class Meta:
        model = OrphanInstance
        fields = [
            "id",
            "instance_id",
            "region",
            "node_uuid",
            "pool_tag",
            "pool",
            "instance_type",
            "instance_state",
            "launched_at",
            "action",
            "first_seen_at",
            "last_seen_at",
            "gone_at",
        ]
        read_only_fields = fields


TELEMETRY_DEFAULT_SPAN = dt.timedelta(hours=1)
TELEMETRY_MAX_SPAN = max(window.span for window in TELEMETRY_WINDOWS.values())


class TelemetryQuerySerializer(StrictSerializer):
    """A node's telemetry: which span, which GPU, which form."""

    since = serializers.DateTimeField(
        required=False,
        help_text="From this time (ISO 8601); default: an hour before `until`.",
    )
    until = serializers.DateTimeField(
        required=False, help_text="Up to this time (ISO 8601); default: now."
    )
    gpu = serializers.IntegerField(
        min_value=0, max_value=63, required=False, help_text="Only this GPU (its index)."
    )
    format = serializers.ChoiceField(
        choices=["json", "csv"],
        required=False,
        help_text="csv: one row per GPU and point, for a spreadsheet; default json.",
    )

    def validate(self, attrs):
        until = attrs.get("until") or timezone.now()
        since = attrs.get("since") or until - TELEMETRY_DEFAULT_SPAN
        if since >= until:
            raise serializers.ValidationError({"since": ["Must be before until."]})
        if until - since > TELEMETRY_MAX_SPAN:
            days = TELEMETRY_MAX_SPAN.days
            raise serializers.ValidationError(
                {
                    "since": [
                        f"At most {days} days before until (one-minute means are kept {days} days)."
                    ]
                }
            )
        return {**attrs, "since": since, "until": until}


class TelemetryPointSerializer(StrictSerializer):
    at = serializers.DateTimeField(help_text="The reading's time (a minute's or hour's start).")
    utilization_pct = serializers.FloatField(allow_null=True)
    memory_used_mib = serializers.FloatField(allow_null=True)
    temperature_c = serializers.FloatField(allow_null=True)
    power_w = serializers.FloatField(allow_null=True)


class GpuTelemetrySerializer(StrictSerializer):
    gpu = serializers.IntegerField(help_text="The GPU's index on the node.")
    points = TelemetryPointSerializer(many=True)


class NodeTelemetrySerializer(StrictSerializer):
    node = serializers.IntegerField()
    name = serializers.CharField()
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    resolution = serializers.ChoiceField(
        choices=["raw", "minute", "hour"],
        help_text="What a point is, as on the node's page: raw (one heartbeat's reading, the "
        "last hour), minute (one-minute means, up to a day) or hour (the hour's mean of "
        "its minutes, longer spans).",
    )
    gpus = GpuTelemetrySerializer(many=True, help_text="The GPUs that reported, by index.")
