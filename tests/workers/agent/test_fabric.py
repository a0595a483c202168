"""The agent's fabric counters, read from a generated sysfs tree."""

import os
from pathlib import Path

import pytest

from workers.agent import config
from workers.agent.fabric import EFA_COUNTERS, IB_COUNTERS, fabric_counters


def write(directory: Path, values: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in values.items():
        (directory / name).write_text(text)


@pytest.fixture
def sysfs(tmp_path):
    ib = tmp_path / "class" / "infiniband"
    # A ConnectX port: every counter, one of them garbage, one missing, one unreadable.
    counters = {name: f"{i}\n" for i, name in enumerate(IB_COUNTERS)}
    counters["port_rcv_errors"] = "not a number\n"
    del counters["excessive_buffer_overrun_errors"]
    write(ib / "mlx5_0" / "ports" / "1" / "counters", counters)
    (ib / "mlx5_0" / "ports" / "1" / "counters" / "excessive_buffer_overrun_errors").mkdir()
    write(ib / "mlx5_1" / "ports" / "1" / "counters", {"symbol_error": "18446744073709551615"})
    # An EFA device: its hw_counters, traffic counters among them (not read), one negative.
    write(
        ib / "rdmap0s31" / "ports" / "1" / "hw_counters",
        {
            "rx_drops": "7\n",
            "retrans_pkts": "12\n",
            "retrans_timeout_events": "-1\n",
            "tx_bytes": "123456789\n",
            "lifespan": "12\n",
        },
    )
    # A device with no ports directory, and a port with nothing to read.
    (ib / "broken0").mkdir()
    (ib / "mlx5_2" / "ports" / "1").mkdir(parents=True)
    return tmp_path


def test_ib_and_efa_counters_are_read_per_link_as_integers(sysfs):
    links = fabric_counters(root=sysfs)
    assert sorted(links) == ["mlx5_0/1", "mlx5_1/1", "rdmap0s31/1"]
    assert links["mlx5_0/1"] == {
        "symbol_error": 0,
        "link_error_recovery": 1,
        "link_downed": 2,
        "port_xmit_discards": 4,
        "port_rcv_remote_physical_errors": 5,
        "local_link_integrity_errors": 6,
    }
    assert links["mlx5_1/1"] == {"symbol_error": 2**64 - 1}
    assert links["rdmap0s31/1"] == {"rx_drops": 7, "retrans_pkts": 12}
    assert set(links["rdmap0s31/1"]) <= set(EFA_COUNTERS)


def test_a_node_without_a_fabric_reports_nothing(tmp_path):
    assert fabric_counters(root=tmp_path) == {}
    assert fabric_counters(root=tmp_path / "missing") == {}


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_counter_is_left_out(sysfs):
    path = sysfs / "class/infiniband/mlx5_1/ports/1/counters/symbol_error"
    path.chmod(0)
    try:
        assert sorted(fabric_counters(root=sysfs)) == ["mlx5_0/1", "rdmap0s31/1"]
    finally:
        path.chmod(0o644)


def test_the_sysfs_root_is_a_setting(tmp_path):
    environ = {"CONTROLPLANE_URL": "http://cp", "CONTROLPLANE_NODE_TOKEN": "cpn_x"}
    assert config.load(tmp_path, environ).sysfs_root == Path("/sys")
    environ["AGENT_SYSFS_ROOT"] = str(tmp_path / "sys")
    assert config.load(tmp_path, environ).sysfs_root == tmp_path / "sys"
