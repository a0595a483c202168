"""Running one run plan on this node: its directory, its files, its code, its process, its output.

A run plan (from the control plane) says what to run: an argument list (never a
shell string), environment variables, secrets (injected as variables, and
masked in every output line the agent relays), a working directory, files to
write, the directories the job must own (its checkpoints), optionally a git
repository and ref to check out first, and on node rank 0 the rendezvous port its
processes will listen on (refused, as the node's fault, if something holds it). The
process starts in a new session, so a stop or a spot notice signals torchrun and all
its workers together. Where the
agent is privileged it runs as the job's own user (workers/agent/isolation.py),
and whatever that user still runs when the run ends is killed. Its exit report says
which of its processes the kernel saw killed by a signal the agent did not send
(workers/agent/exits.py), where the agent can hear the kernel.
"""

import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from workers.agent import isolation
from workers.agent.exits import ExitWatch
from workers.agent.isolation import Isolation
from workers.agent.leftovers import process_start_time

log = logging.getLogger("agent")

STATUS_FILE_VARIABLE = "CONTROLPLANE_STATUS_FILE"
RUN_ID_VARIABLE = "CONTROLPLANE_RUN_ID"
MASK = "********"
# Variables the run inherits from the agent; everything else comes from the plan.
INHERITED = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")
STATUS_LIMIT = 64 * 1024  # bytes of status file read back
MAX_LINE = 16 * 1024  # characters of one output line kept (the control plane keeps as many)
_REF = re.compile(r"[\w./-]+\Z")


class PlanRefused(Exception):
    """The plan cannot be run as given (a file outside the run directory, a bad ref...)."""

    node_fault = ""  # set where the node, not the plan, is to blame (the job is requeued)


class RendezvousPortBusy(PlanRefused):
    node_fault = "rendezvous_port_busy"


