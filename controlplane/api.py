"""The REST API's shared parts: the error shape, strict serializers, service-backed viewsets."""

import logging

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import models
from django.http import Http404
from rest_framework import exceptions, serializers, status, viewsets
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.errors import ApplicationError

log = logging.getLogger(__name__)

# PostgreSQL's column ranges, enforced on every backend so SQLite and
# PostgreSQL answer the same 400 for an integer that does not fit.
INTEGER_RANGES = {
    models.SmallIntegerField: (-32768, 32767),
    models.PositiveSmallIntegerField: (0, 32767),
    models.IntegerField: (-2147483648, 2147483647),
    models.PositiveIntegerField: (0, 2147483647),
    models.BigIntegerField: (-9223372036854775808, 9223372036854775807),
    models.PositiveBigIntegerField: (0, 9223372036854775807),
}


def integer_range(model_field) -> tuple[int, int] | None:
    for klass in type(model_field).__mro__:
        if klass in INTEGER_RANGES:
            return INTEGER_RANGES[klass]
    return None


def unstorable_text_problem(value: str) -> str | None:
    """Why PostgreSQL could not store or compare `value`, or None: it takes neither NUL nor
    lone UTF-16 surrogates."""
    if "\x00" in value:
        return "Null characters are not allowed."
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "Text must be valid Unicode (no lone surrogates)."
    return None


def reject_unstorable_text(value: str) -> None:
    """Refuse unstorable text up front, before any query or message uses it."""
    problem = unstorable_text_problem(value)
    if problem is not None:
        raise serializers.ValidationError(problem)


def showable(value):
    """`value` (text, or dicts and lists of it) with what UTF-8 cannot carry (a lone surrogate
    echoed from the input) escaped, so an error that names it still renders."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {showable(key): showable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [showable(item) for item in value]
    return value


class StorableTextMixin:
    """Refuse unstorable text before any validator (a uniqueness check included) queries with it."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        reject_unstorable_text(value)
        return value


_storable_classes: dict[type, type] = {}


def storable(field_class: type) -> type:
    if issubclass(field_class, StorableTextMixin):
        return field_class
    if field_class not in _storable_classes:
        _storable_classes[field_class] = type(
            field_class.__name__, (StorableTextMixin, field_class), {}
        )
    return _storable_classes[field_class]


# Unknown fields are an error, not silently dropped; text and integers fit the database.
# (Comments, not docstrings, on these bases: the schema would show a docstring on
# every serializer and view that inherits it.)
class StrictSerializerMixin:
    def to_internal_value(self, data):
        if isinstance(data, dict):
            writable = {name for name, field in self.fields.items() if not field.read_only}
            unknown = sorted(str(key) for key in data if key not in writable)
            if unknown:
                raise serializers.ValidationError({key: ["Unknown field."] for key in unknown})
        return super().to_internal_value(data)

    def build_standard_field(self, field_name, model_field):
        field_class, field_kwargs = super().build_standard_field(field_name, model_field)
        bounds = integer_range(model_field)
        if bounds is not None:
            low, high = bounds
            field_kwargs["min_value"] = max(field_kwargs.get("min_value", low), low)
            field_kwargs["max_value"] = min(field_kwargs.get("max_value", high), high)
        if issubclass(field_class, serializers.CharField):
            field_class = storable(field_class)
        return field_class, field_kwargs


class StrictModelSerializer(StrictSerializerMixin, serializers.ModelSerializer):
    pass


class StrictSerializer(StrictSerializerMixin, serializers.Serializer):
    pass


class SharedFieldsMixin:
    """Build the serializer's fields once per process instead of once per instance.

    DRF deep-copies every declared field (nested serializers' fields included) for
    each serializer instance, which on a hot endpoint costs more than the
    validation itself. Only for serializers whose fields read nothing from the
    request or the instance's context, and that never run partial updates: the
    shared fields are bound to one prototype, whose context is empty.
    """

    @property
    def fields(self):
        cls = type(self)
        shared = cls.__dict__.get("_shared_fields")
        if shared is None:
            prototype = cls.__new__(cls)
            serializers.BaseSerializer.__init__(prototype)
            shared = serializers.Serializer.fields.func(prototype)
            cls._shared_fields = shared
        return shared


