"""The local provider: node directories and real agent processes on this machine."""

import json
import os
import socket
import stat
import sys
import time
import uuid
from pathlib import Path

import pytest

from workers.providers.bundle import AGENT_PACKAGE, TRAINER_PACKAGE, Bundle
from workers.providers.errors import ConfigurationError, ProvisioningFailed
from workers.providers.interface import CapacityType, MachineState
from workers.providers.local import LocalConfig, LocalNodeSpec, LocalProvider

# Stands in for the lead's agent until it exists: it writes down the environment
# it was given, then waits to be stopped.
STAND_IN_AGENT = (
    sys.executable,
    "-c",
    "import json, os, time; "
    "json.dump(dict(os.environ), open('agent-env.json', 'w')); "
    "time.sleep(600)",
)
# The same, but deaf to SIGTERM: only SIGKILL ends it.
STUBBORN_AGENT = (
    sys.executable,
    "-c",
    "import json, os, signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "json.dump(dict(os.environ), open('agent-env.json', 'w')); "
    "time.sleep(600)",
)

# An agent whose job process ignores SIGTERM: the agent goes, the job must go too.
STUBBORN_JOB = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "open('child.pid', 'w').write(str(os.getpid())); time.sleep(600)"
)
AGENT_WITH_A_STUBBORN_JOB = (
    sys.executable,
    "-c",
    "import subprocess, sys, time; "
    f"subprocess.Popen([sys.executable, '-c', {STUBBORN_JOB!r}]); time.sleep(600)",
)


@pytest.fixture
def provider(tmp_path) -> LocalProvider:
    provider = LocalProvider(LocalConfig(root=tmp_path / "nodes", stop_timeout_s=1))
    yield provider
    for node_dir in (tmp_path / "nodes").glob("node-*"):  # never leave an agent running
        provider.terminate(LocalNodeSpec(uuid=node_dir.name.removeprefix("node-")))


@pytest.fixture
def spec() -> LocalNodeSpec:
    return LocalNodeSpec(uuid=str(uuid.uuid4()), name="fra1-a1-01", slots=4)


def test_create_makes_the_node_directory_and_is_idempotent(provider, spec):
    described = provider.create(spec)
    again = provider.create(spec)

    node_dir = provider.node_dir(spec)
    assert node_dir.is_dir()
    # Jobs' own users pass through to their run directories; they list nothing here.
    assert stat.S_IMODE(node_dir.stat().st_mode) == 0o711
    assert described == again
    assert described.state == MachineState.RUNNING
    assert described.capacity_type == CapacityType.OWNED
    assert described.agent_alive is False
    assert described.slots == 4


