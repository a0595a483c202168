"""The whole path on real parts: the live server, local nodes whose agents are real
processes, the scheduler's pass and the dispatch service called as their tasks would."""

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from apps.accounts import services as accounts
from apps.fleet.models import Node
from tests import factories
from workers.tasks.provisioning import provision_node, terminate_node


@pytest.fixture
def open_dir():
    """A scratch folder other users may pass through (pytest's own tmp_path is closed to
    them): local nodes started by root run each job as its own unprivileged user, which
    must reach its run directory and checkpoints under here."""
    path = Path(tempfile.mkdtemp(prefix="cp-e2e-", dir="/tmp"))
    os.chmod(path, 0o711)  # noqa: S103 (pass through, list nothing)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agents_reach(live_server, settings, open_dir):
    """Agents call the live server; local nodes and checkpoints live under a scratch folder."""
    settings.CONTROLPLANE_URL = live_server.url
    settings.VAR_DIR = open_dir
    settings.CHECKPOINT_ROOT = str(open_dir / "checkpoints")
    settings.AGENT_HEARTBEAT_S = 1
    settings.NODE_MIN_FREE_DISK_GB = 0
    return live_server


def wait_for(what, predicate, timeout_s: float = 60.0, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


@pytest.fixture
def local_nodes(agents_reach):
    """`local_nodes(pool, count, gpus)`: local nodes brought up to READY by their real agents."""
    with _node_maker() as up:
        yield lambda pool, count=1, gpus=2: up(
            [factories.make_node(pool=pool, provider="local", gpu_count=gpus) for _ in range(count)]
        )


@contextlib.contextmanager
def _node_maker():
    """`up(nodes)`: provision nodes, wait for their agents to register (READY); every node
    brought up is terminated at the end (a test may have taken one down itself)."""
    made = []

    def up(nodes):
        for node in nodes:
            provision_node(node.pk)
            made.append(node.pk)
        for node in nodes:
            wait_for(
                f"{node.name} to register",
                lambda node=node: Node.objects.get(pk=node.pk).state == "ready",
            )
        return nodes

    try:
        yield up
    finally:
        for node_id in made:
            with contextlib.suppress(Exception):
                terminate_node(node_id)


@pytest.fixture
def e2e_team(db):
    team = factories.make_team(slug="e2e")
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    return team


@pytest.fixture
def ssh_nodes(agents_reach, ssh_server, client_key, settings, open_dir):
    """`ssh_nodes(pool, count, gpus)`: owned nodes reached over a real sshd on 127.0.0.1 (its
    host key pinned, as ops would have accepted it), brought up to READY by their agents,
    which run as the sshd's user (root in CI) with a stand-in nvidia-smi."""
    from tests.workers.providers.servers import public_key
    from tests.workers.providers.test_ssh_provisioning import FAKE_NVIDIA_SMI

    settings.SSH_KEY_FILE = str(client_key)
    settings.SSH_NODE_ROOT = str(open_dir / "ssh-nodes")
    fake = ssh_server.fakebin / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)

    def make(pool, count: int = 1):
        return up(
            [
                factories.make_node(
                    pool=pool,
                    provider="ssh",
                    address="127.0.0.1",
                    ssh_port=ssh_server.port,
                    ssh_user=ssh_server.user,
                    host_key=public_key(ssh_server.host_key),
                    gpu_count=4,
                )
                for _ in range(count)
            ]
        )

    with _node_maker() as up:
        yield make
    fake.unlink(missing_ok=True)
