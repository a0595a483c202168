"""Services from admission to the end: run plans per node, what agents report, and what it
means for the job.

ADMITTED → PROVISIONING (plans being written) → STARTING (plans offered to the
nodes' agents) → RUNNING (every rank started) → SUCCEEDED when every rank exits
0. A rank that fails in the job's own code fails the job (FAILED, not retried);
infrastructure (a node lost, a spot notice, a plan no agent started in time, a
rendezvous port found busy, a process the node's kernel killed) requeues it to
PENDING, up to its restart limit. A job that must stop (cancel, preemption, time
limit) asks its runs to stop, and ends when the last one has.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import secrets
import signal
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max
from django.utils import timezone

from apps.accounts.selectors import team_secret_values
from apps.fleet.agents import agent_runs_held
from apps.fleet.models import GONE_STATES, NodeState
from apps.fleet.selectors import node_names, nodes_by_rack
from apps.jobs import datasets
from apps.jobs.models import (
    OPEN_RUN_STATES,
    Allocation,
    EvalMetric,
    Job,
    JobKind,
    JobState,
    LogLine,
    NodeFault,
    RankEnvironment,
    Run,
    RunState,
    StepMetric,
)
from apps.jobs.models.jobs import FINISHED_STATES, STARTED_STATES, STOPPING_STATES
from apps.jobs.trainer_lines import (
    eval_metric,
    int_or_none,
    rank_environment,
    stage_progress,
    step_metric,
    trainer_event,
)
from apps.jobs.transitions import allocations_runs_ended, job_note, job_transition, runs_stop_for
from apps.tuning.runs import tuning_events_record
from apps.tuning.services import nccl_environments_render
from controlplane.errors import ApplicationError

if TYPE_CHECKING:
    from apps.fleet.models import Node

log = logging.getLogger(__name__)
J = JobState
R = RunState

# What a run's process may write to its status file to say it stopped for the
# infrastructure, not because of its own code (the trainer writes these).
INFRASTRUCTURE_EXITS = {
    "preempted",
    "spot_interruption",
    "node_lost",
    "collective_timeout",
    "storage",
}
SPOT_REASON = "spot interruption notice"
# A dispatch that loses its chosen rendezvous port to a concurrent one chooses again, this
# many times in all; a port an agent found busy is not chosen on its host for this long.
RENDEZVOUS_TRIES = 5
BUSY_PORT_AVOIDED_S = 3600
MAX_LINE = 16 * 1024


def _transition(job: Job, to: str, reason: str, **fields) -> Job:
    return job_transition(job=job, to=to, reason=reason, by=None, **fields)


def _current_attempt(job: Job) -> int:
    return Run.objects.filter(job=job).aggregate(n=Max("attempt"))["n"] or 0


# --- plans -------------------------------------------------------------------------------------


def _node_address(node: Node) -> str:
    return node.address or "127.0.0.1"


def _distributed_env(
    job: Job, *, rank: int, nnodes: int, head: Node, attempt: int, port: int
) -> dict[str, str]:
    return {
        "CONTROLPLANE_JOB_ID": str(job.pk),
        "CONTROLPLANE_JOB_UUID": str(job.uuid),
        "CONTROLPLANE_ATTEMPT": str(attempt),
        "CONTROLPLANE_NODE_RANK": str(rank),
        "CONTROLPLANE_NNODES": str(nnodes),
        "CONTROLPLANE_GPUS_PER_NODE": str(job.gpus_per_node),
        "MASTER_ADDR": _node_address(head),
        "MASTER_PORT": str(port),
    }


def processes_per_node(job: Job) -> int:
    """How many processes (ranks) each node of the job runs: torchrun starts one per GPU for
    the trainer; a command job's node runs its one command (its own launcher, if any, starts
    the rest)."""
    return job.gpus_per_node if job.kind != JobKind.COMMAND else 1


def ranks_did(job: Job, nodes: int, did: str) -> str:
    """What every rank of an attempt on `nodes` nodes did, counted in ranks (nodes ×
    processes per node), not nodes: "all 8 ranks (1 node × 8 processes) exited 0"."""
    if job.kind == JobKind.COMMAND:
        return f"the command {did} on " + ("its node" if nodes == 1 else f"all {nodes} nodes")
    per_node = processes_per_node(job)
    ranks = nodes * per_node
    return (
        f"{'its' if ranks == 1 else 'all'} {ranks} rank{'s' if ranks != 1 else ''} "
        f"({nodes} node{'s' if nodes != 1 else ''} × {per_node} "
        f"process{'es' if per_node != 1 else ''}) {did}"
    )


def trainer_argv(job: Job, *, rank: int, nnodes: int, head: Node, port: int) -> list[str]:
    """torchrun for the bundled trainer (workers/trainer), one agent per node (c10d rendezvous);
    `nnodes`: the attempt's node count (fewer than job.nodes when placed within its range).

    The first node hosts the rendezvous store, said outright (`is_host`) rather than left to
    torchrun's guess from host names: a host that cannot bind its port then fails at once,
    instead of joining whatever listens there as a client.
    """
    return [
        "python3",
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={processes_per_node(job)}",
        f"--node-rank={rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={_node_address(head)}:{port}",
        f"--rdzv-id={job.uuid}",
        f"--rdzv-conf=is_host={int(rank == 0)}",
        "-m",
        "workers.trainer",
        "--config",
        "run.json",
    ]


def run_plan(
    job: Job,
    *,
    rank: int,
    nnodes: int,
    head: Node,
    attempt: int,
    port: int,
    nccl_env: dict,
    gpu_slots: list[int] | None = None,
    resume_from: str | None = None,
    checkpoint_s3: dict | None = None,
) -> dict:
    """What the node of `rank` of the attempt's `nnodes` runs: JSON, without secret values.

    `gpu_slots`: the node's GPUs the job holds (its allocation); the processes see only
    those (CUDA_VISIBLE_DEVICES), and the agent records them with the run.

    Rank 0's plan names the rendezvous port when its processes will listen there (torchrun
    hosts its store on it; a command job across nodes has MASTER_PORT for its launcher), and
    the agent checks that nothing holds it before starting: a torchrun that cannot bind its
    port joins whatever listens there as a client, and waits.
    """
    spec = job.spec
    slots = list(gpu_slots or [])
    env = {
        **nccl_env,
        **(spec.get("env") or {}),
        **_distributed_env(job, rank=rank, nnodes=nnodes, head=head, attempt=attempt, port=port),
    }
    if slots:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in slots)
    listens = rank == 0 and (job.kind != JobKind.COMMAND or nnodes > 1)
    checked = {"rendezvous_port": port} if listens else {}
    if job.kind == JobKind.COMMAND:
        command = spec["command"]
        return {
            "job": job.pk,  # the agent runs the job's processes as the job's own user
            "gpu_slots": slots,
            "argv": list(command["argv"]),
            "env": env,
            "workdir": command.get("workdir") or command.get("path") or "",
            "git": command.get("git"),
            "files": [],
            **checked,
        }
    if job.kind == JobKind.TUNING:
        from apps.jobs.tuning_runs import PLAN_FILE, tuning_plan_file

        # The driver sets each candidate's whole NCCL environment per launch.
        return {
            "job": job.pk,
            "gpu_slots": slots,
            "argv": ["python3", "-m", "workers.trainer.tuning", "--plan", PLAN_FILE],
            "env": env,
            "workdir": "",
            "git": None,
            **checked,
            "files": [tuning_plan_file(job)],
        }
    from apps.jobs.runconfig import checkpoint_dir, trainer_run_config

    # Fewer out-of-memory stops from fragmentation on long runs (PyTorch's allocator).
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    argv = trainer_argv(job, rank=rank, nnodes=nnodes, head=head, port=port)
    run_json = trainer_run_config(
        job, attempt=attempt, nodes=nnodes, resume_from=resume_from, s3=checkpoint_s3
    )
    files = [{"path": "run.json", "content": run_json}]
    # Made on the node and handed to the job's user before the trainer starts.
    owned_dirs = [checkpoint_dir(job)]
    team_dirs: list[str] = []
    mixture = datasets.job_datasets(job)
    weights = datasets.init_hf_staged(job)
    if mixture or weights:
        # The datasets are staged (S3 ones copied into the node's cache, shared ones checked),
        # and starting weights on S3 copied, before torchrun starts, which the stage module
        # execs: an argument list throughout.
        argv = [
            *("python3", "-m", "workers.trainer.stage", "--plan", datasets.STAGE_PLAN_FILE),
            *("--then", "--", *argv),
        ]
        plan = datasets.stage_plan(mixture, init_hf=weights)
        files.append({"path": datasets.STAGE_PLAN_FILE, "content": plan})
        # The node's copies are the team's, shared by its jobs there: made by the agent as
        # the team's group's, not handed to this job's user.
        team_dirs += [datasets.node_dir(d) for d, _ in mixture if d.on_s3]
        team_dirs += [weights["dest"]] if weights else []
        if settings.AWS_ENDPOINT_URL and (weights or any(d.on_s3 for d, _ in mixture)):
            env.setdefault("AWS_ENDPOINT_URL", settings.AWS_ENDPOINT_URL)
    return {
        "job": job.pk,
        "gpu_slots": slots,
        "argv": argv,
        "env": env,
        "workdir": "",
        "git": None,
        **checked,
        "owned_dirs": owned_dirs,
        "team": job.team_id,
        "team_dirs": team_dirs,
        "files": files,
    }


def _rendezvous_ports_free(host: str) -> list[int]:
    """The rendezvous range's ports that no open run holds on `host`, less those an agent
    found busy there lately (unless nothing else is left)."""
    first = settings.RENDEZVOUS_PORT_BASE
    held = set(
        Run.objects.filter(
            rendezvous_host=host, rendezvous_port__isnull=False, state__in=OPEN_RUN_STATES
        ).values_list("rendezvous_port", flat=True)
    )
    free = [p for p in range(first, first + settings.RENDEZVOUS_PORT_SPREAD) if p not in held]
    since = timezone.now() - dt.timedelta(seconds=BUSY_PORT_AVOIDED_S)
    busy = set(
        Run.objects.filter(
            node_fault=NodeFault.RENDEZVOUS_PORT_BUSY, rendezvous_host=host, ended_at__gte=since
        ).values_list("rendezvous_port", flat=True)
    )
    return [p for p in free if p not in busy] or free


def _runs_create_holding_a_port(host: str, runs_for) -> int | None:
    """Write an attempt's runs (`runs_for(port)`), rank 0's holding a rendezvous port of
    `host` that no open run holds; the port, or None when none is free.

    Any free port, not the lowest: one that a stray process holds would otherwise be handed
    out again at once. Between concurrent dispatches the database's constraint decides: the
    one that loses reads again and chooses among what is left.
    """
    tries = RENDEZVOUS_TRIES
    while True:
        free = _rendezvous_ports_free(host)
        if not free:
            return None
        port = secrets.choice(free)
        try:
            with transaction.atomic():
                Run.objects.bulk_create(runs_for(port))
            return port
        except IntegrityError:
            tries -= 1
            if not tries:
                raise


def job_dispatch(
    *, job_id: int, resume_from: str | None = None, checkpoint_s3: dict | None = None
) -> Job | None:
    """Turn an ADMITTED job into one run plan per node; its agents start them.

    Safe to run twice (a redelivered task): only an ADMITTED job is dispatched. A trainer
    job resumes from `resume_from` and copies its checkpoints to `checkpoint_s3`, as the
    jobs.dispatch task found them in the checkpoint registry (which sits above jobs).
    """
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id, state=J.ADMITTED).first()
        if job is None:
            return None
        job = _transition(job, J.PROVISIONING, "writing run plans")
        held = {
            a.node_id: a
            for a in Allocation.objects.filter(job=job, ended_at__isnull=True, release_wanted=False)
        }
        nodes = nodes_by_rack(node_ids=list(held))
        # The attempt runs on the nodes it was given: all of job.nodes, or, for a job with a
        # node range, as few as min_nodes when the scheduler could place no more.
        nnodes = len(nodes)
        if not job.fewest_nodes <= nnodes <= job.nodes:
            least = f"; it needs at least {job.fewest_nodes}" if job.min_nodes else ""
            return _requeue(job, f"{nnodes} of {job.nodes} nodes still allocated{least}")
        rendered = nccl_environments_render(
            nccl=job.spec.get("nccl"), nodes=nnodes, pool_ids=[job.pool_id]
        )
        if rendered and not rendered[0].ok:
            # The profile or the pool changed since submission: the job cannot run as asked.
            problems = rendered[0].problems + [
                f"{v.name}: {v.reason}" for v in rendered[0].verdicts if v.blocking
            ]
            return _transition(job, J.FAILED, ("NCCL settings refused: " + "; ".join(problems)))
        nccl_env = rendered[0].env if rendered else {}
        gone = datasets.missing_datasets(job) if job.kind == JobKind.TRAINER else []
        if gone:
            return _transition(job, J.FAILED, f"dataset {gone[0]} is no longer registered")
        attempt = _current_attempt(job) + 1
        head = nodes[0]
        host = _node_address(head)
        port = _runs_create_holding_a_port(
            host,
            lambda port: [
                Run(
                    job=job,
                    node=node,
                    attempt=attempt,
                    node_rank=rank,
                    allocation=held[node.pk],
                    plan=run_plan(
                        job,
                        rank=rank,
                        nnodes=nnodes,
                        head=head,
                        attempt=attempt,
                        port=port,
                        nccl_env=nccl_env,
                        gpu_slots=held[node.pk].slots,
                        resume_from=resume_from,
                        checkpoint_s3=checkpoint_s3,
                    ),
                    secret_names=sorted(job.spec.get("secrets") or []),
                    nccl_profile=rendered[0].profile if rendered else "",
                    nccl_profile_version=rendered[0].version or None if rendered else None,
                    rendezvous_host=host if rank == 0 else "",
                    rendezvous_port=port if rank == 0 else None,
                )
                for rank, node in enumerate(nodes)
            ],
        )
        if port is None:
            first, spread = settings.RENDEZVOUS_PORT_BASE, settings.RENDEZVOUS_PORT_SPREAD
            return _requeue(
                job,
                f"no free rendezvous port on {head.name} ({host}): "
                f"all {spread} from {first} to {first + spread - 1} are held by other jobs",
            )
        of = f" ({nnodes} of {job.nodes} nodes)" if nnodes < job.nodes else ""
        # Offered, not taken: the trainer may reject it and fall back (it says which it took).
        resuming = f"; checkpoint offered: {resume_from.rstrip('/')[-200:]}" if resume_from else ""
        return _transition(
            job, J.STARTING, f"attempt {attempt}: plans for {nnodes} node(s) offered{of}{resuming}"
        )


# --- what the agents fetch -----------------------------------------------------------------------


def _secret_values(job: Job, names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    return team_secret_values(team_id=job.team_id, names=names)


MAX_RUNS_HELD = 256
UNWANTED = "the control plane does not want this run"


def agent_have(text: str | None) -> list[int]:
    """The `have` parameter of an agent's poll: run ids, comma-separated."""
    if not text:
        return []
    parts = text.split(",")
    if len(parts) > MAX_RUNS_HELD or not all(p.isdigit() and len(p) <= 18 for p in parts):
        raise ApplicationError(
            "have lists run ids, comma-separated.",
            details={"have": [f"At most {MAX_RUNS_HELD} ids, each a positive integer."]},
        )
    return [int(p) for p in parts]


