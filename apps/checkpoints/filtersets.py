"""One FilterSet per model: the Checkpoints page, its CSV and the API's query parameters filter
alike (`?team_id=2&state=verified`, `?overdue=true`)."""

import django_filters as filters
from django import forms

from apps.checkpoints.models import (
    Checkpoint,
    CheckpointCopy,
    CheckpointState,
    CopyKind,
    CopyState,
    S3Destination,
)
from apps.jobs.models import JobState
from controlplane.filters import ChoicesFilter, IdFilter, InstantFilter


class StepFilter(filters.NumberFilter):
    field_class = forms.IntegerField

    def __init__(self, *args, **kwargs):
        super().__init__(*args, min_value=0, max_value=2**31 - 1, **kwargs)


class CheckpointFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")
    job_id = IdFilter(field_name="job_id")
    node_id = IdFilter(field_name="node_id")
    state = ChoicesFilter(choices=CheckpointState.choices)
    step_min = StepFilter(field_name="step", lookup_expr="gte")
    step_max = StepFilter(field_name="step", lookup_expr="lte")
    since = InstantFilter(field_name="committed_at", lookup_expr="gte")
    attempt = StepFilter(field_name="attempt")

    class Meta:
        model = Checkpoint
        fields = []


class CheckpointCopyFilterSet(filters.FilterSet):
    checkpoint_id = IdFilter(field_name="checkpoint_id")
    job_id = IdFilter(field_name="checkpoint__job_id")
    team_id = IdFilter(field_name="checkpoint__team_id")
    node_id = IdFilter(field_name="node_id")
    kind = filters.ChoiceFilter(choices=CopyKind.choices)
    state = ChoicesFilter(choices=CopyState.choices)

    class Meta:
        model = CheckpointCopy
        fields = []


class JobCheckpointsFilterSet(filters.FilterSet):
    """The jobs of the Checkpoints page (and /api/v1/checkpoint-jobs/), filtering
    selectors.trainer_jobs_visible_to (no model of its own: jobs are another app's rows)."""

    team_id = IdFilter(field_name="team_id")
    state = ChoicesFilter(choices=JobState.choices, label="Job state")
    newest_state = filters.ChoiceFilter(
        field_name="newest_state",
        choices=[*CheckpointState.choices, ("none", "None yet")],
        method="_newest",
        label="Newest checkpoint",
    )
    # Overdue needs each job's step times: running jobs here, the overdue ones picked after
    # (selectors.job_rows(..., overdue_only=overdue_only(params))).
    overdue = filters.BooleanFilter(method="_running", label="Overdue only")
    q = filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")

    def _newest(self, queryset, name, value):
        if value == "none":
            return queryset.filter(newest_state__isnull=True)
        return queryset.filter(newest_state=value)

    def _running(self, queryset, name, value):
        return queryset.filter(state=JobState.RUNNING) if value else queryset


class S3DestinationFilterSet(filters.FilterSet):
    team_id = IdFilter(field_name="team_id")
    pool_id = IdFilter(field_name="pool_id")

    class Meta:
        model = S3Destination
        fields = ["bucket"]


def overdue_only(params) -> bool:
    """Whether `?overdue` asks for overdue jobs only (the page's checkbox sends true)."""
    return params.get("overdue") in ("true", "True", "on", "1")
