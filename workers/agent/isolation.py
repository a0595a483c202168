"""Each job's processes run as an unprivileged user of their own, never as the agent.

A job is someone else's code. When the agent is privileged (root, or the
capabilities below), every run of job J starts as uid = gid = `base + J`: a number
no login account uses, the same on every node (a shared checkpoint directory then
has one owner), and different for every job. Such a process cannot read another
job's `/proc/<pid>/environ`, its run directory or its checkpoints, nor the agent's
token (agent.env is root's, mode 600). When the agent is not privileged (a `local`
node started by a developer's own user), runs start as the agent's user and the
node says so when it registers: the scheduler then keeps one team per node.

The agent acts as root on directories a job can write to, so it never follows a
job's links there: files the agent reads from them are opened with O_NOFOLLOW and
must be regular files the job's user owns; ownership is changed without following
links; a directory left from an earlier start is removed, never reused.

What a team's jobs share on a node (its dataset cache) belongs to the team's group:
gid = `base + count + team`, just above the jobs' range, the same on every node. Each
job's processes hold that group as their one supplementary group; the agent makes the
team's directories (root's, setgid, closed to everyone else), so no job owns them and
the next job of the team finds them as the first left them.
"""

import contextlib
import errno
import itertools
import logging
import os
import shutil
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("agent")

# Above the ranges distributions give people, systemd and containers: no account lives here.
DEFAULT_UID_BASE = 1_500_000_000
DEFAULT_UID_COUNT = 500_000_000
# Teams' groups, just above the jobs' uids: `uid_base + uid_count + team id % TEAM_GID_COUNT`.
TEAM_GID_COUNT = 10_000_000
# What switching a child to another user, handing it its directories and stopping
# everything it left behind takes: CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_KILL,
# CAP_SETGID, CAP_SETUID.
NEEDED_CAPABILITIES = {0: "CAP_CHOWN", 1: "CAP_DAC_OVERRIDE", 3: "CAP_FOWNER", 5: "CAP_KILL"}
NEEDED_CAPABILITIES |= {6: "CAP_SETGID", 7: "CAP_SETUID"}
MODES = ("auto", "required", "off")


class IsolationUnavailable(Exception):
    """AGENT_JOB_USERS=required, and this agent cannot switch users."""


@dataclass(frozen=True)
class Isolation:
    """How this agent starts runs: `user` (each job its own uid) or `none` (as the agent)."""

    mode: str
    reason: str = ""
    uid_base: int = DEFAULT_UID_BASE
    uid_count: int = DEFAULT_UID_COUNT

    @property
    def on(self) -> bool:
        return self.mode == "user"

    def uid_for(self, job_id: int) -> int:
        """The job's own uid (and gid): the same on every node, different for every job."""
        return self.uid_base + job_id % self.uid_count

    def gid_for_team(self, team_id: int) -> int:
        """The team's group (its jobs' one supplementary group): the same on every node."""
        return self.uid_base + self.uid_count + team_id % TEAM_GID_COUNT

    def report(self) -> dict:
        """What the agent tells the control plane when it registers."""
        return {"mode": self.mode, "reason": self.reason}


def missing_capabilities(status_text: str | None = None) -> list[str]:
    """The capabilities this process lacks for isolation (none for an ordinary root)."""
    if status_text is None:
        try:
            status_text = Path("/proc/self/status").read_text()
        except OSError:
            return [] if os.geteuid() == 0 else list(NEEDED_CAPABILITIES.values())
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
            return [name for bit, name in NEEDED_CAPABILITIES.items() if not effective >> bit & 1]
    return [] if os.geteuid() == 0 else list(NEEDED_CAPABILITIES.values())


def detect(
    mode: str = "auto", *, work_dir: Path | None = None, uid_base: int = 0, uid_count: int = 0
) -> Isolation:
    """Decide how runs start here. `required` refuses to go on without isolation."""
    uid_base = uid_base or DEFAULT_UID_BASE
    uid_count = uid_count or DEFAULT_UID_COUNT
    if mode not in MODES:
        raise IsolationUnavailable(f"AGENT_JOB_USERS={mode!r}: use one of {', '.join(MODES)}")
    if not 0 < uid_base <= 2**32 - 2 - uid_count - TEAM_GID_COUNT:
        raise IsolationUnavailable(
            "AGENT_JOB_UID_BASE and _COUNT, and the teams' groups above them, must fit in 32 bits"
        )
    if mode == "off":
        return Isolation("none", "turned off by AGENT_JOB_USERS=off", uid_base, uid_count)
    missing = missing_capabilities()
    # The node directory itself the agent opens (open_code); what leads to it, it cannot.
    blocked = blocked_by(work_dir.parent) if work_dir is not None else ""
    if not missing and not blocked:
        return Isolation("user", "", uid_base, uid_count)
    if missing:
        reason = f"the agent runs as uid {os.geteuid()} without {', '.join(missing)}"
    else:
        reason = f"jobs' users could not reach the node directory: {blocked} is closed to them"
    if mode == "required":
        raise IsolationUnavailable(f"jobs cannot run as their own users: {reason}")
    return Isolation("none", reason, uid_base, uid_count)