def agent_work(*, node_id: int, have: list[int] = ()) -> dict:
    """The plans this node's agent should start (secrets decrypted) and the runs to stop:
    those asked to stop, and those it holds that this node has no open run for."""
    runs = list(
        Run.objects.select_related("job")
        .filter(node_id=node_id, state__in=OPEN_RUN_STATES)
        .order_by("id")
    )
    start = [
        {"id": run.pk, **run.plan, "secrets": _secret_values(run.job, run.secret_names)}
        for run in runs
        if run.state == R.PLANNED and run.stop_requested_at is None
    ]
    stop = [
        {"id": run.pk, "reason": run.stop_reason}
        for run in runs
        if run.state == R.RUNNING and run.stop_requested_at is not None
    ]
    wanted = {run.pk for run in runs}
    stop += [{"id": run_id, "reason": UNWANTED} for run_id in sorted(set(have) - wanted)]
    return {"start": start, "stop": stop}


# --- what the agents report ---------------------------------------------------------------------


def _run_of(node_id: int, run_id: int, *, lock: bool = False) -> Run:
    runs = Run.objects.select_for_update() if lock else Run.objects
    run = runs.filter(pk=run_id, node_id=node_id).first()
    if run is None:
        raise ApplicationError("No such run on this node.", code="not_found", status=404)
    return run


