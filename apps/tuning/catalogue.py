"""The NCCL, PyTorch-NCCL and EFA environment variables the control plane knows, as plain data.

Nothing here imports Django: the linter (apps/tuning/linter.py) is a pure function of
this table, the command-line linters use it, and the tests check it with hypothesis.

Where the facts come from (restated in our own words; see SOURCES for each entry's `source`):

- NCCL's user guide, chapter "Environment Variables", as published for NCCL 2.28.6
  (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html). The guide splits the
  variables in two: "System configuration" (fit to keep in scripts and system files)
  and "Debugging" (meant for experiments and workarounds; NVIDIA warns that keeping
  them set can cost performance, crash or hang as NCCL evolves). `debugging=True`
  marks the second kind. The "(since x.y)" notes, defaults and ranges are the guide's.
- NCCL's source code, for a handful of variables the guide does not document but
  NCCL reads (NCCL_PARAM definitions in src/enqueue.cc and src/transport/net_ib.cc),
  and for details the guide leaves out: NCCL_DEBUG also accepts ABORT and an unknown
  level silently means "no logging" (src/debug.cc); the path-type names of
  NCCL_P2P_LEVEL and NCCL_NET_GDR_LEVEL are compared case-sensitively, so "phb" is
  ignored rather than read as PHB (src/graph/paths.cc).
- PyTorch: the page "PYTORCH ProcessGroupNCCL Environment Variables"
  (docs/source/torch_nccl_environment_variables, torch 2.4 and later) and the header
  it points to, torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (read at a torch
  2.7-era revision). Torch 2.2.0 renamed its NCCL_* variables to TORCH_NCCL_*
  (pytorch/pytorch#114077); the old names still work but log a deprecation warning.
- AWS: aws-ofi-nccl's doc/efa-env-var.md (which settings current plugin and
  libfabric versions no longer need) and src/platform-aws.cpp (what the plugin sets by
  itself on p5: NCCL_BUFFSIZE, NCCL_P2P_NET_CHUNKSIZE, the NVLS chunk sizes,
  NCCL_NET_FORCE_FLUSH, FI_EFA_FORK_SAFE, the efa provider, and NCCL_PROTO=simple
  only when EFA cannot keep 128-byte writes in order).
"""

from dataclasses import dataclass

# Fabrics a pool's nodes talk over (the same values as apps.fleet's Fabric choices).
INFINIBAND = "infiniband"
ROCE = "roce"
EFA = "efa"
TCP = "tcp"
FABRICS = (INFINIBAND, ROCE, EFA, TCP)
IB_VERBS = (INFINIBAND, ROCE)  # NCCL's own IB transport drives both

# Kinds of value, each with its own check in the linter.
BOOL = "bool"  # NCCL: 0 or 1
TORCH_BOOL = "torch-bool"  # PyTorch's getCvarBool: 1/0, true/false, yes/no, y/n, t/f
INT = "int"
BYTES = "bytes"
CHOICE = "choice"
LEVEL = "path-level"  # LOC, NVL, PIX, PXB, PHB, SYS, or a legacy integer
ALGORITHMS = "algorithms"
PROTOCOLS = "protocols"
INTERFACES = "interfaces"  # NCCL_SOCKET_IFNAME's prefix list
HCAS = "hcas"  # NCCL_IB_HCA's device[:port] list
SUBSYSTEMS = "subsystems"
LOG_LEVELS = "log-levels"
NETWORK = "network"  # NCCL_NET: IB, Socket, or a plugin's name
NETDEVS = "netdevs-policy"
CIDR = "cidr"
HOST_PORT = "host:port"
PATH = "path"
TEXT = "text"

SOURCES = {
    "nccl-guide": "NCCL user guide, Environment Variables (NCCL 2.28.6)",
    "nccl-source": "NCCL source (NCCL_PARAM), not in the user guide",
    "torch-docs": "PyTorch docs, ProcessGroupNCCL environment variables (torch 2.4+)",
    "torch-header": "PyTorch torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp (torch 2.7 era)",
    "aws-ofi-nccl": "aws-ofi-nccl doc/efa-env-var.md and src/platform-aws.cpp (plugin 1.7+)",
    "torch-run": "torch 2.13 (the bundled trainer's), run: the names it reads and its warnings",
}

# Names under these prefixes are covered completely: an unknown one is an error.
COVERED_PREFIXES = ("NCCL_", "TORCH_NCCL_")
# Names under these are covered in part: an unknown one is only "not checked".
PARTLY_COVERED_PREFIXES = ("FI_", "OFI_NCCL_", "RDMAV_")


@dataclass(frozen=True)
class Variable:
    name: str
    kind: str
    summary: str
    source: str = "nccl-guide"
    default: str | None = None  # what applies when it is unset; None: it depends
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    maximum: int | None = None
    since: str = ""  # first NCCL version that reads it (torch versions for torch's)
    removed_in: str = ""
    renamed_to: str = ""  # the current name: the old one is refused
    superseded_by: str = ""  # a newer variable does the same job (advice only)
    debugging: bool = False
    documented: bool = True
    discouraged: str = ""  # why setting it is not advised
    fabrics: tuple[str, ...] = ()  # it only has an effect on these fabrics
    case_sensitive: bool = False
    allow_empty: bool = False
    note: str = ""

    @property
    def family(self) -> str:
        if self.name.startswith("TORCH_") or self.source.startswith("torch"):
            return "torch"
        if self.name.startswith(("FI_", "RDMAV_", "OFI_")):
            return "efa"
        return "nccl"

    @property
    def current(self) -> bool:
        return not (self.removed_in or self.renamed_to)


def _v(name: str, kind: str, summary: str, **details) -> Variable:
    return Variable(name=name, kind=kind, summary=summary, **details)


