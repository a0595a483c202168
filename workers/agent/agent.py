"""The agent's loop: register, then heartbeat, fetch run plans, run them, report, relay output.

Threads: the main loop (plans, run starts and exits), the heartbeats (apart, so that a
node's liveness never waits on a slow plan fetch, a run's start or its end), the outbox
(reports that must arrive, in order), the log shipper, and on AWS the spot watch. When the
control plane cannot be reached, heartbeats are skipped, reports and output
wait in memory, and the runs carry on.

The protocol (paths under /api/v1/agent/, JSON, `Authorization: Bearer <node token>`):

    POST register            {version, hostname, metrics, nccl_version, slots, isolation}
                             -> {..., "token"} when it registered with a cloud node's
                             bootstrap token: the node's own token from then on
    POST heartbeat           {seq, version, metrics, disk_free_bytes, nccl_version, runs,
                              have: ids of the runs it runs or whose end is not yet told,
                              fabric: {"mlx5_0/1": {counter: value}} (workers/agent/fabric.py)}
    GET  runs/?have=1,2      -> {"start": [plan, ...], "stop": [{"id", "reason"}, ...]}
    POST runs/{id}/status    {state: running | exited | refused, pid, exit_code, signal,
                              reason, status, node_fault, evidence: how its processes died,
                              as the kernel said (workers/agent/exits.py), or null}
    POST runs/{id}/logs      {lines: [{seq, stream, at, text}], dropped}
    POST events              {kind: "spot_interruption", notice, runs}

and checkpoints/... (workers/agent/checkpoints.py): the trainer's checkpoint lines as
reports, and the checks, listings, deletions and exports the control plane asks for.
"""

import functools
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from workers.agent import VERSION, exits, fabric, isolation, metrics
from workers.agent import config as config_module
from workers.agent.checkpoints import CheckpointKeeper
from workers.agent.client import ControlPlane, Message, Outbox, Refused, Unreachable
from workers.agent.config import AgentConfig
from workers.agent.leftovers import leftovers_stop
from workers.agent.runs import Ledger, LogBuffer, Plan, PlanRefused, Run
from workers.agent.spot import SpotWatch

log = logging.getLogger("agent")
API = "/api/v1/agent"
LEDGER_FILE = "runs.jsonl"  # the agent's own record of each run's start and end (Ledger)


