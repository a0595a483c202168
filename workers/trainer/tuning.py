"""An NCCL tuning run on one node: the collective benchmark once per candidate and round.

    python3 -m workers.trainer.tuning --plan tuning.json

The node agent runs this same command on every node of a tuning job; the control plane's
environment says which node this is (CONTROLPLANE_NODE_RANK of CONTROLPLANE_NNODES, with
CONTROLPLANE_GPUS_PER_NODE processes each) and where the rendezvous is (MASTER_ADDR,
MASTER_PORT). The plan, written by the control plane:

    {"rounds": 2, "order": [[1, 0, 2], [2, 1, 0]],
     "candidates": [{"index": 0, "env": {"NCCL_ALGO": "Ring"}}, ...],
     "ops": ["all_reduce"], "sizes": "1K:1G", "warmup": 5, "iters": 20, "dtype": "bfloat16"}

Candidate 0 is the baseline; each candidate's env is its whole NCCL environment. For each
round r, in the order the plan gives (shuffled by the control plane, so that a slow drift in
the fabric does not favour whoever runs first), every candidate i gets its own torchrun of
workers.trainer.collectives, labelled candidate=i,round=r, with rendezvous id
<job uuid>-r<r>-c<i>. NCCL reads most of its settings once per process, so each launch is a
fresh set of processes, whose environment is this one with every variable that any
candidate names removed and candidate i's added: one candidate's settings never reach the
next.

Node rank 0 prints, besides the benchmark's own events (passed through line by line):

    {"event": "tuning_start", "rounds", "candidates", "launches"}
    {"event": "tuning_launch", "round", "candidate", "done", "of", "rc", "elapsed_s"}
    {"event": "tuning_end", "launches", "failed", "elapsed_s"}

torchrun exits 1 when any worker failed, whatever the worker's own code: the benchmark's
"a result was wrong" and a candidate that breaks NCCL alike. Such a launch is recorded (its
rc) and the run goes on; the control plane disqualifies the candidate. Any other failure
(torchrun killed, bad arguments) stops the run with that exit code. SIGTERM or SIGINT goes
on to the running launch; after at most 30 s (then SIGKILL) the driver exits 143.
Exits 2 on a bad plan or environment, 0 when every launch ran.

Standard library only: the benchmark's processes import torch, this one need not.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from workers.trainer.collectives import DTYPES, parse_ops, parse_sizes

PLAN_FIELDS = {"rounds", "order", "candidates", "ops", "sizes", "warmup", "iters"}
PLAN_OPTIONAL = {"dtype"}
ENVIRONMENT = (
    "CONTROLPLANE_NODE_RANK",
    "CONTROLPLANE_NNODES",
    "CONTROLPLANE_GPUS_PER_NODE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CONTROLPLANE_JOB_UUID",
)
RESULT_WRONG = 1  # torchrun's code for any failed worker
STOP_GRACE_S = 30
STOPPED = 128 + signal.SIGTERM


class PlanError(ValueError):
    """The plan or the environment cannot be run as given."""


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def plan_check(plan) -> dict:
    """The plan, if every field is as the control plane writes it; else PlanError."""
    if not isinstance(plan, dict):
        raise PlanError("the plan is not a JSON object")
    missing, unknown = PLAN_FIELDS - plan.keys(), plan.keys() - PLAN_FIELDS - PLAN_OPTIONAL
    if missing or unknown:
        raise PlanError(f"plan fields missing: {sorted(missing)}, unknown: {sorted(unknown)}")
    rounds, candidates, order = plan["rounds"], plan["candidates"], plan["order"]
    if not _integer(rounds) or rounds < 1:
        raise PlanError(f"rounds must be a whole number, 1 or more, not {rounds!r}")
    if not isinstance(candidates, list) or not candidates:
        raise PlanError("candidates must be a non-empty list")
    for position, candidate in enumerate(candidates):
        if not isinstance(candidate, dict) or candidate.keys() != {"index", "env"}:
            raise PlanError(f"candidate {position}: must be exactly {{'index', 'env'}}")
        if candidate["index"] != position or not _integer(candidate["index"]):
            raise PlanError(f"candidate {position}: index {candidate['index']!r} out of place")
        env = candidate["env"]
        if not isinstance(env, dict) or not all(
            isinstance(name, str)
            and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
            and isinstance(value, str)
            for name, value in env.items()
        ):
            raise PlanError(f"candidate {position}: env must map variable names to strings")
    indices = list(range(len(candidates)))
    if not isinstance(order, list) or len(order) != rounds:
        raise PlanError(f"order must list the candidates of each of the {rounds} rounds")
    for r, launches in enumerate(order):
        if not isinstance(launches, list) or not all(_integer(i) for i in launches):
            raise PlanError(f"order[{r}] is not a list of candidate indices")
        if sorted(launches) != indices:
            raise PlanError(f"order[{r}] = {launches} is not a permutation of {indices}")
    ops, sizes = plan["ops"], plan["sizes"]
    if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
        raise PlanError("ops must be a list of operation names")
    if isinstance(sizes, list) and sizes and all(isinstance(s, (str, int)) for s in sizes):
        sizes = ",".join(map(str, sizes))
    if not isinstance(sizes, str):
        raise PlanError("sizes must be MIN:MAX or a non-empty list of sizes")
    try:
        parse_ops(",".join(ops))
        if not parse_sizes(sizes):
            raise ValueError("no sizes")
    except ValueError as error:
        raise PlanError(str(error)) from None
    if not _integer(plan["warmup"]) or plan["warmup"] < 0:
        raise PlanError("warmup must be a whole number, 0 or more")
    if not _integer(plan["iters"]) or plan["iters"] < 1:
        raise PlanError("iters must be a whole number, 1 or more")
    if plan.get("dtype", "float32") not in DTYPES:
        raise PlanError(f"dtype must be one of {', '.join(DTYPES)}")
    return {**plan, "ops": ",".join(ops), "sizes": sizes}


def node_of(environ: Mapping[str, str]) -> dict:
    """What the control plane's environment says about this node and the rendezvous."""
    missing = [name for name in ENVIRONMENT if not environ.get(name)]
    if missing:
        raise PlanError(f"not set in the environment: {', '.join(missing)}")
    numbers = {}
    for name in ("CONTROLPLANE_NODE_RANK", "CONTROLPLANE_NNODES", "CONTROLPLANE_GPUS_PER_NODE"):
        if not environ[name].isdigit():
            raise PlanError(f"{name}={environ[name]!r} is not a whole number")
        numbers[name] = int(environ[name])
    rank, nnodes = numbers["CONTROLPLANE_NODE_RANK"], numbers["CONTROLPLANE_NNODES"]
    if not rank < nnodes or not numbers["CONTROLPLANE_GPUS_PER_NODE"]:
        raise PlanError(f"node rank {rank} of {nnodes} nodes, with no processes, cannot run")
    return {
        "rank": rank,
        "nnodes": nnodes,
        "nproc": numbers["CONTROLPLANE_GPUS_PER_NODE"],
        "endpoint": f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
        "job": environ["CONTROLPLANE_JOB_UUID"],
    }


