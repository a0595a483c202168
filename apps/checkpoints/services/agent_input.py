"""The values agents send, made storable, and the answer the agent API gives to a bad one."""

import datetime as dt
import math

from controlplane.errors import ApplicationError


def invalid_input(field: str, message: str) -> ApplicationError:
    """A 400 naming the field (the agent endpoints use it too)."""
    return ApplicationError(f"Invalid input: {field}.", details={field: [message]})


def storable(text: str) -> bool:
    """PostgreSQL stores neither NUL nor lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def clean_text(text, limit: int = 500) -> str:
    """Free text from an agent, made storable."""
    text = str(text or "").replace("\x00", "")
    return text.encode("utf-8", "replace").decode("utf-8")[:limit]


def instant_or(value, now):
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 4e9:
        return dt.datetime.fromtimestamp(value, tz=dt.UTC)
    return now


def finite_or_none(value) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def layout_of(value) -> dict:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:20]: v for k, v in value.items() if isinstance(v, int) and 0 < v < 2**31}
