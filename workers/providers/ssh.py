"""The `ssh` provider: owned nodes reached with paramiko, their host keys pinned.

A node with no pinned host key is never connected to: the first attempt raises
HostKeyUnknown with the key it offered, for ops to check and accept. A node
whose key differs from the pinned one raises HostKeyChanged before anything is
sent. Connections are pooled per (host, port, user, pinned key, client key)
and reused by later calls in the same worker process.

Every remote command is an argument list turned into a string by
`shell.quote_argv`; the few shell scripts below are constants that take their
values as positional arguments ("$1", "$@"), never pasted in.
"""

import base64
import binascii
import contextlib
import hashlib
import logging
import os
import posixpath
import random
import select
import threading
import time
import uuid as uuid_module
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from workers.providers.bundle import (
    AGENT_ENV_FILE,
    AGENT_LOG_FILE,
    AGENT_PID_FILE,
    NODE_DIR_PREFIX,
    NODE_UUID_VARIABLE,
    Bundle,
    bundle_files,
    env_file_text,
)
from workers.providers.errors import (
    AuthenticationFailed,
    CommandFailed,
    CommandTimedOut,
    ConfigurationError,
    HostKeyChanged,
    HostKeyError,
    HostKeyUnknown,
    NodeUnreachable,
    ProvisioningFailed,
)
from workers.providers.gpus import NVIDIA_SMI_QUERY, gpu_report
from workers.providers.interface import (
    BootstrapReport,
    CapacityType,
    GpuReport,
    MachineState,
    NodeDescription,
    Progress,
    node_uuid,
    report,
)
from workers.providers.shell import quote_argv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SshConfig:
    key_file: Path  # the client's private key; read at connect time, never copied anywhere
    key_passphrase: str | None = field(default=None, repr=False)
    remote_root: str = ".controlplane"  # relative paths are under the login user's home
    connect_timeout_s: float = 10.0  # TCP connect, banner, authentication, channel open
    command_timeout_s: float = 120.0
    connect_attempts: int = 4
    backoff_base_s: float = 0.5  # doubled after each failed attempt, up to backoff_max_s
    backoff_max_s: float = 10.0
    keepalive_s: int = 30
    stop_timeout_s: float = 10.0  # SIGTERM to the agent, then SIGKILL after this long

    def __post_init__(self):
        if not self.remote_root or any(c in self.remote_root for c in "\n\r\0"):
            raise ConfigurationError("remote_root must be a one-line path.")
        if self.connect_attempts < 1:
            raise ConfigurationError("connect_attempts must be at least 1.")


@dataclass(frozen=True)
class SshNodeSpec:
    uuid: str
    address: str
    port: int = 22
    user: str = "root"
    host_key: str = ""  # the pinned public key, 'type base64'; empty until ops accept one
    name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "uuid", node_uuid(self.uuid))
        if not self.address or any(c.isspace() or c == "\0" for c in self.address):
            raise ConfigurationError(f"{self.address!r} is not a host name or address.")
        if not 0 < self.port < 65536:
            raise ConfigurationError(f"{self.port} is not a TCP port.")


@dataclass(frozen=True)
class CommandResult:
    exit_status: int
    stdout: str
    stderr: str


# --- host keys --------------------------------------------------------------------------


def key_fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's `SHA256:...` fingerprint, as `ssh-keygen -lf` prints it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode("ascii").rstrip("=")


def parse_host_key(text: str) -> paramiko.PKey:
    """A pinned key as stored: 'type base64' (a known_hosts line without the host)."""
    parts = text.split()
    if len(parts) < 2:
        raise ConfigurationError("A pinned host key reads 'TYPE BASE64'.")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        return paramiko.PKey.from_type_string(parts[0], blob)
    except (binascii.Error, ValueError, paramiko.SSHException) as error:
        raise ConfigurationError(f"The pinned host key cannot be read: {error}") from None


def _known_hosts_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


class _RefuseUnpinned(paramiko.RejectPolicy):
    """RejectPolicy that says which key was offered, so ops can accept it."""

    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port

    def missing_host_key(self, client, hostname, key):
        raise HostKeyUnknown(
            host=self.host,
            port=self.port,
            key_type=key.get_name(),
            key_base64=key.get_base64(),
            fingerprint=key_fingerprint(key),
        )


# --- connections -------------------------------------------------------------------------