def _int_within(value, low: int, high: int) -> int | None:
    number = int_or_none(value)
    return number if number is not None and low <= number <= high else None


EVIDENCE_KINDS = ("oom", "signal")
_COMMAND = re.compile(r"[\w .:/@+-]{0,64}\Z")


def _evidence(value) -> dict | None:
    """The agent's evidence of how a run's processes died, kept only when every field is
    what the agent writes (workers/agent/exits.py); anything else is dropped whole."""
    if not isinstance(value, dict) or value.get("kind") not in EVIDENCE_KINDS:
        return None
    number = _int_within(value.get("signal"), 1, 64)
    pid = _int_within(value.get("pid"), 1, 1 << 22)
    if number is None or pid is None:
        return None
    ranks = {}
    for name in ("rank", "local_rank"):
        ranks[name] = _int_within(value.get(name), 0, 1 << 20)
        if value.get(name) is not None and ranks[name] is None:
            return None
    command = value.get("command", "")
    if not isinstance(command, str) or not _COMMAND.match(command):
        return None
    return {
        "kind": value["kind"],
        "signal": number,
        "pid": pid,
        **ranks,
        "command": command,
        "incomplete": value.get("incomplete") is True,
    }


@transaction.atomic
def run_report(*, node_id: int, run_id: int, report: dict) -> Run:
    """An agent says a run started, could not start, or ended; the job follows."""
    run = _run_of(node_id, run_id, lock=True)
    state = report.get("state")
    now = timezone.now()
    if state == "running" and run.state == R.PLANNED:
        run.state, run.pid, run.started_at = R.RUNNING, int_or_none(report.get("pid")), now
    elif state in ("exited", "refused") and run.state in OPEN_RUN_STATES:
        run.state = R.EXITED if state == "exited" else R.REFUSED
        run.exit_code = int_or_none(report.get("exit_code"))
        run.signal = int_or_none(report.get("signal"))
        run.reason = str(report.get("reason") or "")[:300]
        # Said outright by the agent (never read from a job's output): the node, not the
        # job, kept the run from starting.
        fault = report.get("node_fault")
        run.node_fault = fault if fault in NodeFault.values else ""
        status = report.get("status")
        run.status = status if isinstance(status, dict) else None
        run.evidence = _evidence(report.get("evidence")) if state == "exited" else None
        run.ended_at = now
    elif state not in ("running", "exited", "refused"):
        raise ApplicationError(
            "state must be running, exited or refused.", details={"state": ["Unknown state."]}
        )
    else:
        return run  # a repeat (the agent retried after a lost answer): nothing new
    run.save()
    _job_follows(run.job_id, changed=run)
    if run.state not in OPEN_RUN_STATES:
        # Its process is gone: GPUs its job already let go of are free now.
        allocations_runs_ended(allocation_ids=[run.allocation_id], now=now)
    return run


def _describe_exit(run: Run) -> str:
    node = node_names(node_ids=[run.node_id]).get(run.node_id)
    if run.state == R.LOST:
        return f"rank {run.node_rank} on {node} was lost: {run.reason}"
    if run.state == R.REFUSED:
        return f"rank {run.node_rank} on {node} could not start: {run.reason}"
    if _killed(run):
        return _describe_death(run.evidence, node_rank=run.node_rank, node=node)
    status = run.status if isinstance(run.status, dict) else {}
    if status.get("reason") == "storage" and isinstance(status.get("message"), str):
        # The trainer's words, shown as text: what it needed and where ("checkpoint: needs
        # 13.2 GB at DIR, 4.1 GB free").
        return f"rank {run.node_rank} on {node} could not save: {status['message'][:160]}"
    how = f"signal {run.signal}" if run.signal else f"exit code {run.exit_code}"
    return f"rank {run.node_rank} on {node} ended with {how}"


def _describe_death(evidence: dict, *, node_rank: int, node: str) -> str:
    rank = evidence["rank"] if evidence["rank"] is not None else node_rank
    who = f"rank {rank} (pid {evidence['pid']}) on {node}"
    if evidence["kind"] == "oom":
        text = f"{who} was killed by the kernel's OOM killer"
    else:
        try:
            name = f" ({signal.Signals(evidence['signal']).name})"
        except ValueError:
            name = ""
        text = f"{who} was killed by signal {evidence['signal']}{name}"
    if evidence.get("incomplete"):
        text += " (the first death the agent saw: some process events were lost)"
    return text