def blocked_by(path: Path) -> str:
    """The first directory on the way to `path` that other users cannot pass through
    ('' when there is none): a job's user could not reach what lies under it."""
    path = path.resolve()
    for directory in [*reversed(path.parents), path]:
        try:
            mode = directory.stat().st_mode
        except OSError:
            return str(directory)
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return f"{directory} (mode {stat.S_IMODE(mode):o})"
    return ""


IMPORT_DIR = "code"  # under the node directory: what runs find the bundled packages through


def import_dir(code_dir: Path) -> Path:
    """The directory runs import the bundled packages from (their PYTHONPATH): one that
    holds nothing but a link to them. Python lists each directory on its path before it
    imports from it, and the node directory is closed to listing (open_code), so a job's
    user could never find `workers` there itself."""
    path = code_dir / IMPORT_DIR
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o755)
    link = path / "workers"
    if not link.is_symlink():
        if link.exists():  # something else sits where the link goes: not ours to keep
            shutil.rmtree(link) if link.is_dir() else link.unlink()
        link.symlink_to(Path("..") / "workers")
    os.chmod(path, 0o755)  # noqa: S103 (lists one public link)
    return path


def open_code(code_dir: Path) -> None:
    """Let job users pass through the node directory and read the bundled packages
    (public code), but list nothing else in it (agent.env, agent.log stay the agent's)."""
    os.chmod(code_dir, 0o711)  # noqa: S103 (pass through, list nothing)
    packages = code_dir / "workers"
    if not packages.is_dir():
        return
    for root, _dirs, files in os.walk(packages):
        os.chmod(root, 0o755)  # noqa: S103 (public code)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


# --- directories a job may write to -----------------------------------------------------------


def traversable(path: Path) -> None:
    """Make `path` and its missing parents as directories a job's user may pass through
    but not list (0711), whatever the umask."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir()
        os.chmod(directory, 0o711)  # noqa: S103 (pass through, list nothing)


def fresh_directory(path: Path) -> None:
    """An empty directory at `path` owned by the agent, whatever was there before.

    A directory left from an earlier start of the same run may hold a job's links
    (run.json -> /etc/passwd): it is removed (rmtree does not follow links), not reused.
    """
    traversable(path.parent)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    path.mkdir(mode=0o700)


def hand_over(path: Path, uid: int, gid: int) -> None:
    """Give a tree to the job's user, never following a link (a link itself is chowned)."""
    os.chown(path, uid, gid, follow_symlinks=False)
    if path.is_symlink() or not path.is_dir():
        return
    for root, dirs, files in os.walk(path):  # os.walk does not descend into linked dirs
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.chown(os.path.join(root, name), uid, gid, follow_symlinks=False)


def owned_directory(path: Path, uid: int, gid: int) -> None:
    """A directory that must belong to the job (its checkpoints): made if missing, its
    parents made traversable but not listable, the tree handed to the job's user if an
    earlier start or an older agent left it to someone else."""
    traversable(path.parent)
    if path.is_symlink():
        raise PermissionError(f"{path} is a link")
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if (info.st_uid, info.st_gid) != (uid, gid):
        hand_over(path, uid, gid)
    os.chmod(path, 0o700)


TEAM_DIR_MODE = 0o2750  # the team's group passes through and lists; no one else enters
SHARED_DIR_MODE = 0o2770  # the team's jobs write; what they make takes the team's group


def team_directory(path: Path, gid: int) -> None:
    """A directory the team's jobs share (a dataset's cache): root's, of the team's group,
    setgid and group-writable, under a team directory closed to other teams.

    Neither can be replaced by a job: the team directory's parent is root's, and the team
    directory is not writable by the group. One left in another form (an older agent handed
    it to one job's user, 0700) is removed and made afresh: a cache, fetched again.
    """
    team = path.parent
    traversable(team.parent)
    try:
        team.mkdir(mode=0o700)
        made = True
    except FileExistsError:
        made = False
    info = team.lstat()
    # Only a directory the agent made is given to a team (now, before, or by an older agent,
    # 0711), never another directory of root's that a plan might name.
    before = (info.st_uid, info.st_gid) == (0, gid)
    older = info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o711
    if not stat.S_ISDIR(info.st_mode) or not (made or before or older):
        raise PermissionError(f"{team} is not a team directory the agent made")
    os.chown(team, 0, gid, follow_symlinks=False)
    os.chmod(team, TEAM_DIR_MODE)
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    wanted = (0, gid, stat.S_IFDIR | SHARED_DIR_MODE)
    if info is not None and (info.st_uid, info.st_gid, info.st_mode) == wanted:
        return
    if info is not None:
        shutil.rmtree(path) if stat.S_ISDIR(info.st_mode) else path.unlink()
    path.mkdir(mode=0o700)
    os.chown(path, 0, gid)
    os.chmod(path, SHARED_DIR_MODE)


