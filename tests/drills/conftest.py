"""The fault drills' stack, started once for the suite (`make drills`).

pytest runs these with `--confcutdir=tests/drills -p no:django`: the drills are clients of
a control plane running in other processes, not Django tests, and none of the unit suite's
fixtures apply. Each drill records how long the product took to recover; the table is
printed at the end of the run.
"""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.drills import checks
from tests.drills.stack import Stack, why_not
from tests.procs import wait_for

RECOVERIES: list[tuple[str, float, str]] = []


@pytest.fixture(scope="session")
def stack():
    reason = why_not()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="cp-drills-", dir="/tmp"))
    up = Stack(root)
    try:
        up.start()
        nodes_up(up, up.seed["local_nodes"] + up.seed["ssh_nodes"])
        yield up
    finally:
        up.stop()
        if os.environ.get("DRILLS_KEEP"):
            print(f"[drills] logs and data kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def nodes_up(stack: Stack, node_ids: list[int], timeout_s: float = 120) -> None:
    """Provision every node not READY (through the API, as ops would) and wait for them."""
    for node_id in node_ids:
        state = checks.node_state(stack, node_id)
        if state == "down":  # as ops would: drained (its jobs went when it went DOWN), then up
            answer = stack.api("POST", f"/api/v1/nodes/{node_id}/drain/", {"reason": "drill"})
            assert answer.status_code == 200, answer.text
            state = "drained"
        if state in ("requested", "failed", "drained"):
            answer = stack.api("POST", f"/api/v1/nodes/{node_id}/provision/")
            assert answer.status_code == 200, answer.text
        elif state == "draining":
            stack.api("POST", f"/api/v1/nodes/{node_id}/undrain/")
    wait_for(
        f"nodes {node_ids} to be READY",
        lambda: all(checks.node_state(stack, n) in ("ready", "busy") for n in node_ids),
        timeout_s=timeout_s,
    )


@pytest.fixture
def drill(stack, request):
    """The stack, whole, for one drill; after it, whatever it broke is mended, and the
    invariants every drill promises are checked over everything that ran so far."""
    stack.ensure_up()
    nodes_up(stack, stack.seed["local_nodes"] + stack.seed["ssh_nodes"])
    started = time.monotonic()
    yield stack
    stack.ensure_up()
    report = getattr(request.node, "drill_report", None)
    if report is not None and report.failed:
        print(stack.diagnosis())
        checks.cancel_unfinished(stack)  # the next drill starts from a quiet fleet
        return
    checks.nothing_stuck(stack)
    checks.ledger_balances(stack)
    checks.no_node_overbooked(stack)
    print(f"[drill] {request.node.name}: {time.monotonic() - started:.0f} s in all")


@pytest.fixture
def recovered():
    """`recovered(name, seconds, what)`: a drill's recovery time, for the closing table."""

    def record(name: str, seconds: float, what: str) -> None:
        RECOVERIES.append((name, seconds, what))
        print(f"[recovery] {name}: {seconds:.1f} s ({what})")

    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.drill_report = report
    return report


def pytest_terminal_summary(terminalreporter):
    if not RECOVERIES:
        return
    terminalreporter.section("recovery times")
    for name, seconds, what in RECOVERIES:
        terminalreporter.write_line(f"{name:<34} {seconds:6.1f} s  {what}")
