"""Where a write comes from (address, channel, request id), for the audit log.

The middleware sets it per request; tasks and commands set it with `acting_from`.
Services read it, so their signatures need only say who acts.
"""

import contextlib
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Origin:
    channel: str = "task"
    address: str | None = None
    request_id: uuid.UUID = field(default_factory=uuid.uuid4)
    label: str = ""


_origin: ContextVar[Origin | None] = ContextVar("controlplane_origin", default=None)


def current_origin() -> Origin:
    return _origin.get() or Origin()


@contextlib.contextmanager
def acting_from(origin: Origin):
    token = _origin.set(origin)
    try:
        yield origin
    finally:
        _origin.reset(token)