def _killed(run: Run) -> bool:
    """The node's kernel OOM-killed one of the run's processes, or a rank (a process torchrun
    started, with a RANK) died of a signal the agent did not send: an exit code of 1 from
    torchrun says nothing more than that a rank died. A signal to any other process of the
    job may be the job's own doing (a subprocess it killed), so it is not evidence."""
    evidence = run.evidence or {}
    return evidence.get("kind") == "oom" or evidence.get("rank") is not None


def _infrastructure(run: Run) -> bool:
    if run.node_fault or run.state == R.LOST or _killed(run):
        return True
    status_reason = (run.status or {}).get("reason") if isinstance(run.status, dict) else None
    return run.reason == "spot interruption" or status_reason in INFRASTRUCTURE_EXITS


def _collective_timeout(run: Run) -> bool:
    return isinstance(run.status, dict) and run.status.get("reason") == "collective_timeout"


def _describe_failure(run: Run) -> str:
    """A collective timeout is what a healthy rank sees of a peer's loss: said as such,
    unless the rank's own death is what the run's evidence shows."""
    if not _collective_timeout(run) or _killed(run):
        return _describe_exit(run)
    node = node_names(node_ids=[run.node_id]).get(run.node_id)
    return f"rank {run.node_rank} on {node} lost its peers (collective timeout)"


def _to_blame(failed: list[Run]) -> Run:
    """The failed run an infrastructure requeue names: one the node's kernel or a signal
    killed first, then one lost, refused or failed by its node (the cause), a collective
    timeout last (what its peers saw of it)."""

    def order(run: Run) -> tuple[int, int]:
        if _killed(run):
            return 0, run.node_rank
        if run.state in (R.LOST, R.REFUSED) or run.node_fault:
            return 1, run.node_rank
        return (3 if _collective_timeout(run) else 2), run.node_rank

    return min(failed, key=order)


def _late_cause_note(job: Job, runs: list[Run]) -> None:
    """A run of an attempt already over (its job requeued, often on a peer's collective
    timeout) found lost, or killed by a signal its agent did not send, is likely the real
    cause: the job's timeline names it."""
    if job.state in STARTED_STATES | STOPPING_STATES | {J.PROVISIONING}:
        over = [r for r in runs if r.attempt < _current_attempt(job)]
    else:
        over = runs
    for run in over:
        # A signal the agent sent says why (the stop it was asked for); any other is news.
        if run.state == R.LOST or _killed(run) or (run.signal and not run.reason):
            job_note(job_id=job.pk, reason=f"attempt {run.attempt}: {_describe_exit(run)}")


