"""The agent's parts, each against the real thing: processes, an HTTP server for the
control plane's absence, and a small HTTP server standing in for EC2 instance metadata.

(The agent against the real control plane is in tests/e2e.) No database here.
"""

import itertools
import json
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.agent import metrics
from workers.agent.client import ControlPlane, Message, Outbox, Refused, Unreachable
from workers.agent.runs import (
    MASK,
    LogBuffer,
    LogLine,
    Masker,
    Plan,
    PlanRefused,
    RendezvousPortBusy,
    Run,
)
from workers.agent.spot import SpotWatch

PY = sys.executable


def _drain(logs: LogBuffer) -> list[LogLine]:
    return [line for lines in logs.take(100_000).values() for line in lines]


def _wait(run: Run, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (code := run.poll()) is None:
        assert time.monotonic() < deadline, "the run did not end"
        time.sleep(0.05)
    return code


def _run(tmp_path, **plan) -> tuple[Run, LogBuffer]:
    logs = LogBuffer(10_000)
    run = Run(
        Plan.from_json({"id": 7, **plan}),
        runs_dir=tmp_path,
        logs=logs,
        base_env={"PATH": "/usr/bin:/bin"},
    )
    return run, logs


# --- runs -----------------------------------------------------------------------------------


def test_an_argument_with_shell_syntax_arrives_as_that_literal_string(tmp_path):
    dangerous = "; rm -rf / #$(whoami) `id`"
    run, logs = _run(tmp_path, argv=[PY, "-c", "import sys; print(sys.argv[1])", dangerous])
    run.start()
    assert run.exit_report(_wait(run))["exit_code"] == 0
    assert [x.text for x in _drain(logs) if x.stream == "stdout"] == [dangerous]


def test_secrets_are_injected_and_masked_in_every_line(tmp_path):
    code = "import os; v = os.environ['WANDB_API_KEY']; print('key=' + v); print(v[:3])"
    run, logs = _run(
        tmp_path,
        argv=[PY, "-c", code],
        env={"PLAIN": "visible"},
        secrets={"WANDB_API_KEY": "s3cr3t-value-42"},
    )
    run.start()
    _wait(run)
    run.exit_report(0)
    texts = [x.text for x in _drain(logs)]
    assert f"key={MASK}" in texts
    assert all("s3cr3t-value-42" not in t for t in texts)
    assert "s3c" in texts  # a fragment is not the secret


def test_files_workdir_status_file_and_exit_code(tmp_path):
    writer = (
        "import json, os, pathlib, sys; print(pathlib.Path('conf/run.json').read_text()); "
        "json.dump({'reason': 'code_error', 'step': 12}, "
        "open(os.environ['CONTROLPLANE_STATUS_FILE'], 'w')); sys.exit(3)"
    )
    run, logs = _run(
        tmp_path,
        argv=[PY, "-c", writer],
        files=[{"path": "conf/run.json", "content": '{"steps": 5}'}],
    )
    run.start()
    report = run.exit_report(_wait(run))
    assert report["exit_code"] == 3
    assert report["status"] == {"reason": "code_error", "step": 12}
    assert '{"steps": 5}' in [x.text for x in _drain(logs)]


@pytest.mark.parametrize(
    "plan",
    [
        {"argv": "python train.py"},  # a shell string
        {"argv": []},
        {"argv": ["true"], "files": [{"path": "../outside", "content": "x"}]},
        {"argv": ["true"], "files": [{"path": "/etc/passwd", "content": "x"}]},
        {"argv": ["true"], "git": {"repo": "https://example.com/r.git", "ref": "--upload-pack=x"}},
        {"argv": ["/no/such/binary"]},
        {"argv": ["true"], "rendezvous_port": "29500"},
        {"argv": ["true"], "rendezvous_port": 70000},
        {"argv": ["true"], "rendezvous_port": True},
    ],
)
def test_plans_that_cannot_run_safely_are_refused(tmp_path, plan):
    with pytest.raises(PlanRefused):
        run, _ = _run(tmp_path, **plan)
        run.start()


def _listener(address: str = "127.0.0.1") -> socket.socket:
    """Something else on the node listening on a port (a stray process, another job)."""
    held = socket.socket()
    held.bind((address, 0))
    held.listen()
    return held


def test_a_rendezvous_port_held_on_the_node_refuses_the_run_before_anything_starts(tmp_path):
    held = _listener()
    port = held.getsockname()[1]
    marker = tmp_path / "started"
    argv = [PY, "-c", f"open({str(marker)!r}, 'w')"]
    try:
        run, _ = _run(tmp_path, argv=argv, rendezvous_port=port)
        with pytest.raises(RendezvousPortBusy) as refused:
            run.start()
    finally:
        held.close()
    assert str(refused.value) == f"rendezvous port {port} is busy on this node"
    assert refused.value.node_fault == "rendezvous_port_busy"
    assert run.process is None and not marker.exists()

    # Let go: the same plan starts.
    run, _ = _run(tmp_path, argv=argv, rendezvous_port=port)
    run.start()
    assert run.exit_report(_wait(run))["exit_code"] == 0 and marker.exists()


def test_a_git_repository_is_checked_out_at_the_ref(tmp_path):
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.py").write_text("print('first')\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    subprocess.run([*git, "tag", "v1"], check=True)
    (repo / "train.py").write_text("print('second')\n")
    subprocess.run([*git, "commit", "-qam", "two"], check=True)

    run, logs = _run(tmp_path / "runs", argv=[PY, "train.py"], git={"repo": str(repo), "ref": "v1"})
    run.start()
    assert run.exit_report(_wait(run))["exit_code"] == 0
    assert "first" in [x.text for x in _drain(logs) if x.stream == "stdout"]


def test_stop_sends_sigterm_to_the_whole_group_then_sigkill_after_the_grace(tmp_path):
    # A parent that ignores SIGTERM and a child that does too: only SIGKILL ends them.
    stubborn = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)']); "
        "time.sleep(60)"
    )
    run, _ = _run(tmp_path, argv=[PY, "-c", stubborn])
    run.start()
    time.sleep(0.5)
    started = time.monotonic()
    run.stop(reason="cancelled", grace_s=1.0)
    code = _wait(run)
    assert code == -signal.SIGKILL
    assert time.monotonic() - started >= 1.0
    report = run.exit_report(code)
    assert report["signal"] == signal.SIGKILL and report["reason"] == "cancelled"