def test_bootstrap_copies_the_packages_and_starts_the_agent_once(provider, spec, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", "postgres://controlplane:secret@db/controlplane")
    provider.create(spec)
    bundle = Bundle(
        agent_argv=STAND_IN_AGENT,
        agent_env={"CONTROLPLANE_URL": "http://127.0.0.1:8000", "CONTROLPLANE_NODE_TOKEN": "cpn_x"},
    )
    steps = []

    report = provider.bootstrap(spec, bundle, progress=lambda *step: steps.append(step))

    node_dir = provider.node_dir(spec)
    for package in (AGENT_PACKAGE, TRAINER_PACKAGE):
        for source in package.glob("*.py"):
            copied = node_dir / "workers" / package.name / source.name
            assert copied.read_bytes() == source.read_bytes()
    assert not list(node_dir.rglob("__pycache__"))
    assert not (node_dir / "nccl.env").exists()  # run plans carry the NCCL settings
    agent_env = node_dir / "agent.env"
    assert stat.S_IMODE(agent_env.stat().st_mode) == 0o600
    # The agent's log is its own too: a job must not read what the agent writes.
    assert stat.S_IMODE((node_dir / "agent.log").stat().st_mode) == 0o600
    assert agent_env.read_text().splitlines() == [
        "CONTROLPLANE_URL=http://127.0.0.1:8000",
        "CONTROLPLANE_NODE_TOKEN=cpn_x",
        f"CONTROLPLANE_NODE_UUID={spec.uuid}",
        "AGENT_SLOTS=4",
    ]

    assert report.agent_started is True
    assert int((node_dir / "agent.pid").read_text()) == report.agent_pid
    assert os.getsid(report.agent_pid) == report.agent_pid, "the agent has its own session"
    environment = _read_json(node_dir / "agent-env.json")
    assert environment["CONTROLPLANE_NODE_UUID"] == spec.uuid
    assert environment["AGENT_SLOTS"] == "4"
    assert "DATABASE_URL" not in environment, "the control plane's secrets stay with it"
    assert steps[-1] == ("start_agent", 100, f"Agent started as {report.agent_pid}.")

    described = provider.describe(spec)
    assert described.agent_alive is True
    assert described.agent_pid == report.agent_pid

    again = provider.bootstrap(spec, bundle)
    assert again.agent_started is False
    assert again.agent_pid == report.agent_pid


def test_the_real_agent_runs_from_the_copied_packages(provider, spec):
    # workers/agent as bootstrap installs it: `python -m workers.agent` in the node
    # directory, settings from agent.env. No control plane answers at this address;
    # the agent keeps retrying, as it must through an outage.
    closed = f"http://127.0.0.1:{_closed_port()}"
    bundle = Bundle(
        agent_argv=(sys.executable, "-m", "workers.agent"),
        agent_env={"CONTROLPLANE_URL": closed, "CONTROLPLANE_NODE_TOKEN": "cpn_x"},
    )

    report = provider.bootstrap(spec, bundle)
    time.sleep(1)  # long enough to fail at once on a bad layout or a missing setting

    assert provider.describe(spec).agent_alive is True, _log(provider, spec)
    provider.terminate(spec)
    assert not _alive(report.agent_pid)


def test_terminate_stops_the_agent_and_removes_the_directory(provider, spec):
    report = provider.bootstrap(spec, Bundle(agent_argv=STAND_IN_AGENT))
    _read_json(provider.node_dir(spec) / "agent-env.json")  # it is up

    ended = provider.terminate(spec)

    assert ended.state == MachineState.ABSENT
    assert not _alive(report.agent_pid)
    assert not provider.node_dir(spec).exists()
    assert provider.describe(spec).state == MachineState.ABSENT
    assert provider.terminate(spec).state == MachineState.ABSENT  # again: nothing to do


def test_an_agent_deaf_to_sigterm_is_killed_after_the_timeout(provider, spec):
    report = provider.bootstrap(spec, Bundle(agent_argv=STUBBORN_AGENT))
    _read_json(provider.node_dir(spec) / "agent-env.json")  # SIGTERM is ignored from here on
    started = time.monotonic()

    provider.terminate(spec)

    assert not _alive(report.agent_pid)
    assert 1 <= time.monotonic() - started < 5


def test_terminate_also_ends_job_processes_the_agent_started(provider, spec):
    provider.bootstrap(spec, Bundle(agent_argv=AGENT_WITH_A_STUBBORN_JOB))
    child_pid_file = provider.node_dir(spec) / "child.pid"
    _wait_for(lambda: child_pid_file.exists() and child_pid_file.read_text())
    child = int(child_pid_file.read_text())

    provider.terminate(spec)

    _wait_for(lambda: not _alive(child))


def test_restart_agent_replaces_a_running_agent(provider, spec):
    first = provider.bootstrap(spec, Bundle(agent_argv=STAND_IN_AGENT))

    second = provider.bootstrap(spec, Bundle(agent_argv=STAND_IN_AGENT), restart_agent=True)

    assert second.agent_started is True
    assert second.agent_pid != first.agent_pid
    assert not _alive(first.agent_pid)


def test_an_agent_that_died_is_reported_and_started_again(provider, spec):
    short_lived = Bundle(agent_argv=(sys.executable, "-c", "pass"))
    first = provider.bootstrap(spec, short_lived)
    _wait_for(lambda: provider.describe(spec).agent_alive is False)

    second = provider.bootstrap(spec, Bundle(agent_argv=STAND_IN_AGENT))

    assert second.agent_started is True and second.agent_pid != first.agent_pid
    assert provider.describe(spec).agent_alive is True


def test_a_pid_file_naming_another_process_is_not_our_agent(provider, spec):
    # A pid can be reused after a reboot: the process behind it must carry our node's UUID.
    provider.create(spec)
    (provider.node_dir(spec) / "agent.pid").write_text(f"{os.getpid()}\n")

    assert provider.describe(spec).agent_alive is False
    provider.terminate(spec)  # must not signal the test runner

    assert not provider.node_dir(spec).exists()


def test_an_agent_command_that_cannot_start_is_a_provisioning_failure(provider, spec):
    with pytest.raises(ProvisioningFailed) as failed:
        provider.bootstrap(spec, Bundle(agent_argv=("/nonexistent/agent",)))

    assert failed.value.retryable is False


def test_specs_are_checked(tmp_path):
    with pytest.raises(ConfigurationError):
        LocalNodeSpec(uuid="../../etc")
    with pytest.raises(ConfigurationError):
        LocalNodeSpec(uuid=str(uuid.uuid4()), slots=0)
    with pytest.raises(ConfigurationError):
        Bundle(agent_argv="python3 -m workers.agent")  # a string, not an argument list


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log(provider: LocalProvider, spec: LocalNodeSpec) -> str:
    return (provider.node_dir(spec) / "agent.log").read_text()


def _read_json(path: Path) -> dict:
    _wait_for(lambda: path.exists() and path.stat().st_size > 0)
    return json.loads(path.read_text())


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