def _job_follows(job_id: int, *, changed: Run | None = None) -> None:
    """Move the job as its current attempt's runs say."""
    job = Job.objects.select_for_update().get(pk=job_id)
    if changed is not None:
        _late_cause_note(job, [changed])
    if job.state in FINISHED_STATES or job.state in (J.PENDING, J.HELD, J.ADMITTED):
        return
    attempt = _current_attempt(job)
    runs = list(Run.objects.filter(job=job, attempt=attempt))
    if changed is not None and changed.attempt != attempt:
        return  # an older attempt's run: recorded, nothing more
    open_runs = [r for r in runs if r.state in OPEN_RUN_STATES]
    ended = [r for r in runs if r.state not in OPEN_RUN_STATES]
    failed = [
        r
        for r in ended
        if r.state in (R.REFUSED, R.LOST) or r.exit_code not in (0, None) or r.signal
    ]

    if job.state in (J.PREEMPTING, J.STOPPING):
        if not open_runs:
            _finish_stopping(job)
        return
    if failed:
        # The job's own error on any node wins over what other nodes saw of it (a peer's
        # crash looks like a collective timeout from elsewhere).
        own = [r for r in failed if not _infrastructure(r)]
        if own:
            _runs_stop(job, reason="another rank failed")
            _transition(job, J.FAILED, _describe_exit(own[0]))
        else:
            _requeue(job, f"{_describe_failure(_to_blame(failed))} (infrastructure)")
        return
    # Every rank has started once each is running or has ended (well: failures went above).
    # A quick job's first rank may end before the last reports its start, so the job never
    # sees them all running at once; it ran all the same, and goes through RUNNING.
    if (
        job.state in (J.PROVISIONING, J.STARTING)
        and runs
        and not any(r.state == R.PLANNED for r in runs)
    ):
        if job.state == J.PROVISIONING:
            job = _transition(job, J.STARTING, "plans offered")
        # Begun when the last rank said so; or, if one has ended already, at the first start.
        started = [r.started_at for r in runs if r.started_at is not None]
        job = _transition(
            job,
            J.RUNNING,
            ranks_did(job, len(runs), "started"),
            started_at=min(started) if ended and started else timezone.now(),
        )
    if runs and not open_runs:
        _transition(job, J.SUCCEEDED, ranks_did(job, len(runs), "exited 0"))


def _finish_stopping(job: Job) -> None:
    if job.state == J.PREEMPTING and job.state_reason.startswith(SPOT_REASON):
        _requeue(job, "stopped after a spot interruption notice")  # infrastructure: counted
    elif job.state == J.PREEMPTING:
        _transition(job, J.PENDING, "preempted: stopped; back in the queue to resume")
    else:
        limit = job.state_reason.startswith(("time limit", "cost limit"))
        _transition(job, J.FAILED if limit else J.CANCELLED, job.state_reason or "stopped")


def _requeue(job: Job, reason: str) -> Job:
    """Back to the queue after an infrastructure fault, or FAILED past the restart limit."""
    _runs_stop(job, reason=reason)
    if job.restarts >= job.restart_limit:
        return _transition(
            job, J.FAILED, f"{reason}; restart limit ({job.restart_limit}) reached"[:300]
        )
    return _transition(job, J.PENDING, f"requeued: {reason}"[:300], restarts=job.restarts + 1)


def _runs_stop(job: Job, *, reason: str) -> int:
    return runs_stop_for(job_ids=[job.pk], reasons={job.pk: reason})


# --- output ----------------------------------------------------------------------------------


def _masker(job: Job, names: list[str]):
    """Secrets are masked by the agent; masked here too, in case an agent does not."""
    values = sorted(
        (v for v in _secret_values(job, names).values() if len(v) >= 4), key=len, reverse=True
    )

    def mask(text: str) -> str:
        for value in values:
            text = text.replace(value, "********")
        return text

    return mask


