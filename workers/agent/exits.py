"""How a run's processes died, as the kernel says: evidence the job's own output cannot forge.

torchrun exits 1 when one of its ranks is killed, whoever killed it, so an exit code
cannot tell the OOM killer or a hardware fault from the job's own error. The watch
listens to the kernel's process events (the proc connector, over netlink): it follows
each run's process tree from its fork events, reads each process's RANK and LOCAL_RANK
when it execs, and records the processes that died by a signal. The kernel's log
(/dev/kmsg) says which of those the OOM killer chose.

Both need root (CAP_NET_ADMIN for the connector, which exists only in the host's
network namespace). Where they cannot be opened the watch is off, said once in the
agent's log, and runs are reported without evidence, as before.
"""

import contextlib
import errno
import logging
import os
import re
import select
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

log = logging.getLogger("agent")

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
NLMSG_DONE = 3
PROC_EVENT_FORK = 0x1
PROC_EVENT_EXEC = 0x2
PROC_EVENT_EXIT = 0x80000000
NLMSGHDR = struct.Struct("=IHHII")  # length, type, flags, seq, pid
CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
PROC_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns (CLOCK_MONOTONIC)
FORK = struct.Struct("=iiii")  # parent pid, parent tgid, child pid, child tgid
EXEC = struct.Struct("=ii")  # pid, tgid
EXIT = struct.Struct("=iiII")  # pid, tgid, exit code (a wait status), exit signal

RECEIVE_BUFFER = 8 << 20  # bytes: a burst of forks on a busy node must not overflow it
DEATHS_KEPT = 64  # per run: the earliest is the one reported
OOM_KILLS_KEPT = 256  # pids the kernel said it OOM-killed, newest kept
OOM_MATCH_S = 60  # a kernel record older than this names an earlier process of that pid
TOP_EXIT_WAIT_S = 2.0  # how long a report waits for the watch to read its run's last event

# The kernel's OOM kill lines, in /dev/kmsg's records ("6,1234,5678901,-;text"):
# "Out of memory: Killed process 1234 (python) total-vm:..." (the system's OOM killer),
# "Memory cgroup out of memory: Killed process 1234 (python) ..." (a cgroup's) and
# "oom-kill:constraint=CONSTRAINT_MEMCG,...,task=python,pid=1234,uid=1001" (both).
_OOM_KILLED = re.compile(r"out of memory: Killed process (\d+) \(([^)]*)\)", re.IGNORECASE)
_OOM_KILL = re.compile(r"oom-kill:.*\btask=([^,]*),pid=(\d+)")
# Signals a process raises on itself when its own code fails (a bad pointer, an abort):
# the job's fault, not the node's, so never evidence against the node.
OWN_FAULTS = frozenset({4, 5, 6, 8, 11, 31})  # SIGILL TRAP ABRT FPE SEGV SYS (SIGBUS is kept)


@dataclass
class Process:
    pid: int
    rank: int | None = None
    local_rank: int | None = None
    command: str = ""


@dataclass
class Death:
    at_ns: int
    process: Process
    signal: int


@dataclass
class Tree:
    """One run's processes, alive, and those that died by a signal."""

    top: int
    alive: dict[int, Process] = field(default_factory=dict)
    deaths: list[Death] = field(default_factory=list)
    stop_ns: int | None = None  # from when the agent asked the run to stop
    # When a rank first ended on its own (an exit code other than 0, or a crash of its own
    # making): what dies after it (torchrun stopping the other ranks) is its consequence.
    own_failure_ns: int | None = None
    incomplete: bool = False  # events were lost while it ran
    top_exited: threading.Event = field(default_factory=threading.Event)


def oom_kill_in(record: str) -> tuple[int, str] | None:
    """(pid, command) of the process a kernel log record says the OOM killer killed."""
    if match := _OOM_KILLED.search(record):
        return int(match.group(1)), match.group(2)
    if match := _OOM_KILL.search(record):
        return int(match.group(2)), match.group(1)
    return None


def kmsg_record(raw: bytes) -> tuple[int, str]:
    """(microseconds since boot, text) of one /dev/kmsg record."""
    header, _, text = raw.decode("utf-8", "replace").partition(";")
    fields = header.split(",")
    try:
        at_us = int(fields[2])
    except (IndexError, ValueError):
        at_us = 0
    return at_us, text.split("\n", 1)[0]