class NotAPlainFile(OSError):
    """A job left a FIFO, a device or a directory where a file was expected."""


def open_plain(path: Path):
    """A file in a directory a job can write to, opened for reading as the agent (root):
    never through a link (ELOOP), never a FIFO or device that would hang or mislead it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotAPlainFile("not a regular file")
    return os.fdopen(fd, "rb")


def read_job_file(path: Path, *, uid: int | None, limit: int = 64 * 1024) -> bytes | None:
    """A small file the job wrote, read safely as root (open_plain), not someone else's,
    and no more than `limit` bytes. None when there is none to read."""
    try:
        file = open_plain(path)
    except NotAPlainFile:
        raise ValueError("not a regular file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a link, not followed") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise
    with file:
        if uid is not None and os.fstat(file.fileno()).st_uid not in (uid, os.geteuid()):
            raise ValueError("not written by the job")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


# --- what a job leaves behind ------------------------------------------------------------------


# The module every node agent runs as (`python3 -m workers.agent`).
AGENT_MODULE = __name__.rpartition(".")[0]


def _uids(pid: int | str) -> tuple[int, int] | None:
    """A process's real and effective uid, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as file:
            for line in file:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real), int(effective)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return None


def _parents(uid: int) -> dict[int, int]:
    """Every live process whose real or effective uid is `uid`, and its parent's id."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or uid not in (_uids(entry.name) or ()):
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as file:
                # After the command's name (which may hold anything): state, then the parent.
                found[int(entry.name)] = int(file.read().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
    return found


def processes_of(uid: int) -> list[int]:
    """Every live process whose real or effective uid is `uid`."""
    return list(_parents(uid))


def _is_agent(pid: int) -> bool:
    """This agent, or another node's agent on this machine (local nodes share one): a
    process of the agent's own user running the agent module, which no job can start."""
    if pid == os.getpid():
        return True
    if pid <= 1 or (_uids(pid) or (None, None))[1] != os.geteuid():
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    module = AGENT_MODULE.encode()
    return any(a == b"-m" and b == module for a, b in itertools.pairwise(argv))


def _in_live_runs(parents: dict[int, int]) -> set[int]:
    """The processes of runs still going: an agent starts each run's first process, and
    everything that run starts descends from it (torchrun's workers too, though each is in
    a session of its own). A daemon that left its run, or outlived it, was handed to init
    (or the nearest subreaper): its line of parents reaches no agent."""
    under_agent: dict[int, bool] = {}
    for pid in parents:
        line = []
        while pid in parents and pid not in under_agent:
            line.append(pid)
            pid = parents[pid]
        verdict = under_agent[pid] if pid in under_agent else _is_agent(pid)
        under_agent.update(dict.fromkeys(line, verdict))
    return {pid for pid, verdict in under_agent.items() if verdict}


def runs_going_of(uid: int) -> bool:
    """Whether a run of the job's user is still going on this machine (by any agent)."""
    return bool(_in_live_runs(_parents(uid)))


def stop_everything_of(uid: int, *, timeout_s: float = 5.0) -> list[str]:
    """SIGKILL whatever the job's user still runs outside its runs still going (a daemon
    that left the session, a double fork, workers whose launcher is gone): nothing of a
    job outlives its run. Another run of the same job is spared, with all it started:
    another attempt on this node, or, on local nodes (one machine), the job's run on
    another node. Returns what was killed, as "pid name (parent pid)"."""
    killed: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        parents = _parents(uid)
        going = _in_live_runs(parents)
        pids = [pid for pid in parents if pid not in going and pid != os.getpid()]
        if not pids:
            break
        for pid in pids:
            name = _name(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.setdefault(pid, f"{pid} {name} (parent {parents[pid]})")
        time.sleep(0.05)
    return list(killed.values())


def _name(pid: int) -> str:
    """A process's command name (the job's own data: said in its log, never acted on)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").strip()[:32]
    except OSError:
        return "?"


def remove_temporary_files_of(uid: int, places=("/tmp", "/var/tmp", "/dev/shm")) -> int:  # noqa: S108
    """Remove what the job's user left at the top of the shared temporary directories."""
    removed = 0
    for place in places:
        try:
            entries = list(os.scandir(place))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
            except OSError:
                continue
    return removed
