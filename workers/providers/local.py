"""The `local` provider: a node is a directory and an agent process on this machine.

Its "GPUs" are CPU slots. `make run`'s demo fleet and the tests use it; nothing
here needs a network, a cloud account or root. It is for development: its jobs run
on the control plane's own host. Started by root, the agent runs each job as its
own unprivileged user (workers/agent/isolation.py); started by anyone else it
cannot, its jobs run as the control plane's user, and the node says so when it
registers (the scheduler then keeps one team per node).
"""

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

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
from workers.providers.errors import ConfigurationError, ProvisioningFailed
from workers.providers.interface import (
    BootstrapReport,
    CapacityType,
    MachineState,
    NodeDescription,
    Progress,
    node_uuid,
    report,
)

SLOTS_VARIABLE = "AGENT_SLOTS"  # what workers/agent/config.py reads
# The agent gets these from our environment and nothing else: a Celery worker's
# environment holds the control plane's own secrets (database URL, secret key).
_PASSED_THROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
_LOCK_FILE = ".provider.lock"
# Agents this process started, kept so that they are reaped when they exit
# rather than left as zombies in a long-lived worker.
_children: dict[int, subprocess.Popen] = {}


@dataclass(frozen=True)
class LocalConfig:
    root: Path  # node directories are made under it (make run: var/nodes)
    stop_timeout_s: float = 10.0  # SIGTERM, then SIGKILL after this long


@dataclass(frozen=True)
class LocalNodeSpec:
    uuid: str
    name: str = ""
    slots: int = 1  # CPU slots standing in for GPUs

    def __post_init__(self):
        object.__setattr__(self, "uuid", node_uuid(self.uuid))
        if not 0 < self.slots <= 1024:
            raise ConfigurationError("A local node has between 1 and 1024 slots.")