def _debug(name: str, kind: str, summary: str, **details) -> Variable:
    return Variable(name=name, kind=kind, summary=summary, debugging=True, **details)


def _torch(name: str, kind: str, summary: str, **details) -> Variable:
    details.setdefault("source", "torch-docs")
    return Variable(name=name, kind=kind, summary=summary, **details)


# PyTorch's flight recorder took names of its own (TORCH_FR_*): torch 2.13 reads the new
# name first and logs "Environment variable … is deprecated" on every rank for the old one
# (seen running it); torches from before the rename read only the old names.
_FR_RENAMED = (
    " Torch 2.13 still reads it and logs a deprecation warning on every rank; torches from "
    "before the rename read only this name (the bundled trainer passes it on under the new)."
)
_FR_NEW = " Torches from before the rename ignore it: they read only the old name."

_IB = {"fabrics": IB_VERBS}
_SOCKETS = {"fabrics": (TCP,)}

# --- NCCL: system configuration (fit for scripts and profiles) ---------------------------

SYSTEM = [
    _v(
        "NCCL_SOCKET_IFNAME",
        INTERFACES,
        "IP interfaces NCCL uses for bootstrap and socket traffic: prefixes, `^` to "
        "exclude, `=` for exact names.",
        note="Without `=`, `eth1` also matches eth10..eth19.",
    ),
    _v(
        "NCCL_SOCKET_FAMILY",
        CHOICE,
        "Forces IPv4 or IPv6 interfaces.",
        choices=("AF_INET", "AF_INET6"),
        case_sensitive=True,
    ),
    _v(
        "NCCL_SOCKET_RETRY_CNT",
        INT,
        "Retries of a socket connection after a timeout, refusal or unreachable host.",
        default="34",
        minimum=1,
        since="2.24",
    ),
    _v(
        "NCCL_SOCKET_RETRY_SLEEP_MSEC",
        INT,
        "Wait before the first socket retry, in ms; later waits grow linearly.",
        default="100",
        minimum=1,
        since="2.24",
    ),
    _v(
        "NCCL_SOCKET_NTHREADS",
        INT,
        "CPU helper threads per connection of the socket transport.",
        minimum=1,
        maximum=16,
        since="2.4.8",
        note="Its product with NCCL_NSOCKS_PERTHREAD may not exceed 64.",
        **_SOCKETS,
    ),
    _v(
        "NCCL_NSOCKS_PERTHREAD",
        INT,
        "Sockets each socket-transport helper thread opens.",
        minimum=1,
        since="2.4.8",
        note="Its product with NCCL_SOCKET_NTHREADS may not exceed 64.",
        **_SOCKETS,
    ),
    _v(
        "NCCL_CROSS_NIC",
        CHOICE,
        "Whether rings and trees may use different NICs on different nodes: 0 keeps each "
        "on one rail, 1 allows crossing, 2 prefers one rail but may cross.",
        default="2",
        choices=("0", "1", "2"),
    ),
    _v(
        "NCCL_IB_HCA",
        HCAS,
        "RDMA devices (and ports) NCCL uses: comma-separated, `^` to exclude, `=` for exact names.",
        note="Prefer the `=` form: `mlx5_1` also matches mlx5_10..mlx5_19.",
        **_IB,
    ),
    _v(
        "NCCL_IB_TIMEOUT",
        INT,
        "InfiniBand Verbs local ack timeout: 4.096 µs × 2^value per retry.",
        default="20",
        minimum=1,
        maximum=31,
        note="NCCL's default is 20 since 2.23 (18 from 2.14, 14 before); 0 or ≥ 32 mean "
        "no timeout at all.",
        **_IB,
    ),
    _v(
        "NCCL_IB_RETRY_CNT",
        INT,
        "InfiniBand retry count (a 3-bit field of the queue pair).",
        default="7",
        minimum=0,
        maximum=7,
        since="2.1.15",
        **_IB,
    ),
    _v(
        "NCCL_IB_GID_INDEX",
        INT,
        "Global ID index used in RoCE mode (see show_gids); -1 lets NCCL choose.",
        default="-1",
        minimum=-1,
        since="2.1.4",
        **_IB,
    ),
    _v(
        "NCCL_IB_ADDR_FAMILY",
        CHOICE,
        "Address family of the GID NCCL picks when NCCL_IB_GID_INDEX is unset.",
        default="AF_INET",
        choices=("AF_INET", "AF_INET6"),
        case_sensitive=True,
        since="2.21",
        **_IB,
    ),
    _v(
        "NCCL_IB_ADDR_RANGE",
        CIDR,
        "Range (CIDR) of GIDs NCCL may pick when NCCL_IB_GID_INDEX is unset.",
        since="2.21",
        **_IB,
    ),
    _v(
        "NCCL_IB_ROCE_VERSION_NUM",
        CHOICE,
        "RoCE version of the GID NCCL picks when NCCL_IB_GID_INDEX is unset.",
        default="2",
        choices=("1", "2"),
        since="2.21",
        **_IB,
    ),
    _v(
        "NCCL_IB_SL",
        INT,
        "InfiniBand service level.",
        default="0",
        minimum=0,
        maximum=15,
        since="2.1.4",
        **_IB,
    ),
    _v(
        "NCCL_IB_TC",
        INT,
        "InfiniBand traffic class.",
        default="0",
        minimum=0,
        maximum=255,
        since="2.1.15",
        **_IB,
    ),
    _v(
        "NCCL_IB_FIFO_TC",
        INT,
        "Traffic class of the short control messages (credit returns).",
        minimum=0,
        maximum=255,
        since="2.22.3",
        note="Defaults to NCCL_IB_TC.",
        **_IB,
    ),
    _v(
        "NCCL_IB_RETURN_ASYNC_EVENTS",
        BOOL,
        "Stop IB communication on fatal asynchronous IB events (they are always warned).",
        default="1",
        since="2.23",
        **_IB,
    ),
    _v(
        "NCCL_OOB_NET_ENABLE",
        BOOL,
        "Use NCCL's network (instead of sockets) for the out-of-band allgather at init.",
        since="2.23",
    ),
    _v(
        "NCCL_OOB_NET_IFNAME",
        HCAS,
        "Interfaces for out-of-band traffic when NCCL_OOB_NET_ENABLE=1.",
        since="2.23",
    ),
    _v(
        "NCCL_UID_STAGGER_THRESHOLD",
        INT,
        "Ranks per ncclUniqueId above which contacting the root is staggered.",
        default="256",
        minimum=1,
        since="2.23",
    ),
    _v(
        "NCCL_UID_STAGGER_RATE",
        INT,
        "Messages per second aimed at when staggering.",
        default="7000",
        minimum=1,
        since="2.23",
    ),
    _v(
        "NCCL_NET",
        NETWORK,
        "Forces one network: IB, Socket, or a plugin's name (aws-ofi-nccl: "
        "'AWS Libfabric'), so NCCL fails instead of falling back to another.",
        since="2.10",
    ),
    _v(
        "NCCL_NET_PLUGIN",
        TEXT,
        "Which net plugin library to load (suffix, file name, or 'none').",
        since="2.11",
    ),
    _v("NCCL_TUNER_PLUGIN", TEXT, "Which tuner plugin library to load (or 'none')."),
    _v("NCCL_PROFILER_PLUGIN", TEXT, "Which profiler plugin library to load (or 'none')."),
    _v(
        "NCCL_ENV_PLUGIN",
        TEXT,
        "Which environment plugin library to load (or 'none').",
        since="2.28",
    ),
    _v(
        "NCCL_IGNORE_CPU_AFFINITY",
        BOOL,
        "Ignore the job's CPU affinity and use the GPU's.",
        default="0",
        since="2.4.6",
    ),
    _v(
        "NCCL_CONF_FILE",
        PATH,
        "File with static NCCL settings (instead of ~/.nccl.conf).",
        since="2.23",
    ),
    _v(
        "NCCL_DEBUG",
        CHOICE,
        "How much NCCL logs: VERSION, WARN, INFO, TRACE (and ABORT).",
        choices=("VERSION", "WARN", "INFO", "ABORT", "TRACE"),
        note="INFO and TRACE are verbose; WARN is the usual production level.",
    ),
    _v(
        "NCCL_DEBUG_FILE",
        PATH,
        "Where NCCL's log goes (%h host name, %p PID); stdout by default.",
        since="2.2.12",
        note="Make the name unique per process (%h.%p), or output is lost.",
    ),
    _v(
        "NCCL_DEBUG_SUBSYS",
        SUBSYSTEMS,
        "Subsystems that NCCL_DEBUG=INFO logs; `^` excludes.",
        default="INIT,BOOTSTRAP,ENV",
        since="2.3.4",
    ),
    _v(
        "NCCL_DEBUG_TIMESTAMP_FORMAT",
        TEXT,
        "strftime format of log timestamps (empty: none).",
        since="2.26",
        allow_empty=True,
    ),
    _v(
        "NCCL_DEBUG_TIMESTAMP_LEVELS",
        LOG_LEVELS,
        "Log levels that carry a timestamp.",
        default="WARN",
        since="2.26",
        allow_empty=True,
    ),
    _v(
        "NCCL_COLLNET_ENABLE",
        BOOL,
        "Use the CollNet plugin (in-network reductions).",
        default="0",
        since="2.6",
    ),
    _v(
        "NCCL_COLLNET_NODE_THRESHOLD",
        INT,
        "Fewest nodes for which CollNet is used.",
        default="2",
        minimum=0,
        since="2.9.9",
    ),
    _v(
        "NCCL_CTA_POLICY",
        CHOICE,
        "Communicator CTA policy: 0 default, 1 efficiency, 2 zero-CTA.",
        default="0",
        choices=("0", "1", "2"),
        since="2.27",
    ),
    _v(
        "NCCL_NETDEVS_POLICY",
        NETDEVS,
        "How network devices are assigned to GPUs: AUTO, ALL or MAX:n.",
        default="AUTO",
        since="2.28",
    ),
    _v(
        "NCCL_TOPO_FILE",
        PATH,
        "XML topology loaded before detection (e.g. for virtual machines or odd PCI trees).",
        since="2.6",
    ),
    _v(
        "NCCL_TOPO_DUMP_FILE",
        PATH,
        "Where NCCL writes the topology it detected, as XML.",
        since="2.6",
    ),
    _v(
        "NCCL_SET_THREAD_NAME",
        BOOL,
        "Name NCCL's CPU threads, for debugging and profiling.",
        default="0",
        since="2.12",
    ),
]

