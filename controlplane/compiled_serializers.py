"""DRF serializers compiled, once per process, into plain Python for the API's hottest
request (a job submission): the same validated data and the same answer for a fraction of
the CPU.

DRF validates and represents field by field through several layers of generic calls
(empty values, defaults, validators, error collection, attribute look-ups), which for a
job submission cost about as much as writing the job (bench/RESULTS.md).

The compiled check (compile_check) walks the same fields and takes the common case
directly: an int for an IntegerField within its bounds, a known string for a
ChoiceField, a bool for a BooleanField, storable text within its lengths, a nested
serializer compiled alike. Every other field (lists, dicts, decimals, regexes, custom
fields) is handed to DRF's own `field.run_validation`, and a serializer's
`validate_<field>` methods run as DRF runs them, so what the check returns is what DRF
would have. Anything it cannot vouch for (an error, a null, a type DRF would coerce, a
serializer with its own `validate` or validators) raises NotPlain: the caller then runs
the serializer, which gives the answer and the error messages.

The compiled representation (compile_representation) reads each field's attribute
directly where its source is one plain attribute and calls the field's own
`to_representation`, as DRF does, without DRF's per-field look-up machinery.

tests/controlplane/test_compiled_serializers.py holds both equal to DRF.
"""

from collections.abc import Callable

from django.core import validators as django_validators
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import fields as drf_fields
from rest_framework import relations, serializers
from rest_framework.exceptions import ValidationError
from rest_framework.fields import SkipField, empty

from controlplane.api import SharedFieldsMixin, StrictSerializerMixin, Text

Check = Callable[[object], dict]
Representation = Callable[[object], dict]


class NotPlain(Exception):
    """The body is not one the compiled check vouches for: let the serializer decide."""


def compile_check(serializer_class: type[serializers.Serializer]) -> Check:
    """check(data) -> the validated data the serializer would give, or raises NotPlain."""
    return _compile(serializer_class())


def _compile(serializer: serializers.Serializer) -> Check:
    if type(serializer).validate is not serializers.Serializer.validate or serializer.validators:
        return _by_drf(serializer.run_validation)  # checks of the whole: DRF runs them
    steps = []
    for field in serializer._writable_fields:
        name = field.field_name
        if field.source_attrs != [name]:
            return _by_drf(serializer.run_validation)  # a dotted or renamed source
        validate_method = getattr(serializer, f"validate_{name}", None)
        steps.append(
            (
                name,
                _value_check(field),
                field.required,
                field.default,
                _by_drf(validate_method) if validate_method is not None else None,
            )
        )
    names = frozenset(step[0] for step in steps)
    strict = isinstance(serializer, StrictSerializerMixin)

    def check(data) -> dict:
        if type(data) is not dict:
            raise NotPlain
        if strict and not names.issuperset(data):
            raise NotPlain  # an unknown field
        validated = {}
        for name, value_check, required, default, validate_method in steps:
            value = data.get(name, empty)
            if value is empty:
                if required:
                    raise NotPlain
                if default is empty:
                    continue
                if callable(default):
                    raise NotPlain
                value = default  # as DRF gives it: the default itself, not checked
            elif value is None:
                raise NotPlain  # null, allowed or not: DRF decides
            else:
                value = value_check(value)
            if validate_method is not None:
                value = validate_method(value)
            validated[name] = value
        return validated

    return check


