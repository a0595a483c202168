"""What bootstrap puts on a node, and where: one layout for local and SSH nodes.

A node directory holds

    workers/__init__.py, workers/agent/..., workers/trainer/...   the packages
    agent.env    the agent's settings (KEY=value lines, mode 600: it holds the node token)
    agent.pid    the agent's process id
    agent.log    the agent's output

and the agent runs with that directory as its working directory, so
`python3 -m workers.agent` finds its package without any install step. No NCCL settings
are left on a node: each run plan carries the environment rendered when it was dispatched.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workers.providers.errors import ConfigurationError

WORKERS_DIR = Path(__file__).resolve().parents[1]
AGENT_PACKAGE = WORKERS_DIR / "agent"
TRAINER_PACKAGE = WORKERS_DIR / "trainer"

NODE_DIR_PREFIX = "node-"
AGENT_ENV_FILE = "agent.env"
AGENT_PID_FILE = "agent.pid"
AGENT_LOG_FILE = "agent.log"

# Set in the agent's environment by every provider: it tells a reused process id
# from our agent, and tells the agent which node it is.
NODE_UUID_VARIABLE = "CONTROLPLANE_NODE_UUID"

_PACKAGE_INIT = b'"""Packages copied to this node by the control plane."""\n'
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Bundle:
    """The files and the command a bootstrap installs and starts.

    `agent_argv` runs in the node directory (a list, never a shell string);
    `agent_env` is written to agent.env for the agent to read (control-plane
    URL, node token).
    """

    agent_argv: tuple[str, ...]
    agent_env: Mapping[str, str] = field(default_factory=dict, repr=False)
    packages: tuple[Path, ...] = (AGENT_PACKAGE, TRAINER_PACKAGE)

    def __post_init__(self):
        argv = self.agent_argv
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigurationError("agent_argv must be a non-empty list of strings.")
        object.__setattr__(self, "agent_argv", tuple(self.agent_argv))
        for package in self.packages:
            if not (Path(package) / "__init__.py").is_file():
                raise ConfigurationError(f"{package} is not a Python package.")
        env_file_text(self.agent_env)  # refuse bad names or values now, not on the node


def bundle_files(bundle: Bundle) -> list[tuple[str, Path | bytes]]:
    """(path relative to the node directory, local file or contents) for every package file."""
    files: list[tuple[str, Path | bytes]] = [("workers/__init__.py", _PACKAGE_INIT)]
    for package in bundle.packages:
        package = Path(package)
        for path in sorted(package.rglob("*")):
            relative = path.relative_to(package)
            if "__pycache__" in relative.parts or path.suffix == ".pyc":
                continue
            if path.is_file() and not path.is_symlink():
                files.append((f"workers/{package.name}/{relative.as_posix()}", path))
    return files


def env_file_text(variables: Mapping[str, str]) -> str:
    """KEY=value lines, checked so that no value can smuggle in a second line."""
    lines = []
    for name, value in variables.items():
        if not _ENV_NAME.match(name):
            raise ConfigurationError(f"{name!r} is not an environment variable name.")
        if not isinstance(value, str) or any(c in value for c in "\n\r\0"):
            raise ConfigurationError(f"The value of {name} must be one line of text.")
        lines.append(f"{name}={value}\n")
    return "".join(lines)