# --- NCCL: the guide's "Debugging" section ---------------------------------------------

DEBUGGING = [
    _debug("NCCL_P2P_DISABLE", BOOL, "Turns off direct GPU-to-GPU (P2P) transport.", default="0"),
    _debug(
        "NCCL_P2P_LEVEL",
        LEVEL,
        "Farthest GPU-to-GPU distance at which P2P is used.",
        choices=("LOC", "NVL", "PIX", "PXB", "PHB", "SYS"),
        since="2.3.4",
    ),
    _debug(
        "NCCL_P2P_DIRECT_DISABLE",
        BOOL,
        "Forbids direct access to user buffers between GPUs of one process.",
        default="0",
    ),
    _debug("NCCL_SHM_DISABLE", BOOL, "Turns off the shared-memory transport.", default="0"),
    _debug(
        "NCCL_BUFFSIZE",
        BYTES,
        "Buffer size per pair of GPUs, in bytes (powers of two recommended).",
        default="4194304",
    ),
    _debug(
        "NCCL_NTHREADS",
        CHOICE,
        "CUDA threads per block (one block per channel).",
        default="512",
        choices=("64", "128", "256", "512"),
    ),
    _debug(
        "NCCL_MAX_NCHANNELS",
        INT,
        "Most channels (CUDA blocks) NCCL may use.",
        minimum=1,
        since="2.5",
        superseded_by="NCCL_MAX_CTAS",
    ),
    _debug(
        "NCCL_MIN_NCHANNELS",
        INT,
        "Fewest channels (CUDA blocks) NCCL uses.",
        minimum=1,
        maximum=32,
        since="2.5",
        superseded_by="NCCL_MIN_CTAS",
    ),
    _debug(
        "NCCL_CHECKS_DISABLE",
        BOOL,
        "Turned off argument checks on every call.",
        default="0",
        discouraged="deprecated since NCCL 2.2.12, when the checks became opt-in "
        "(NCCL_CHECK_POINTERS); it does nothing now",
    ),
    _debug(
        "NCCL_CHECK_POINTERS",
        BOOL,
        "Checks CUDA pointers on every collective call (adds latency).",
        default="0",
        since="2.2.12",
    ),
    _debug(
        "NCCL_LAUNCH_MODE",
        CHOICE,
        "How kernels are launched: PARALLEL (the default) or GROUP (cooperative groups, "
        "deprecated since 2.9).",
        default="PARALLEL",
        choices=("PARALLEL", "GROUP"),
        since="2.1",
    ),
    _debug(
        "NCCL_IB_DISABLE",
        BOOL,
        "Turns off the IB/RoCE transport: NCCL falls back to IP sockets.",
        default="0",
    ),
    _debug(
        "NCCL_IB_AR_THRESHOLD",
        BYTES,
        "Size above which IB data goes in a separate message that can use adaptive routing.",
        default="8192",
        since="2.6",
        **_IB,
    ),
    _debug(
        "NCCL_IB_QPS_PER_CONNECTION",
        INT,
        "IB queue pairs per connection (routing entropy on multi-level fabrics).",
        default="1",
        minimum=1,
        maximum=128,
        since="2.10",
        **_IB,
    ),
    _debug(
        "NCCL_IB_SPLIT_DATA_ON_QPS",
        BOOL,
        "Split each message over all queue pairs (1) or use them round-robin (0).",
        default="0",
        since="2.18",
        **_IB,
    ),
    _debug(
        "NCCL_IB_PCI_RELAXED_ORDERING",
        CHOICE,
        "PCI relaxed ordering for IB: 2 when available, 1 forced, 0 off.",
        default="2",
        choices=("0", "1", "2"),
        since="2.12",
        **_IB,
    ),
    _debug(
        "NCCL_IB_ADAPTIVE_ROUTING",
        BOOL,
        "Adaptive-routing capable transfers (on by default on IB, off on RoCE).",
        since="2.16",
        **_IB,
    ),
    _debug(
        "NCCL_IB_ECE_ENABLE",
        BOOL,
        "Enhanced Connection Establishment on IB/RoCE.",
        default="1",
        since="2.19",
        **_IB,
    ),
    _debug(
        "NCCL_MEM_SYNC_DOMAIN",
        CHOICE,
        "CUDA memory sync domain of NCCL's kernels (sm90+, CUDA 12).",
        default="1",
        choices=("0", "1"),
        since="2.16",
    ),
    _debug(
        "NCCL_CUMEM_ENABLE",
        BOOL,
        "Allocate with CUDA's cuMem* API (auto-enabled where supported since 2.19).",
        since="2.18",
    ),
    _debug(
        "NCCL_CUMEM_HOST_ENABLE",
        BOOL,
        "Allocate host memory with cuMem* (default on since 2.24 where supported).",
        since="2.23",
    ),
    _debug(
        "NCCL_NET_GDR_LEVEL",
        LEVEL,
        "Farthest NIC-to-GPU distance at which GPU Direct RDMA is used.",
        choices=("LOC", "PIX", "PXB", "PHB", "SYS"),
        since="2.3.4",
    ),
    _debug(
        "NCCL_NET_GDR_C2C",
        BOOL,
        "GPU Direct RDMA to a NIC on a C2C-attached CPU (default 1 since 2.27).",
        since="2.26",
    ),
    _debug(
        "NCCL_NET_GDR_READ",
        BOOL,
        "GPU Direct RDMA on the send side (default 1 on NVLink platforms since 2.4.2).",
    ),
    _debug(
        "NCCL_NET_SHARED_BUFFERS",
        BOOL,
        "One shared buffer pool for inter-node point-to-point.",
        default="1",
        since="2.8",
    ),
    _debug(
        "NCCL_NET_SHARED_COMMS",
        BOOL,
        "Reuse connections for PXN.",
        default="1",
        since="2.12",
    ),
    _debug(
        "NCCL_ALGO",
        ALGORITHMS,
        "Which algorithms NCCL may use (Ring, Tree, CollnetChain, CollnetDirect, NVLS, "
        "NVLSTree, PAT); `^` excludes; per-function lists since 2.24.",
        since="2.5",
    ),
    _debug(
        "NCCL_PROTO",
        PROTOCOLS,
        "Which protocols NCCL may use (LL, LL128, Simple); `^` excludes.",
        since="2.5",
        note="NVIDIA discourages it except to switch off a protocol suspected of a bug; "
        "turning LL128 on where it is not supported can corrupt data.",
    ),
    _debug(
        "NCCL_NVB_DISABLE",
        BOOL,
        "No intra-node NVLink traffic through an intermediate GPU.",
        default="0",
        since="2.11",
    ),
    _debug(
        "NCCL_PXN_DISABLE",
        BOOL,
        "No inter-node traffic through a non-local NIC via NVLink (PXN).",
        default="0",
        since="2.12",
    ),
    _debug(
        "NCCL_P2P_PXN_LEVEL",
        CHOICE,
        "When send/receive uses PXN: 0 never, 1 when the NIC is not on a PCI switch, 2 always.",
        default="2",
        choices=("0", "1", "2"),
        since="2.12",
    ),
    _debug(
        "NCCL_PXN_C2C",
        BOOL,
        "PXN through C2C + PCIe (default 1 since 2.28).",
        since="2.27",
    ),
    _debug(
        "NCCL_RUNTIME_CONNECT",
        BOOL,
        "Connect peers when first used instead of at init.",
        default="1",
        since="2.22",
    ),
    _debug(
        "NCCL_GRAPH_REGISTER",
        BOOL,
        "User buffer registration under CUDA Graphs.",
        default="1",
        since="2.11",
    ),
    _debug(
        "NCCL_LOCAL_REGISTER",
        BOOL,
        "User buffer registration through ncclCommRegister.",
        default="1",
        since="2.19",
    ),
    _debug(
        "NCCL_LEGACY_CUDA_REGISTER",
        BOOL,
        "Registration of cudaMalloc buffers (can hang).",
        default="0",
        since="2.24",
    ),
    _debug("NCCL_WIN_ENABLE", BOOL, "Window memory registration.", default="1", since="2.27"),
    _debug(
        "NCCL_SET_STACK_SIZE",
        BOOL,
        "Set the CUDA stack size to NCCL's largest kernel's need.",
        default="0",
        since="2.9",
    ),
    _debug(
        "NCCL_GRAPH_MIXING_SUPPORT",
        BOOL,
        "Outstanding NCCL calls from parallel CUDA graphs.",
        default="1",
        since="2.13",
    ),
    _debug(
        "NCCL_DMABUF_ENABLE",
        BOOL,
        "GPU Direct RDMA registration through Linux dma-buf.",
        default="1",
        since="2.13",
    ),
    _debug(
        "NCCL_P2P_NET_CHUNKSIZE",
        BYTES,
        "Message size of send/receive over the network.",
        default="131072",
        since="2.14",
    ),
    _debug(
        "NCCL_P2P_LL_THRESHOLD",
        INT,
        "Largest send/receive that uses the LL protocol.",
        default="16384",
        minimum=0,
        since="2.14",
    ),
    _debug(
        "NCCL_ALLOC_P2P_NET_LL_BUFFERS",
        BOOL,
        "Dedicated LL buffers for every network send/receive connection.",
        default="0",
        since="2.14",
    ),
    _debug(
        "NCCL_COMM_BLOCKING",
        BOOL,
        "Blocking (1) or non-blocking (0) communicators for every communicator.",
        since="2.14",
    ),
    _debug(
        "NCCL_CGA_CLUSTER_SIZE",
        INT,
        "Thread block cluster size of NCCL's kernels (sm90+).",
        minimum=0,
        maximum=8,
        since="2.16",
    ),
    _debug(
        "NCCL_MAX_CTAS",
        INT,
        "Most CTAs NCCL uses (up to 64 since 2.25, 32 before).",
        minimum=1,
        maximum=64,
        since="2.17",
    ),
    _debug(
        "NCCL_MIN_CTAS",
        INT,
        "Fewest CTAs NCCL uses (up to 64 since 2.25, 32 before).",
        minimum=1,
        maximum=64,
        since="2.17",
    ),
    _debug(
        "NCCL_NVLS_ENABLE",
        CHOICE,
        "NVLink SHARP: 0 off, 1 required, 2 when available.",
        default="2",
        choices=("0", "1", "2"),
        since="2.17",
    ),
    _debug(
        "NCCL_IB_MERGE_NICS",
        BOOL,
        "Merge the two ports of dual-port NICs into one device.",
        default="1",
        since="2.20",
        **_IB,
    ),
    _debug(
        "NCCL_MNNVL_ENABLE",
        CHOICE,
        "Multi-node NVLink: 0 off, 1 required, 2 when available.",
        choices=("0", "1", "2"),
        since="2.21",
    ),
    _debug("NCCL_MNNVL_UUID", INT, "Multi-node NVLink UUID (64-bit).", since="2.25"),
    _debug(
        "NCCL_MNNVL_CLIQUE_ID",
        INT,
        "Multi-node NVLink clique id (32-bit), to partition an NVLink domain.",
        since="2.25",
    ),
    _debug(
        "NCCL_RAS_ENABLE",
        BOOL,
        "NCCL's RAS subsystem (health queries of running jobs).",
        default="1",
        since="2.24",
    ),
    _debug(
        "NCCL_RAS_ADDR",
        HOST_PORT,
        "Where RAS listens for clients.",
        default="localhost:28028",
        since="2.24",
    ),
    _debug(
        "NCCL_RAS_TIMEOUT_FACTOR",
        INT,
        "Multiplier on every RAS timeout.",
        default="1",
        minimum=1,
        since="2.24",
    ),
    _debug(
        "NCCL_LAUNCH_ORDER_IMPLICIT",
        BOOL,
        "Order operations of different communicators on one device by host program order.",
        default="0",
        since="2.26",
    ),
    _debug(
        "NCCL_LAUNCH_RACE_FATAL",
        BOOL,
        "Fail when host threads race to launch on one device.",
        default="1",
        since="2.26",
    ),
]