class Agent:
    def __init__(self, config: AgentConfig, *, control: ControlPlane | None = None):
        self.config = config
        self.control = control or ControlPlane(
            config.url, config.token, timeout_s=config.request_timeout_s
        )
        self.outbox = Outbox(self.control)
        self.logs = LogBuffer(config.max_buffered_lines)
        # Changed by the main loop only, always under _runs_lock; read by the heartbeats.
        self.runs: dict[int, Run] = {}
        self.ledger = Ledger(config.work_dir / LEDGER_FILE)
        self.seen: set[int] = set()  # every run id ever started here: plans are re-sent until acked
        # Runs that ended here but whose end the control plane has not heard yet: heartbeats
        # still list them, or the control plane would take an exit for a lost process.
        self.ending: set[int] = set()
        self._runs_lock = threading.Lock()
        self.stopping = threading.Event()
        self.heartbeats = 0
        self.spot_notice: dict | None = None  # set by the spot watch thread
        self._spot_handled = False
        self._nccl_version = ""
        self.isolation = isolation.detect(
            config.job_users,
            work_dir=config.work_dir,
            uid_base=config.job_uid_base,
            uid_count=config.job_uid_count,
        )
        self.import_dir = isolation.import_dir(config.work_dir)
        self.checkpoints = CheckpointKeeper(
            self.control,
            self.outbox,
            every_s=config.plans_every_s,
            isolation=self.isolation,
            code_dir=self.import_dir,
        )
        self.exits = exits.watch()
        if self.isolation.on:
            isolation.open_code(config.work_dir)
            python = isolation.blocked_by(Path(sys.executable).parent)
            if python:
                log.warning(
                    "jobs cannot run this agent's Python (%s): their python3 is the "
                    "first on PATH they can run",
                    python,
                )
        else:
            log.warning("jobs run as the agent's own user: %s", self.isolation.reason)

    # --- lifecycle ---------------------------------------------------------------------------

    def register(self) -> None:
        """Say who we are; retried until the control plane answers."""
        self._nccl_version = metrics.nccl_version()
        delay = 1.0
        while not self.stopping.is_set():
            try:
                answer = self.control.call(
                    "POST",
                    f"{API}/register",
                    {
                        "version": VERSION,
                        "hostname": socket.gethostname(),
                        "metrics": metrics.gpu_metrics(slots=self.config.slots),
                        "nccl_version": self._nccl_version,
                        "slots": self.config.slots,
                        "isolation": self.isolation.report(),
                    },
                )
            except Unreachable as exc:
                log.warning("register: control plane unreachable (%s); retrying", exc)
                self.stopping.wait(delay)
                delay = min(delay * 2, 30.0)
                continue
            token = answer.pop("token", None)
            if token:
                self._take_token(str(token))
            log.info("registered: %s", answer)
            return

    def _take_token(self, token: str) -> None:
        """The node's own token, for the bootstrap one its user data carried: kept in
        agent.env (the agent's alone) so a restart uses it, and used from now on."""
        config_file = self.config.work_dir / config_module.ENV_FILE
        config_module.write_value(config_file, "CONTROLPLANE_NODE_TOKEN", token)
        self.control.use_token(token)
        log.info("took a token of the node's own; the bootstrap token is retired")

    def run(self) -> None:
        self.leftovers_stop()
        self.register()
        threads = [
            threading.Thread(target=self._heartbeats, name="heartbeats"),
            threading.Thread(target=self.outbox.run, args=(self.stopping,), name="outbox"),
            threading.Thread(target=self._ship_logs, name="logs"),
            threading.Thread(
                target=self.checkpoints.run, args=(self.stopping,), name="checkpoints"
            ),
        ]
        if self.config.imds_url:
            threads.append(threading.Thread(target=self._watch_spot, name="spot"))
        for thread in threads:
            thread.daemon = True
            thread.start()
        next_plans = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_plans:
                self._fetch_plans()
                next_plans = now + self.config.plans_every_s
            self._act_on_spot_notice()
            self._reap()
            self.stopping.wait(0.2)
        self._shutdown(threads)

    def leftovers_stop(self) -> list[int]:
        """Stop what a previous agent here left running (it was killed, not stopped): its
        runs are not ours to report; the control plane, hearing nothing of them, marks
        them lost. Their plans are not started again either."""
        self.seen.update(record["run"] for record in self.ledger.read())
        return leftovers_stop(self.ledger, isolation=self.isolation)

    def stop(self, *_args) -> None:
        self.stopping.set()

    def _shutdown(self, threads) -> None:
        for run in self.runs.values():
            run.stop(reason="agent stopping", grace_s=self.config.stop_grace_s)
        deadline = time.monotonic() + self.config.stop_grace_s + 5
        while self.runs and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.2)
        self._send_logs()
        self.outbox.flush(timeout_s=5)

    # --- heartbeats and plans -----------------------------------------------------------------

    def _heartbeats(self) -> None:
        """One every heartbeat_every_s (or as fast as the control plane answers, if slower)."""
        while not self.stopping.is_set():
            started = time.monotonic()
            self._heartbeat()
            self.stopping.wait(max(0.0, started + self.config.heartbeat_every_s - time.monotonic()))

    def _heartbeat(self) -> None:
        self.heartbeats += 1
        with self._runs_lock:
            runs = [{"id": i, "pid": r.pid} for i, r in self.runs.items()]
        body = {
            "seq": self.heartbeats,
            "version": VERSION,
            "metrics": metrics.gpu_metrics(slots=self.config.slots),
            "disk_free_bytes": metrics.disk_free_bytes(self.config.work_dir),
            "nccl_version": self._nccl_version,
            "runs": runs,
            "have": self._held(),
            "fabric": fabric.fabric_counters(root=self.config.sysfs_root),
        }
        try:
            self.control.call("POST", f"{API}/heartbeat", body)
        except (Unreachable, Refused) as exc:
            # A missed heartbeat is not buffered: the next one says the same, newer.
            log.warning("heartbeat %d not delivered: %s", self.heartbeats, exc)

    def _held(self) -> list[int]:
        """The runs it runs, and those whose end is not yet told."""
        with self._runs_lock:
            return sorted(set(self.runs) | self.ending)

    def _fetch_plans(self) -> None:
        # The runs held are sent along: the control plane answers "stop" for any it does
        # not want (ended or unknown to it).
        have = ",".join(str(i) for i in sorted(self.runs)[:256])
        try:
            answer = self.control.call("GET", f"{API}/runs/" + (f"?have={have}" if have else ""))
        except (Unreachable, Refused) as exc:
            log.warning("could not fetch run plans: %s", exc)
            return
        for data in answer.get("start", []):
            self._start(data)
        for item in answer.get("stop", []):
            run = self.runs.get(int(item["id"]))
            if run is not None:
                run.stop(reason=str(item.get("reason", "")), grace_s=self.config.stop_grace_s)

    def _start(self, data: dict) -> None:
        try:
            run_id = int(data["id"])
        except (KeyError, TypeError, ValueError):
            log.error("a run plan without an id: ignored")
            return
        if run_id in self.seen:
            return  # already started here; our "running" report is on its way
        self.seen.add(run_id)
        run = None
        try:
            plan = Plan.from_json(data)
            run = Run(
                plan,
                runs_dir=self.config.work_dir / "runs",
                logs=self.logs,
                base_env=run_base_env(),
                on_stdout=functools.partial(self.checkpoints.relay, run_id),
                isolation=self.isolation,
                code_dir=self.import_dir,
                exits=self.exits,
            )
            run.start()
        except (PlanRefused, KeyError, TypeError, ValueError, OSError) as exc:
            if run is not None:
                run.note(f"could not start: {exc}")
            report = {"state": "refused", "reason": str(exc)[:300]}
            if getattr(exc, "node_fault", ""):
                report["node_fault"] = exc.node_fault  # the control plane requeues the job
            self._report(run_id, report)
            return
        with self._runs_lock:
            self.runs[run_id] = run
        self.ledger.write("started", run, **run.identity())
        self._report(run_id, {"state": "running", "pid": run.pid})

    def _reap(self) -> None:
        for run_id, run in list(self.runs.items()):
            code = run.poll()
            if code is None:
                continue
            report = run.exit_report(code)
            self.ledger.write("ended", run, exit_code=code)
            if self.spot_notice is not None and not report["reason"]:
                report["reason"] = "spot interruption"
            with self._runs_lock:
                self.ending.add(run_id)
                del self.runs[run_id]
            self._report(run_id, report, on_sent=functools.partial(self._ended, run_id))

    def _ended(self, run_id: int) -> None:
        with self._runs_lock:
            self.ending.discard(run_id)

    def _report(self, run_id: int, body: dict, on_sent=None) -> None:
        what = f"run {run_id} {body['state']}"
        self.outbox.put(Message("POST", f"{API}/runs/{run_id}/status", body, what, on_sent))

    # --- output ----------------------------------------------------------------------------------

    def _ship_logs(self) -> None:
        while not self.stopping.is_set():
            if not self._send_logs():
                self.stopping.wait(2.0)  # unreachable: wait a little longer
            self.stopping.wait(0.5)

    def _send_logs(self) -> bool:
        batch = self.logs.take()
        for run_id, lines in batch.items():
            body = {
                "lines": [
                    {"seq": x.seq, "stream": x.stream, "at": x.at, "text": x.text} for x in lines
                ],
                "dropped": self.logs.dropped.pop(run_id, 0),
            }
            try:
                self.control.call("POST", f"{API}/runs/{run_id}/logs", body)
            except Unreachable:
                # Back to the front of the buffer, in order; sent when it answers again.
                rest = [x for r, xs in batch.items() if r >= run_id for x in xs]
                self.logs.put_back(rest)
                if body["dropped"]:
                    self.logs.dropped[run_id] = self.logs.dropped.get(run_id, 0) + body["dropped"]
                return False
            except Refused as exc:
                log.error("output of run %d refused: %s", run_id, exc)
        return True

    # --- spot ------------------------------------------------------------------------------------

    def _watch_spot(self) -> None:
        """Only notices the notice; the main loop acts on it (it alone touches the runs)."""
        watch = SpotWatch(self.config.imds_url)
        while not self.stopping.is_set() and self.spot_notice is None:
            notice = watch.check()
            if notice is not None:
                log.warning("spot interruption notice: %s", notice)
                self.spot_notice = notice
                return
            self.stopping.wait(self.config.spot_poll_s)

    def _act_on_spot_notice(self) -> None:
        if self.spot_notice is None or self._spot_handled:
            return
        self._spot_handled = True
        runs = list(self.runs.values())
        for run in runs:
            run.note(f"spot interruption notice: {self.spot_notice}")
            run.stop(reason="spot interruption", grace_s=self.config.stop_grace_s)
        body = {
            "kind": "spot_interruption",
            "notice": self.spot_notice,
            "runs": [r.plan.id for r in runs],
        }
        self.outbox.put(Message("POST", f"{API}/events", body, "spot notice"))


def run_base_env() -> dict[str, str]:
    """What runs inherit: the agent's environment, with its own Python first on PATH, so
    a plan's `python3` is the interpreter the agent runs on (the node's, or a venv's)."""
    env = dict(os.environ)
    here = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join([here, env.get("PATH", os.defpath)])
    return env


def main(config: AgentConfig) -> None:
    # What the agent writes itself (its log, its runs' files before they are handed
    # over) is its own; directories a job must pass through are opened up explicitly.
    os.umask(0o077)
    try:
        agent = Agent(config)
    except isolation.IsolationUnavailable as exc:
        raise SystemExit(f"agent: {exc}") from None
    signal.signal(signal.SIGTERM, agent.stop)
    signal.signal(signal.SIGINT, agent.stop)
    agent.run()