def _value_check(field) -> Callable[[object], object]:
    """The check of one field's given, non-null value."""
    if isinstance(field, serializers.Serializer):
        return _compile(field)
    kind = type(field)
    validators = field.validators
    if any(callable(getattr(v, "limit_value", None)) for v in validators):
        return _by_drf(field.run_validation)  # a limit worked out per call
    if kind is drf_fields.IntegerField and _only(validators, _BOUNDS):
        low, high = _bounds(validators)

        def integer(value):
            if type(value) is int and low <= value <= high:
                return value
            raise NotPlain

        return integer
    if kind is drf_fields.ChoiceField and not validators:
        choices = dict(field.choice_strings_to_values)

        def choice(value):
            if type(value) is str and value and value in choices:
                return choices[value]
            raise NotPlain

        return choice
    if kind is drf_fields.BooleanField and not validators:

        def boolean(value):
            if type(value) is bool:
                return value
            raise NotPlain

        return boolean
    if kind is Text and _only(validators, _TEXT):
        shortest, longest = _lengths(validators)
        trim = field.trim_whitespace

        def text(value):
            if type(value) is not str:
                raise NotPlain
            if trim:
                value = value.strip()
            if not value or "\x00" in value or not shortest <= len(value) <= longest:
                raise NotPlain  # blank, or refused
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise NotPlain from None  # a lone surrogate
            return value

        return text
    return _by_drf(field.run_validation)


def _by_drf(validation: Callable[[object], object]) -> Callable[[object], object]:
    """One of DRF's own steps (a field's or serializer's run_validation, a validate_<field>
    method), its refusals as NotPlain so the serializer gives them with their messages."""

    def by_drf(value):
        try:
            return validation(value)
        except (SkipField, ValidationError, DjangoValidationError):
            raise NotPlain from None

    return by_drf


_BOUNDS = (django_validators.MinValueValidator, django_validators.MaxValueValidator)
_TEXT = (
    django_validators.MinLengthValidator,
    django_validators.MaxLengthValidator,
    django_validators.ProhibitNullCharactersValidator,
    drf_fields.ProhibitSurrogateCharactersValidator,
)


def _only(validators, kinds) -> bool:
    return all(type(v) in kinds for v in validators)


def _bounds(validators) -> tuple[float, float]:
    low, high = float("-inf"), float("inf")
    for v in validators:
        if type(v) is django_validators.MinValueValidator:
            low = max(low, v.limit_value)
        else:
            high = min(high, v.limit_value)
    return low, high


def _lengths(validators) -> tuple[float, float]:
    shortest, longest = 0, float("inf")
    for v in validators:
        if type(v) is django_validators.MinLengthValidator:
            shortest = max(shortest, v.limit_value)
        elif type(v) is django_validators.MaxLengthValidator:
            longest = min(longest, v.limit_value)
    return shortest, longest


def compile_representation(serializer_class: type[serializers.Serializer]) -> Representation:
    """represent(instance) -> what serializer_class(instance).data holds (a plain dict).

    For serializers whose fields read nothing from the context (SharedFieldsMixin); any
    other is represented by DRF itself."""
    serializer = serializer_class()
    if (
        not isinstance(serializer, SharedFieldsMixin)  # its fields may read the context
        or type(serializer).to_representation is not serializers.Serializer.to_representation
    ):
        return lambda instance: dict(serializer_class(instance).data)
    steps = []
    for field in serializer._readable_fields:
        attrs = field.source_attrs
        plain = (
            len(attrs) == 1
            and not isinstance(field, serializers.BaseSerializer | relations.RelatedField)
            and type(field).get_attribute is drf_fields.Field.get_attribute
        )
        steps.append((field.field_name, attrs[0] if plain else None, field))

    def represent(instance) -> dict:
        answer = {}
        for name, attr, field in steps:
            if attr is not None:
                try:
                    value = getattr(instance, attr)
                except Exception:  # DRF, asked again, gives the default, None or the error
                    value = _attribute_by_drf(field, instance)
                else:
                    if callable(value):
                        value = _attribute_by_drf(field, instance)
            else:
                value = _attribute_by_drf(field, instance)
            if value is _SKIP:
                continue
            if (value.pk if isinstance(value, relations.PKOnlyObject) else value) is None:
                answer[name] = None
            else:
                answer[name] = field.to_representation(value)
        return answer

    return represent


_SKIP = object()


def _attribute_by_drf(field, instance):
    try:
        return field.get_attribute(instance)
    except SkipField:
        return _SKIP