# --- NCCL: gone, renamed, or real but undocumented -------------------------------------

RETIRED = [
    _debug(
        "NCCL_IB_CUDA_SUPPORT",
        BOOL,
        "Forced or disabled GPU Direct RDMA.",
        removed_in="2.4.0",
        superseded_by="NCCL_NET_GDR_LEVEL",
    ),
    _debug(
        "NCCL_IB_GDR_LEVEL",
        LEVEL,
        "GPU Direct RDMA distance (old name).",
        renamed_to="NCCL_NET_GDR_LEVEL",
        since="2.3.4",
        note="Renamed in NCCL 2.4.0.",
    ),
    _debug(
        "NCCL_MAX_NRINGS",
        INT,
        "Most rings (old name).",
        renamed_to="NCCL_MAX_NCHANNELS",
        note="Renamed in NCCL 2.5.0; ignored when NCCL_MAX_NCHANNELS is set.",
    ),
    _debug(
        "NCCL_MIN_NRINGS",
        INT,
        "Fewest rings (old name).",
        renamed_to="NCCL_MIN_NCHANNELS",
        note="Renamed in NCCL 2.5.0; ignored when NCCL_MIN_NCHANNELS is set.",
    ),
    _debug(
        "NCCL_SINGLE_RING_THRESHOLD",
        BYTES,
        "Size under which only one ring was used.",
        since="2.1",
        removed_in="2.3",
    ),
    _debug(
        "NCCL_LL_THRESHOLD",
        BYTES,
        "Size under which the low-latency protocol was used.",
        since="2.1",
        removed_in="2.5",
        superseded_by="NCCL_PROTO",
    ),
    _debug(
        "NCCL_TREE_THRESHOLD",
        BYTES,
        "Size under which trees were used instead of rings.",
        since="2.4",
        removed_in="2.5",
        superseded_by="NCCL_ALGO",
    ),
]