class Text(StorableTextMixin, serializers.CharField):
    """A CharField for plain serializers that refuses what the database cannot store."""


class TextKeyedDictField(serializers.DictField):
    """A JSON object whose keys are storable text of at most `max_key_length` characters,
    checked before anything (an error message included) uses them."""

    def __init__(self, *, max_key_length: int = 128, **kwargs):
        self.max_key_length = max_key_length
        super().__init__(**kwargs)

    def to_internal_value(self, data):
        if isinstance(data, dict):
            for key in data:
                problem = unstorable_text_problem(str(key))
                if problem is None and len(str(key)) > self.max_key_length:
                    problem = f"At most {self.max_key_length} characters."
                if problem is not None:
                    raise serializers.ValidationError(f"Names: {problem}")
        return super().to_internal_value(data)


class ScopedPrimaryKeyField(serializers.PrimaryKeyRelatedField):
    """A foreign key limited to what the requesting user may see (others "do not exist")."""

    def __init__(self, *, selector, **kwargs):
        self.selector = selector
        super().__init__(**kwargs)

    def get_queryset(self):
        return self.selector(user=self.context["request"].user)


# CRUD whose writes go through the app's services (which check roles and audit).
# Subclasses name the services; `instance_kwarg` is the keyword the update and
# delete services take the object by (`site=`, `node=`...).
class ServiceViewSet(viewsets.ModelViewSet):
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    create_service = None
    update_service = None
    delete_service = None
    instance_kwarg = "instance"
    # Integer ids only: anything else is a plain 404 before any query runs.
    lookup_value_regex = "[0-9]{1,18}"

    def perform_create(self, serializer):
        serializer.instance = type(self).create_service(
            by=self.request.user, **serializer.validated_data
        )

    def perform_update(self, serializer):
        serializer.instance = type(self).update_service(
            by=self.request.user,
            **{self.instance_kwarg: serializer.instance},
            **serializer.validated_data,
        )

    def perform_destroy(self, instance):
        type(self).delete_service(by=self.request.user, **{self.instance_kwarg: instance})


def error_body(code: str, message: str, details=None) -> dict:
    return {"error": {"code": code, "message": message, "details": details or {}}}


def _validation_message(detail) -> str:
    if isinstance(detail, dict):
        fields = ", ".join(str(key) for key in detail)
        return f"Invalid input: {fields}."
    return "Invalid input."


def exception_handler(exc, context):
    """Render every API error as `{"error": {"code", "message", "details"}}`."""
    if isinstance(exc, ApplicationError):
        body = error_body(exc.code, exc.message, exc.details)
        return Response(showable(body), status=exc.status)
    if isinstance(exc, DjangoValidationError):
        detail = (
            exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        )
        exc = exceptions.ValidationError(detail)
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()

    response = drf_exception_handler(exc, context)
    if response is None:
        return None  # a real bug: let Django log it and answer 500
    if isinstance(exc, exceptions.ValidationError):
        detail = exc.detail if isinstance(exc.detail, dict) else {"non_field_errors": exc.detail}
        response.data = error_body("invalid", _validation_message(detail), detail)
    else:
        codes = exc.get_codes() if hasattr(exc, "get_codes") else "error"
        code = codes if isinstance(codes, str) else "error"
        message = str(exc.detail) if hasattr(exc, "detail") else str(exc)
        response.data = error_body(code, message)
    response.data = showable(response.data)
    return response


def not_found_json(request, exception=None):
    from django.http import JsonResponse

    return JsonResponse(error_body("not_found", "Not found."), status=status.HTTP_404_NOT_FOUND)


def server_error_json(request):
    from django.http import JsonResponse

    return JsonResponse(
        error_body("server_error", "Internal error; it has been logged."),
        status=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )
