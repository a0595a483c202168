"""API views for the fleet: CRUD for inventory, and the operations on nodes."""

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response

from apps.fleet import selectors, services
from apps.fleet.api import serializers as s
from apps.fleet.filtersets import (
    GpuFilterSet,
    InstanceTypeFilterSet,
    NodeEventFilterSet,
    NodeFilterSet,
    NodePoolFilterSet,
    OrphanInstanceFilterSet,
    RackFilterSet,
    SiteFilterSet,
)
from apps.fleet.models import Gpu, InstanceType, NodeEvent, OrphanInstance, Site
from controlplane.api import ServiceViewSet
from controlplane.exports import CsvRenderer, csv_errors_as_json, csv_response


class SiteViewSet(ServiceViewSet):
    queryset = Site.objects.all()
    serializer_class = s.SiteSerializer
    filterset_class = SiteFilterSet
    ordering_fields = ["name", "created_at"]
    create_service = services.site_create
    update_service = services.site_update
    delete_service = services.site_delete
    instance_kwarg = "site"


class RackViewSet(ServiceViewSet):
    serializer_class = s.RackSerializer
    filterset_class = RackFilterSet
    ordering_fields = ["name", "created_at"]
    create_service = services.rack_create
    update_service = services.rack_update
    delete_service = services.rack_delete
    instance_kwarg = "rack"

    def get_queryset(self):
        return selectors.racks_for_listing()


class InstanceTypeViewSet(ServiceViewSet):
    queryset = InstanceType.objects.all()
    serializer_class = s.InstanceTypeSerializer
    filterset_class = InstanceTypeFilterSet
    ordering_fields = ["name", "gpu_type"]
    create_service = services.instance_type_create
    update_service = services.instance_type_update
    delete_service = services.instance_type_delete
    instance_kwarg = "instance_type"


class NodePoolViewSet(ServiceViewSet):
    serializer_class = s.NodePoolSerializer
    filterset_class = NodePoolFilterSet
    ordering_fields = ["name", "created_at"]
    create_service = services.pool_create
    update_service = services.pool_update
    delete_service = services.pool_delete
    instance_kwarg = "pool"

    def get_queryset(self):
        return selectors.pools_for_listing()


class NodeViewSet(ServiceViewSet):
    filterset_class = NodeFilterSet
    ordering_fields = ["name", "state", "created_at", "last_heartbeat_at"]
    create_service = services.node_create
    update_service = services.node_update
    delete_service = services.node_delete
    instance_kwarg = "node"

    def get_queryset(self):
        return selectors.nodes_for_listing()

    def get_serializer_class(self):
        if self.action in ("update", "partial_update"):
            return s.NodeUpdateSerializer
        return s.NodeSerializer

    def _answer(self, node):
        return Response(s.NodeSerializer(node, context=self.get_serializer_context()).data)

    @extend_schema(request=s.DrainSerializer, responses=s.NodeSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request, pk=None):
        """Stop placing work on the node; an idle node is DRAINED at once."""
        body = s.DrainSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        node = services.node_drain(node=self.get_object(), by=request.user, **body.validated_data)
        return self._answer(node)

    @extend_schema(request=None, responses=s.NodeSerializer)
    @action(detail=True, methods=["post"])
    def undrain(self, request, pk=None):
        """Return a drained node to service."""
        return self._answer(services.node_undrain(node=self.get_object(), by=request.user))

    @extend_schema(request=s.AcceptHostKeySerializer, responses=s.NodeSerializer)
    @action(detail=True, methods=["post"], url_path="accept-host-key")
    def accept_host_key(self, request, pk=None):
        """Pin the host key the node offered, after checking its fingerprint."""
        body = s.AcceptHostKeySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        node = services.node_host_key_accept(
            node=self.get_object(), by=request.user, **body.validated_data
        )
        return self._answer(node)

    @extend_schema(request=None, responses=s.NodeSerializer)
    @action(detail=True, methods=["post"])
    def provision(self, request, pk=None):
        """Ask a worker to bring the node up again (a failed, drained or requested node)."""
        return self._answer(services.node_provision(node=self.get_object(), by=request.user))

    @extend_schema(
        parameters=[s.TelemetryQuerySerializer],
        responses={
            (200, "application/json"): s.NodeTelemetrySerializer,
            (200, "text/csv"): OpenApiTypes.STR,
        },
    )
    @action(
        detail=True,
        methods=["get"],
        filter_backends=[],
        pagination_class=None,
        renderer_classes=[JSONRenderer, CsvRenderer],
    )
    def telemetry(self, request, pk=None):
        """Each GPU's utilisation, memory used, temperature and power over a span (the last
        hour unless `since` and `until` say), at the node page's resolution: raw readings
        for an hour or less of the last day, one-minute means up to a day, hourly means of
        them past it (up to 30 days). `format=csv`: one row per GPU and point."""
        node = self.get_object()
        query = s.TelemetryQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        since, until = query.validated_data["since"], query.validated_data["until"]
        window = selectors.telemetry_window_for(since=since, until=until)
        gpus = selectors.node_gpu_telemetry(
            node_id=node.pk,
            window=window,
            since=since,
            until=until,
            gpu=query.validated_data.get("gpu"),
        )
        if isinstance(request.accepted_renderer, CsvRenderer):
            return csv_response(
                f"{node.name}-telemetry.csv",
                ["node", "gpu", "at", *selectors.TELEMETRY_METRICS],
                (
                    [node.name, series["gpu"], point["at"].isoformat()]
                    + [point[metric] for metric in selectors.TELEMETRY_METRICS]
                    for series in gpus
                    for point in series["points"]
                ),
            )
        answer = {
            "node": node.pk,
            "name": node.name,
            "since": since,
            "until": until,
            "resolution": window.resolution,
            "gpus": gpus,
        }
        return Response(s.NodeTelemetrySerializer(answer).data)

    def finalize_response(self, request, response, *args, **kwargs):
        csv_errors_as_json(request, response)
        return super().finalize_response(request, response, *args, **kwargs)


class NodeEventViewSet(viewsets.ReadOnlyModelViewSet):
    queryset = NodeEvent.objects.all()
    serializer_class = s.NodeEventSerializer
    filterset_class = NodeEventFilterSet
    ordering_fields = ["at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex


class OrphanInstanceViewSet(viewsets.ReadOnlyModelViewSet):
    """Instances with our control-plane tag that no node knows, as the orphan sweep found
    them: reported, or terminated where their pool's `orphans` policy says so."""

    queryset = OrphanInstance.objects.all()
    serializer_class = s.OrphanInstanceSerializer
    filterset_class = OrphanInstanceFilterSet
    ordering_fields = ["last_seen_at", "first_seen_at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex


class GpuViewSet(ServiceViewSet):
    queryset = Gpu.objects.select_related("node")
    serializer_class = s.GpuSerializer
    filterset_class = GpuFilterSet
    ordering_fields = ["index", "health"]
    create_service = services.gpu_create
    update_service = services.gpu_update
    delete_service = services.gpu_delete
    instance_kwarg = "gpu"