UNDOCUMENTED = [
    _debug(
        "NCCL_CHUNK_SIZE",
        BYTES,
        "Send/receive chunk size (NCCL_PARAM ChunkSize in src/enqueue.cc).",
        source="nccl-source",
        documented=False,
    ),
    _debug(
        "NCCL_NVLS_CHUNKSIZE",
        BYTES,
        "NVLS chunk size; aws-ofi-nccl sets 524288 on p5 by itself.",
        source="nccl-source",
        documented=False,
    ),
    _debug(
        "NCCL_NVLSTREE_MAX_CHUNKSIZE",
        BYTES,
        "NVLSTree chunk size cap (a tunable since 2.20.3); aws-ofi-nccl sets it on p5.",
        source="nccl-source",
        documented=False,
    ),
    _debug(
        "NCCL_NET_FORCE_FLUSH",
        BOOL,
        "Forces a network flush after receives; aws-ofi-nccl sets 0 on p5 by itself.",
        source="nccl-source",
        documented=False,
    ),
    _debug(
        "NCCL_IB_USE_INLINE",
        BOOL,
        "Inline small IB sends (NCCL_PARAM IbUseInline in src/transport/net_ib.cc).",
        source="nccl-source",
        documented=False,
        **_IB,
    ),
    _debug(
        "NCCL_IB_PKEY",
        INT,
        "IB partition key index (NCCL_PARAM IbPkey in src/transport/net_ib.cc).",
        source="nccl-source",
        documented=False,
        minimum=0,
        **_IB,
    ),
]

