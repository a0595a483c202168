"""An owned node over SSH, provisioned by the control plane against a real sshd: the host key
waits for ops, the agent is copied and started over SSH and registers with the live server;
a changed host key refuses the connection and runs nothing."""

import shutil
import sys
from pathlib import Path

import pytest

from apps.fleet import services as fleet
from apps.fleet.models import Node, NodeEvent
from tests import factories
from tests.e2e.conftest import wait_for
from tests.workers.providers.servers import (
    FAKE_NVIDIA_SMI,
    keygen,
    public_key,
    ssh_keygen_fingerprint,
)
from workers.tasks.provisioning import provider_for, provision_node, terminate_node

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def owned_host(ssh_server, client_key, live_server, settings, tmp_path):
    if shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") is None:
        pytest.skip("the remote side needs a python3 on its PATH for the agent")
    settings.SSH_KEY_FILE = str(client_key)
    settings.CONTROLPLANE_URL = live_server.url
    settings.VAR_DIR = tmp_path
    settings.AGENT_HEARTBEAT_S = 1
    settings.NODE_MIN_FREE_DISK_GB = 0
    fake = ssh_server.fakebin / "nvidia-smi"
    fake.write_text(FAKE_NVIDIA_SMI)
    fake.chmod(0o755)
    yield ssh_server
    fake.unlink(missing_ok=True)


def _ssh_node(server, **extra) -> Node:
    return factories.make_node(
        provider="ssh",
        address="127.0.0.1",
        ssh_port=server.port,
        ssh_user=server.user,
        gpu_count=4,
        **extra,
    )


def test_a_new_owned_node_waits_for_its_host_key_then_comes_up(owned_host, ops_user, api_for):
    node = _ssh_node(owned_host)
    assert provision_node(node.pk) == "awaiting_host_key"
    node.refresh_from_db()
    expected = ssh_keygen_fingerprint(owned_host.host_key)
    api = api_for(ops_user, scopes=("admin",))
    shown = api.get(f"/api/v1/nodes/{node.pk}/").json()
    assert shown["offered_host_key_fingerprint"] == expected  # what ops compare out of band
    assert not node.host_key  # never trusted on first sight
    wrong = api.post(
        f"/api/v1/nodes/{node.pk}/accept-host-key/", {"fingerprint": "SHA256:nope"}, format="json"
    )
    assert wrong.status_code == 400
    accepted = api.post(
        f"/api/v1/nodes/{node.pk}/accept-host-key/", {"fingerprint": expected}, format="json"
    )
    assert accepted.status_code == 200, accepted.content
    try:
        provision_node(node.pk)  # what the task sent on accept does
        wait_for("the agent to register", lambda: Node.objects.get(pk=node.pk).state == "ready")
        node.refresh_from_db()
        assert node.agent_version and node.host_key_fingerprint == expected
        assert sorted(node.gpus.values_list("uuid", flat=True))[0] == "GPU-00000000-e2e"
    finally:
        terminate_node(node.pk)


def test_a_changed_host_key_is_refused_before_anything_runs(
    owned_host, ssh_server_factory, client_key
):
    other = ssh_server_factory()  # another machine answering where ours was
    pinned = keygen(owned_host.directory / "pinned_elsewhere")
    pinned_blob = pinned.with_suffix(".pub").read_text().split()[1]
    node = _ssh_node(other, host_key=f"ssh-ed25519 {pinned_blob}")
    assert provision_node(node.pk) == "failed"
    node.refresh_from_db()
    assert node.state == "failed"
    assert "HOST KEY CHANGED" in node.state_reason
    # Nothing was copied or started: bootstrap never ran on the impostor.
    assert not list(other.directory.glob("**/agent.env"))
    assert NodeEvent.objects.filter(node=node, to_state="failed").exists()
    # Ops are told which key was offered, and nothing was pinned in its place.
    assert node.host_key.endswith(pinned_blob)
    with pytest.raises(Exception):  # noqa: B017 (any refusal will do)
        fleet.node_transition(node=node, to="ready", reason="no", by=None)


def test_an_owned_nodes_agent_runs_on_the_python_ops_name(owned_host, settings):
    """Where a host's torch lives in a virtual environment, SSH_NODE_PYTHON names its Python:
    the agent runs on it, and so does every run's `python3` (the agent puts its own
    interpreter's directory first on its runs' PATH)."""
    settings.SSH_NODE_PYTHON = sys.executable
    node = _ssh_node(owned_host, host_key=public_key(owned_host.host_key))
    try:
        provision_node(node.pk)
        wait_for("the agent to register", lambda: Node.objects.get(pk=node.pk).state == "ready")
        provider, spec = provider_for(node)
        pid = provider.describe(spec).agent_pid
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert argv[:3] == [sys.executable.encode(), b"-m", b"workers.agent"]
    finally:
        terminate_node(node.pk)