class SshPool:
    """Open connections kept for reuse; one per key, closed after `max_idle_s` unused.

    A pool copied into a forked process (Celery's prefork workers) starts empty
    there: a transport's thread does not survive a fork.
    """

    def __init__(self, max_idle_s: float = 300.0):
        self.max_idle_s = max_idle_s
        self.opened = 0  # connections made so far, for tests and metrics
        self._clients: dict[tuple, tuple[paramiko.SSHClient, float]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def get(self, key: tuple, connect) -> paramiko.SSHClient:
        now = time.monotonic()
        stale = []
        with self._lock:
            if self._pid != os.getpid():
                self._clients.clear()
                self._pid = os.getpid()
            for other, (client, last_used) in list(self._clients.items()):
                if other != key and now - last_used > self.max_idle_s:
                    stale.append(client)
                    del self._clients[other]
            client, _ = self._clients.get(key, (None, 0.0))
            if client is not None and _is_active(client):
                self._clients[key] = (client, now)
            else:
                self._clients.pop(key, None)
                if client is not None:
                    stale.append(client)
                client = None
        for old in stale:
            old.close()
        if client is not None:
            return client
        client = connect()
        with self._lock:
            existing, _ = self._clients.get(key, (None, 0.0))
            if existing is not None and _is_active(existing):
                client.close()  # another thread connected first
                return existing
            self._clients[key] = (client, time.monotonic())
            self.opened += 1
        return client

    def discard(self, key: tuple) -> None:
        with self._lock:
            client, _ = self._clients.pop(key, (None, 0.0))
        if client is not None:
            client.close()

    def close_all(self) -> None:
        with self._lock:
            clients = [client for client, _ in self._clients.values()]
            self._clients.clear()
        for client in clients:
            client.close()


def _is_active(client: paramiko.SSHClient) -> bool:
    transport = client.get_transport()
    return transport is not None and transport.is_active()


DEFAULT_POOL = SshPool()


# --- scripts run on the node (constants; values come in as "$1", "$2", "$@") -------------

# Is the pid in agent.pid alive, not a zombie, and started by us for this node?
# stop: SIGTERM to its process group, SIGKILL after $stop_ticks tenths of a second.
# lock: one bootstrap or terminate at a time per node, where flock(1) exists.
_FUNCTIONS = r"""
ours() {
  pid=$(cat agent.pid 2>/dev/null) || return 1
  case $pid in ""|*[!0-9]*) return 1;; esac
  kill -0 "$pid" 2>/dev/null || return 1
  if [ -r "/proc/$pid/environ" ]; then
    tr "\000" "\n" < "/proc/$pid/environ" | grep -qxF "UUID_VARIABLE=$uuid" || return 1
    state=$(sed "s/.*) //" "/proc/$pid/stat" | cut -d" " -f1)
    [ "$state" != Z ] || return 1
  fi
}
stop() {
  kill -TERM "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  ticks=0
  while ours && [ "$ticks" -lt "$stop_ticks" ]; do sleep 0.1; ticks=$((ticks + 1)); done
  if ours || kill -0 "-$pid" 2>/dev/null; then
    kill -KILL "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
  fi
  ticks=0
  while ours && [ "$ticks" -lt 50 ]; do sleep 0.1; ticks=$((ticks + 1)); done
  ! ours
}
lock() {
  if command -v flock >/dev/null 2>&1; then
    exec 9>>.provider.lock && flock -w 60 9 || exit 75
  fi
}
""".replace("UUID_VARIABLE", NODE_UUID_VARIABLE)

_BUSY = 75  # the start script's status when another one holds the node's lock

# $1 node dir, $2 node uuid: prints the agent's pid if it is running.
_AGENT_PID_SCRIPT = (
    _FUNCTIONS
    + r"""
uuid=$2
cd "$1" 2>/dev/null || exit 0
if ours; then echo "$pid"; fi
"""
)

# $1 node dir, $2 node uuid, $3 restart (0/1), $4 stop timeout in tenths; then the agent argv.
# The agent gets its own session (setsid), survives the SSH session (nohup), and
# does not inherit the lock (9>&-), which it would otherwise hold for its lifetime.
_START_SCRIPT = (
    _FUNCTIONS
    + r"""
dir=$1; uuid=$2; restart=$3; stop_ticks=$4; shift 4
cd "$dir" || exit 1
lock
if ours; then
  if [ "$restart" != 1 ]; then echo "running $pid"; exit 0; fi
  stop || { echo "agent $pid would not stop" >&2; exit 1; }
fi
export UUID_VARIABLE="$uuid"
umask 077
touch LOG_FILE && chmod 600 LOG_FILE
setsid nohup "$@" >>LOG_FILE 2>&1 </dev/null 9>&- &
echo $! > PID_FILE
sleep 0.3
if ! ours; then echo "the agent exited at once:" >&2; tail -n 20 LOG_FILE >&2; exit 1; fi
echo "started $pid"
""".replace("UUID_VARIABLE", NODE_UUID_VARIABLE)
    .replace("LOG_FILE", AGENT_LOG_FILE)
    .replace("PID_FILE", AGENT_PID_FILE)
)

# $1 node dir, $2 node uuid, $3 stop timeout in tenths: stops the agent, removes the dir.
_TERMINATE_SCRIPT = (
    _FUNCTIONS
    + r"""
dir=$1; uuid=$2; stop_ticks=$3
[ -d "$dir" ] || exit 0
cd "$dir" && dir=$(pwd) || exit 1
lock
if ours; then stop || { echo "agent $pid would not stop" >&2; exit 1; }; fi
cd / && rm -rf -- "$dir"
"""
)


# --- the provider --------------------------------------------------------------------------


class SshProvider:
    kind = "ssh"

    def __init__(self, config: SshConfig, pool: SshPool | None = None):
        self.config = config
        self.pool = pool if pool is not None else DEFAULT_POOL

    def node_dir(self, spec: SshNodeSpec) -> str:
        return posixpath.join(self.config.remote_root, f"{NODE_DIR_PREFIX}{spec.uuid}")

    # create or reach: connect (which checks the host key), make the node directory.
    def create(self, spec: SshNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        report(progress, "connect", 10, f"Connecting to {spec.user}@{spec.address}:{spec.port}.")
        self.run(spec, ["mkdir", "-p", "--", self.node_dir(spec)])
        report(progress, "connect", 100, "Reached; host key matches the pinned one.")
        return self.describe(spec)

    def bootstrap(
        self,
        spec: SshNodeSpec,
        bundle: Bundle,
        *,
        restart_agent: bool = False,
        progress: Progress | None = None,
    ) -> BootstrapReport:
        node_dir = self.node_dir(spec)
        report(progress, "connect", 5, f"Connecting to {spec.address}.")
        files = [(relative, _contents(source)) for relative, source in bundle_files(bundle)]
        agent_env = {**bundle.agent_env, NODE_UUID_VARIABLE: spec.uuid}
        files.append((AGENT_ENV_FILE, env_file_text(agent_env).encode()))

        directories = sorted({posixpath.dirname(posixpath.join(node_dir, r)) for r, _ in files})
        self.run(spec, ["mkdir", "-p", "--", *directories])
        client = self.connection(spec)
        try:
            sftp = client.open_sftp()
        except (OSError, EOFError, paramiko.SSHException) as error:
            self.pool.discard(self._pool_key(spec))
            raise NodeUnreachable(f"SFTP to {spec.address} failed: {error}", attempts=1) from error
        try:
            for done, (relative, data) in enumerate(files, start=1):
                mode = 0o600 if relative == AGENT_ENV_FILE else 0o644
                _put_atomically(sftp, posixpath.join(node_dir, relative), data, mode)
                report(progress, "upload", 10 + 60 * done // len(files), relative)
        except (OSError, EOFError, paramiko.SSHException) as error:
            raise ProvisioningFailed(
                f"Uploading to {spec.address}:{node_dir} failed: {error}", retryable=True
            ) from error
        finally:
            sftp.close()

        report(progress, "detect_gpus", 75, "Running nvidia-smi.")
        gpus = self.detect_gpus(spec)
        report(progress, "detect_gpus", 80, gpus.message)

        report(progress, "start_agent", 85, "Starting the agent.")
        stop_ticks = str(max(1, int(self.config.stop_timeout_s * 10)))
        result = self.run(
            spec,
            [
                "sh",
                "-c",
                _START_SCRIPT,
                "sh",
                node_dir,
                spec.uuid,
                "1" if restart_agent else "0",
                stop_ticks,
                *bundle.agent_argv,
            ],
            check=False,
        )
        if result.exit_status == _BUSY:
            raise ProvisioningFailed(
                f"Another bootstrap or terminate of node {spec.uuid} holds its lock.",
                retryable=True,
            )
        if result.exit_status != 0:
            raise ProvisioningFailed(
                f"The agent did not start on {spec.address}: {result.stderr.strip()[-500:]}",
                retryable=False,
            )
        word, _, pid = result.stdout.strip().partition(" ")
        report(progress, "start_agent", 100, f"Agent {word} as {pid}.")
        return BootstrapReport(
            spec.uuid, node_dir, int(pid), agent_started=word == "started", gpus=gpus
        )

    def describe(self, spec: SshNodeSpec) -> NodeDescription:
        result = self.run(
            spec, ["sh", "-c", _AGENT_PID_SCRIPT, "sh", self.node_dir(spec), spec.uuid]
        )
        pid = int(result.stdout) if result.stdout.strip().isdigit() else None
        return NodeDescription(
            uuid=spec.uuid,
            state=MachineState.RUNNING,
            capacity_type=CapacityType.OWNED,
            address=spec.address,
            agent_alive=pid is not None,
            agent_pid=pid,
        )

    def terminate(self, spec: SshNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        """Stop the agent and remove the node directory; the host itself stays as it is."""
        report(progress, "stop_agent", 10, f"Stopping the agent on {spec.address}.")
        stop_ticks = str(max(1, int(self.config.stop_timeout_s * 10)))
        self.run(
            spec,
            ["sh", "-c", _TERMINATE_SCRIPT, "sh", self.node_dir(spec), spec.uuid, stop_ticks],
            timeout_s=self.config.command_timeout_s + self.config.stop_timeout_s + 5,
        )
        report(progress, "terminate", 100, "Agent stopped and node directory removed.")
        return NodeDescription(uuid=spec.uuid, state=MachineState.ABSENT, address=spec.address)

    def detect_gpus(self, spec: SshNodeSpec) -> GpuReport:
        result = self.run(spec, list(NVIDIA_SMI_QUERY), check=False)
        return gpu_report(result.exit_status, result.stdout, result.stderr)

    def run(
        self,
        spec: SshNodeSpec,
        argv: list[str],
        *,
        timeout_s: float | None = None,
        check: bool = True,
    ) -> CommandResult:
        """Run one command (an argument list) on the node and wait for it.

        A pooled connection found dead before the command was sent is replaced
        once; a command that was sent is never sent again.
        """
        command = quote_argv(argv)
        timeout_s = self.config.command_timeout_s if timeout_s is None else timeout_s
        channel = self._open_channel(spec)
        try:
            channel.exec_command(command)  # built by quote_argv from a list
            result = _wait_for(channel, timeout_s, argv)
        except (OSError, EOFError, paramiko.SSHException) as error:
            self.pool.discard(self._pool_key(spec))
            raise NodeUnreachable(
                f"The connection to {spec.address} failed during {argv[0]}: {error}", attempts=1
            ) from error
        finally:
            channel.close()
        if check and result.exit_status != 0:
            raise CommandFailed(
                argv=list(argv),
                exit_status=result.exit_status,
                stdout=result.stdout,
                stderr=result.stderr,
            )
        return result

    # --- connections -------------------------------------------------------------------

    def _pool_key(self, spec: SshNodeSpec) -> tuple:
        return (spec.address, spec.port, spec.user, spec.host_key, str(self.config.key_file))

    def connection(self, spec: SshNodeSpec) -> paramiko.SSHClient:
        """The pooled connection to the node, made (host key checked) if there is none."""
        return self.pool.get(self._pool_key(spec), lambda: self._connect(spec))

    def _open_channel(self, spec: SshNodeSpec) -> paramiko.Channel:
        for attempt in (1, 2):
            client = self.connection(spec)
            try:
                return client.get_transport().open_session(timeout=self.config.connect_timeout_s)
            except (OSError, EOFError, paramiko.SSHException, AttributeError) as error:
                self.pool.discard(self._pool_key(spec))
                if attempt == 2:
                    raise NodeUnreachable(
                        f"Cannot open a session on {spec.address}: {error}", attempts=attempt
                    ) from error
                logger.info("Pooled connection to %s was dead; reconnecting", spec.address)
        raise AssertionError("unreachable")

    def _connect(self, spec: SshNodeSpec) -> paramiko.SSHClient:
        config = self.config
        client_key = self._client_key()
        pinned = parse_host_key(spec.host_key) if spec.host_key else None
        last_error: Exception | None = None
        for attempt in range(1, config.connect_attempts + 1):
            client = paramiko.SSHClient()
            client.set_missing_host_key_policy(_RefuseUnpinned(spec.address, spec.port))
            if pinned is not None:
                client.get_host_keys().add(
                    _known_hosts_name(spec.address, spec.port), pinned.get_name(), pinned
                )
            try:
                client.connect(
                    spec.address,
                    port=spec.port,
                    username=spec.user,
                    pkey=client_key,
                    timeout=config.connect_timeout_s,
                    banner_timeout=config.connect_timeout_s,
                    auth_timeout=config.connect_timeout_s,
                    channel_timeout=config.connect_timeout_s,
                    allow_agent=False,
                    look_for_keys=False,
                )
            except HostKeyError:
                client.close()
                raise
            except paramiko.BadHostKeyException as error:
                client.close()
                raise HostKeyChanged(
                    host=spec.address,
                    port=spec.port,
                    expected_fingerprint=key_fingerprint(error.expected_key),
                    offered_key_type=error.key.get_name(),
                    offered_key_base64=error.key.get_base64(),
                    offered_fingerprint=key_fingerprint(error.key),
                ) from None
            except paramiko.AuthenticationException as error:
                client.close()
                raise AuthenticationFailed(
                    f"{spec.user}@{spec.address}:{spec.port} refused our key: {error}"
                ) from error
            except (OSError, EOFError, paramiko.SSHException) as error:
                client.close()
                last_error = error
                if attempt < config.connect_attempts:
                    delay = self._backoff(attempt)
                    logger.info(
                        "SSH to %s:%s failed (%s); attempt %d of %d, next in %.2fs",
                        spec.address,
                        spec.port,
                        error,
                        attempt,
                        config.connect_attempts,
                        delay,
                    )
                    time.sleep(delay)
                continue
            client.get_transport().set_keepalive(config.keepalive_s)
            return client
        raise NodeUnreachable(
            f"Cannot reach {spec.address}:{spec.port} after {config.connect_attempts} attempts: "
            f"{last_error or 'no answer'}",
            attempts=config.connect_attempts,
        )

    def _backoff(self, attempt: int) -> float:
        delay = min(self.config.backoff_max_s, self.config.backoff_base_s * 2 ** (attempt - 1))
        # Jitter, so that workers retrying the same host do not arrive together.
        return delay * random.uniform(0.5, 1.0)  # noqa: S311 (not a secret)

    def _client_key(self) -> paramiko.PKey:
        try:
            return paramiko.PKey.from_path(self.config.key_file, self.config.key_passphrase)
        except (OSError, ValueError, paramiko.SSHException) as error:
            raise ConfigurationError(
                f"Cannot read the SSH key {self.config.key_file}: {error}"
            ) from error


# --- channels and files -------------------------------------------------------------------


def _wait_for(channel: paramiko.Channel, timeout_s: float, argv: list[str]) -> CommandResult:
    channel.shutdown_write()
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout_s
    while True:
        if channel.recv_ready():
            out += channel.recv(65536)
        elif channel.recv_stderr_ready():
            err += channel.recv_stderr(65536)
        elif channel.exit_status_ready():
            break
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandTimedOut(f"{argv[0]} ran past {timeout_s:.0f}s on the node.")
            if channel.eof_received:
                channel.status_event.wait(min(remaining, 1.0))
            else:
                select.select([channel], [], [], min(remaining, 1.0))
    return CommandResult(
        exit_status=channel.recv_exit_status(),
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
    )


def _contents(source: Path | bytes) -> bytes:
    return source if isinstance(source, bytes) else Path(source).read_bytes()


def _put_atomically(sftp: paramiko.SFTPClient, path: str, data: bytes, mode: int) -> None:
    """Write beside the target, then rename over it: a reader never sees half a file."""
    directory, name = posixpath.split(path)
    temporary = posixpath.join(directory, f".{name}.{uuid_module.uuid4().hex[:12]}.tmp")
    try:
        with sftp.open(temporary, "wb") as file:
            file.chmod(mode)  # before any byte is written: agent.env holds the node token
            file.set_pipelined(True)
            file.write(data)
        sftp.posix_rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError, paramiko.SSHException):
            sftp.remove(temporary)
        raise
