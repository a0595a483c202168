"""API views for NCCL settings: profiles and their versions (ops write), the catalogue, and
the linter."""

from dataclasses import asdict

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import generics
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.models import TokenScope
from apps.tuning import catalogue, linter, selectors, services
from apps.tuning.api import serializers as s
from apps.tuning.filtersets import NcclProfileFilterSet
from controlplane.api import ServiceViewSet


class NcclProfileViewSet(ServiceViewSet):
    """NCCL profiles: every signed-in user reads them; ops create, edit and delete them.

    A profile that does not pass the linter is refused with a 400 naming each variable
    (`env.NCCL_...`); a warning is kept only with `reasons.NAME`.
    """

    serializer_class = s.NcclProfileSerializer
    filterset_class = NcclProfileFilterSet
    ordering_fields = ["name", "updated_at"]
    create_service = services.nccl_profile_create
    update_service = services.nccl_profile_update
    delete_service = services.nccl_profile_delete
    instance_kwarg = "profile"

    def get_queryset(self):
        return selectors.profiles_visible()


class NcclLintView(APIView):
    """Lint an environment block (or a mapping) for the nodes described; writes nothing."""

    required_scope = TokenScope.READ

    @extend_schema(request=s.LintRequestSerializer, responses=s.LintResultSerializer)
    def post(self, request):
        body = s.LintRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        data = body.validated_data
        context = linter.Context(
            fabric=data["fabric"],
            nccl_version=data["nccl_version"],
            single_node=data["single_node"],
        )
        if "env" in data:
            verdicts, ignored = linter.lint(data["env"], context=context), 0
        else:
            verdicts, parsed = linter.lint_text(data["text"], context=context)
            ignored = parsed.ignored_lines
        return Response(
            {
                "verdicts": [v.as_dict() for v in verdicts],
                "counts": linter.counts(verdicts),
                "ignored_lines": ignored,
            }
        )


class NcclVariablesView(APIView):
    """The catalogue: every NCCL, PyTorch-NCCL and EFA variable the linter knows."""

    @extend_schema(responses=s.VariableSerializer(many=True))
    def get(self, request):
        rows = [{**asdict(var), "family": var.family} for var in catalogue.VARIABLES.values()]
        return Response(s.VariableSerializer(sorted(rows, key=lambda r: r["name"]), many=True).data)


def _profile(name: str):
    profile = selectors.profile_named(name=name)
    if profile is None:
        raise Http404
    return profile


class NcclProfileVersionsView(generics.ListAPIView):
    """A profile's versions, newest first: each one's environment, where it came from (an
    edit, a tuning run's adoption, a restore), who made it and when."""

    serializer_class = s.NcclProfileVersionSerializer
    filter_backends = []

    def get_queryset(self):
        return selectors.profile_versions(profile=_profile(self.kwargs["name"]))


class NcclProfileVersionRestoreView(APIView):
    """Make an earlier version the profile's environment again, as its next version (ops):
    linted like any edit; 409 for the current version."""

    @extend_schema(request=None, responses=s.NcclProfileSerializer)
    def post(self, request, name: str, number: str):
        version = selectors.profile_versions(profile=_profile(name)).filter(number=number).first()
        if version is None:
            raise Http404
        profile = services.nccl_profile_version_restore(version=version, by=request.user)
        return Response(s.NcclProfileSerializer(profile).data)