def _environment(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            data = environ.read(1 << 20)
    except OSError:
        return {}
    return dict(item.split(b"=", 1) for item in data.split(b"\0") if b"=" in item)


def _number(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as comm:
            return comm.read().strip()[:64]
    except OSError:
        return ""


def _children() -> dict[int, list[int]]:
    """Parent pid → child pids of every process now, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    return children


class ExitWatch:
    """The process events of this machine, read by one daemon thread, kept for the runs
    followed; `evidence` says how a run's tree died. Off (`on` False, `reason` why) where
    the kernel will not tell this process."""

    def __init__(self, *, receive_buffer: int = RECEIVE_BUFFER):
        self._receive_buffer = receive_buffer
        self.on = False
        self.reason = "not started"
        self._closing = threading.Event()
        self._socket: socket.socket | None = None
        self._kmsg: int | None = None
        self._lock = threading.Lock()
        self._trees: dict[int, Tree] = {}  # run id → its tree
        self._run_of: dict[int, int] = {}  # pid → run id, for the processes alive
        self._oom_kills: OrderedDict[int, tuple[int, str]] = OrderedDict()  # pid → (µs, command)

    def start(self) -> "ExitWatch":
        try:
            self._socket = self._listen(self._receive_buffer)
        except OSError as exc:
            self.reason = f"the kernel's process events cannot be read here: {exc}"
            log.warning("exit evidence is off: %s", self.reason)
            return self
        try:
            self._kmsg = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
            os.lseek(self._kmsg, 0, os.SEEK_END)  # what happens from now on
        except OSError as exc:
            self._kmsg = None
            log.warning("the kernel log cannot be read (%s): OOM kills show as SIGKILL", exc)
        self.on, self.reason = True, ""
        threading.Thread(target=self._read_forever, name="exits", daemon=True).start()
        return self

    @staticmethod
    def _listen(receive_buffer: int = RECEIVE_BUFFER) -> socket.socket:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        try:
            with contextlib.suppress(OSError):  # SO_RCVBUFFORCE needs CAP_NET_ADMIN
                sock.setsockopt(socket.SOL_SOCKET, 33, receive_buffer)  # SO_RCVBUFFORCE
            sock.bind((0, CN_IDX_PROC))  # 0: the kernel picks our port id
            listen = struct.pack("=I", PROC_CN_MCAST_LISTEN)
            message = CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(listen), 0) + listen
            header = NLMSGHDR.pack(NLMSGHDR.size + len(message), NLMSG_DONE, 0, 0, 0)
            sock.send(header + message)
        except OSError:
            sock.close()
            raise
        return sock

    # --- what the agent asks --------------------------------------------------------------

    def follow(self, run_id: int, pid: int) -> None:
        """Follow a run whose process just started, and whatever it has started already."""
        if not self.on:
            return
        tree = Tree(top=pid)
        with self._lock:
            self._trees[run_id] = tree
            self._join(run_id, tree, Process(pid, command=_command(pid)))
            self._read_rank(tree.alive[pid])
            children, queue = _children(), [pid]
            while queue:
                for child in children.get(queue.pop(), ()):
                    if child not in tree.alive:
                        self._join(run_id, tree, Process(child, command=_command(child)))
                        self._read_rank(tree.alive[child])
                        queue.append(child)

    def stopping(self, run_id: int) -> None:
        """The agent is about to signal the run: deaths from now on are its own doing."""
        with self._lock:
            tree = self._trees.get(run_id)
            if tree is not None and tree.stop_ns is None:
                tree.stop_ns = time.monotonic_ns()

    def evidence(self, run_id: int) -> dict | None:
        """The earliest process of the run that died by a signal the agent did not send:
        its kind ("oom" where the kernel's log names it, else "signal"), signal, pid,
        rank, local rank and command; None if none did (or the watch is off). Called when
        the run's top process has ended, so the watch has that event or soon will."""
        with self._lock:
            tree = self._trees.get(run_id)
        if tree is None:
            return None
        tree.top_exited.wait(TOP_EXIT_WAIT_S)
        with self._lock:
            until = min(t for t in (tree.stop_ns, tree.own_failure_ns, 1 << 63) if t is not None)
            deaths = [d for d in tree.deaths if d.at_ns < until]
            if not deaths:
                return {"incomplete": True} if tree.incomplete else None
            first = min(deaths, key=lambda d: d.at_ns)
            oom = self._oom_kills.get(first.process.pid)
            killed_by_oom = (
                first.signal == 9
                and oom is not None
                and abs(oom[0] * 1000 - first.at_ns) < OOM_MATCH_S * 1_000_000_000
            )
            found = {
                "kind": "oom" if killed_by_oom else "signal",
                "signal": first.signal,
                "pid": first.process.pid,
                "rank": first.process.rank,
                "local_rank": first.process.local_rank,
                "command": first.process.command or (oom[1] if oom else ""),
            }
            if tree.incomplete:
                found["incomplete"] = True
            return found

    def close(self) -> None:
        """Stop listening (the agent's watch lives as long as the agent; tests close theirs)."""
        self._closing.set()

    def forget(self, run_id: int) -> None:
        with self._lock:
            tree = self._trees.pop(run_id, None)
            if tree is not None:
                for pid in tree.alive:
                    if self._run_of.get(pid) == run_id:
                        del self._run_of[pid]

    # --- the watch thread -----------------------------------------------------------------

    def _read_forever(self) -> None:
        try:
            while not self._closing.is_set():
                sources = [self._socket] + ([self._kmsg] if self._kmsg is not None else [])
                readable, _, _ = select.select(sources, [], [], 1.0)
                if self._kmsg is not None:
                    self._read_kmsg()  # first: a kill is logged before its victim's exit is read
                if self._socket in readable:
                    self._read_events()
            self._socket.close()
            if self._kmsg is not None:
                os.close(self._kmsg)
        except OSError as exc:
            log.error("exit evidence is off from now on: %s", exc)
            with self._lock:  # what the runs followed now saw is partial
                self.on, self.reason = False, str(exc)
                for tree in self._trees.values():
                    tree.incomplete = True
                    tree.top_exited.set()

    def _read_kmsg(self) -> None:
        while True:
            try:
                raw = os.read(self._kmsg, 8192)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # records overwritten before we read them: on with the next
                log.warning("kernel log unreadable from now on: %s", exc)
                os.close(self._kmsg)
                self._kmsg = None
                return
            if not raw:
                return
            at_us, text = kmsg_record(raw)
            if (kill := oom_kill_in(text)) is not None:
                pid, command = kill
                with self._lock:
                    self._oom_kills[pid] = (at_us, command)
                    self._oom_kills.move_to_end(pid)
                    while len(self._oom_kills) > OOM_KILLS_KEPT:
                        self._oom_kills.popitem(last=False)

    def _read_events(self) -> None:
        while True:
            try:
                data = self._socket.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                with self._lock:  # events were dropped: no tree can be trusted to be whole
                    for tree in self._trees.values():
                        tree.incomplete = True
                log.warning("process events were lost (the kernel's buffer overflowed)")
                continue
            self._messages(data)

    def _messages(self, data: bytes) -> None:
        offset = 0
        while offset + NLMSGHDR.size <= len(data):
            length = NLMSGHDR.unpack_from(data, offset)[0]
            if length < NLMSGHDR.size:
                return
            start = offset + NLMSGHDR.size + CN_MSG.size
            if start + PROC_EVENT.size <= offset + length:
                self._event(data, start)
            offset += (length + 3) & ~3

    def _event(self, data: bytes, at: int) -> None:
        what, _cpu, at_ns = PROC_EVENT.unpack_from(data, at)
        body = at + PROC_EVENT.size
        if what == PROC_EVENT_FORK:
            _, parent, child, child_tgid = FORK.unpack_from(data, body)
            if child != child_tgid:
                return  # a thread, not a process
            with self._lock:
                run_id = self._run_of.get(parent)
                tree = self._trees.get(run_id) if run_id is not None else None
                if tree is not None and parent in tree.alive and child not in tree.alive:
                    known = tree.alive[parent]
                    self._join(
                        run_id, tree, Process(child, known.rank, known.local_rank, known.command)
                    )
        elif what == PROC_EVENT_EXEC:
            pid, tgid = EXEC.unpack_from(data, body)
            with self._lock:
                run_id = self._run_of.get(tgid)
                tree = self._trees.get(run_id) if run_id is not None else None
                process = tree.alive.get(tgid) if tree is not None else None
            if process is not None:  # read outside the lock: /proc can be slow
                process.command = _command(tgid) or process.command
                self._read_rank(process)
        elif what == PROC_EVENT_EXIT:
            pid, tgid, status, _ = EXIT.unpack_from(data, body)
            if pid != tgid:
                return  # a thread ended; its process goes on
            with self._lock:
                run_id = self._run_of.pop(pid, None)
                tree = self._trees.get(run_id) if run_id is not None else None
                if tree is None:
                    return
                process = tree.alive.pop(pid, None)
                signum = status & 0x7F
                killed = process is not None and signum and signum not in OWN_FAULTS
                if killed and len(tree.deaths) < DEATHS_KEPT:
                    tree.deaths.append(Death(at_ns, process, signum))
                own = signum in OWN_FAULTS or (not signum and status >> 8)
                if own and process is not None and process.rank is not None:
                    tree.own_failure_ns = min(tree.own_failure_ns or at_ns, at_ns)
                if pid == tree.top:
                    tree.top_exited.set()

    def _join(self, run_id: int, tree: Tree, process: Process) -> None:
        tree.alive[process.pid] = process
        self._run_of[process.pid] = run_id

    @staticmethod
    def _read_rank(process: Process) -> None:
        env = _environment(process.pid)
        if b"RANK" in env:
            process.rank = _number(env.get(b"RANK"))
            process.local_rank = _number(env.get(b"LOCAL_RANK"))


def unavailable() -> str:
    """Why this process cannot hear the kernel's process events, or "" where it can."""
    try:
        ExitWatch._listen().close()
    except OSError as exc:
        return str(exc)
    return ""


_watch: ExitWatch | None = None
_watch_lock = threading.Lock()


def watch() -> ExitWatch:
    """This agent process's one watch, started on first use."""
    global _watch
    with _watch_lock:
        if _watch is None:
            _watch = ExitWatch().start()
        return _watch