# --- PyTorch's ProcessGroupNCCL ---------------------------------------------------------

_TORCH_RENAME = (
    "Renamed in torch 2.2.0 (pytorch/pytorch#114077); the old name still works but warns."
)

TORCH = [
    _torch(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        CHOICE,
        "What the watchdog does on an NCCL error or collective timeout: 0 nothing, 1 abort "
        "the communicator and end the process, 2 abort the communicator only, 3 end the "
        "process without aborting (the default).",
        default="3",
        choices=("0", "1", "2", "3"),
        since="2.2",
    ),
    _torch(
        "TORCH_NCCL_BLOCKING_WAIT",
        TORCH_BOOL,
        "Make wait() block and raise on timeout (the CPU waits for every collective).",
        default="0",
        since="2.2",
    ),
    _torch(
        "TORCH_NCCL_HIGH_PRIORITY",
        TORCH_BOOL,
        "Run NCCL on high-priority CUDA streams.",
        default="0",
    ),
    _torch(
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        TORCH_BOOL,
        "Dump the flight recorder when the watchdog sees a timeout or error; needs "
        "TORCH_FR_BUFFER_SIZE > 0 (TORCH_NCCL_TRACE_BUFFER_SIZE > 0 before the rename).",
    ),
    _torch(
        "TORCH_NCCL_DESYNC_DEBUG",
        TORCH_BOOL,
        "Desync debugging: report which rank fell out of step.",
        default="0",
        since="2.2",
        debugging=True,
    ),
    _torch(
        "TORCH_NCCL_ENABLE_TIMING",
        TORCH_BOOL,
        "Record start events of every collective for exact timings (can make the "
        "watchdog hang more likely, says the header).",
        default="0",
        since="2.2",
        debugging=True,
    ),
    _torch(
        "TORCH_NCCL_ENABLE_MONITORING",
        TORCH_BOOL,
        "A monitor thread that ends the process when the watchdog itself stops "
        "heartbeating (e.g. stuck in a CUDA or NCCL call).",
        default="1",
    ),
    _torch(
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
        INT,
        "Watchdog heartbeat timeout after which the monitor thread ends the process.",
        minimum=1,
        note="The default varies by torch version (600 s, later 480 s).",
    ),
    _torch(
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        INT,
        "Events kept in the flight recorder's ring buffer (0 turns it off)." + _FR_RENAMED,
        minimum=0,
        superseded_by="TORCH_FR_BUFFER_SIZE",
    ),
    _torch(
        "TORCH_NCCL_TRACE_CPP_STACK",
        TORCH_BOOL,
        "Collect C++ stacks for the flight recorder." + _FR_RENAMED,
        default="0",
        superseded_by="TORCH_FR_CPP_STACK",
    ),
    _torch(
        "TORCH_FR_BUFFER_SIZE",
        INT,
        "Events kept in the flight recorder's ring buffer (0 turns it off); the current "
        "name of TORCH_NCCL_TRACE_BUFFER_SIZE." + _FR_NEW,
        minimum=0,
        source="torch-run",
    ),
    _torch(
        "TORCH_FR_CPP_STACK",
        TORCH_BOOL,
        "Collect C++ stacks for the flight recorder; the current name of "
        "TORCH_NCCL_TRACE_CPP_STACK." + _FR_NEW,
        default="0",
        source="torch-run",
    ),
    _torch(
        "TORCH_NCCL_COORD_CHECK_MILSEC",
        INT,
        "How often the monitor thread checks for other ranks' dump signals, in ms.",
        default="1000",
        minimum=1,
    ),
    _torch(
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
        INT,
        "Extra time to finish a debug dump before raising the timeout, in ms.",
        minimum=0,
    ),
    _torch(
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
        PATH,
        "Path prefix of the debug dumps (the rank is appended).",
    ),
    _torch(
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
        PATH,
        "Path prefix of a named pipe; writing to it triggers a dump.",
    ),
    _torch(
        "TORCH_NCCL_NAN_CHECK",
        TORCH_BOOL,
        "Check every collective's input for NaNs and raise.",
        default="0",
        debugging=True,
    ),
    _torch(
        "TORCH_NCCL_AVOID_RECORD_STREAMS",
        TORCH_BOOL,
        "Keep tensors alive by stashing instead of recordStream calls.",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
        TORCH_BOOL,
        "Register every allocation from the CUDA caching allocator with NCCL.",
        source="torch-header",
        since="2.2",
    ),
    _torch(
        "TORCH_NCCL_PROPAGATE_ERROR",
        TORCH_BOOL,
        "Propagate an NCCL error to all ranks through the store.",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_RETHROW_CUDA_ERRORS",
        TORCH_BOOL,
        "Rethrow CUDA errors seen by the watchdog.",
        default="1",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN",
        TORCH_BOOL,
        "Log C++ stacks on an unclean shutdown.",
        default="1",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_CUDA_EVENT_CACHE",
        TORCH_BOOL,
        "Reuse CUDA events in the watchdog (destroying them can hang under the CUDA lock).",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_RANKS_PER_ROOT",
        INT,
        "Ranks each root covers during NCCL communicator init.",
        minimum=1,
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_BCAST_UNIQUEID",
        TORCH_BOOL,
        "Broadcast the NCCL unique id through the store.",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING",
        TORCH_BOOL,
        "Warn when eager init serializes point-to-point operations.",
        source="torch-header",
    ),
    _torch(
        "TORCH_NCCL_ABORT_IN_DESTROY_PG",
        TORCH_BOOL,
        "Abort communicators in destroy_process_group (torch 2.3/2.4; see pytorch/pytorch#128204).",
        source="torch-header",
        documented=False,
    ),
    # The names torch used before 2.2 (pytorch/pytorch#114077); still read, with a warning.
    _torch(
        "NCCL_ASYNC_ERROR_HANDLING",
        CHOICE,
        "PyTorch's async error handling (old name).",
        renamed_to="TORCH_NCCL_ASYNC_ERROR_HANDLING",
        note=_TORCH_RENAME,
        choices=("0", "1", "2", "3"),
    ),
    _torch(
        "NCCL_BLOCKING_WAIT",
        TORCH_BOOL,
        "PyTorch's blocking wait (old name).",
        renamed_to="TORCH_NCCL_BLOCKING_WAIT",
        note=_TORCH_RENAME,
    ),
    _torch(
        "NCCL_DESYNC_DEBUG",
        TORCH_BOOL,
        "PyTorch's desync debugging (old name).",
        renamed_to="TORCH_NCCL_DESYNC_DEBUG",
        note=_TORCH_RENAME,
    ),
    _torch(
        "NCCL_ENABLE_TIMING",
        TORCH_BOOL,
        "PyTorch's collective timing (old name).",
        renamed_to="TORCH_NCCL_ENABLE_TIMING",
        note=_TORCH_RENAME,
    ),
    _torch(
        "NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
        TORCH_BOOL,
        "PyTorch's allocator registration hook (old name).",
        renamed_to="TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK",
        note=_TORCH_RENAME,
        source="torch-header",
    ),
]

