"""The one interface every provider offers, and the plain data it takes and returns.

A provider is built from a plain config dataclass (the caller reads settings;
providers never import Django) and is called with a node spec, a dataclass
that names the node by its UUID. Every operation is idempotent and starts from
the spec alone, not from anything an earlier call returned, so a Celery task
that died half-way can simply be run again:

    create(spec)              make the node exist or reach it; a repeat finds it
    bootstrap(spec, bundle)   put the agent, trainer and NCCL file in place; start the agent once
    describe(spec)            what the node is now
    terminate(spec)           end it; ending an ended node does nothing
"""

import datetime as dt
import enum
import uuid as uuid_module
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from workers.providers.bundle import Bundle
from workers.providers.errors import ConfigurationError

Progress = Callable[[str, int, str], None]
"""`progress(step, percent, message)`: how far an operation has gone, for the Fleet page."""


def report(progress: Progress | None, step: str, percent: int, message: str) -> None:
    if progress is not None:
        progress(step, max(0, min(100, percent)), message)


def node_uuid(value: object) -> str:
    """The canonical text of a node UUID; anything else is a configuration error."""
    try:
        return str(uuid_module.UUID(str(value)))
    except ValueError:
        raise ConfigurationError(f"{value!r} is not a node UUID.") from None


class MachineState(enum.StrEnum):
    """Where the machine behind a node is in its life, in EC2's words where they apply."""

    ABSENT = "absent"  # nothing exists for this node (never created, or cleaned up)
    PENDING = "pending"
    RUNNING = "running"  # local: the directory exists; ssh: the host answered
    STOPPING = "stopping"
    STOPPED = "stopped"
    SHUTTING_DOWN = "shutting-down"
    TERMINATED = "terminated"


class CapacityType(enum.StrEnum):
    """The same values as the fleet's CapacityType choices."""

    OWNED = "owned"
    ON_DEMAND = "on_demand"
    SPOT = "spot"


@dataclass(frozen=True)
class Gpu:
    """One line of `nvidia-smi --query-gpu=index,uuid,name,memory.total,driver_version`."""

    index: int
    uuid: str
    name: str
    memory_mib: int | None
    driver_version: str


@dataclass(frozen=True)
class GpuReport:
    """What GPU detection found. `found` is false when nvidia-smi is missing or failed:
    `message` says which, and the caller treats it as a failed health check on a GPU node."""

    found: bool
    gpus: tuple[Gpu, ...] = ()
    message: str = ""


@dataclass(frozen=True)
class NodeDescription:
    uuid: str
    state: MachineState
    capacity_type: CapacityType | None = None
    address: str = ""  # ssh: the host; aws: the private IP; local: 127.0.0.1
    agent_alive: bool | None = None  # None: this provider cannot tell (aws: the agent reports)
    agent_pid: int | None = None
    slots: int | None = None  # local: CPU slots standing in for GPUs
    instance_id: str = ""
    instance_type: str = ""
    launch_time: dt.datetime | None = None
    placement_group: str = ""
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BootstrapReport:
    uuid: str
    node_dir: str
    agent_pid: int | None
    agent_started: bool  # false when the agent was already running and was left alone
    gpus: GpuReport | None = None  # None where the provider does not detect GPUs itself
    message: str = ""


Spec = TypeVar("Spec", contravariant=True)


class Provider(Protocol[Spec]):
    """What the node services call. `Spec` is the provider's own node spec dataclass."""

    kind: str

    def create(self, spec: Spec, *, progress: Progress | None = None) -> NodeDescription: ...

    def bootstrap(
        self,
        spec: Spec,
        bundle: Bundle,
        *,
        restart_agent: bool = False,
        progress: Progress | None = None,
    ) -> BootstrapReport: ...

    def describe(self, spec: Spec) -> NodeDescription: ...

    def terminate(self, spec: Spec, *, progress: Progress | None = None) -> NodeDescription: ...