def launch_env(base: Mapping[str, str], candidates: list[dict], index: int) -> dict[str, str]:
    """`base` without any variable that some candidate sets, with candidate `index`'s added."""
    named = {name for candidate in candidates for name in candidate["env"]}
    return {
        **{name: value for name, value in base.items() if name not in named},
        **candidates[index]["env"],
    }


def launch_argv(plan: dict, node: dict, *, round_: int, candidate: int) -> list[str]:
    """torchrun of the benchmark, with the flags the control plane gives the trainer's
    (apps.jobs.dispatch.trainer_argv): node 0 hosts the rendezvous store."""
    return [
        sys.executable or "python3",
        "-m",
        "torch.distributed.run",
        f"--nnodes={node['nnodes']}",
        f"--nproc-per-node={node['nproc']}",
        f"--node-rank={node['rank']}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={node['endpoint']}",
        f"--rdzv-id={node['job']}-r{round_}-c{candidate}",
        f"--rdzv-conf=is_host={int(node['rank'] == 0)}",
        "-m",
        "workers.trainer.collectives",
        f"--sizes={plan['sizes']}",
        f"--ops={plan['ops']}",
        f"--warmup={plan['warmup']}",
        f"--iters={plan['iters']}",
        f"--dtype={plan.get('dtype', 'float32')}",
        f"--label=candidate={candidate},round={round_}",
    ]


