"""The processes of this machine as /proc shows them (a run's torchrun workers, a node's
agent) and waiting for what they do. Plain Python (no Django): the end-to-end tests and
the drills both use them."""

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Worker:
    """One torchrun worker process, as /proc shows it: who it is in the job's world."""

    pid: int
    rank: int
    local_rank: int
    world_size: int


def workers_of(torchrun_pid: int) -> list[Worker]:
    """The worker processes a run's torchrun has started (its children that carry a RANK),
    read from /proc: on local and SSH nodes alike they are processes of this machine."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != torchrun_pid:
                continue
            env = _environ(entry.name)
        except (OSError, ValueError):
            continue  # gone, or not ours to read
        if b"RANK" in env:
            workers.append(
                Worker(
                    int(entry.name),
                    int(env[b"RANK"]),
                    int(env[b"LOCAL_RANK"]),
                    int(env[b"WORLD_SIZE"]),
                )
            )
    return sorted(workers, key=lambda w: w.rank)


def _environ(pid: int | str) -> dict[bytes, bytes]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)


def agent_of(node_uuid: str) -> int | None:
    """The pid of the agent serving the node with this UUID (local and SSH nodes alike run
    theirs on this machine, with the UUID in its environment), or None."""
    wanted = f"CONTROLPLANE_NODE_UUID={node_uuid}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"workers.agent" not in (entry / "cmdline").read_bytes():
                continue
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except OSError:
            continue
    return None


def wait_for(what: str, predicate, timeout_s: float = 60.0, every_s: float = 0.2):
    """Call `predicate` until it returns something true (returned), or fail after
    `timeout_s` saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)
