"""The fabric's error counters, read from sysfs on each heartbeat: InfiniBand port counters
and EFA's hardware counters, per link (`<device>/<port>`), as integers.

The control plane turns them into rates and marks degraded links (apps/fleet/fabric.py).
A file that is missing, unreadable or not a number is left out; nothing here raises.
"""

from pathlib import Path

# InfiniBand port counters (ports/<n>/counters/), as the kernel names them.
IB_COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_xmit_discards",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
# EFA's error counters among its hw_counters (drivers/infiniband/hw/efa/efa_verbs.c).
EFA_COUNTERS = (
    "rx_drops",
    "retrans_pkts",
    "retrans_timeout_events",
    "unresponsive_remote_events",
    "impaired_remote_conn_events",
    "rdma_read_wr_err",
    "rdma_write_wr_err",
)
MAX_LINKS = 64


def _integer(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None


def _read(directory: Path, names: tuple[str, ...]) -> dict[str, int]:
    found = {}
    for name in names:
        value = _integer(directory / name)
        if value is not None:
            found[name] = value
    return found


def fabric_counters(*, root: str | Path = "/sys") -> dict[str, dict[str, int]]:
    """{"mlx5_0/1": {"symbol_error": 0, ...}, "rdmap0s31/1": {"rx_drops": 0, ...}}; {} on a
    node without InfiniBand or EFA devices."""
    links: dict[str, dict[str, int]] = {}
    try:
        devices = sorted((Path(root) / "class" / "infiniband").iterdir())
    except OSError:
        return links
    for device in devices:
        try:
            ports = sorted((device / "ports").iterdir())
        except OSError:
            continue
        for port in ports:
            counters = _read(port / "counters", IB_COUNTERS)
            counters.update(_read(port / "hw_counters", EFA_COUNTERS))
            if counters and len(links) < MAX_LINKS:
                links[f"{device.name}/{port.name}"] = counters
    return links
