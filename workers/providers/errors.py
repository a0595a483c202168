"""What can go wrong when a provider creates, reaches, bootstraps or ends a node.

Every error carries `retryable`: true when the same call may succeed later
(a network blip, capacity that may come back), false when a person has to act
first (a host key to accept, a key file to fix, a quota to raise).
"""


class ProviderError(Exception):
    """Base of every provider error."""

    retryable = False

    def __init__(self, message: str, *, retryable: bool | None = None):
        super().__init__(message)
        self.message = message
        if retryable is not None:
            self.retryable = retryable


class ConfigurationError(ProviderError):
    """The caller's configuration or spec cannot work (a missing key file, a bad path)."""


class HostKeyError(ProviderError):
    """The node's SSH host key is not the one pinned for it. Nothing was run."""


class HostKeyUnknown(HostKeyError):
    """No host key is pinned for the node: ops must accept the key it offered.

    `offered_key` is the key as OpenSSH writes it without the host ('type base64'),
    ready to be pinned once ops have checked `fingerprint` (`SHA256:...`).
    """

    def __init__(self, *, host: str, port: int, key_type: str, key_base64: str, fingerprint: str):
        super().__init__(
            f"{host}:{port} offered a {key_type} host key {fingerprint} and none is pinned; "
            "accept it once its fingerprint is checked."
        )
        self.host = host
        self.port = port
        self.key_type = key_type
        self.key_base64 = key_base64
        self.fingerprint = fingerprint

    @property
    def offered_key(self) -> str:
        return f"{self.key_type} {self.key_base64}"


class HostKeyChanged(HostKeyError):
    """The node offered a host key other than the pinned one: possibly another machine."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        expected_fingerprint: str,
        offered_key_type: str,
        offered_key_base64: str,
        offered_fingerprint: str,
    ):
        super().__init__(
            f"HOST KEY CHANGED for {host}:{port}: pinned {expected_fingerprint}, offered "
            f"{offered_key_type} {offered_fingerprint}. The connection was refused and nothing "
            "was run. If the host was reinstalled, ops must accept the new key; otherwise "
            "someone may be impersonating it."
        )
        self.host = host
        self.port = port
        self.expected_fingerprint = expected_fingerprint
        self.offered_key_type = offered_key_type
        self.offered_key_base64 = offered_key_base64
        self.offered_fingerprint = offered_fingerprint

    @property
    def offered_key(self) -> str:
        return f"{self.offered_key_type} {self.offered_key_base64}"


class AuthenticationFailed(ProviderError):
    """The node refused our key: retrying will not help until someone fixes authorized_keys."""


class NodeUnreachable(ProviderError):
    """The node could not be reached after every attempt (refused, timed out, reset)."""

    retryable = True

    def __init__(self, message: str, *, attempts: int):
        super().__init__(message)
        self.attempts = attempts


class CommandFailed(ProviderError):
    """A command on the node exited with a non-zero status."""

    def __init__(self, *, argv: list[str], exit_status: int, stdout: str, stderr: str):
        tail = (stderr or stdout).strip()[-500:]
        super().__init__(f"{argv[0]} exited with status {exit_status}: {tail}")
        self.argv = argv
        self.exit_status = exit_status
        self.stdout = stdout
        self.stderr = stderr


class CommandTimedOut(ProviderError):
    """A command on the node ran past its time limit; its channel was closed."""

    retryable = True


class ProvisioningFailed(ProviderError):
    """The node could not be created or bootstrapped; `retryable` says whether to try again."""


class CapacityUnavailable(ProvisioningFailed):
    """The cloud had no capacity (or quota) for the request."""
