"""Filters for NCCL profiles and tuning runs: API query parameters and the pages alike."""

import django_filters as filters

from apps.tuning.models import (
    PROFILE_FABRICS,
    NcclProfile,
    TuningRun,
    TuningRunKind,
    TuningRunState,
)
from controlplane.filters import ChoicesFilter, IdFilter


class NcclProfileFilterSet(filters.FilterSet):
    fabric = filters.ChoiceFilter(choices=PROFILE_FABRICS)
    q = filters.CharFilter(field_name="title", lookup_expr="icontains", label="Title contains")

    class Meta:
        model = NcclProfile
        fields = ["name", "single_node", "is_default", "built_in"]


class TuningRunFilterSet(filters.FilterSet):
    """`?pool=ib-h100&state=adopted`: a pool by its slug (or `pool_id`), the profile a run
    measured by name."""

    pool = filters.CharFilter(field_name="pool__slug", label="Pool (its slug)")
    pool_id = IdFilter(field_name="pool_id")
    profile = filters.CharFilter(field_name="profile__name")
    state = ChoicesFilter(choices=TuningRunState.choices)
    kind = filters.ChoiceFilter(choices=TuningRunKind.choices)

    class Meta:
        model = TuningRun
        fields = []