# --- EFA: libfabric and aws-ofi-nccl ---------------------------------------------------

_EFA = {"source": "aws-ofi-nccl", "fabrics": (EFA,)}

LIBFABRIC = [
    _v(
        "FI_PROVIDER",
        TEXT,
        "Which libfabric provider to use ('efa' on EFA).",
        note="Needed only with aws-ofi-nccl ≤ 1.5.0; newer plugins pick efa themselves.",
        **_EFA,
    ),
    _v(
        "FI_EFA_USE_DEVICE_RDMA",
        BOOL,
        "Use the EFA device's RDMA (GPU Direct) on p4/p5.",
        note="Not needed with libfabric ≥ 1.18 and aws-ofi-nccl ≥ 1.7; harmless on p4/p5.",
        **_EFA,
    ),
    _v(
        "FI_EFA_USE_HUGE_PAGE",
        BOOL,
        "Huge pages for libfabric's buffers.",
        note="Set 0 only when fork() fails with 'Cannot allocate memory' (data loaders); "
        "it costs a little performance.",
        **_EFA,
    ),
    _v(
        "FI_EFA_FORK_SAFE",
        BOOL,
        "Fork safety for old kernels and rdma-core.",
        discouraged="not needed: aws-ofi-nccl sets it itself where it matters",
        **_EFA,
    ),
    _v(
        "FI_EFA_ENABLE_SHM_TRANSFER",
        BOOL,
        "libfabric's shared-memory transfers.",
        discouraged="not needed: libfabric turns SHM off when the plugin forbids CUDA calls",
        **_EFA,
    ),
    _v(
        "RDMAV_FORK_SAFE",
        BOOL,
        "rdma-core's fork safety.",
        discouraged="aws-ofi-nccl's notes say not to use RDMAV_* with EFA: on newer kernels "
        "RDMAV_FORK_SAFE=1 can break things (FI_EFA_FORK_SAFE is the EFA setting)",
        **_EFA,
    ),
]

