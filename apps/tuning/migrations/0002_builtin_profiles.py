"""The built-in NCCL profiles: owned 8-GPU NVSwitch nodes on InfiniBand, AWS p5 on EFA,
and single-node jobs, each with PyTorch's watchdog and flight-recorder settings.

Ops edit them afterwards (they cannot delete them). The values are ours, chosen from
NCCL's user guide (2.28) and aws-ofi-nccl's notes; apps/tuning/catalogue.py cites both.
"""

from django.db import migrations

# PyTorch's side, the same on every fabric: when a collective hangs, the watchdog ends
# the process (so the job is requeued rather than stuck), and the flight recorder
# leaves a dump that says which collective and which rank.
TORCH = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/var/lib/controlplane/nccl-traces/rank_",
}
TORCH_TEXT = (
    "PyTorch: on an NCCL error or a collective timeout the watchdog ends the process "
    "(TORCH_NCCL_ASYNC_ERROR_HANDLING=3, pinned at torch's documented default), the "
    "monitor thread ends it if the watchdog itself is stuck for 10 minutes, and the flight "
    "recorder (2000 events) is dumped per rank under /var/lib/controlplane/nccl-traces/ so the "
    "timeline can say which collective hung."
)

PROFILES = [
    {
        "name": "ib-nvswitch-8gpu",
        "title": "Owned 8-GPU NVSwitch nodes on InfiniBand",
        "fabric": "infiniband",
        "single_node": False,
        "min_nccl_version": "2.18",
        "is_default": True,
        "env": {
            "NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_4,mlx5_5,mlx5_6,mlx5_7",
            "NCCL_SOCKET_IFNAME": "=bond0",
            "NCCL_IB_TIMEOUT": "22",
            "NCCL_CROSS_NIC": "0",
            "NCCL_TOPO_FILE": "/etc/controlplane/nccl/topology.xml",
            "NCCL_DEBUG": "WARN",
            **TORCH,
        },
        "description": (
            "One compute HCA per GPU, named exactly (the = prefix: mlx5_1 alone would also "
            "match mlx5_10 to mlx5_19); the bonded management interface for bootstrap; an IB "
            "timeout of 22 (4.096 µs × 2^22 ≈ 17 s per retry, above NCCL 2.23's default of "
            "20) so a switch reboot or a flapping link does not tear down queue pairs; "
            "CROSS_NIC=0 because the racks are cabled rail-optimized (NIC i of every node on "
            "leaf i); and the rack's topology file, which provisioning copies to the node. "
            "Change the HCA and interface names to match the racks. " + TORCH_TEXT
        ),
    },
    {
        "name": "efa-p5",
        "title": "AWS p5 on EFA",
        "fabric": "efa",
        "single_node": False,
        "min_nccl_version": "2.18.5",
        "is_default": True,
        "env": {"NCCL_NET": "AWS Libfabric", "NCCL_DEBUG": "WARN", **TORCH},
        "description": (
            "For aws-ofi-nccl 1.7.2 or newer with libfabric 1.18 or newer (efa-installer "
            "1.29+), which AWS names for p5.48xlarge with NCCL 2.18.5 or newer. With those, "
            "the plugin picks the efa provider and sets NCCL_BUFFSIZE, "
            "NCCL_P2P_NET_CHUNKSIZE, the NVLS chunk sizes and FI_EFA_FORK_SAFE itself, and "
            "falls back to NCCL_PROTO=simple only when EFA cannot keep writes in order; so "
            "this profile sets none of them. NCCL_NET makes NCCL fail if the plugin is "
            "missing instead of crawling over TCP ('AWS Libfabric' is the name every plugin "
            "version answers to). " + TORCH_TEXT
        ),
    },
    {
        "name": "single-node",
        "title": "Single-node jobs",
        "fabric": "any",
        "single_node": True,
        "min_nccl_version": "2.18",
        "is_default": True,
        "env": {"NCCL_DEBUG": "WARN", **TORCH},
        "description": (
            "Inside one NVSwitch node NCCL's own choices (NVLink, NVLS where available) are "
            "the right ones; nothing is forced. " + TORCH_TEXT
        ),
    },
]


def load(apps, schema_editor):
    NcclProfile = apps.get_model("tuning", "NcclProfile")
    for profile in PROFILES:
        fields = {k: v for k, v in profile.items() if k != "name"}
        NcclProfile.objects.update_or_create(
            name=profile["name"], defaults={**fields, "reasons": {}, "built_in": True}
        )


def unload(apps, schema_editor):
    NcclProfile = apps.get_model("tuning", "NcclProfile")
    NcclProfile.objects.filter(name__in=[p["name"] for p in PROFILES], built_in=True).delete()


class Migration(migrations.Migration):
    dependencies = [("tuning", "0001_initial")]

    operations = [migrations.RunPython(load, unload)]
