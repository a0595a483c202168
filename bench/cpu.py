"""Where a benchmark's CPU went, read from Linux's /proc: the machine's busy share and the
CPU seconds of the processes that served the load (the server, PostgreSQL, Redis)."""

import os
from pathlib import Path


def machine_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def _stats():
    """(pid, command name, the fields after it) of every process here."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        head, _, rest = text.rpartition(")")
        yield int(stat.parent.name), head.partition("(")[2], rest.split()


def children(pid: int) -> list[int]:
    return [child for child, _, fields in _stats() if int(fields[1]) == pid]


def named(name: str) -> list[int]:
    """The processes whose command name is `name` (e.g. every PostgreSQL process)."""
    return [pid for pid, command, _ in _stats() if command == name]


def redis_pid(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def process_cpu_s(pids: list[int]) -> list[float]:
    """CPU seconds (user + system) each process and its reaped children have used; 0 for
    one that is not here (gunicorn's master counts the workers it has replaced, the
    postmaster the backends that have exited)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            used.append(0.0)
            continue
        used.append(sum(int(x) for x in fields[11:15]) / tick)
    return used
