"""`{{ text|code_spans }}`: the catalogue's and linter's `NAME` spans as <code>, the rest escaped.

Their texts are written once for the API (plain text, where backticks read as code) and the
pages alike."""

import re

from django import template
from django.utils.html import escape
from django.utils.safestring import mark_safe

register = template.Library()

SPAN = re.compile(r"`([^`\n]+)`")


@register.filter
def code_spans(text) -> str:
    if text in (None, ""):
        return ""
    parts = SPAN.split(str(text))  # even places: prose; odd places: what was in backticks
    return mark_safe(  # noqa: S308  (every part is escaped)
        "".join(
            f"<code>{escape(part)}</code>" if index % 2 else escape(part)
            for index, part in enumerate(parts)
        )
    )
