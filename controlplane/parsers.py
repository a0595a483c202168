"""The API's request parser (REST_FRAMEWORK's DEFAULT_PARSER_CLASSES), a module of its own:
DRF imports it while its views load, before controlplane.api can be imported."""

from rest_framework import exceptions, parsers


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, for which a body nested past Python's recursion limit is a 400 too."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise exceptions.ParseError("JSON parse error - nested too deeply.") from None
