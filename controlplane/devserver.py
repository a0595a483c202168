"""`make run`: the web server, a Celery worker and beat in one terminal; Ctrl-C stops all three."""

import argparse
import getpass
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def _logins(var_dir: Path) -> dict:
    path = var_dir / "demo-logins.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _wait_for_web(health_url: str, web: subprocess.Popen, timeout_s: float = 60) -> None:
    """Wait until the web server answers, so the banner comes after the start-up noise."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and web.poll() is None:
        try:
            with urllib.request.urlopen(health_url, timeout=2):  # noqa: S310 (our own URL)
                break
        except OSError:
            time.sleep(0.5)
    time.sleep(1.0)  # let the worker and beat finish their banners


# Every node's agent sends a heartbeat and asks for its plan (runs and checkpoint work) every
# few seconds: with the demo fleet that was most of runserver's access log (about 500 lines
# a minute), and the banner scrolled away. Those answered well are not printed; a refused or
# failed one still is, and every other request's line too.
AGENT_POLL = re.compile(
    r'"(POST /api/v1/agent/heartbeat|GET /api/v1/agent/runs/|GET /api/v1/agent/checkpoints/work)'
    r'[ ?][^"]*" [23]\d\d '
)


def print_all_but_agent_polls(source, sink) -> None:
    """Copy the web server's log lines from `source` to `sink`, leaving out the agents'
    polls that succeeded (runserver logs a request as `[when] "METHOD path HTTP/1.1" status
    size`)."""
    for line in iter(source.readline, ""):
        if not AGENT_POLL.search(line):
            sink.write(line)
            sink.flush()


# What jobs on local nodes must pass through (var/nodes/<node>/runs/<run>, var/checkpoints/...,
# the demo's dataset under var/datasets/).
PASSED_THROUGH = ("nodes", "checkpoints", "datasets")


def close_var(var_dir: Path) -> None:
    """Local nodes run jobs on this machine: nothing of the control plane's own under var/
    (its secret key, its database, the broker's messages, the demo's passwords) may be
    read by them. var/ can be passed through but not listed; the rest is ours alone."""
    var_dir.mkdir(exist_ok=True)
    os.chmod(var_dir, 0o711)  # noqa: S103 (pass through to PASSED_THROUGH)
    for entry in var_dir.iterdir():
        if entry.is_symlink():
            continue
        if entry.name in PASSED_THROUGH:
            os.chmod(entry, 0o711)  # noqa: S103
        else:
            os.chmod(entry, 0o700 if entry.is_dir() else 0o600)


def isolation_notice() -> str:
    if os.geteuid() == 0:
        return "Local nodes run each job as its own unprivileged user."
    return (
        f"Local nodes run jobs as {getpass.getuser()}: a job can read this control plane's "
        "files. Development only; each node holds one team's jobs at a time."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default="8000")
    parser.add_argument("--var-dir", default="var")
    args = parser.parse_args()
    var_dir = Path(args.var_dir)
    python = sys.executable
    # The worker and beat say only what went wrong (CELERY_LOG_LEVEL=INFO: every task), so
    # the banner and the web server's lines stay readable.
    level = os.environ.get("CELERY_LOG_LEVEL", "WARNING")
    commands = {
        "web": [python, "manage.py", "runserver", f"{args.host}:{args.port}", "--noreload"],
        "worker": [
            python,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            f"--loglevel={level}",
            "--concurrency=2",
            "--hostname=worker@%h",
        ],
        "beat": [python, "-m", "celery", "-A", "controlplane", "beat", f"--loglevel={level}"],
    }
    (var_dir / "broker" / "queue").mkdir(parents=True, exist_ok=True)
    (var_dir / "broker" / "processed").mkdir(parents=True, exist_ok=True)
    (var_dir / "nodes").mkdir(exist_ok=True)
    (var_dir / "checkpoints").mkdir(exist_ok=True)
    close_var(var_dir)
    children = {
        name: subprocess.Popen(
            cmd, **({"stderr": subprocess.PIPE, "text": True} if name == "web" else {})
        )
        for name, cmd in commands.items()
    }
    threading.Thread(
        target=print_all_but_agent_polls, args=(children["web"].stderr, sys.stderr), daemon=True
    ).start()

    url = f"http://{args.host}:{args.port}/"
    _wait_for_web(f"{url}healthz", children["web"])
    print(f"\n  Control plane: {url}   (API docs: {url}api/docs/, health: {url}healthz)")
    logins = _logins(var_dir)
    if logins:
        print("  Logins (first start's passwords; kept in var/demo-logins.json):")
        for username, password in logins.items():
            print(f"    {username:<8} {password}")
    print(f"  {isolation_notice()}")
    print("  Ctrl-C stops the web server, the worker and beat.\n", flush=True)

    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    exit_code = 0
    while not stopping:
        for name, child in children.items():
            if child.poll() is not None:
                print(f"{name} exited with {child.returncode}; stopping the others.", flush=True)
                exit_code = child.returncode or 1
                stopping = True
        time.sleep(0.5)
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
    stopped = _stop_local_agents(var_dir / "nodes")
    print(f"stopped (and {stopped} local node agent(s)).", flush=True)
    return exit_code


def _stop_local_agents(nodes_dir: Path) -> int:
    """The demo's local nodes are processes of this machine: stop their agents with us.
    The next `make run` starts them again (fleet.local_nodes_revive)."""
    stopped = 0
    for pid_file in nodes_dir.glob("node-*/agent.pid"):
        try:
            pid = int(pid_file.read_text().strip())
            os.killpg(pid, signal.SIGTERM)  # the agent leads its own session
            stopped += 1
        except (OSError, ValueError):
            continue  # already gone
    return stopped


if __name__ == "__main__":
    sys.exit(main())
