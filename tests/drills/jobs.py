"""What drills do as users and ops would: submit jobs (in bursts, with Idempotency-Keys),
keep work on chosen nodes, call a beat task by hand, find a node's processes."""

import contextlib
import datetime as dt
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.drills import checks
from tests.drills.stack import PYTHON, ROOT, Stack
from tests.jobspecs import command_spec, tiny_trainer_spec
from tests.procs import agent_of, wait_for


def submit(stack: Stack, spec: dict, *, key: str = "") -> int:
    answer = stack.api("POST", "/api/v1/jobs/", spec, key=key)
    assert answer.status_code == 201, answer.text
    return answer.json()["id"]


def command(stack: Stack, argv: list[str], *, gpus: int = 1, name: str = "drill", **extra) -> dict:
    return command_spec(stack.seed["teams"]["drills"], argv, gpus=gpus, name=name, **extra)


def trainer(stack: Stack, *, nodes: int = 1, gpus_per_node: int = 2, team: str = "drills", **kw):
    """A tiny trainer job long enough to be hit while it trains (checkpoints every 10 steps)."""
    fields = {"steps": 120, "checkpoint_every_steps": 10, **kw}
    extra = {k: fields.pop(k) for k in ("restart_limit", "min_nodes") if k in fields}
    spec = tiny_trainer_spec(
        stack.seed["teams"][team], nodes=nodes, gpus_per_node=gpus_per_node, **fields
    )
    if "min_nodes" in extra:
        spec["resources"]["min_nodes"] = extra.pop("min_nodes")
    return {**spec, **extra}


class Burst:
    """Many submissions at once from several threads, each with its own Idempotency-Key
    (its job's name); what each got back is kept: the status, the job's id, Retry-After,
    and when (monotonic)."""

    def __init__(self, stack: Stack, names: list[str], argv=("true",)):
        self.stack, self.names, self.argv = stack, names, list(argv)
        self.answers: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self.answered = threading.Semaphore(0)

    def _one(self, name: str) -> None:
        try:
            answer = self.stack.api(
                "POST", "/api/v1/jobs/", command(self.stack, self.argv, name=name), key=name,
                timeout_s=30,
            )  # fmt: skip
            got = (
                answer.status_code,
                answer.json().get("id") if answer.status_code in (200, 201) else None,
                answer.headers.get("Retry-After"),
                time.monotonic(),
            )
        except requests.RequestException as error:
            got = ("unanswered", None, type(error).__name__, time.monotonic())
        with self._lock:
            self.answers[name] = got
        self.answered.release()

    def run(
        self, *, threads: int = 8, every_s: float = 0.0, after: int = 0, fault=None
    ) -> dict[str, tuple]:
        """Submit every name, one every `every_s` at most (so that a fault lands among
        them); once `after` have been answered, call `fault()` (in this thread, while the
        others go on submitting)."""
        start = time.monotonic()

        def paced(n: int, name: str) -> None:
            time.sleep(max(0.0, start + n * every_s - time.monotonic()))
            self._one(name)

        with ThreadPoolExecutor(threads) as pool:
            for n, name in enumerate(self.names):
                pool.submit(paced, n, name)
            if fault is not None:
                for _ in range(after):
                    self.answered.acquire()
                fault()
        return self.answers

    def until_all_accepted(self, timeout_s: float = 120) -> dict[str, int]:
        """Submit again, with the same keys, everything not yet answered 201, as a client
        following Retry-After would; the job id of each name in the end."""

        def retried() -> bool:
            for name in self.names:
                if self.answers.get(name, (None,))[0] not in (200, 201):
                    self._one(name)
            return all(self.answers[n][0] in (200, 201) for n in self.names)

        wait_for("every submission to be accepted", retried, timeout_s=timeout_s, every_s=1)
        return {name: self.answers[name][1] for name in self.names}

    def first_accepted_after(self, since: float) -> float:
        """Seconds from `since` (monotonic) to the first 201 answered after it."""
        return min(a[3] for a in self.answers.values() if a[0] == 201 and a[3] > since) - since


def exactly_once(stack: Stack, ids: dict[str, int]) -> None:
    """Each name (Idempotency-Key) made one job, the one its 201 named."""
    rows = stack.sql(
        "SELECT name, array_agg(id) FROM jobs_job WHERE name = ANY(%s) GROUP BY name",
        list(ids),
    )
    made = dict(rows)
    assert len(made) == len(ids), f"{len(ids) - len(made)} accepted submission(s) lost"
    twice = {name: got for name, got in made.items() if len(got) != 1}
    assert not twice, f"keys that made more than one job: {twice}"
    wrong = {name: (ids[name], made[name][0]) for name in ids if made[name][0] != ids[name]}
    assert not wrong, f"a 201 named another job than the key made: {wrong}"