def test_a_polite_process_stops_on_sigterm(tmp_path):
    polite = (
        "import signal, sys, time\n"
        "def bye(*_): print('checkpointing', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    run, logs = _run(tmp_path, argv=[PY, "-c", polite])
    run.start()
    deadline = time.monotonic() + 10
    while "ready" not in [x.text for x in list(logs._lines)]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run.stop(reason="spot interruption", grace_s=30)
    assert _wait(run, timeout=10) == 0
    assert "checkpointing" in [x.text for x in _drain(logs)]


# --- small parts ------------------------------------------------------------------------------


def test_the_masker_prefers_the_longest_secret_and_ignores_tiny_values():
    mask = Masker(["abcd", "abcdefgh", "on"])
    assert mask("x abcdefgh y abcd on") == f"x {MASK} y {MASK} on"


def test_the_log_buffer_drops_the_oldest_and_counts_them():
    buffer = LogBuffer(limit=3)
    for seq in range(5):
        buffer.add(LogLine(1, seq, "stdout", 0.0, str(seq)))
    assert [x.seq for x in _drain(buffer)] == [2, 3, 4]
    assert buffer.dropped == {1: 2}


def test_nvidia_smi_lines_parse_with_missing_values():
    out = (
        "0, GPU-aaa, NVIDIA H100 80GB HBM3, 97, 61234, 81559, 612.35, 71, 0, 550.54.15\n"
        "1, GPU-bbb, NVIDIA H100 80GB HBM3, 0, 3, 81559, [N/A], 35, [N/A], 550.54.15\n"
    )
    gpus = metrics.parse_nvidia_smi(out)
    assert gpus[0]["utilization"] == 97 and gpus[0]["power_w"] == pytest.approx(612.35)
    assert gpus[1]["power_w"] is None and gpus[1]["ecc_errors"] is None
    assert [g["index"] for g in gpus] == [0, 1]


def test_without_nvidia_smi_cpu_slots_stand_in():
    report = metrics.gpu_metrics(slots=4)
    if report["source"] == "nvidia-smi":
        pytest.skip("this machine has nvidia-smi")
    assert report["source"] == "cpu-slots" and len(report["gpus"]) == 4


# --- HTTP: the control plane's absence, and instance metadata ---------------------------------


class _Server:
    """A real HTTP server on 127.0.0.1 whose answers a test sets."""

    def __init__(self, handler):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _control_plane_handler(received: list, status: dict):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code = status["code"]
            if code == 200:
                received.append((self.path, body, self.headers["Authorization"]))
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    return Handler


def test_the_outbox_keeps_reports_in_order_until_the_control_plane_answers():
    received, status = [], {"code": 503}
    server = _Server(_control_plane_handler(received, status))
    stop = threading.Event()
    outbox = Outbox(ControlPlane(server.url, "cpn_secret", timeout_s=2), max_delay_s=0.2)
    sender = threading.Thread(target=outbox.run, args=(stop,), daemon=True)
    sender.start()
    try:
        for i in range(3):
            outbox.put(Message("POST", f"/r/{i}", {"i": i}, f"report {i}"))
        time.sleep(1.0)
        assert received == [] and outbox.pending() == 3  # 503s: kept, retried
        status["code"] = 200
        assert outbox.flush(timeout_s=10)
        assert [path for path, _, _ in received] == ["/r/0", "/r/1", "/r/2"]
        assert received[0][2] == "Bearer cpn_secret"
    finally:
        stop.set()
        server.close()


def test_the_client_tells_unreachable_from_refused():
    received, status = [], {"code": 404}
    server = _Server(_control_plane_handler(received, status))
    control = ControlPlane(server.url, "t", timeout_s=2)
    try:
        with pytest.raises(Refused):
            control.call("POST", "/x", {})
        status["code"] = 502
        with pytest.raises(Unreachable):
            control.call("POST", "/x", {})
    finally:
        server.close()
    with pytest.raises(Unreachable):
        control.call("POST", "/x", {})  # nobody listens any more


def _imds_handler(state: dict):
    """Stands in for EC2 instance metadata (IMDSv2): a token from PUT, then the notice or 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_PUT(self):
            assert self.path == "/latest/api/token"
            assert self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"token-1")

        def do_GET(self):
            if self.headers.get("X-aws-ec2-metadata-token") != "token-1":
                self.send_response(401)
                self.end_headers()
                return
            notice = state.get("notice")
            if self.path != "/latest/meta-data/spot/instance-action" or notice is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps(notice).encode())

        def log_message(self, *args):
            pass

    return Handler


def test_the_spot_watch_reads_the_notice_through_imdsv2():
    state: dict = {}
    server = _Server(_imds_handler(state))
    try:
        watch = SpotWatch(server.url)
        assert watch.check() is None  # 404: no notice
        state["notice"] = {"action": "terminate", "time": "2026-12-01T12:00:00Z"}
        assert watch.check() == state["notice"]
    finally:
        server.close()
    assert SpotWatch(server.url, timeout_s=0.5).check() is None  # metadata gone: no notice


def test_a_token_handed_back_at_registration_replaces_the_bootstrap_one(tmp_path, caplog):
    """A cloud node registers with its user data's token and is answered with its own:
    kept in agent.env (the agent's alone) and used from then on, never logged."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers["Authorization"])
            answer = {"token": "cpn_own_token"} if self.path.endswith("/register") else {}
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(answer).encode())

        def log_message(self, *args):
            pass

    server = _Server(Handler)
    env_file = tmp_path / "agent.env"
    env_file.write_text(f"CONTROLPLANE_URL={server.url}\nCONTROLPLANE_NODE_TOKEN=cpn_boot\n")
    try:
        from workers.agent.agent import Agent
        from workers.agent.config import load

        agent = Agent(load(tmp_path, environ={"AGENT_JOB_USERS": "off"}))
        with caplog.at_level("INFO", logger="agent"):
            agent.register()
            agent._heartbeat()
    finally:
        server.close()
    assert seen == ["Bearer cpn_boot", "Bearer cpn_own_token"]
    assert "CONTROLPLANE_NODE_TOKEN=cpn_own_token" in env_file.read_text().splitlines()
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    assert "cpn_own_token" not in caplog.text


def test_a_batch_of_output_stays_under_the_control_planes_request_limit():
    """Django refuses a body past 2.5 MB: a batch of long lines is cut into several."""
    logs = LogBuffer(100_000)
    for seq in range(2000):
        logs.add(LogLine(1, seq, "stdout", 0.0, "x" * 16_000))
    batches = []
    while len(logs):
        batch = logs.take()
        batches.append(batch)
        body = json.dumps({"lines": [vars(x) for x in batch[1]]})
        assert len(body.encode()) < 2_500_000
    assert sum(len(b[1]) for b in batches) == 2000
    one = LogBuffer(10)
    one.add(LogLine(1, 1, "stdout", 0.0, "y" * 3_000_000))
    assert len(one.take()[1]) == 1  # a line longer than the budget still goes, alone


def test_the_agent_reports_a_busy_rendezvous_port_as_the_nodes_fault(tmp_path):
    """The report the control plane requeues on: refused, with the reason and the fault."""
    received, status = [], {"code": 200}
    server = _Server(_control_plane_handler(received, status))
    (tmp_path / "agent.env").write_text(
        f"CONTROLPLANE_URL={server.url}\nCONTROLPLANE_NODE_TOKEN=cpn_t\n"
    )
    held = _listener()
    port = held.getsockname()[1]
    stop = threading.Event()
    try:
        from workers.agent.agent import Agent
        from workers.agent.config import load

        agent = Agent(load(tmp_path, environ={"AGENT_JOB_USERS": "off"}))
        sender = threading.Thread(target=agent.outbox.run, args=(stop,), daemon=True)
        sender.start()
        agent._start({"id": 41, "job": 5, "argv": [PY, "-c", "pass"], "rendezvous_port": port})
        assert agent.outbox.flush(timeout_s=10)
    finally:
        stop.set()
        held.close()
        server.close()
    assert agent.runs == {}
    assert [(path, body) for path, body, _ in received] == [
        (
            "/api/v1/agent/runs/41/status",
            {
                "state": "refused",
                "reason": f"rendezvous port {port} is busy on this node",
                "node_fault": "rendezvous_port_busy",
            },
        )
    ]


def test_the_agent_lists_a_run_until_its_end_is_told_and_stops_one_it_is_told_to(tmp_path):
    """Heartbeats list the runs the agent holds, ended ones too until their end reached the
    control plane (or an exit would read as a lost process); polls send the live ones, and
    a run answered with "stop" is stopped."""
    heartbeats, polls, status = [], [], {"code": 503}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            code = status["code"] if self.path.endswith("/status") else 200
            if self.path.endswith("/heartbeat"):
                heartbeats.append(body["have"])
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        def do_GET(self):
            polls.append(self.path)
            answer = {"start": [], "stop": [{"id": 41, "reason": "not wanted"}]}
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(answer).encode())

        def log_message(self, *args):
            pass

    server = _Server(Handler)
    (tmp_path / "agent.env").write_text(
        f"CONTROLPLANE_URL={server.url}\nCONTROLPLANE_NODE_TOKEN=cpn_t\n"
    )
    stop = threading.Event()
    try:
        from workers.agent.agent import Agent
        from workers.agent.config import load

        environ = {"AGENT_JOB_USERS": "off", "AGENT_STOP_GRACE_S": "5"}
        agent = Agent(load(tmp_path, environ=environ))
        agent.control.timeout_s = 2
        agent.outbox._max_delay_s = 0.2
        sender = threading.Thread(target=agent.outbox.run, args=(stop,), daemon=True)
        sender.start()
        agent._start({"id": 41, "job": 5, "argv": [PY, "-c", "import time; time.sleep(60)"]})
        agent._heartbeat()
        agent._fetch_plans()  # answered "stop 41"
        assert polls == ["/api/v1/agent/runs/?have=41"]
        assert _wait(agent.runs[41], timeout=10) == -signal.SIGTERM
        agent._reap()
        agent._heartbeat()  # ended, but its end not yet told (503s)
        status["code"] = 200
        assert agent.outbox.flush(timeout_s=10)
        agent._heartbeat()
        agent._fetch_plans()
    finally:
        stop.set()
        server.close()
    assert heartbeats == [[41], [41], []]
    assert polls[-1] == "/api/v1/agent/runs/"


