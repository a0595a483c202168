"""Filters for NCCL profiles: API query parameters and the Profiles page alike."""

import django_filters as filters

from apps.tuning.models import PROFILE_FABRICS, NcclProfile


class NcclProfileFilterSet(filters.FilterSet):
    fabric = filters.ChoiceFilter(choices=PROFILE_FABRICS)
    q = filters.CharFilter(field_name="title", lookup_expr="icontains", label="Title contains")

    class Meta:
        model = NcclProfile
        fields = ["name", "single_node", "is_default", "built_in"]
