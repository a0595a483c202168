"""The catalogue's facts, checked against the sources it cites (read for NCCL 2.28.6)."""

import pytest

from apps.fleet.models import Fabric
from apps.tuning import catalogue as c


def _names(block: str) -> list[str]:
    return block.split()


# NCCL user guide 2.28.6, "Environment Variables": the two sections, name by name.
GUIDE_SYSTEM_CONFIGURATION = _names(
    """
NCCL_SOCKET_IFNAME NCCL_SOCKET_FAMILY NCCL_SOCKET_RETRY_CNT NCCL_SOCKET_RETRY_SLEEP_MSEC
NCCL_SOCKET_NTHREADS NCCL_NSOCKS_PERTHREAD NCCL_CROSS_NIC NCCL_IB_HCA NCCL_IB_TIMEOUT
NCCL_IB_RETRY_CNT NCCL_IB_GID_INDEX NCCL_IB_ADDR_FAMILY NCCL_IB_ADDR_RANGE
NCCL_IB_ROCE_VERSION_NUM NCCL_IB_SL NCCL_IB_TC NCCL_IB_FIFO_TC NCCL_IB_RETURN_ASYNC_EVENTS
NCCL_OOB_NET_ENABLE NCCL_OOB_NET_IFNAME NCCL_UID_STAGGER_THRESHOLD NCCL_UID_STAGGER_RATE
NCCL_NET NCCL_NET_PLUGIN NCCL_TUNER_PLUGIN NCCL_PROFILER_PLUGIN NCCL_ENV_PLUGIN
NCCL_IGNORE_CPU_AFFINITY NCCL_CONF_FILE NCCL_DEBUG NCCL_DEBUG_FILE NCCL_DEBUG_SUBSYS
NCCL_DEBUG_TIMESTAMP_FORMAT NCCL_DEBUG_TIMESTAMP_LEVELS NCCL_COLLNET_ENABLE
NCCL_COLLNET_NODE_THRESHOLD NCCL_CTA_POLICY NCCL_NETDEVS_POLICY NCCL_TOPO_FILE
NCCL_TOPO_DUMP_FILE NCCL_SET_THREAD_NAME
"""
)
GUIDE_DEBUGGING = _names(
    """
NCCL_P2P_DISABLE NCCL_P2P_LEVEL NCCL_P2P_DIRECT_DISABLE NCCL_SHM_DISABLE NCCL_BUFFSIZE
NCCL_NTHREADS NCCL_MAX_NCHANNELS NCCL_MIN_NCHANNELS NCCL_CHECKS_DISABLE NCCL_CHECK_POINTERS
NCCL_LAUNCH_MODE NCCL_IB_DISABLE NCCL_IB_AR_THRESHOLD NCCL_IB_QPS_PER_CONNECTION
NCCL_IB_SPLIT_DATA_ON_QPS NCCL_IB_CUDA_SUPPORT NCCL_IB_PCI_RELAXED_ORDERING
NCCL_IB_ADAPTIVE_ROUTING NCCL_IB_ECE_ENABLE NCCL_MEM_SYNC_DOMAIN NCCL_CUMEM_ENABLE
NCCL_CUMEM_HOST_ENABLE NCCL_NET_GDR_LEVEL NCCL_NET_GDR_C2C NCCL_NET_GDR_READ
NCCL_NET_SHARED_BUFFERS NCCL_NET_SHARED_COMMS NCCL_SINGLE_RING_THRESHOLD NCCL_LL_THRESHOLD
NCCL_TREE_THRESHOLD NCCL_ALGO NCCL_PROTO NCCL_NVB_DISABLE NCCL_PXN_DISABLE NCCL_P2P_PXN_LEVEL
NCCL_PXN_C2C NCCL_RUNTIME_CONNECT NCCL_GRAPH_REGISTER NCCL_LOCAL_REGISTER
NCCL_LEGACY_CUDA_REGISTER NCCL_WIN_ENABLE NCCL_SET_STACK_SIZE NCCL_GRAPH_MIXING_SUPPORT
NCCL_DMABUF_ENABLE NCCL_P2P_NET_CHUNKSIZE NCCL_P2P_LL_THRESHOLD NCCL_ALLOC_P2P_NET_LL_BUFFERS
NCCL_COMM_BLOCKING NCCL_CGA_CLUSTER_SIZE NCCL_MAX_CTAS NCCL_MIN_CTAS NCCL_NVLS_ENABLE
NCCL_IB_MERGE_NICS NCCL_MNNVL_ENABLE NCCL_MNNVL_UUID NCCL_MNNVL_CLIQUE_ID NCCL_RAS_ENABLE
NCCL_RAS_ADDR NCCL_RAS_TIMEOUT_FACTOR NCCL_LAUNCH_ORDER_IMPLICIT NCCL_LAUNCH_RACE_FATAL
"""
)
# PyTorch docs, "PYTORCH ProcessGroupNCCL Environment Variables".
TORCH_DOCUMENTED = _names(
    """
TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_HIGH_PRIORITY TORCH_NCCL_BLOCKING_WAIT
TORCH_NCCL_DUMP_ON_TIMEOUT TORCH_NCCL_DESYNC_DEBUG TORCH_NCCL_ENABLE_TIMING
TORCH_NCCL_ENABLE_MONITORING TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC TORCH_NCCL_TRACE_BUFFER_SIZE
TORCH_NCCL_TRACE_CPP_STACK TORCH_NCCL_COORD_CHECK_MILSEC TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC
TORCH_NCCL_DEBUG_INFO_TEMP_FILE TORCH_NCCL_DEBUG_INFO_PIPE_FILE TORCH_NCCL_NAN_CHECK
"""
)


