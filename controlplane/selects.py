"""A long <select>'s options drawn in one go: a thousand teams' options through a template
loop cost a page ~15 ms (bench/pages.py), joined here well under one."""

from collections.abc import Iterable
from html import escape

from django.utils.safestring import SafeString, mark_safe


def options_html(choices: Iterable[tuple[object, object]], selected: object = None) -> SafeString:
    """<option> elements of (value, label) pairs, escaped, the one whose value reads as
    `selected` (compared as text, as a query parameter is) marked selected."""
    chosen = "" if selected is None else str(selected)
    parts = []
    for value, label in choices:
        value = str(value)
        mark = " selected" if value == chosen else ""
        parts.append(f'<option value="{escape(value)}"{mark}>{escape(str(label))}</option>')
    return mark_safe("".join(parts))  # noqa: S308 (every text above is escaped)