def all_succeed_once(stack: Stack, job_ids, timeout_s: float = 240) -> None:
    """Every job SUCCEEDED, with exactly one run, which exited 0."""
    job_ids = list(job_ids)
    wait_for(
        f"{len(job_ids)} jobs to finish",
        lambda: (
            not stack.sql(
                "SELECT id FROM jobs_job WHERE id = ANY(%s) AND state <> ALL(%s)",
                job_ids,
                list(checks.FINISHED),
            )
        ),
        timeout_s=timeout_s,
        every_s=1,
    )
    not_ok = stack.sql(
        "SELECT id, state, state_reason FROM jobs_job WHERE id = ANY(%s) AND state <> 'succeeded'",
        job_ids,
    )
    assert not not_ok, f"jobs that did not succeed: {not_ok[:5]}"
    runs = stack.sql(
        "SELECT job_id, count(*) FROM jobs_run WHERE job_id = ANY(%s) GROUP BY job_id "
        "HAVING count(*) <> 1",
        job_ids,
    )
    assert not runs, f"jobs with other than one run (job, runs): {runs[:5]}\n" + story(
        stack, [job_id for job_id, _ in runs[:3]]
    )


def story(stack: Stack, job_ids: list[int]) -> str:
    """The jobs' state changes and runs, in order: what a failed drill prints to say why."""
    events = stack.sql(
        "SELECT job_id, at, from_state, to_state, reason FROM jobs_jobevent "
        "WHERE job_id = ANY(%s) ORDER BY job_id, at, id",
        job_ids,
    )
    runs = stack.sql(
        "SELECT job_id, id, node_id, attempt, state, reason, exit_code, signal, created_at, "
        "started_at, ended_at FROM jobs_run WHERE job_id = ANY(%s) ORDER BY job_id, id",
        job_ids,
    )
    # Their nodes' changes since (a node lost is the usual cause of a second run), less the
    # churn between busy and ready.
    nodes = stack.sql(
        "SELECT node_id, at, from_state, to_state, reason FROM fleet_nodeevent "
        "WHERE node_id = ANY(%s) AND at >= %s "
        "AND NOT (from_state IN ('busy', 'ready') AND to_state IN ('busy', 'ready')) "
        "ORDER BY at, id",
        sorted({row[2] for row in runs}),
        min(row[8] for row in runs) - dt.timedelta(seconds=30),
    )
    return "\n".join(
        [f"event {row}" for row in events]
        + [f"run {row}" for row in runs]
        + [f"node {row}" for row in nodes]
    )


def task_call(stack: Stack, name: str) -> None:
    """Send a beat task now (`celery call`), as its schedule would."""
    subprocess.run(
        [PYTHON, "-m", "celery", "-A", "controlplane", "call", name],
        env=stack.env, cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip


def node_ids(stack: Stack, *names: str) -> list[int]:
    rows = dict(stack.sql("SELECT name, id FROM fleet_node WHERE name = ANY(%s)", list(names)))
    return [rows[name] for name in names]


def agent_pid(stack: Stack, node_id: int) -> int:
    uuid = str(stack.sql("SELECT uuid FROM fleet_node WHERE id = %s", node_id)[0][0])
    return wait_for(f"node {node_id}'s agent", lambda: agent_of(uuid), timeout_s=30)


@contextlib.contextmanager
def only_on(stack: Stack, *names: str):
    """Keep new work on the named nodes: every other node of the drills is drained (they are
    idle between drills, so at once) and undrained after."""
    others = [
        node_id
        for name, node_id in stack.sql(
            "SELECT name, id FROM fleet_node WHERE state IN ('ready', 'busy', 'suspect')"
        )
        if name not in names
    ]
    for node_id in others:
        answer = stack.api("POST", f"/api/v1/nodes/{node_id}/drain/", {"reason": "drill"})
        assert answer.status_code == 200, answer.text
    try:
        left = stack.sql(
            "SELECT name, state FROM fleet_node WHERE state IN ('ready', 'busy') "
            "AND NOT name = ANY(%s)",
            list(names),
        )
        assert not left, f"nodes still taking work: {left}"
        yield node_ids(stack, *names)
    finally:
        for node_id in others:
            stack.api("POST", f"/api/v1/nodes/{node_id}/undrain/")


def run_of(stack: Stack, job_id: int, *, attempt: int | None = None, node_rank: int = 0) -> dict:
    runs = [r for r in checks.runs(stack, job_id) if r["rank"] == node_rank]
    if attempt is not None:
        runs = [r for r in runs if r["attempt"] == attempt]
    return runs[-1]


def checkpoints_committed(stack: Stack, job_id: int) -> list[tuple[int, str]]:
    """(step, location) of the job's usable checkpoints (committed or verified), oldest first."""
    return stack.sql(
        "SELECT c.step, k.location FROM checkpoints_checkpoint c "
        "JOIN checkpoints_checkpointcopy k ON k.checkpoint_id = c.id "
        "WHERE c.job_id = %s AND c.state IN ('committed', 'verified') "
        "AND k.state IN ('committed', 'verified') ORDER BY c.step",
        job_id,
    )


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
