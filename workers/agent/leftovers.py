"""What a previous agent on this node left running: found in its ledger, stopped at start.

An agent killed outright (SIGKILL, an out-of-memory kill) leaves its runs' processes
going, each in a session of its own: torchrun and its workers keep training and hold
the GPUs, while the control plane, hearing of no such run from the new agent, marks it
lost and places the job again. The new agent owns none of them; it stops them before it
registers, and writes the end line its predecessor never wrote.

A process is the one the ledger names only if its pid AND its start time match (a pid
is reused once its process is gone; the pair is not), so nothing unrelated is signalled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.agent import isolation as isolation_module

if TYPE_CHECKING:
    from workers.agent.isolation import Isolation
    from workers.agent.runs import Ledger

log = logging.getLogger("agent")

GRACE_S = 5.0  # SIGTERM first (the trainer checkpoints), SIGKILL after this
LEFT_BY_PREDECESSOR = "left running by a previous agent; stopped"
GONE_BEFORE_START = "its process was gone when the agent started"


@dataclass(frozen=True)
class Process:
    parent: int
    session: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22)


def _stat(pid: int | str) -> Process | None:
    """A live process as /proc says, or None once it is gone (or only a zombie is left)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            # After the command's name (which may hold anything): fields 3 onwards.
            fields = file.read().rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            return None
        return Process(parent=int(fields[1]), session=int(fields[3]), start_time=int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """When the process started, which with its pid names it for good; None once gone."""
    found = _stat(pid)
    return found.start_time if found else None


def _processes() -> dict[int, Process]:
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (found := _stat(entry.name)) is not None:
            table[int(entry.name)] = found
    return table


def run_processes(pid: int, start_time: int) -> dict[int, int]:
    """The run's processes (pid → start time): its first process, if it is still the one
    the ledger names, everything descending from it (torchrun's workers sit in sessions
    of their own) and whatever is still in its session. Empty once it is gone."""
    table = _processes()
    first = table.get(pid)
    if first is None or first.start_time != start_time:
        return {}
    found = {pid} | {p for p, process in table.items() if process.session == pid}
    growing = True
    while growing:
        more = {p for p, process in table.items() if process.parent in found} - found
        found |= more
        growing = bool(more)
    return {p: table[p].start_time for p in found}


def _alive(processes: dict[int, int]) -> dict[int, int]:
    return {p: t for p, t in processes.items() if process_start_time(p) == t}


def _signal_each(processes: dict[int, int], signum: int) -> None:
    for pid in _alive(processes):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def processes_stop(
    pid: int, start_time: int, *, pgid: int | None = None, grace_s: float = GRACE_S
) -> int:
    """SIGTERM the run's process group and all its processes, SIGKILL what is left after
    the grace period; returns how many processes there were."""
    processes = run_processes(pid, start_time)
    if not processes:
        return 0
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid or pid, signal.SIGTERM)
    _signal_each(processes, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + 5
    while (left := _alive(processes)) and time.monotonic() < deadline:
        _signal_each(left, signal.SIGKILL)
        # A worker started during the grace period is killed as well.
        processes |= run_processes(pid, start_time)
        time.sleep(0.05)
    return len(processes)


def leftovers_stop(
    ledger: Ledger, *, isolation: Isolation | None = None, grace_s: float = GRACE_S
) -> list[int]:
    """Stop every run the ledger shows started and never ended, and end it in the ledger.
    Returns the ids of the runs whose processes were still going."""
    stopped = []
    uids = set()
    for record in ledger.open_runs():
        pid, start_time = record.get("pid"), record.get("start_time")
        count = 0
        if isinstance(pid, int) and isinstance(start_time, int):
            pgid = record.get("pgid") if isinstance(record.get("pgid"), int) else None
            count = processes_stop(pid, start_time, pgid=pgid, grace_s=grace_s)
        if count:
            stopped.append(record["run"])
            log.warning(
                "run %s of job %s was left running by a previous agent: stopped %d process(es)",
                record["run"],
                record.get("job"),
                count,
            )
        if isinstance(record.get("uid"), int):
            uids.add(record["uid"])
        ledger.close(record, reason=LEFT_BY_PREDECESSOR if count else GONE_BEFORE_START)
    if isolation is not None and isolation.on:
        for uid in sorted(uids):
            # A run of the same job under another live agent (local nodes share a machine)
            # is spared; what the job's user left outside one goes.
            killed = isolation_module.stop_everything_of(uid)
            if killed:
                log.warning("killed %d process(es) uid %d still ran: %s", len(killed), uid, killed)
            if not isolation_module.runs_going_of(uid):
                isolation_module.remove_temporary_files_of(uid)
    return stopped