def rendezvous_port_check(port: int) -> None:
    """Refuse a rank-0 plan whose rendezvous port something on this node holds.

    torchrun hosts its store on every address of the node (IPv6 and IPv4 alike), reusing a
    port left in TIME_WAIT; where it cannot bind, it joins whatever listens there as a
    client and waits for a rendezvous that never comes. So bind as it would, and let go.
    """
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):  # noqa: S104
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((address, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise RendezvousPortBusy(
                        f"rendezvous port {port} is busy on this node"
                    ) from None
                # Another error (IPv6 present but off) says nothing about the port.


@dataclass(frozen=True)
class Plan:
    id: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    workdir: str = ""
    files: tuple[dict, ...] = ()
    git: dict | None = None
    job_id: int | None = None
    owned_dirs: tuple[str, ...] = ()  # absolute paths the job's user must own (checkpoints)
    team_id: int | None = None  # the job's team: its processes hold the team's group
    team_dirs: tuple[str, ...] = ()  # absolute paths the team's jobs share (dataset caches)
    gpu_slots: tuple[int, ...] = ()  # the node's GPUs the job holds (CUDA_VISIBLE_DEVICES)
    rendezvous_port: int | None = None  # node rank 0's: checked free before the start

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        argv = data.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise PlanRefused("argv must be a non-empty list of strings")
        return cls(
            id=int(data["id"]),
            argv=tuple(argv),
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            secrets={str(k): str(v) for k, v in (data.get("secrets") or {}).items()},
            workdir=str(data.get("workdir") or ""),
            files=tuple(data.get("files") or ()),
            git=data.get("git") or None,
            job_id=_job_id(data),
            owned_dirs=_owned_dirs(data.get("owned_dirs")),
            team_id=_team_id(data.get("team")),
            team_dirs=_owned_dirs(data.get("team_dirs")),
            gpu_slots=_gpu_slots(data.get("gpu_slots")),
            rendezvous_port=_port(data.get("rendezvous_port")),
        )


def _gpu_slots(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 64 for i in value
    ):
        raise PlanRefused("gpu_slots must be a list of GPU indices")
    return tuple(value)


class Ledger:
    """The agent's own record of what ran here: one JSON line when a run's process starts
    and one when it and everything it left are gone, with the job and its GPU slots. It
    is evidence kept on the node, apart from what the control plane was told."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, event: str, run: "Run", **extra) -> None:
        self._append(
            {
                "event": event,
                "at": time.time(),
                "run": run.plan.id,
                "job": run.plan.job_id,
                "slots": list(run.plan.gpu_slots),
                **extra,
            }
        )

    def close(self, started: dict, **extra) -> None:
        """The end line of a run this agent did not start (its predecessor did)."""
        self._append(
            {
                "event": "ended",
                "at": time.time(),
                **{key: started.get(key) for key in ("run", "job", "slots")},
                **extra,
            }
        )

    def _append(self, record: dict) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "r+", encoding="utf-8") as out:
                size = os.fstat(fd).st_size
                # A line an agent was killed in the middle of ends here, not in this one.
                cut = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                out.write(("\n" if cut else "") + json.dumps(record) + "\n")
        except OSError as exc:  # the record is for people; the run goes on without it
            log.warning("could not write to %s: %s", self.path, exc)

    def read(self) -> list[dict]:
        """Every whole line; one cut short (the agent killed as it wrote) is passed over."""
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and isinstance(record.get("run"), int):
                    records.append(record)
        return records

    def open_runs(self) -> list[dict]:
        """The start lines of runs whose end line never came."""
        started: dict[int, dict] = {}
        for record in self.read():
            if record.get("event") == "started":
                started[record["run"]] = record
            elif record.get("event") == "ended":
                started.pop(record["run"], None)
        return list(started.values())


def _job_id(data: dict) -> int | None:
    try:
        job_id = int(data.get("job"))
    except (TypeError, ValueError):
        return None
    return job_id if job_id >= 0 else None


def _port(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 65536:
        raise PlanRefused(f"{value!r} is not a port")
    return value


def _team_id(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PlanRefused(f"{value!r} is not a team")
    return value


def _owned_dirs(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanRefused("owned_dirs and team_dirs must be lists of paths")
    for path in value:
        pure = PurePosixPath(path)
        if not pure.is_absolute() or ".." in pure.parts or len(pure.parts) < 3:
            raise PlanRefused(f"{path!r} cannot be given to a job")
    return tuple(value)


class Masker:
    """Replaces every secret value in a line with a mask, longest values first."""

    def __init__(self, values):
        # Very short values would mask ordinary text ("1", "on"); they are not secrets.
        self._values = sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for value in self._values:
            if value in text:
                text = text.replace(value, MASK)
        return text


@dataclass
class LogLine:
    run_id: int
    seq: int
    stream: str  # "stdout" | "stderr" | "agent"
    at: float
    text: str


class LogBuffer:
    """Output lines waiting to be sent, bounded: beyond `limit`, the oldest are dropped
    and counted, so a control plane that is away for hours cannot fill the node's memory."""

    def __init__(self, limit: int):
        self._lines: deque[LogLine] = deque()
        self._lock = threading.Lock()
        self._limit = limit
        self.dropped: dict[int, int] = {}

    def add(self, line: LogLine) -> None:
        with self._lock:
            self._lines.append(line)
            while len(self._lines) > self._limit:
                old = self._lines.popleft()
                self.dropped[old.run_id] = self.dropped.get(old.run_id, 0) + 1

    def take(self, limit: int = 2000, max_bytes: int = 1 << 20) -> dict[int, list[LogLine]]:
        """Up to `limit` lines and about `max_bytes` of text, by run; they leave the buffer
        (put_back returns them). The byte budget keeps a batch well under the control
        plane's request size limit, which refuses a larger one outright."""
        out: dict[int, list[LogLine]] = {}
        size = 0
        with self._lock:
            while self._lines and limit > 0 and (size < max_bytes or not out):
                line = self._lines.popleft()
                out.setdefault(line.run_id, []).append(line)
                size += len(line.text) * 4 + 64  # the most it can take as JSON-escaped UTF-8
                limit -= 1
        return out

    def put_back(self, lines: list[LogLine]) -> None:
        with self._lock:
            self._lines.extendleft(reversed(lines))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lines)


class Run:
    def __init__(
        self,
        plan: Plan,
        *,
        runs_dir: Path,
        logs: LogBuffer,
        base_env: dict[str, str],
        on_stdout=None,
        isolation: Isolation | None = None,
        code_dir: Path | None = None,
        exits: ExitWatch | None = None,
    ):
        self.plan = plan
        # The kernel's account of how the run's processes died (workers/agent/exits.py).
        self._exits = exits
        # Called with each stdout line (masked) by the reader thread: the agent picks out
        # the lines that must reach the control plane even if output is dropped.
        self._on_stdout = on_stdout
        self.dir = runs_dir / f"run-{plan.id}"
        self.status_file = self.dir / "status.json"
        self._logs = logs
        self._base_env = base_env
        # Where runs import the bundled packages from (isolation.import_dir): `-m
        # workers.trainer` works from any working directory.
        self._code_dir = code_dir
        self.uid: int | None = None
        if isolation is not None and isolation.on:
            if plan.job_id is None:
                raise PlanRefused("the plan names no job, so the job's user cannot be chosen")
            self.uid = isolation.uid_for(plan.job_id)
        self.team_gid: int | None = None
        if self.uid is not None and plan.team_id is not None:
            self.team_gid = isolation.gid_for_team(plan.team_id)
        elif plan.team_dirs and self.uid is not None:
            raise PlanRefused("the plan shares directories with a team it does not name")
        self._mask = Masker(plan.secrets.values())
        self._seq = 0
        self._seq_lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self._readers: list[threading.Thread] = []
        self.stop_reason = ""
        self._kill_at: float | None = None
        self.leftovers_killed = 0

    # --- output -------------------------------------------------------------------------

    def note(self, text: str, stream: str = "agent") -> None:
        with self._seq_lock:
            self._seq += 1
            seq = self._seq
        masked = self._mask(text)[:MAX_LINE]  # masked whole first: a cut never halves a secret
        self._logs.add(LogLine(self.plan.id, seq, stream, time.time(), masked))

    def _read(self, pipe, stream: str) -> None:
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.note(text, stream)
            if self._on_stdout is not None and stream == "stdout":
                self._on_stdout(self._mask(text))
        pipe.close()

    # --- start ----------------------------------------------------------------------------

    def _inside(self, relative: str) -> Path:
        """A path in the run directory; anything that would leave it is refused."""
        path = PurePosixPath(relative)
        if path.is_absolute() or ".." in path.parts:
            raise PlanRefused(f"{relative!r} is outside the run directory")
        return self.dir / path

    def _write_files(self) -> None:
        for item in self.plan.files:
            target = self._inside(str(item["path"]))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(str(item.get("content", "")), encoding="utf-8")
            target.chmod(int(item.get("mode", 0o600)))

    def _as_job(self) -> dict:
        """Popen's arguments that start a process as the job's own user (none without one)."""
        if self.uid is None:
            return {}
        groups = [] if self.team_gid is None else [self.team_gid]
        return {"user": self.uid, "group": self.uid, "extra_groups": groups, "umask": 0o077}

    def _checkout(self, env: dict[str, str]) -> Path:
        repo, ref = str(self.plan.git["repo"]), str(self.plan.git["ref"])
        if ref.startswith("-") or not _REF.match(ref):
            raise PlanRefused(f"{ref!r} is not a branch, tag or commit")
        if repo.startswith("-"):
            raise PlanRefused(f"{repo!r} is not a repository")
        source = self.dir / "src"
        self._git(["git", "clone", "--quiet", "--no-checkout", "--", repo, str(source)], env)
        self._git(["git", "-C", str(source), "checkout", "--quiet", "--detach", ref, "--"], env)
        return source

    def _git(self, argv: list[str], env: dict[str, str]) -> None:
        """git runs as the job's user: a repository is the job's code, and so is its checkout."""
        self.note("$ " + " ".join(argv))
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=600, env=env, **self._as_job()
        )
        for line in (done.stdout + done.stderr).splitlines():
            self.note(line, "stderr")
        if done.returncode != 0:
            raise PlanRefused(f"git exited {done.returncode}")

    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in self._base_env.items() if k in INHERITED}
        if self._code_dir is not None:
            env["PYTHONPATH"] = str(self._code_dir)
        if self.uid is not None:
            # Nothing of the agent's own account: the job's home and temporary files are its
            # run directory's.
            name = f"job{self.plan.job_id}"
            env.update(HOME=str(self.dir), USER=name, LOGNAME=name, TMPDIR=str(self.dir / "tmp"))
        env.update(self.plan.env)
        env.update(self.plan.secrets)
        env[STATUS_FILE_VARIABLE] = str(self.status_file)
        env[RUN_ID_VARIABLE] = str(self.plan.id)
        return env

    def start(self) -> None:
        if self.plan.rendezvous_port is not None:
            rendezvous_port_check(self.plan.rendezvous_port)
        isolation.fresh_directory(self.dir)
        self._write_files()
        if self.uid is not None:
            (self.dir / "tmp").mkdir(mode=0o700)
            isolation.hand_over(self.dir, self.uid, self.uid)
            for path in self.plan.owned_dirs:
                isolation.owned_directory(Path(path), self.uid, self.uid)
            for path in self.plan.team_dirs:
                isolation.team_directory(Path(path), self.team_gid)
        env = self._environment()
        cwd = self._checkout(env) if self.plan.git else self.dir
        if self.plan.workdir:
            workdir = Path(self.plan.workdir)
            cwd = workdir if workdir.is_absolute() else cwd / workdir
        try:
            self.process = subprocess.Popen(
                list(self.plan.argv),
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                **self._as_job(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise PlanRefused(f"could not start {self.plan.argv[0]!r}: {exc}") from None
        if self._exits is not None:
            self._exits.follow(self.plan.id, self.process.pid)
        for pipe, stream in ((self.process.stdout, "stdout"), (self.process.stderr, "stderr")):
            reader = threading.Thread(target=self._read, args=(pipe, stream), daemon=True)
            reader.start()
            self._readers.append(reader)

    # --- while it runs -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def identity(self) -> dict:
        """What names its process for good, for the ledger: a later agent stops it only if
        the pid still has this start time, and the job's user's leftovers with it."""
        record = {"pid": self.pid, "pgid": None, "sid": None, "start_time": None, "uid": self.uid}
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                record.update(pgid=os.getpgid(self.pid), sid=os.getsid(self.pid))
            record["start_time"] = process_start_time(self.pid)
        return record

    def signal(self, signum: int) -> None:
        """Signal the whole process group (torchrun and its workers)."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def stop(self, *, reason: str, grace_s: float) -> None:
        """SIGTERM now (the trainer checkpoints and exits), SIGKILL after the grace period."""
        if self._kill_at is None:
            if self._exits is not None:
                self._exits.stopping(self.plan.id)
            self.stop_reason = reason
            self.note(f"stopping: {reason}")
            self.signal(signal.SIGTERM)
            self._kill_at = time.monotonic() + grace_s

    def poll(self) -> int | None:
        if self.process is None:
            return None
        code = self.process.poll()
        if code is None and self._kill_at is not None and time.monotonic() > self._kill_at:
            self.note("did not stop within the grace period: SIGKILL")
            self.signal(signal.SIGKILL)
            self._kill_at = float("inf")
        return code

    def exit_report(self, code: int) -> dict:
        """What the control plane learns when the process ends."""
        evidence = None
        if self._exits is not None:
            # Before the leftovers are killed: those deaths are the agent's doing.
            evidence = self._exits.evidence(self.plan.id)
            self._exits.forget(self.plan.id)
            if evidence and evidence.get("incomplete"):
                self.note("some process events were lost: how its processes died may be partial")
        if self.uid is not None:
            # Whatever the job left running (a daemon out of its session holds our pipes
            # open too) and its files in the shared temporary directories go with it.
            killed = isolation.stop_everything_of(self.uid)
            self.leftovers_killed = len(killed)
            if killed:
                named = ", ".join(killed[:8]) + (", …" if len(killed) > 8 else "")
                self.note(f"killed {len(killed)} process(es) the run left behind: {named}")
            if not isolation.runs_going_of(self.uid):  # else they may be that run's
                isolation.remove_temporary_files_of(self.uid)
        for reader in self._readers:
            reader.join(timeout=5)  # the last lines first
        status = None
        try:
            data = isolation.read_job_file(self.status_file, uid=self.uid, limit=STATUS_LIMIT)
            if data is not None:
                status = json.loads(data.decode("utf-8"))
        except (OSError, ValueError) as exc:
            status = {"unreadable": str(exc)[:200]}
        return {
            "state": "exited",
            "exit_code": code if code >= 0 else None,
            "signal": -code if code < 0 else None,
            "reason": self.stop_reason,
            "status": status,
            "evidence": evidence,
        }