def run_logs_append(*, node_id: int, run_id: int, lines: list, dropped: int = 0) -> int:
    """Store a batch of a run's output lines; a batch sent twice is stored once."""
    run = Run.objects.select_related("job").filter(pk=run_id, node_id=node_id).first()
    if run is None:
        raise ApplicationError("No such run on this node.", code="not_found", status=404)
    if not isinstance(lines, list):
        raise ApplicationError("lines must be a list.", details={"lines": ["A list."]})
    mask = _masker(run.job, run.secret_names)
    rows = []
    for item in lines[:5000]:
        if not isinstance(item, dict) or not isinstance(item.get("seq"), int):
            continue
        at = item.get("at")
        when = (
            dt.datetime.fromtimestamp(at, tz=dt.UTC)
            if isinstance(at, int | float) and 0 < at < 4e9
            else timezone.now()
        )
        text = mask(str(item.get("text", "")).replace("\x00", ""))[:MAX_LINE]
        rows.append(
            LogLine(
                run=run,
                job_id=run.job_id,
                seq=item["seq"],
                stream=str(item.get("stream", "stdout"))[:10],
                at=when,
                text=text,
            )
        )
    if isinstance(dropped, int) and dropped > 0:
        # A line of its own, numbered past the batch, so it sorts where the gap was.
        last = max((r.seq for r in rows), default=0)
        rows.append(
            LogLine(
                run=run,
                job_id=run.job_id,
                seq=last + 1_000_000_000,
                stream="agent",
                at=timezone.now(),
                text=f"[{dropped} lines dropped while the control plane was unreachable]",
            )
        )
    try:
        LogLine.objects.bulk_create(rows, ignore_conflicts=True)
    except IntegrityError:  # pragma: no cover (ignore_conflicts covers duplicates)
        log.warning("log lines of run %s not stored", run_id, exc_info=True)
    printed = [r for r in rows if r.stream == "stdout"]
    metrics = [m for m in (step_metric(run, r) for r in printed) if m]
    if metrics:
        StepMetric.objects.bulk_create(metrics, ignore_conflicts=True)
    evaluations = [m for m in (eval_metric(run, r) for r in printed) if m]
    if evaluations:
        EvalMetric.objects.bulk_create(evaluations, ignore_conflicts=True)
    if run.job.kind == JobKind.TUNING:
        # Figures and progress, checked against the run's plan; each launch's ranks have
        # their candidate's environment, so no rank's is kept as the job's.
        events = [e for e in (trainer_event(r.text) for r in printed) if e]
        tuning_events_record(job_id=run.job_id, events=events, head=run.node_rank == 0)
        return len(rows)
    staging = [e for e in (stage_progress(r.text) for r in printed) if e]
    if staging:
        Run.objects.filter(pk=run.pk).update(staging=staging[-1])
    environments = [e for e in (rank_environment(run, r) for r in printed) if e]
    if environments:
        # The first report of a rank counts: a second one (a forged or repeated line) is dropped.
        RankEnvironment.objects.bulk_create(environments, ignore_conflicts=True)
    return len(rows)


