"""One FilterSet per fleet model: API query parameters, page filters and CSV exports."""

import django_filters as filters

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
from controlplane.filters import ChoicesFilter, IdFilter


class SiteFilterSet(filters.FilterSet):
    q = filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")

    class Meta:
        model = Site
        fields = ["slug"]


class RackFilterSet(filters.FilterSet):
    site_id = IdFilter(field_name="site_id")
    q = filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")

    class Meta:
        model = Rack
        fields = ["name"]


class InstanceTypeFilterSet(filters.FilterSet):
    class Meta:
        model = InstanceType
        fields = ["name", "gpu_type"]


class NodePoolFilterSet(filters.FilterSet):
    site_id = IdFilter(field_name="site_id")

    class Meta:
        model = NodePool
        fields = [
            "slug",
            "kind",
            "gpu_type",
            "enabled",
            "capacity_preference",
            "fabric",
            "orphans",
            "tenancy",
        ]


class NodeFilterSet(filters.FilterSet):
    # By name for people (the Fleet page's selects), by id for scripts and links.
    pool = filters.ModelChoiceFilter(
        field_name="pool",
        to_field_name="slug",
        queryset=NodePool.objects.order_by("name"),
        label="Pool",
    )
    site = filters.ModelChoiceFilter(
        field_name="rack__site",
        to_field_name="slug",
        queryset=Site.objects.order_by("name"),
        label="Site",
    )
    rack = filters.CharFilter(field_name="rack__name", label="Rack name")
    pool_id = IdFilter(field_name="pool_id")
    rack_id = IdFilter(field_name="rack_id")
    site_id = IdFilter(field_name="rack__site_id")
    state = ChoicesFilter(choices=Node._meta.get_field("state").choices)
    q = filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")

    class Meta:
        model = Node
        fields = ["provider", "capacity_type", "gpu_type", "instance_id"]


class NodeEventFilterSet(filters.FilterSet):
    node_id = IdFilter(field_name="node_id")

    class Meta:
        model = NodeEvent
        fields = ["to_state"]


class GpuFilterSet(filters.FilterSet):
    node_id = IdFilter(field_name="node_id")

    class Meta:
        model = Gpu
        fields = ["health", "model"]


class OrphanInstanceFilterSet(filters.FilterSet):
    pool_id = IdFilter(field_name="pool_id")
    live = filters.BooleanFilter(
        field_name="gone_at", lookup_expr="isnull", label="Still running when last swept"
    )

    class Meta:
        model = OrphanInstance
        fields = ["region", "action", "instance_id"]
