"""The SSH provider against a real OpenSSH server on 127.0.0.1 (see conftest.py)."""

import os
import stat
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.workers.providers.servers import free_port, keygen, public_key, ssh_keygen_fingerprint
from workers.providers.bundle import AGENT_PACKAGE, TRAINER_PACKAGE, Bundle
from workers.providers.errors import (
    AuthenticationFailed,
    CommandFailed,
    CommandTimedOut,
    HostKeyChanged,
    HostKeyUnknown,
    NodeUnreachable,
    ProvisioningFailed,
)
from workers.providers.gpus import NVIDIA_SMI_QUERY
from workers.providers.interface import MachineState
from workers.providers.ssh import SshConfig, SshNodeSpec, SshPool, SshProvider

# A stand-in for the lead's agent until it exists: it records its node and sleeps.
STAND_IN_AGENT = (
    sys.executable,
    "-c",
    "import os, time; "
    "open('agent-ran', 'w').write(os.environ['CONTROLPLANE_NODE_UUID']); "
    "time.sleep(600)",
)


@pytest.fixture
def remote_root(tmp_path) -> Path:
    return tmp_path / "remote"


@pytest.fixture(scope="module")
def shared_pool():
    """One pool for the module, as a worker process has: most tests reuse its connection."""
    pool = SshPool()
    yield pool
    pool.close_all()


def make_provider(client_key, remote_root, pool: SshPool) -> SshProvider:
    config = SshConfig(
        key_file=client_key,
        remote_root=str(remote_root),
        connect_timeout_s=5,
        command_timeout_s=30,
        connect_attempts=2,
        backoff_base_s=0.05,
        stop_timeout_s=2,
    )
    return SshProvider(config, pool=pool)


@pytest.fixture
def provider(client_key, remote_root, shared_pool) -> SshProvider:
    return make_provider(client_key, remote_root, shared_pool)


@pytest.fixture
def fresh_provider(client_key, remote_root) -> SshProvider:
    """A provider with a pool of its own, for tests that count connections."""
    pool = SshPool()
    yield make_provider(client_key, remote_root, pool)
    pool.close_all()


def spec_for(server, *, pinned: str | None = None) -> SshNodeSpec:
    return SshNodeSpec(
        uuid=str(uuid.uuid4()),
        address="127.0.0.1",
        port=server.port,
        user=server.user,
        host_key=public_key(server.host_key) if pinned is None else pinned,
    )


# --- host keys ------------------------------------------------------------------------------


def test_an_unpinned_host_is_refused_with_the_key_it_offered(ssh_server, provider, remote_root):
    spec = spec_for(ssh_server, pinned="")

    with pytest.raises(HostKeyUnknown) as refused:
        provider.create(spec)

    error = refused.value
    assert error.fingerprint == ssh_keygen_fingerprint(ssh_server.host_key)
    assert error.offered_key == public_key(ssh_server.host_key)
    assert error.key_type == "ssh-ed25519"
    assert error.retryable is False
    assert error.fingerprint in str(error)
    assert not remote_root.exists(), "nothing may run on a host whose key is not pinned"


def test_a_pinned_host_key_lets_commands_run(ssh_server, provider, remote_root):
    spec = spec_for(ssh_server)

    described = provider.create(spec)

    assert (remote_root / f"node-{spec.uuid}").is_dir()
    assert described.state == MachineState.RUNNING
    assert described.agent_alive is False
    assert provider.run(spec, ["id", "-un"]).stdout.strip() == ssh_server.user


def test_a_changed_host_key_is_refused_and_nothing_runs(
    ssh_server_factory, fresh_provider, tmp_path
):
    provider = fresh_provider
    server = ssh_server_factory()
    pinned = public_key(server.host_key)
    old_fingerprint = ssh_keygen_fingerprint(server.host_key)
    # The host is reinstalled (or impersonated): same address and port, another key.
    server.stop()
    keygen(server.host_key)
    server.start()
    marker = tmp_path / "must-not-exist"

    with pytest.raises(HostKeyChanged) as refused:
        provider.run(spec_for(server, pinned=pinned), ["touch", str(marker)])

    error = refused.value
    assert error.expected_fingerprint == old_fingerprint
    assert error.offered_fingerprint == ssh_keygen_fingerprint(server.host_key)
    assert error.offered_key == public_key(server.host_key)
    assert "HOST KEY CHANGED" in str(error) and "nothing was run" in str(error)
    assert error.retryable is False
    assert not marker.exists()
    assert provider.pool.opened == 0


def test_a_pinned_key_of_another_type_is_a_changed_key(ssh_server, provider, tmp_path):
    # The server has only an ed25519 host key; an RSA key pinned for it is not its key.
    rsa = keygen(tmp_path / "rsa_host_key", key_type="rsa")
    marker = tmp_path / "must-not-exist"

    with pytest.raises(HostKeyChanged):
        provider.run(spec_for(ssh_server, pinned=public_key(rsa)), ["touch", str(marker)])

    assert not marker.exists()