def emit(event: dict) -> None:
    sys.stdout.buffer.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")
    sys.stdout.buffer.flush()


class Driver:
    """The launches one after another, and the stop signal handed on to the running one."""

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None
        self.kill_at = float("inf")

    def stop(self, signum: int, _frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = signum
            self.kill_at = time.monotonic() + STOP_GRACE_S
        self._signal_child(signum)

    def _signal_child(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signum)

    def launch(self, argv: list[str], env: dict[str, str]) -> int:
        """Run one launch to its end; its exit code as a shell reports it (128 + a signal)."""
        # A process group of its own: the stop goes to torchrun and its workers together.
        self.child = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, process_group=0
        )
        relay = threading.Thread(target=_relay, args=(self.child.stdout,), daemon=True)
        relay.start()
        if self.stop_signal is not None:  # a signal came while it started
            self._signal_child(self.stop_signal)
        while True:
            try:
                code = self.child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > self.kill_at:
                    self._signal_child(signal.SIGKILL)
        relay.join(timeout=5)
        return 128 - code if code < 0 else code


def _relay(stream) -> None:
    # Line by line as they come, so the agent relays each event when it happens.
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
    stream.close()


def run(plan: dict, node: dict, environ: Mapping[str, str], driver: Driver) -> int:
    began = time.monotonic()
    leader = node["rank"] == 0
    candidates = plan["candidates"]
    launches = [(r, i) for r, order in enumerate(plan["order"]) for i in order]
    if leader:
        emit(
            {
                "event": "tuning_start",
                "rounds": plan["rounds"],
                "candidates": len(candidates),
                "launches": len(launches),
            }
        )
    failed = 0
    for done, (round_, candidate) in enumerate(launches, start=1):
        started = time.monotonic()
        if driver.stop_signal is None:
            code = driver.launch(
                launch_argv(plan, node, round_=round_, candidate=candidate),
                launch_env(environ, candidates, candidate),
            )
        if driver.stop_signal is not None:
            name = signal.Signals(driver.stop_signal).name
            print(f"tuning: stopped by {name} during launch {done}", file=sys.stderr)
            return STOPPED
        if leader:
            emit(
                {
                    "event": "tuning_launch",
                    "round": round_,
                    "candidate": candidate,
                    "done": done,
                    "of": len(launches),
                    "rc": code,
                    "elapsed_s": round(time.monotonic() - started, 3),
                }
            )
        if code not in (0, RESULT_WRONG):
            print(f"tuning: launch {done} exited {code}; stopping", file=sys.stderr)
            return code
        failed += code != 0
    if leader:
        emit(
            {
                "event": "tuning_end",
                "launches": len(launches),
                "failed": failed,
                "elapsed_s": round(time.monotonic() - began, 3),
            }
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m workers.trainer.tuning", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--plan", required=True, type=Path, help="the tuning plan (JSON)")
    args = parser.parse_args(argv)
    try:
        plan = plan_check(json.loads(args.plan.read_text()))
    except (OSError, ValueError) as error:  # PlanError and JSONDecodeError are ValueErrors
        print(f"tuning: bad plan {args.plan}: {error}", file=sys.stderr)
        return 2
    try:
        node = node_of(os.environ)
    except PlanError as error:
        print(f"tuning: cannot run here: {error}", file=sys.stderr)
        return 2
    driver = Driver()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, driver.stop)
    return run(plan, node, os.environ, driver)


if __name__ == "__main__":
    sys.exit(main())
