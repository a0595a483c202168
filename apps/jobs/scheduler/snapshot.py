"""The plain data the planner reads and the decisions it returns (no ORM, no Django).

Times are seconds since the epoch (floats). GPU types are "H100", "H200", "A100";
a pending job may ask for "ANY". Priority classes are ranks: 0 low, 1 normal,
2 high, 3 urgent.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

ANY_GPU = "ANY"

# Placement preferences of a job.
OWNED = "owned"
OWNED_THEN_CLOUD = "owned_then_cloud"
CLOUD = "cloud"


class NodeSlot(NamedTuple):
    """A node as the planner sees it: how many GPUs it has and how many are free now.
    A named tuple, like Pending: a pass reads one per node (10,000)."""

    id: int
    pool_id: int
    rack_id: int | None
    gpus_total: int
    gpus_free: int  # total minus what current allocations hold
    schedulable: bool  # READY or BUSY; draining, suspect, down... are not
    # Whether it may hold several teams' jobs at once (its pool's tenancy is shared and its
    # agent runs each job as its own user); if not, it holds one team's jobs at a time.
    shared: bool = False
    # Its InfiniBand/EFA error rates passed their limits (Node.fabric_degraded_since): a gang
    # avoids it while healthy nodes can hold the gang; a one-node job's traffic stays on it.
    degraded: bool = False


@dataclass(frozen=True, slots=True)
class PoolInfo:
    id: int
    kind: str  # "owned" or "cloud"
    gpu_type: str
    spot: bool  # the pool's nodes may be spot (capacity preference spot_then_on_demand)
    enabled: bool
    burst_delay_s: int = 600
    max_nodes: int = 0
    gpus_per_node: int = 8  # what a burst node of this pool has (its instance type)


class Running(NamedTuple):
    """A job holding GPUs now (ADMITTED through RUNNING). A named tuple, like Pending."""

    job_id: int
    team_id: int
    gpu_type: str  # the pool's GPU type, never ANY
    priority: int
    pool_id: int
    node_gpus: tuple[tuple[int, int], ...]  # (node id, GPUs held on it)
    expected_end: float  # start + time limit: when its GPUs are free at the latest
    preemptible: bool = True  # False once it is already PREEMPTING or STOPPING

    @property
    def gpus(self) -> int:
        return sum(g for _, g in self.node_gpus)


class Pending(NamedTuple):
    """A pending job. A named tuple, like Wait: a pass makes one per pending job (50,000),
    and a tuple is built about seven times faster than a frozen dataclass."""

    job_id: int
    team_id: int
    priority: int
    queued_at: float  # keeps its value across preemption, so a requeued job keeps its place
    gpu_type: str  # or ANY_GPU
    nodes: int
    gpus_per_node: int
    placement: str  # OWNED, OWNED_THEN_CLOUD or CLOUD
    spot_allowed: bool
    time_limit_s: int
    budget_ok: bool = True  # the team has budget left to burst (budget_left), read before planning
    # The fewest nodes it may start on (Slurm's --nodes=min-max): fewer than `nodes` only
    # when the whole gang cannot be placed now. 0: exactly `nodes` (no range).
    min_nodes: int = 0
    # Pinned (Job.node_ids): it runs on exactly these nodes, all of them, or waits; it never
    # goes elsewhere, never bursts and never preempts (a tuning run measures the nodes ops
    # chose). None: wherever the planner places it.
    node_ids: frozenset[int] | None = None

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class Quota:
    """Kueue-style: `nominal` GPUs guaranteed, and up to `borrow` more of others' idle ones."""

    nominal: int
    borrow: int = 0

    @property
    def limit(self) -> int:
        return self.nominal + self.borrow


@dataclass(frozen=True, slots=True)
class Window:
    """A reservation of nodes for [start, end): a team's (team_id) or maintenance (None)."""

    id: int
    node_ids: frozenset[int]
    team_id: int | None
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class PlanSettings:
    age_weight: float = 1000.0  # priority points at max_age_s of waiting
    fair_share_weight: float = 10000.0  # priority points of a fair-share factor of 1
    max_age_s: float = 7 * 86400.0
    backfill_depth: int = 100  # how many jobs below the first blocked one backfill tries
    preemption: bool = True


@dataclass(frozen=True)
class Snapshot:
    now: float
    nodes: tuple[NodeSlot, ...]
    pools: dict[int, PoolInfo]
    running: tuple[Running, ...]
    pending: tuple[Pending, ...]
    quotas: dict[tuple[int, str], Quota] = field(default_factory=dict)  # missing: no limit
    usage: dict[int, float] = field(default_factory=dict)  # team -> decayed GPU-seconds
    shares: dict[int, float] = field(default_factory=dict)  # team -> share weight; missing: 1
    windows: tuple[Window, ...] = ()
    settings: PlanSettings = field(default_factory=PlanSettings)


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: int
    pool_id: int
    node_gpus: tuple[tuple[int, int], ...]  # (node id, GPUs), one entry per node of the gang
    backfilled: bool = False


@dataclass(frozen=True, slots=True)
class Preemption:
    job_id: int  # the running job to checkpoint and stop
    for_job_id: int  # the pending job it makes room for
    reason: str


@dataclass(frozen=True, slots=True)
class BurstRequest:
    job_id: int
    pool_id: int
    nodes: int
    spot: bool


class Wait(NamedTuple):
    """Why a pending job is not placed, in plain words, and when it may start."""

    reason: str
    estimated_start: float | None = None


BEYOND_DEPTH = "beyond the backfill depth: waiting for higher jobs"
# The one Wait of every job the pass did not try (past the backfill depth): most of a
# long queue. No wait row is stored for it; a pending job without one that was already
# pending when the last pass read the queue reads as this (Job.pending_reason).
BEYOND = Wait(reason=BEYOND_DEPTH)


@dataclass
class Decisions:
    placements: list[Placement] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    bursts: list[BurstRequest] = field(default_factory=list)
    waits: dict[int, Wait] = field(default_factory=dict)  # job id -> why it waits
    order: list[int] = field(default_factory=list)  # pending job ids, highest priority first
