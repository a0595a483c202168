"""Watching for an EC2 spot interruption notice through instance metadata (IMDSv2).

AWS posts `spot/instance-action` about two minutes before it reclaims a spot
instance; until then the path answers 404. IMDSv2 needs a session token from a
PUT first. The address is configurable, so the tests point it at their own server.
"""

import json
import logging
import urllib.error
import urllib.request

log = logging.getLogger("agent")
TOKEN_TTL_S = 21600


class SpotWatch:
    def __init__(self, base_url: str, *, timeout_s: float = 2.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._token = ""

    def _session_token(self) -> str:
        request = urllib.request.Request(  # noqa: S310 (the configured metadata address)
            f"{self.base_url}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:  # noqa: S310
            return answer.read().decode().strip()

    def check(self) -> dict | None:
        """The notice ({"action": "terminate", "time": "..."}) if there is one, else None."""
        for attempt in range(2):
            if not self._token:
                try:
                    self._token = self._session_token()
                except (urllib.error.URLError, OSError) as exc:
                    log.debug("instance metadata unreachable: %s", exc)
                    return None
            request = urllib.request.Request(  # noqa: S310
                f"{self.base_url}/latest/meta-data/spot/instance-action",
                headers={"X-aws-ec2-metadata-token": self._token},
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:  # noqa: S310
                    return json.loads(answer.read().decode() or "{}")
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and attempt == 0:
                    self._token = ""  # the session token expired: get another
                    continue
                return None  # 404: no notice
            except (urllib.error.URLError, OSError, ValueError) as exc:
                log.debug("spot check failed: %s", exc)
                return None
        return None
