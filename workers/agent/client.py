"""Talking to the control plane over HTTP(S) with the node token, and riding out its absence.

`ControlPlane.call` makes one request. `Outbox` holds the reports that must
arrive (a run's exit, a spot notice) and sends them in order, retrying with
backoff while the control plane is unreachable; the job meanwhile keeps running.
"""

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("agent")


class Unreachable(Exception):
    """No answer (connection refused, timeout, 5xx): worth trying again later."""


class Refused(Exception):
    """The control plane answered and said no (4xx): trying again will not help."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class ControlPlane:
    def __init__(self, url: str, token: str, *, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def use_token(self, token: str) -> None:
        self._token = token

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(  # noqa: S310 (the configured control-plane URL)
            self.url + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self._token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:  # noqa: S310
                text = answer.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            if exc.code >= 500 or exc.code == 429:
                raise Unreachable(f"HTTP {exc.code}") from None
            raise Refused(exc.code, text) from None
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable(str(exc)) from None
        return json.loads(text) if text.strip() else {}


@dataclass
class Message:
    method: str
    path: str
    body: dict
    what: str  # for the agent's own log
    on_sent: Callable[[], None] | None = None  # once delivered, or refused for good


class Outbox:
    """Reports that must reach the control plane, sent in order, retried until they do.

    A 4xx answer drops the message (the control plane will never take it: the run
    was cancelled and removed, say) and is logged; anything else is retried with
    exponential backoff up to `max_delay_s`.
    """

    def __init__(self, control: ControlPlane, *, max_delay_s: float = 30.0):
        self._control = control
        self._queue: deque[Message] = deque()
        self._wake = threading.Condition()
        self._max_delay_s = max_delay_s
        self.delivered = 0

    def put(self, message: Message) -> None:
        with self._wake:
            self._queue.append(message)
            self._wake.notify()

    def pending(self) -> int:
        with self._wake:
            return len(self._queue)

    def run(self, stop: threading.Event) -> None:
        delay = 0.5
        while not stop.is_set() or self.pending():
            with self._wake:
                if not self._queue:
                    self._wake.wait(timeout=0.5)
                    continue
                message = self._queue[0]
            try:
                self._control.call(message.method, message.path, message.body)
            except Unreachable as exc:
                if stop.is_set():
                    return  # shutting down and nobody answers: give up
                log.warning("control plane unreachable (%s); %s retried", exc, message.what)
                stop.wait(delay)
                delay = min(delay * 2, self._max_delay_s)
                continue
            except Refused as exc:
                log.error("control plane refused %s: %s", message.what, exc)
            with self._wake:
                self._queue.popleft()
            if message.on_sent is not None:
                message.on_sent()
            self.delivered += 1
            delay = 0.5

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything queued was sent (or refused); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.pending():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