def test_a_key_the_node_does_not_authorize_fails_at_once_without_retries(
    ssh_server, remote_root, tmp_path
):
    stranger = keygen(tmp_path / "stranger")
    pool = SshPool()
    provider = SshProvider(
        SshConfig(key_file=stranger, remote_root=str(remote_root), connect_attempts=4), pool=pool
    )
    started = time.monotonic()

    with pytest.raises(AuthenticationFailed) as refused:
        provider.create(spec_for(ssh_server))

    assert refused.value.retryable is False
    assert time.monotonic() - started < 3, "an authentication failure is not retried"
    assert not remote_root.exists()


# --- commands --------------------------------------------------------------------------------


def test_a_shell_command_in_an_argument_arrives_as_that_literal_string(ssh_server, provider):
    result = provider.run(spec_for(ssh_server), ["printf", "%s", "; rm -rf /"])

    assert result.stdout == "; rm -rf /"


def test_every_kind_of_shell_syntax_arrives_literally(ssh_server, provider, tmp_path):
    marker = tmp_path / "injected"
    arguments = [
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"x && touch {marker}",
        "a'b\"c\\d",
        "* ? [a-z] ~ $HOME",
        "two\nlines",
        "-n",
        "",
        "  spaces  ",
        "über €",
    ]

    # One NUL after each argument: the split shows each arrived whole, as one argument.
    result = provider.run(spec_for(ssh_server), ["printf", "%s\\0", *arguments])

    assert result.stdout.split("\0")[:-1] == arguments
    assert not marker.exists()


def test_a_failing_command_raises_with_its_status_and_output(ssh_server, provider):
    with pytest.raises(CommandFailed) as failed:
        provider.run(spec_for(ssh_server), ["sh", "-c", "echo broken >&2; exit 3"])

    assert failed.value.exit_status == 3
    assert failed.value.stderr.strip() == "broken"
    unchecked = provider.run(spec_for(ssh_server), ["sh", "-c", "exit 4"], check=False)
    assert unchecked.exit_status == 4


def test_a_command_past_its_time_limit_is_cut_off(ssh_server, provider):
    started = time.monotonic()

    with pytest.raises(CommandTimedOut) as timed_out:
        provider.run(spec_for(ssh_server), ["sleep", "10"], timeout_s=0.5)

    assert timed_out.value.retryable is True
    assert time.monotonic() - started < 3


# --- connections -------------------------------------------------------------------------------


def test_connections_are_pooled_and_reused(ssh_server, fresh_provider):
    provider = fresh_provider
    spec = spec_for(ssh_server)
    # SSH_CONNECTION names the client's port: the same port is the same connection.
    first = provider.run(spec, ["sh", "-c", 'echo "$SSH_CONNECTION"']).stdout
    transport = provider.connection(spec).get_transport()
    second = provider.run(spec, ["sh", "-c", 'echo "$SSH_CONNECTION"']).stdout

    assert first == second
    assert provider.connection(spec).get_transport() is transport
    assert provider.pool.opened == 1


def test_a_dead_pooled_connection_is_replaced(ssh_server, fresh_provider):
    provider = fresh_provider
    spec = spec_for(ssh_server)
    provider.run(spec, ["true"])
    provider.connection(spec).get_transport().close()

    assert provider.run(spec, ["echo", "again"]).stdout == "again\n"
    assert provider.pool.opened == 2


def test_a_port_where_nothing_listens_is_retried_with_backoff_then_unreachable(
    client_key, remote_root
):
    config = SshConfig(
        key_file=client_key,
        remote_root=str(remote_root),
        connect_timeout_s=0.5,
        connect_attempts=3,
        backoff_base_s=0.2,
        backoff_max_s=1,
    )
    provider = SshProvider(config, pool=SshPool())
    spec = SshNodeSpec(uuid=str(uuid.uuid4()), address="127.0.0.1", port=free_port())
    started = time.monotonic()

    with pytest.raises(NodeUnreachable) as unreachable:
        provider.create(spec)

    elapsed = time.monotonic() - started
    assert unreachable.value.attempts == 3
    assert unreachable.value.retryable is True
    # Two waits between three attempts: 0.2 s then 0.4 s, each jittered to at least half.
    assert 0.3 <= elapsed < 3


# --- bootstrap ----------------------------------------------------------------------------------