def log_lines_delete_old(*, now: dt.datetime | None = None, batch: int = 10_000) -> int:
    """Delete output older than LOG_RETENTION_DAYS, a batch at a time."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(days=settings.LOG_RETENTION_DAYS)
    deleted = 0
    while True:
        ids = list(LogLine.objects.filter(at__lt=cutoff).values_list("id", flat=True)[:batch])
        if not ids:
            return deleted
        deleted += LogLine.objects.filter(pk__in=ids).delete()[0]


# --- infrastructure events ---------------------------------------------------------------


@transaction.atomic
def spot_interruption_handle(*, node_id: int, notice: dict) -> list[int]:
    """AWS will reclaim this node: its jobs checkpoint and stop (PREEMPTING), then requeue.

    The agent has already signalled the processes; here the jobs follow. Returns their ids.
    """
    job_ids = set(
        Run.objects.filter(node_id=node_id, state__in=OPEN_RUN_STATES).values_list(
            "job_id", flat=True
        )
    )
    jobs = list(
        Job.objects.select_for_update()
        .filter(pk__in=job_ids, state__in=STARTED_STATES | {J.PROVISIONING})
        .order_by("pk")
    )
    when = str((notice or {}).get("time", ""))[:40]
    for job in jobs:
        if job.state == J.PROVISIONING:
            _requeue(job, f"{SPOT_REASON} for its node ({when})")
        else:
            _transition(
                job, J.PREEMPTING, f"spot interruption notice ({when}): checkpoint, then stop"
            )
    return [job.pk for job in jobs]


# An agent lists a run from the moment it starts it, but says "running" through its outbox,
# which a heartbeat can overtake; and a heartbeat can land late (the agent gives up on it
# after 10 s). A run that started less than this before a heartbeat is not judged by it.
AGENT_REPORT_LAG_S = 15
NO_LONGER_RUN = "the node's agent no longer runs it"


def runs_reconcile_with_agents() -> list[int]:
    """Running runs that their node's newest heartbeat does not list are lost, and their
    jobs follow (requeued by the usual rules). Returns the runs lost."""
    running = list(
        Run.objects.filter(state=R.RUNNING, started_at__isnull=False).values_list(
            "id", "node_id", "started_at"
        )
    )
    if not running:
        return []
    held = agent_runs_held(node_ids=sorted({node_id for _, node_id, _ in running}))
    margin = dt.timedelta(seconds=AGENT_REPORT_LAG_S)
    missing = []
    for run_id, node_id, started_at in running:
        if node_id not in held:
            continue  # an agent that does not list its runs: nothing to judge by
        heard_at, have = held[node_id]
        if run_id not in have and started_at < heard_at - margin:
            missing.append(run_id)
    return [run_id for run_id in missing if _run_lose(run_id)]


@transaction.atomic
def _run_lose(run_id: int) -> bool:
    run = Run.objects.select_for_update().filter(pk=run_id, state=R.RUNNING).first()
    if run is None:
        return False  # its end was reported meanwhile
    now = timezone.now()
    run.state, run.reason, run.ended_at = R.LOST, NO_LONGER_RUN, now
    run.save(update_fields=["state", "reason", "ended_at"])
    _job_follows(run.job_id, changed=run)
    allocations_runs_ended(allocation_ids=[run.allocation_id], now=now)
    return True


def jobs_on_lost_nodes(*, node_ids: list[int]) -> list[int]:
    """Nodes are DOWN (or gone): their runs are lost and their jobs requeued."""
    if not node_ids:
        return []
    requeued = []
    job_ids = set(
        Run.objects.filter(node_id__in=node_ids, state__in=OPEN_RUN_STATES).values_list(
            "job_id", flat=True
        )
    ) | set(
        Allocation.objects.filter(node_id__in=node_ids, ended_at__isnull=True).values_list(
            "job_id", flat=True
        )
    )
    for job_id in sorted(job_ids):
        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=job_id)
            lost = Run.objects.filter(job=job, node_id__in=node_ids, state__in=OPEN_RUN_STATES)
            allocations = list(lost.values_list("allocation_id", flat=True))
            found = list(lost)
            lost.update(state=R.LOST, reason="node lost", ended_at=timezone.now())
            for run in found:
                run.state, run.reason = R.LOST, "node lost"
            _late_cause_note(job, found)
            if job.state in FINISHED_STATES or job.state in (J.PENDING, J.HELD):
                # The node is gone, and its processes with it.
                allocations_runs_ended(allocation_ids=allocations, now=timezone.now())
                continue
            held = Allocation.objects.filter(job=job, node_id__in=node_ids).values_list("node_id")
            names = ", ".join(sorted(node_names(node_ids=held).values()))
            _requeue(job, f"node {names or 'lost'} lost")
            requeued.append(job_id)
    return requeued


def jobs_on_down_nodes() -> list[int]:
    """Jobs holding or running on nodes that are DOWN or gone: requeue them (a sweep)."""
    lost = list(
        Allocation.objects.filter(
            ended_at__isnull=True, node__state__in={NodeState.DOWN} | GONE_STATES
        )
        .values_list("node_id", flat=True)
        .distinct()
    )
    return jobs_on_lost_nodes(node_ids=lost)


def jobs_admitted_redrive(*, now: dt.datetime | None = None, dispatch=None) -> int:
    """Dispatch the jobs placed more than DISPATCH_REDRIVE_S ago and still ADMITTED: their
    dispatch message was lost, or the worker died before it wrote their plans (a broker
    would redeliver it only after its visibility timeout, an hour on Redis). Dispatching a
    job twice skips it the second time. Returns how many were dispatched."""
    now = now or timezone.now()
    cutoff = now - dt.timedelta(seconds=settings.DISPATCH_REDRIVE_S)
    dispatched = 0
    for job_id in (
        Job.objects.live()
        .filter(state=J.ADMITTED, state_changed_at__lt=cutoff)
        .values_list("id", flat=True)
    ):
        if dispatch is not None:
            dispatched += bool(dispatch(job_id))
        elif job_dispatch(job_id=job_id) is not None:
            dispatched += 1
    return dispatched


def jobs_stuck_redrive(*, now: dt.datetime | None = None, dispatch=None) -> dict[str, int]:
    """Jobs whose plans no agent started in time, and jobs past their time limit.

    A reconcile sweep, since broker redelivery alone would not notice either. `dispatch`
    (job id → dispatched or not) is how admitted jobs are dispatched: the jobs.reconcile
    task hands in the one that chooses their checkpoint to resume from.
    """
    now = now or timezone.now()
    counts = {"requeued": 0, "dispatched": 0, "timed_out": 0}
    start_cutoff = now - dt.timedelta(seconds=settings.JOB_START_TIMEOUT_S)
    for job in Job.objects.live().filter(
        state__in=(J.PROVISIONING, J.STARTING), state_changed_at__lt=start_cutoff
    ):
        with transaction.atomic():
            locked = Job.objects.select_for_update().get(pk=job.pk)
            if locked.state in (J.PROVISIONING, J.STARTING):
                _requeue(locked, f"not started within {settings.JOB_START_TIMEOUT_S}s")
                counts["requeued"] += 1
    counts["dispatched"] = jobs_admitted_redrive(now=now, dispatch=dispatch)
    for job in Job.objects.live().filter(state=J.RUNNING, started_at__isnull=False):
        if job.started_at + dt.timedelta(seconds=job.time_limit_s) < now:
            with transaction.atomic():
                locked = Job.objects.select_for_update().get(pk=job.pk)
                if locked.state == J.RUNNING:
                    _transition(locked, J.STOPPING, f"time limit of {job.time_limit_s}s reached")
                    counts["timed_out"] += 1
    return counts
