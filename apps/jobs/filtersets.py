"""Filters for jobs and reservations: API query parameters and page filters alike."""

import django_filters as filters

from apps.jobs.models import Job, JobState, Reservation
from apps.jobs.models.jobs import FINISHED_STATES
from controlplane.filters import ChoicesFilter, IdFilter, InstantFilter


class JobFilterSet(filters.FilterSet):
    """The API's job list, the Queue and the History (the pages filter by team slug)."""

    team_id = IdFilter(field_name="team_id")
    team = filters.CharFilter(field_name="team__slug")
    state = ChoicesFilter(choices=JobState.choices, method="_in_states")
    user = filters.CharFilter(field_name="submitted_by__username")
    since = InstantFilter(field_name="submitted_at", lookup_expr="gte")

    class Meta:
        model = Job
        fields = ["priority_class", "gpu_type", "kind"]

    def _in_states(self, queryset, name, states):
        if not states:
            return queryset
        queryset = queryset.filter(state__in=states)
        # Live states only: through the index of live jobs (Job.objects.live), not every
        # job kept.
        return queryset if FINISHED_STATES.intersection(states) else queryset.live()


class ReservationFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")

    class Meta:
        model = Reservation
        fields = ["name"]
