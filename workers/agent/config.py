"""The agent's settings: agent.env in the node directory, then the process environment.

agent.env holds `KEY=value` lines written by bootstrap (mode 600: it holds the
node token). Values in the environment win, so a test or an operator can
override one setting without editing the file.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_FILE = "agent.env"


@dataclass(frozen=True)
class AgentConfig:
    url: str  # the control plane, e.g. https://controlplane.example.com
    token: str = field(repr=False)  # this node's token: `Authorization: Bearer ...`
    node_uuid: str = ""
    work_dir: Path = Path(".")
    heartbeat_every_s: float = 5.0
    plans_every_s: float = 2.0
    # Local nodes have no GPUs: this many CPU slots stand in for them.
    slots: int = 0
    # AWS instance metadata (IMDSv2); empty turns the spot watch off. Tests point it at
    # a small HTTP server of their own.
    imds_url: str = ""
    spot_poll_s: float = 5.0
    request_timeout_s: float = 10.0
    # How long a stopping run has between SIGTERM and SIGKILL.
    stop_grace_s: float = 30.0
    # Log lines kept while the control plane cannot be reached; older ones are dropped
    # (and counted) beyond this.
    max_buffered_lines: int = 200_000
    # Each job as its own user (workers/agent/isolation.py): auto (when privileged),
    # required (refuse to start without), off. Jobs' uids are base + job id.
    job_users: str = "auto"
    job_uid_base: int = 0
    job_uid_count: int = 0
    # Where the fabric's counters are read (workers/agent/fabric.py); tests point it at a
    # generated tree.
    sysfs_root: Path = Path("/sys")


def read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    if not path.is_file():
        return values
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        values[name.strip()] = value
    return values


def write_value(path: Path, name: str, value: str) -> None:
    """Set one KEY=value line of agent.env, atomically and readable by the agent alone."""
    if any(c in value for c in "\n\r\0"):
        raise ValueError(f"{name} must be one line")
    lines = [
        line
        for line in (path.read_text(encoding="utf-8").splitlines() if path.is_file() else [])
        if line.partition("=")[0].strip() != name
    ]
    lines.append(f"{name}={value}")
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write("\n".join(lines) + "\n")
    os.replace(temporary, path)


def load(work_dir: Path | None = None, environ: dict[str, str] | None = None) -> AgentConfig:
    work_dir = Path(work_dir or Path.cwd()).resolve()
    environ = dict(os.environ if environ is None else environ)
    values = {**read_env_file(work_dir / ENV_FILE), **environ}

    def number(name: str, default: float) -> float:
        text = values.get(name, "")
        try:
            return float(text) if text else default
        except ValueError:
            raise SystemExit(f"agent: {name}={text!r} is not a number") from None

    url = values.get("CONTROLPLANE_URL", "").rstrip("/")
    token = values.get("CONTROLPLANE_NODE_TOKEN", "")
    if not url or not token:
        raise SystemExit("agent: CONTROLPLANE_URL and CONTROLPLANE_NODE_TOKEN are required")
    return AgentConfig(
        url=url,
        token=token,
        node_uuid=values.get("CONTROLPLANE_NODE_UUID", ""),
        work_dir=work_dir,
        heartbeat_every_s=number("AGENT_HEARTBEAT_S", 5.0),
        plans_every_s=number("AGENT_PLANS_S", 2.0),
        slots=int(number("AGENT_SLOTS", 0)),
        imds_url=values.get("AGENT_IMDS_URL", "").rstrip("/"),
        spot_poll_s=number("AGENT_SPOT_POLL_S", 5.0),
        request_timeout_s=number("AGENT_REQUEST_TIMEOUT_S", 10.0),
        stop_grace_s=number("AGENT_STOP_GRACE_S", 30.0),
        max_buffered_lines=int(number("AGENT_MAX_BUFFERED_LINES", 200_000)),
        job_users=values.get("AGENT_JOB_USERS", "") or "auto",
        job_uid_base=int(number("AGENT_JOB_UID_BASE", 0)),
        job_uid_count=int(number("AGENT_JOB_UID_COUNT", 0)),
        sysfs_root=Path(values.get("AGENT_SYSFS_ROOT", "") or "/sys"),
    )
