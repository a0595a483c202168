"""The fleet: where GPUs live (sites, racks, pools) and what they are (nodes, GPUs)."""

from apps.fleet.models.catalogue import InstanceType
from apps.fleet.models.cloud import OrphanAction, OrphanInstance
from apps.fleet.models.nodes import (
    GONE_STATES,
    SCHEDULABLE_STATES,
    Gpu,
    GpuHealth,
    JobIsolation,
    Node,
    NodeEvent,
    NodeState,
)
from apps.fleet.models.pools import (
    CapacityPreference,
    Fabric,
    NodePool,
    OrphanPolicy,
    PoolKind,
    Tenancy,
)
from apps.fleet.models.sites import Rack, Site
from apps.fleet.models.telemetry import GpuMinute, GpuSample