def test_heartbeats_keep_their_pace_while_a_plan_fetch_waits(tmp_path):
    """A node's liveness does not wait on its work: while the control plane takes 3 s to
    answer a plan fetch, the agent's heartbeats still land every 0.2 s."""
    landed: list[float] = []
    fetches: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, answer: dict):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(answer).encode())

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path.endswith("/heartbeat"):
                landed.append(time.monotonic())
            self._answer({})

        def do_GET(self):
            fetches.append(time.monotonic())
            time.sleep(3.0)  # a control plane busy with a burst, for this request
            self._answer({"start": [], "stop": []})

        def log_message(self, *args):
            pass

    server = _Server(Handler)
    (tmp_path / "agent.env").write_text(
        f"CONTROLPLANE_URL={server.url}\nCONTROLPLANE_NODE_TOKEN=cpn_t\n"
    )
    try:
        from workers.agent.agent import Agent
        from workers.agent.config import load

        environ = {"AGENT_JOB_USERS": "off", "AGENT_HEARTBEAT_S": "0.2", "AGENT_PLANS_S": "60"}
        agent = Agent(load(tmp_path, environ=environ))
        loop = threading.Thread(target=agent.run, daemon=True)
        loop.start()
        deadline = time.monotonic() + 10
        while not fetches and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fetches, "the agent never fetched its plans"
        time.sleep(2.5)  # well inside the first fetch's 3 s
    finally:
        agent.stop()
        loop.join(timeout=15)
        server.close()
    during = [at for at in landed if fetches[0] < at < fetches[0] + 2.5]
    assert len(during) >= 6, f"{len(during)} heartbeats in 2.5 s of a waiting fetch"
    assert max(b - a for a, b in itertools.pairwise(during)) < 1.0
