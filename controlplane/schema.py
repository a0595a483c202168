"""The OpenAPI schema: every operation documents its error responses and their shape."""

from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers

ErrorSerializer = inline_serializer(
    name="Error",
    fields={
        "error": inline_serializer(
            name="ErrorBody",
            fields={
                "code": serializers.CharField(),
                "message": serializers.CharField(),
                "details": serializers.DictField(),
            },
        )
    },
)

_ERRORS_ALWAYS = {
    "401": "Not authenticated, or the token is expired or revoked.",
    "403": "Authenticated, but the role or the token's scope does not allow this.",
    "406": "The Accept header asks for something other than JSON.",
}
_ERRORS_WITH_BODY = {
    "400": "Invalid input: `details` names each field and the reason.",
    "413": "The body is over the server's limit (DATA_UPLOAD_MAX_MEMORY_SIZE, 2.5 MB).",
    "415": "The body is not JSON (the API accepts application/json only).",
}
_ERRORS_ON_OBJECT = {
    "404": "No such object, or it belongs to a team you are not in.",
}
_ERRORS_ON_LIST = {
    "400": "A filter value is invalid: `details` names the parameter.",
    "404": "The page does not exist.",
}
_ERRORS_ON_QUERY = "A query parameter is invalid: `details` names it and the reason."


class Schema(AutoSchema):
    """Document the error responses every endpoint can give, with their one shape."""

    def _get_response_bodies(self, direction="response"):
        responses = super()._get_response_bodies(direction)
        errors = dict(_ERRORS_ALWAYS)
        has_body = self.method in ("POST", "PUT", "PATCH")
        if has_body:
            errors.update(_ERRORS_WITH_BODY)
        if self._is_list_view():
            errors.update(_ERRORS_ON_LIST)
        elif self.method == "GET" and any(p.get("in") == "query" for p in self._get_parameters()):
            errors["400"] = _ERRORS_ON_QUERY  # a report's filters, checked as a list's are
        if "{" in self.path:
            errors.update(_ERRORS_ON_OBJECT)
        if self.method != "GET":
            errors["409"] = "The object's current state does not allow this."
        for code, description in errors.items():
            if code not in responses:
                responses[code] = self._get_response_for_code(
                    OpenApiResponse(response=ErrorSerializer, description=description),
                    code,
                    direction=direction,
                )
        return responses


class ScopedPrimaryKeyFieldScheme(OpenApiSerializerFieldExtension):
    """A team-scoped foreign key is an integer id in the schema."""

    target_class = "controlplane.api.ScopedPrimaryKeyField"

    def map_serializer_field(self, auto_schema, direction):
        return {"type": "integer", "minimum": 1, "maximum": 9223372036854775807}