class LocalProvider:
    kind = "local"

    def __init__(self, config: LocalConfig):
        self.config = config
        self.root = Path(config.root).resolve()

    def node_dir(self, spec: LocalNodeSpec) -> Path:
        return self.root / f"{NODE_DIR_PREFIX}{spec.uuid}"

    def create(self, spec: LocalNodeSpec, *, progress: Progress | None = None) -> NodeDescription:
        node_dir = self.node_dir(spec)
        node_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        report(progress, "create", 100, f"Node directory {node_dir}.")
        return self.describe(spec)

    def bootstrap(
        self,
        spec: LocalNodeSpec,
        bundle: Bundle,
        *,
        restart_agent: bool = False,
        progress: Progress | None = None,
    ) -> BootstrapReport:
        node_dir = self.node_dir(spec)
        node_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        with _locked(node_dir):
            files = bundle_files(bundle)
            for done, (relative, source) in enumerate(files, start=1):
                data = source if isinstance(source, bytes) else Path(source).read_bytes()
                _write_atomically(node_dir / relative, data, 0o644)
                report(progress, "copy", 10 + 60 * done // len(files), relative)
            agent_env = {**bundle.agent_env, **self._own_variables(spec)}
            _write_atomically(node_dir / AGENT_ENV_FILE, env_file_text(agent_env).encode(), 0o600)

            pid = self._running_pid(spec)
            if pid is not None and restart_agent:
                report(progress, "start_agent", 75, f"Stopping agent {pid} to restart it.")
                self._stop(pid, spec)
                pid = None
            if pid is not None:
                report(progress, "start_agent", 100, f"Agent already running as {pid}.")
                return BootstrapReport(spec.uuid, str(node_dir), pid, agent_started=False)
            report(progress, "start_agent", 80, "Starting the agent.")
            pid = self._start(spec, bundle, node_dir)
        report(progress, "start_agent", 100, f"Agent started as {pid}.")
        return BootstrapReport(spec.uuid, str(node_dir), pid, agent_started=True)

    def describe(self, spec: LocalNodeSpec) -> NodeDescription:
        node_dir = self.node_dir(spec)
        if not node_dir.is_dir():
            return NodeDescription(uuid=spec.uuid, state=MachineState.ABSENT)
        pid = self._running_pid(spec)
        return NodeDescription(
            uuid=spec.uuid,
            state=MachineState.RUNNING,
            capacity_type=CapacityType.OWNED,
            address="127.0.0.1",
            agent_alive=pid is not None,
            agent_pid=pid,
            slots=spec.slots,
        )

    def terminate(
        self, spec: LocalNodeSpec, *, progress: Progress | None = None
    ) -> NodeDescription:
        node_dir = self.node_dir(spec)
        if node_dir.is_dir():
            with _locked(node_dir):
                pid = self._running_pid(spec)
                if pid is not None:
                    report(progress, "stop_agent", 20, f"Stopping agent {pid}.")
                    self._stop(pid, spec)
            report(progress, "remove", 80, f"Removing {node_dir}.")
            shutil.rmtree(node_dir, ignore_errors=True)
        report(progress, "terminate", 100, "Node removed.")
        return NodeDescription(uuid=spec.uuid, state=MachineState.ABSENT)

    # --- the agent process ------------------------------------------------------------

    def _own_variables(self, spec: LocalNodeSpec) -> dict[str, str]:
        return {NODE_UUID_VARIABLE: spec.uuid, SLOTS_VARIABLE: str(spec.slots)}

    def _start(self, spec: LocalNodeSpec, bundle: Bundle, node_dir: Path) -> int:
        env = {name: os.environ[name] for name in _PASSED_THROUGH if name in os.environ}
        env.update(self._own_variables(spec))
        # The agent's log is the agent's alone (mode 600), like agent.env.
        fd = os.open(node_dir / AGENT_LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "ab") as log:
            try:
                process = subprocess.Popen(
                    list(bundle.agent_argv),
                    cwd=node_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own session: it outlives the Celery task, and a stop
                    # reaches the job processes it started too.
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as error:
                raise ProvisioningFailed(
                    f"Cannot start the agent {bundle.agent_argv[0]!r}: {error}", retryable=False
                ) from error
        _children[process.pid] = process
        _write_atomically(node_dir / AGENT_PID_FILE, f"{process.pid}\n".encode(), 0o644)
        return process.pid

    def _running_pid(self, spec: LocalNodeSpec) -> int | None:
        try:
            pid = int((self.node_dir(spec) / AGENT_PID_FILE).read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if _is_our_agent(pid, spec.uuid) else None

    def _stop(self, pid: int, spec: LocalNodeSpec) -> None:
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        while _is_our_agent(pid, spec.uuid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Whatever is left of the group is killed: the agent if it outlived the
        # timeout, or job processes that ignored SIGTERM. A group id cannot be
        # given to a new process while any member of the group lives.
        if _is_our_agent(pid, spec.uuid) or _group_exists(pid):
            _signal_group(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while _is_our_agent(pid, spec.uuid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # An exiting process stops looking like our agent (its environment reads empty)
        # before it is gone: wait for the exit itself, reaping it when it is our child.
        child = _children.pop(pid, None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=5)
        else:
            while _exists(pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def _is_our_agent(pid: int, uuid: str) -> bool:
    """Alive, not a zombie, and carrying our node's UUID: a reused pid is not our agent."""
    child = _children.get(pid)
    if child is not None and child.poll() is not None:  # reaps our own exited child
        return False
    proc = Path(f"/proc/{pid}")
    if not Path("/proc/self").exists():  # no procfs: all we can ask is whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        stat = (proc / "stat").read_text()
        environ = (proc / "environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except PermissionError:
        return False  # another user's process: not one we started
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return False
    return f"{NODE_UUID_VARIABLE}={uuid}".encode() in environ.split(b"\0")


def _exists(pid: int) -> bool:
    """Any process with this pid that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(temporary, mode)
    os.replace(temporary, path)


@contextlib.contextmanager
def _locked(node_dir: Path):
    """One bootstrap or terminate at a time per node, across worker processes."""
    with open(node_dir / _LOCK_FILE, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
