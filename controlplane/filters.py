"""Filter fields shared by every app's FilterSets."""

import django_filters as filters
from django import forms

BIGINT_MAX = 9223372036854775807


class IdFilter(filters.NumberFilter):
    """A foreign-key id (`team_id`, `pool_id`): a positive integer that fits a bigint column."""

    field_class = forms.IntegerField

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("min_value", 1)
        kwargs.setdefault("max_value", BIGINT_MAX)
        super().__init__(*args, **kwargs)