VARIABLES: dict[str, Variable] = {
    v.name: v for v in [*SYSTEM, *DEBUGGING, *RETIRED, *UNDOCUMENTED, *TORCH, *LIBFABRIC]
}

# Names that circulate in blog posts but no NCCL release reads, with what was probably
# meant. The linter adds these hints to the "did you mean" it computes.
INVENTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "NCCL_IB_DISABLE_CUDA_VGRAPH": (
        "GPU Direct RDMA is governed by NCCL_NET_GDR_LEVEL; InfiniBand as a whole by "
        "NCCL_IB_DISABLE",
        ("NCCL_NET_GDR_LEVEL", "NCCL_IB_DISABLE"),
    ),
    "NCCL_ORDER_VIA_NVLINK": (
        "NCCL orders its rings from the topology it detects, or from NCCL_TOPO_FILE",
        ("NCCL_TOPO_FILE",),
    ),
    "NCCL_MAX_CHUNK_SIZE": (
        "the only chunk size the user guide documents is NCCL_P2P_NET_CHUNKSIZE, for "
        "send/receive over the network",
        ("NCCL_P2P_NET_CHUNKSIZE",),
    ),
    "NCCL_MIN_CHUNK_SIZE": (
        "the only chunk size the user guide documents is NCCL_P2P_NET_CHUNKSIZE, for "
        "send/receive over the network",
        ("NCCL_P2P_NET_CHUNKSIZE",),
    ),
    "NCCL_IB_DISABLE_DIRECT": (
        "NCCL_IB_DISABLE turns InfiniBand off; NCCL_P2P_DIRECT_DISABLE is about GPUs of "
        "one process",
        ("NCCL_IB_DISABLE", "NCCL_P2P_DIRECT_DISABLE"),
    ),
    "NCCL_TIMEOUT": (
        "the collective timeout is PyTorch's init_process_group(timeout=...); the IB "
        "transport's is NCCL_IB_TIMEOUT",
        ("NCCL_IB_TIMEOUT", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"),
    ),
}

# NCCL_ALGO's algorithms, with the NCCL versions that know them (user guide's table).
ALGORITHM_VERSIONS: dict[str, tuple[str, str]] = {
    # lower-case name: (first version, last version or "")
    "ring": ("2.5", ""),
    "tree": ("2.5", ""),
    "collnet": ("2.5", "2.13"),
    "collnetchain": ("2.14", ""),
    "collnetdirect": ("2.14", ""),
    "nvls": ("2.17", ""),
    "nvlstree": ("2.18", ""),
    "pat": ("2.23", ""),
}
PROTOCOL_NAMES = ("ll", "ll128", "simple")
# Collectives that per-function NCCL_ALGO/NCCL_PROTO lists (2.24+) may name.
FUNCTION_NAMES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")
PER_FUNCTION_SINCE = "2.24"

DEBUG_SUBSYSTEMS = (
    "INIT",
    "COLL",
    "P2P",
    "SHM",
    "NET",
    "GRAPH",
    "TUNING",
    "ENV",
    "ALLOC",
    "CALL",
    "PROXY",
    "NVLS",
    "BOOTSTRAP",
    "REG",
    "PROFILE",
    "RAS",
    "ALL",
)
TIMESTAMP_LEVELS = ("VERSION", "WARN", "INFO", "ABORT", "TRACE", "ALL")

# Legacy integers of the path levels (user guide): LOC 0, PIX 1, PXB 2, PHB 3, SYS 4.
LEGACY_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")

# NCCL_NET names: NCCL's own, and aws-ofi-nccl's (its name was "AWS Libfabric" up to
# 1.11, "Libfabric" since, and it answers to "AWS Libfabric" and "OFI" as well).
BUILTIN_NETS = {"ib": "IB", "socket": "Socket"}
LIBFABRIC_NETS = {"aws libfabric", "libfabric", "ofi"}
NETS_FOR_FABRIC = {
    INFINIBAND: {"ib"},
    ROCE: {"ib"},
    EFA: LIBFABRIC_NETS,
    TCP: {"socket"},
}


def known_names() -> list[str]:
    return sorted(VARIABLES)


def version_tuple(text: str) -> tuple[int, ...]:
    """'2.21.5' → (2, 21, 5); '' → (). Raises ValueError on anything else."""
    if not text:
        return ()
    parts = text.split(".")
    if not all(p.isdigit() for p in parts) or len(parts) > 3:
        raise ValueError(f"Not a version: {text!r}.")
    return tuple(int(p) for p in parts)


def version_at_least(version: tuple[int, ...], floor: str) -> bool:
    """Whether `version` is at least `floor` (compared on the parts `floor` gives)."""
    wanted = version_tuple(floor)
    return version[: len(wanted)] >= wanted