def test_bootstrap_puts_the_files_in_place_and_starts_the_agent_once(
    ssh_server, provider, remote_root
):
    spec = spec_for(ssh_server)
    bundle = Bundle(
        agent_argv=STAND_IN_AGENT,
        agent_env={"CONTROLPLANE_URL": "http://127.0.0.1:8000", "CONTROLPLANE_NODE_TOKEN": "cpn_x"},
    )
    steps = []

    report = provider.bootstrap(spec, bundle, progress=lambda *step: steps.append(step))

    node_dir = remote_root / f"node-{spec.uuid}"
    for package in (AGENT_PACKAGE, TRAINER_PACKAGE):
        for source in package.glob("*.py"):
            copied = node_dir / "workers" / package.name / source.name
            assert copied.read_bytes() == source.read_bytes()
    assert (node_dir / "workers" / "__init__.py").is_file()
    assert not (node_dir / "nccl.env").exists()  # run plans carry the NCCL settings
    agent_env = node_dir / "agent.env"
    assert stat.S_IMODE(agent_env.stat().st_mode) == 0o600
    assert "CONTROLPLANE_NODE_TOKEN=cpn_x\n" in agent_env.read_text()
    assert f"CONTROLPLANE_NODE_UUID={spec.uuid}\n" in agent_env.read_text()
    assert not list(node_dir.rglob("*.tmp")), "uploads land by rename, leaving no temporary files"

    assert report.agent_started is True
    assert int((node_dir / "agent.pid").read_text()) == report.agent_pid
    _wait_for(lambda: (node_dir / "agent-ran").exists())
    assert (node_dir / "agent-ran").read_text() == spec.uuid
    _wait_for(lambda: os.getsid(report.agent_pid) == report.agent_pid)  # its own session
    described = provider.describe(spec)
    assert described.agent_alive is True and described.agent_pid == report.agent_pid

    assert steps[-1][0] == "start_agent" and steps[-1][1] == 100
    percents = [percent for _, percent, _ in steps]
    assert percents == sorted(percents)

    again = provider.bootstrap(spec, bundle)
    assert again.agent_started is False and again.agent_pid == report.agent_pid

    restarted = provider.bootstrap(spec, bundle, restart_agent=True)
    assert restarted.agent_started is True and restarted.agent_pid != report.agent_pid
    _wait_for(lambda: not _alive(report.agent_pid))

    ended = provider.terminate(spec)
    assert ended.state == MachineState.ABSENT
    _wait_for(lambda: not _alive(restarted.agent_pid))
    assert not node_dir.exists()
    provider.terminate(spec)  # again: nothing left to do, and no error


def test_an_agent_that_exits_at_once_fails_the_bootstrap_with_its_output(ssh_server, provider):
    bundle = Bundle(agent_argv=(sys.executable, "-c", "raise SystemExit('no config here')"))

    with pytest.raises(ProvisioningFailed, match="no config here") as failed:
        provider.bootstrap(spec_for(ssh_server), bundle)

    assert failed.value.retryable is False


# --- GPUs ---------------------------------------------------------------------------------------


def test_no_nvidia_smi_means_no_gpus_found(ssh_server, provider):
    spec = spec_for(ssh_server)
    if provider.run(spec, ["sh", "-c", "command -v nvidia-smi"], check=False).exit_status == 0:
        pytest.skip("this machine has a real nvidia-smi")

    report = provider.detect_gpus(spec)

    assert report.found is False
    assert report.gpus == ()
    assert "nvidia-smi is not on the node's PATH" in report.message


# What nvidia-smi prints on an 8 × H100 SXM node for our query. CI has no GPUs, so
# a script with this output, first in the node's PATH, stands in for them; it
# also checks that it was asked exactly our query.
H100_CSV = "".join(
    f"{i}, GPU-{i}a7c3f1e-52b9-4c1d-9e0f-6b8d2c4a{i:04d}, NVIDIA H100 80GB HBM3, "
    f"81559 MiB, 550.54.15\n"
    for i in range(8)
)


@pytest.fixture
def fake_nvidia_smi(ssh_server):
    script = ssh_server.fakebin / "nvidia-smi"
    expected = " ".join(NVIDIA_SMI_QUERY[1:])
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$*" = "{expected}" ] || {{ echo "unexpected arguments: $*" >&2; exit 2; }}\n'
        f"cat <<'EOF'\n{H100_CSV}EOF\n"
    )
    script.chmod(0o755)
    yield script
    script.unlink()


def test_gpus_are_read_from_nvidia_smi(ssh_server, provider, fake_nvidia_smi):
    report = provider.detect_gpus(spec_for(ssh_server))

    assert report.found is True
    assert len(report.gpus) == 8
    first = report.gpus[0]
    assert first.index == 0
    assert first.uuid == "GPU-0a7c3f1e-52b9-4c1d-9e0f-6b8d2c4a0000"
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.memory_mib == 81559
    assert first.driver_version == "550.54.15"
    assert [gpu.index for gpu in report.gpus] == list(range(8))


def test_bootstrap_reports_the_gpus_it_found(ssh_server, provider, fake_nvidia_smi):
    spec = spec_for(ssh_server)
    report = provider.bootstrap(spec, Bundle(agent_argv=STAND_IN_AGENT))

    assert report.gpus.found is True and len(report.gpus.gpus) == 8
    provider.terminate(spec)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)
