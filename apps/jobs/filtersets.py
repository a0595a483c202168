"""Filters for jobs and reservations: API query parameters and page filters alike."""

import django_filters as filters

from apps.jobs.models import Job, JobState, Reservation
from controlplane.filters import ChoicesFilter, IdFilter, InstantFilter


class JobFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")
    state = ChoicesFilter(choices=JobState.choices)
    user = filters.CharFilter(field_name="submitted_by__username")
    since = InstantFilter(field_name="submitted_at", lookup_expr="gte")

    class Meta:
        model = Job
        fields = ["priority_class", "gpu_type", "kind"]


class ReservationFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")

    class Meta:
        model = Reservation
        fields = ["name"]
