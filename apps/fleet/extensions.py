"""Parts of the fleet's pages that apps above fleet provide, without fleet importing them.

Jobs sit above the fleet (README, "Design"), yet the node page and the Fleet page's heat
map show which job holds each GPU: jobs hands that in when it starts (apps/jobs/apps.py),
as checkpoints hands a job's detail its checkpoints. Nobody providing it reads as no job
holding any GPU.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuHolder:
    """The job that holds a GPU (an open allocation)."""

    job_id: int
    job_name: str
    team_id: int


# node ids → {node id: {GPU index: its holder}}
GpuHolders = Callable[[Iterable[int]], dict[int, dict[int, GpuHolder]]]
_gpu_holders: list[GpuHolders] = []


def gpu_holders_register(provider: GpuHolders) -> None:
    _gpu_holders[:] = [provider]


def gpu_holders(*, node_ids: Iterable[int]) -> dict[int, dict[int, GpuHolder]]:
    return _gpu_holders[0](node_ids) if _gpu_holders else {}
