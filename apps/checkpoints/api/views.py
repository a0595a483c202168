"""API views for checkpoints: the registry (your teams' jobs only), each job's summary with its
watch, storage used per team, and where copies go (ops)."""

from django.db.models import Prefetch
from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.models import TokenScope
from apps.checkpoints import selectors, services
from apps.checkpoints.api import serializers as s
from apps.checkpoints.filtersets import (
    CheckpointCopyFilterSet,
    CheckpointFilterSet,
    JobCheckpointsFilterSet,
    S3DestinationFilterSet,
    overdue_only,
)
from apps.checkpoints.models import CheckpointExport
from controlplane.api import ServiceViewSet


class CheckpointViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Checkpoints of your teams' jobs, newest first, each with its copies. DELETE starts a
    deletion (202): storage first, the row follows once every copy is gone."""

    filterset_class = CheckpointFilterSet
    ordering_fields = ["committed_at", "step", "size_bytes"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex
    required_scope = TokenScope.ADMIN  # deletion and checks; export takes submit (below)

    def get_queryset(self):
        rows = selectors.checkpoints_visible_to(user=self.request.user)
        if self.action == "retrieve":
            rows = rows.prefetch_related(
                "events",
                Prefetch(
                    "exports",
                    queryset=CheckpointExport.objects.select_related("node", "requested_by"),
                ),
            )
        return selectors.with_best(rows).order_by("-committed_at", "-id")

    def get_serializer_class(self):
        if self.action == "retrieve":
            return s.CheckpointDetailSerializer
        return s.CheckpointSerializer

    @extend_schema(request=s.ReasonSerializer, responses={202: s.CheckpointSerializer})
    def destroy(self, request, *args, **kwargs):
        body = s.ReasonSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        checkpoint = services.checkpoint_delete(
            checkpoint=self.get_object(), by=request.user, **body.validated_data
        )
        return Response(s.CheckpointSerializer(checkpoint).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: s.CheckpointSerializer})
    @action(detail=True, methods=["post"])
    def verify(self, request, pk=None):
        """Check every copy again (agents for directories, the control plane for S3)."""
        checkpoint = services.checkpoint_verify_request(
            checkpoint=self.get_object(), by=request.user
        )
        return Response(s.CheckpointSerializer(checkpoint).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=s.ExportOptionsSerializer, responses={202: s.CheckpointExportSerializer})
    # A new directory beside the checkpoint, nothing lost: a submission's scope, not admin's.
    @action(detail=True, methods=["post"], required_scope=TokenScope.SUBMIT)
    def export(self, request, pk=None):
        """Write a committed checkpoint as a Hugging Face Llama directory beside it (by the
        agent of a node that reaches it, as the job's user); its state in the detail's
        `exports`."""
        body = s.ExportOptionsSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        export = services.checkpoint_export_request(
            checkpoint=self.get_object(), by=request.user, **body.validated_data
        )
        return Response(s.CheckpointExportSerializer(export).data, status=status.HTTP_202_ACCEPTED)


class CheckpointCopyViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Copies of your teams' checkpoints. DELETE removes one copy (not the last usable one)."""

    serializer_class = s.CheckpointCopySerializer
    filterset_class = CheckpointCopyFilterSet
    ordering_fields = ["created_at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return selectors.copies_visible_to(user=self.request.user).order_by("-id")

    @extend_schema(request=s.ReasonSerializer, responses={202: s.CheckpointCopySerializer})
    def destroy(self, request, *args, **kwargs):
        body = s.ReasonSerializer(data=request.data or {})
        body.is_valid(raise_exception=True)
        copy = services.copy_delete(copy=self.get_object(), by=request.user, **body.validated_data)
        return Response(s.CheckpointCopySerializer(copy).data, status=status.HTTP_202_ACCEPTED)


class JobCheckpointsViewSet(viewsets.ReadOnlyModelViewSet):
    """Trainer jobs of your teams with their newest and newest verified checkpoint, storage
    used, retention, and the watch: `overdue` when a running job's last verified checkpoint
    is older than twice its expected interval. `?overdue=true` lists only those."""

    serializer_class = s.JobCheckpointsSerializer
    filterset_class = JobCheckpointsFilterSet
    ordering_fields = ["submitted_at", "id"]
    lookup_value_regex = ServiceViewSet.lookup_value_regex

    def get_queryset(self):
        return selectors.trainer_jobs_visible_to(user=self.request.user)

    def _context(self, rows):
        summaries = {r.job.pk: selectors.job_summary(r) for r in rows}
        return {**self.get_serializer_context(), "summaries": summaries}

    def list(self, request, *args, **kwargs):
        jobs = self.filter_queryset(self.get_queryset())
        if overdue_only(request.query_params):
            # The watch needs each job's step times, so overdue is picked from every running
            # job the filters leave (a few hundred at most) before the page is cut.
            found = selectors.job_rows(list(jobs), overdue_only=True)
            page = self.paginate_queryset(found)
            rows = page if page is not None else found
        else:
            page = self.paginate_queryset(jobs)
            rows = selectors.job_rows(list(page if page is not None else jobs))
        data = s.JobCheckpointsSerializer(rows, many=True, context=self._context(rows)).data
        return self.get_paginated_response(data) if page is not None else Response(data)

    def retrieve(self, request, *args, **kwargs):
        job = self.get_queryset().filter(pk=kwargs["pk"]).first()
        if job is None:
            raise Http404
        rows = selectors.job_rows([job], overdue_only=overdue_only(request.query_params))
        if not rows:
            raise Http404
        context = self._context(rows)
        return Response(s.JobCheckpointsSerializer(rows[0], context=context).data)


class StorageView(APIView):
    """Bytes held by checkpoints per team: on nodes' disks, on shared storage and in S3."""

    @extend_schema(responses=s.StorageSerializer(many=True))
    def get(self, request):
        rows = selectors.storage_by_team(user=request.user)
        return Response(s.StorageSerializer(rows, many=True).data)


class S3DestinationViewSet(ServiceViewSet):
    """Where a team's (or a pool's) checkpoints are copied in S3: a team's members read its
    own; ops and finance read every one; ops write."""

    serializer_class = s.S3DestinationSerializer
    filterset_class = S3DestinationFilterSet
    ordering_fields = ["id"]
    create_service = services.s3_destination_create
    update_service = services.s3_destination_update
    delete_service = services.s3_destination_delete
    instance_kwarg = "destination"

    def get_queryset(self):
        return selectors.s3_destinations_visible_to(user=self.request.user)
