"""Checks on the values an agent sends, as the answers the agent API gives."""

import datetime as dt
import math

from apps.checkpoints.services.states import SHA256
from controlplane.errors import ApplicationError

# --- what an agent sends, checked ---------------------------------------------------------


def invalid_input(field: str, message: str) -> ApplicationError:
    """A 400 naming the field (the agent endpoints use it too)."""
    return ApplicationError(f"Invalid input: {field}.", details={field: [message]})


def _integer(event: dict, name: str, *, default=None, maximum: int = 2**63 - 1) -> int:
    value = event.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise invalid_input(f"event.{name}", f"A whole number from 0 to {maximum}.")
    return value


def _storable(text: str) -> bool:
    """PostgreSQL stores neither NUL nor lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def _clean(text, limit: int = 500) -> str:
    """Free text from an agent, made storable."""
    text = str(text or "").replace("\x00", "")
    return text.encode("utf-8", "replace").decode("utf-8")[:limit]


def _text(event: dict, name: str, *, limit: int = 1024) -> str:
    value = event.get(name)
    if not isinstance(value, str) or not value or len(value) > limit or not _storable(value):
        raise invalid_input(f"event.{name}", f"Text of at most {limit} characters.")
    return value


def _digest(event: dict, name: str = "manifest_sha256") -> str:
    value = event.get(name)
    if not isinstance(value, str) or not SHA256.match(value):
        raise invalid_input(f"event.{name}", "A SHA-256 in lowercase hex.")
    return value


def _instant(value, now):
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 4e9:
        return dt.datetime.fromtimestamp(value, tz=dt.UTC)
    return now


def _finite(value) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def _layout(value) -> dict:
    if not isinstance(value, dict):
        return {}
    return {str(k)[:20]: v for k, v in value.items() if isinstance(v, int) and 0 < v < 2**31}