def test_every_variable_of_the_guide_is_catalogued_in_its_section():
    for name in GUIDE_SYSTEM_CONFIGURATION:
        assert name in c.VARIABLES and not c.VARIABLES[name].debugging, name
    for name in GUIDE_DEBUGGING:
        assert name in c.VARIABLES and c.VARIABLES[name].debugging, name
    documented_nccl = {
        v.name
        for v in c.VARIABLES.values()
        if v.family == "nccl" and v.documented and v.source == "nccl-guide" and not v.renamed_to
    }
    assert documented_nccl == set(GUIDE_SYSTEM_CONFIGURATION) | set(GUIDE_DEBUGGING)


def test_every_documented_torch_variable_is_catalogued():
    assert set(TORCH_DOCUMENTED) <= set(c.VARIABLES)


FACTS = [
    # (variable, attribute, value) — as the sources state them
    ("NCCL_IB_TIMEOUT", "minimum", 1),
    ("NCCL_IB_TIMEOUT", "maximum", 31),
    ("NCCL_IB_TIMEOUT", "default", "20"),  # since 2.23; 18 from 2.14, 14 before
    ("NCCL_IB_RETRY_CNT", "default", "7"),
    ("NCCL_IB_GID_INDEX", "default", "-1"),
    ("NCCL_CROSS_NIC", "default", "2"),
    ("NCCL_BUFFSIZE", "default", "4194304"),
    ("NCCL_NTHREADS", "choices", ("64", "128", "256", "512")),
    ("NCCL_LAUNCH_MODE", "default", "PARALLEL"),
    ("NCCL_LAUNCH_MODE", "choices", ("PARALLEL", "GROUP")),
    ("NCCL_NET_GDR_LEVEL", "choices", ("LOC", "PIX", "PXB", "PHB", "SYS")),
    ("NCCL_P2P_LEVEL", "choices", ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")),
    ("NCCL_MIN_NCHANNELS", "maximum", 32),
    ("NCCL_MIN_NCHANNELS", "superseded_by", "NCCL_MIN_CTAS"),
    ("NCCL_MAX_CTAS", "maximum", 64),
    ("NCCL_IB_QPS_PER_CONNECTION", "maximum", 128),
    ("NCCL_SOCKET_NTHREADS", "maximum", 16),
    ("NCCL_NET", "since", "2.10"),
    ("NCCL_ALGO", "since", "2.5"),
    ("NCCL_PROTO", "since", "2.5"),
    ("NCCL_P2P_NET_CHUNKSIZE", "default", "131072"),
    ("NCCL_IB_CUDA_SUPPORT", "removed_in", "2.4.0"),
    ("NCCL_IB_CUDA_SUPPORT", "superseded_by", "NCCL_NET_GDR_LEVEL"),
    ("NCCL_IB_GDR_LEVEL", "renamed_to", "NCCL_NET_GDR_LEVEL"),
    ("NCCL_LL_THRESHOLD", "removed_in", "2.5"),
    ("NCCL_TREE_THRESHOLD", "removed_in", "2.5"),
    ("NCCL_SINGLE_RING_THRESHOLD", "removed_in", "2.3"),
    ("NCCL_DEBUG", "choices", ("VERSION", "WARN", "INFO", "ABORT", "TRACE")),
    # PyTorch renamed its variables in torch 2.2.0 (pytorch/pytorch#114077)
    ("NCCL_ASYNC_ERROR_HANDLING", "renamed_to", "TORCH_NCCL_ASYNC_ERROR_HANDLING"),
    ("NCCL_BLOCKING_WAIT", "renamed_to", "TORCH_NCCL_BLOCKING_WAIT"),
    ("NCCL_DESYNC_DEBUG", "renamed_to", "TORCH_NCCL_DESYNC_DEBUG"),
    ("NCCL_ENABLE_TIMING", "renamed_to", "TORCH_NCCL_ENABLE_TIMING"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "default", "3"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "choices", ("0", "1", "2", "3")),
    # aws-ofi-nccl: what current plugins no longer need
    ("FI_EFA_FORK_SAFE", "fabrics", ("efa",)),
]


@pytest.mark.parametrize(("name", "attribute", "value"), FACTS, ids=lambda x: str(x))
def test_a_fact(name, attribute, value):
    assert getattr(c.VARIABLES[name], attribute) == value


def test_algorithms_and_the_versions_that_know_them():
    assert c.ALGORITHM_VERSIONS["pat"] == ("2.23", "")
    assert c.ALGORITHM_VERSIONS["nvlstree"] == ("2.18", "")
    assert c.ALGORITHM_VERSIONS["nvls"] == ("2.17", "")
    assert c.ALGORITHM_VERSIONS["collnet"] == ("2.5", "2.13")
    assert c.PROTOCOL_NAMES == ("ll", "ll128", "simple")


@pytest.mark.parametrize("name", sorted(c.INVENTED))
def test_invented_names_are_not_in_the_catalogue_and_point_at_real_ones(name):
    assert name not in c.VARIABLES
    assert all(hint in c.VARIABLES for hint in c.INVENTED[name][1])


def test_every_replacement_and_hint_names_a_catalogued_variable():
    for var in c.VARIABLES.values():
        for other in (var.renamed_to, var.superseded_by):
            if other and other.startswith("NCCL_") and other not in ("NCCL_PROTO", "NCCL_ALGO"):
                assert other in c.VARIABLES, (var.name, other)
        assert var.source in c.SOURCES
        assert var.kind and var.summary


def test_the_fleet_s_fabrics_are_the_catalogue_s():
    assert tuple(Fabric.values) == c.FABRICS


def test_versions_compare_as_numbers():
    assert c.version_tuple("2.21.5") == (2, 21, 5)
    assert c.version_at_least((2, 21, 5), "2.18")
    assert not c.version_at_least((2, 9), "2.18")
    assert c.version_at_least((2, 23), "2.22.3")
    with pytest.raises(ValueError):
        c.version_tuple("2.x")
