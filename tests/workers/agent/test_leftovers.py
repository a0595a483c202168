"""A restarted agent stops what its predecessor left running, and nothing else: real
processes, a real ledger, agents built from a node directory as the node would have one."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.agent.agent import LEDGER_FILE, Agent
from workers.agent.config import load
from workers.agent.leftovers import (
    GONE_BEFORE_START,
    LEFT_BY_PREDECESSOR,
    leftovers_stop,
    process_start_time,
)
from workers.agent.runs import Ledger

PY = sys.executable

# A launcher with a worker in a session of its own (as torchrun starts them), which has a
# child of its own; the pids land in a file, and all of them wait to be stopped.
TREE = (
    "import os, subprocess, sys, time\n"
    "worker = subprocess.Popen([sys.executable, '-c', "
    '\'import subprocess, time; subprocess.Popen(["sleep", "600"]); time.sleep(600)\'], '
    "start_new_session=True)\n"
    "time.sleep(1)\n"
    "open('pids.txt', 'w').write(f'{os.getpid()} {worker.pid}')\n"
    "time.sleep(600)\n"
)


@pytest.fixture
def node_dir(tmp_path):
    """A node directory whose agents never reach a control plane: none is needed here."""
    (tmp_path / "agent.env").write_text(
        "CONTROLPLANE_URL=http://127.0.0.1:9\nCONTROLPLANE_NODE_TOKEN=cpn_t\n"
    )
    return tmp_path


def _agent(node_dir) -> Agent:
    return Agent(load(node_dir, environ={"AGENT_JOB_USERS": "off"}))


def _wait_for(what, predicate, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _descendants(pid: int) -> set[int]:
    children = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                children.add(int(entry.name))
    return children | {d for c in children for d in _descendants(c)}


def test_a_run_left_going_by_a_killed_agent_is_stopped_with_all_its_processes(node_dir):
    before = _agent(node_dir)
    before._start({"id": 41, "job": 5, "argv": [PY, "-c", TREE], "gpu_slots": [0, 1]})
    run = before.runs[41]
    pids_file = run.dir / "pids.txt"
    launcher, worker = map(
        int, _wait_for("the tree", lambda: pids_file.exists() and pids_file.read_text()).split()
    )
    tree = {launcher, worker} | _descendants(worker)
    assert len(tree) == 3 and all(process_start_time(p) for p in tree)
    (started,) = Ledger(node_dir / LEDGER_FILE).read()
    assert started["pid"] == launcher and started["sid"] == started["pgid"] == launcher
    assert started["start_time"] == process_start_time(launcher)
    with open(node_dir / LEDGER_FILE, "a") as ledger:
        ledger.write('{"event": "ended", "run": 4')  # a line cut short as the agent died

    # The agent is gone (nothing of it stops the run); a new one starts in its directory.
    after = _agent(node_dir)
    began = time.monotonic()
    assert after.leftovers_stop() == [41]
    assert time.monotonic() - began < 10
    assert [p for p in tree if process_start_time(p) is not None] == []
    assert run.process.wait(timeout=5) != 0
    started, ended = Ledger(node_dir / LEDGER_FILE).read()
    assert ended["event"] == "ended" and ended["run"] == 41 and ended["job"] == 5
    assert ended["slots"] == [0, 1] and ended["reason"] == LEFT_BY_PREDECESSOR
    # Not its run to report or to start again.
    assert after.runs == {} and after._held() == [] and 41 in after.seen
    assert Ledger(node_dir / LEDGER_FILE).open_runs() == []


def test_a_pid_now_used_by_another_process_is_left_alone(tmp_path):
    unrelated = subprocess.Popen(["sleep", "600"])
    try:
        start_time = process_start_time(unrelated.pid)
        ledger = Ledger(tmp_path / LEDGER_FILE)
        ledger.path.write_text(
            json.dumps(
                {
                    "event": "started",
                    "run": 9,
                    "job": 3,
                    "slots": [0],
                    "pid": unrelated.pid,
                    "pgid": unrelated.pid,
                    "sid": unrelated.pid,
                    "start_time": start_time - 1,  # the run's process started earlier
                    "uid": None,
                }
            )
            + "\n"
        )
        assert leftovers_stop(ledger, grace_s=1) == []
        time.sleep(0.5)
        assert unrelated.poll() is None
        assert process_start_time(unrelated.pid) == start_time
        assert ledger.read()[-1]["reason"] == GONE_BEFORE_START
        assert ledger.open_runs() == []
    finally:
        unrelated.kill()
        unrelated.wait()


def test_a_run_that_ended_cleanly_leaves_nothing_to_do(node_dir):
    before = _agent(node_dir)
    before._start({"id": 42, "job": 6, "argv": [PY, "-c", "pass"]})
    _wait_for("the run to end", lambda: before.runs[42].poll() is not None)
    before._reap()
    lines = (node_dir / LEDGER_FILE).read_text()
    assert [r["event"] for r in Ledger(node_dir / LEDGER_FILE).read()] == ["started", "ended"]
    assert _agent(node_dir).leftovers_stop() == []
    assert (node_dir / LEDGER_FILE).read_text() == lines
