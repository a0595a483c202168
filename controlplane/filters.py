"""Filter fields shared by every app's FilterSets."""

import datetime as dt

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


class _ChoicesField(filters.fields.MultipleChoiceField):
    def clean(self, value):
        return super().clean([v for v in (value or []) if v != ""])


class ChoicesFilter(filters.MultipleChoiceFilter):
    """`?state=running&state=pending`; an empty value (a page's "any" option) means no filter,
    where django-filter's own refuses it as not one of the choices."""

    field_class = _ChoicesField


class UtcIsoDateTimeField(filters.fields.IsoDateTimeField):
    """An ISO 8601 instant, turned into UTC before any query.

    PostgreSQL refuses UTC offsets beyond ±15:59 that ISO 8601 and Python allow,
    so an odd offset would otherwise reach the database and fail there.
    """

    def to_python(self, value):
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(dt.UTC)
        except (OverflowError, ValueError):
            raise forms.ValidationError("The instant is out of range.", code="invalid") from None


class InstantFilter(filters.IsoDateTimeFilter):
    field_class = UtcIsoDateTimeField
