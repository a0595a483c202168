"""The tuning driver: its plan checks and launch environments by hand, its loop over stand-in
launches, and a whole run of real torchrun launches (gloo on the CPU) on a node of two.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from workers.trainer import tuning

ROOT = Path(__file__).resolve().parents[3]


def a_plan(**changes) -> dict:
    return {
        "rounds": 2,
        "order": [[1, 0], [0, 1]],
        "candidates": [
            {"index": 0, "env": {"NCCL_DEBUG": "WARN"}},
            {"index": 1, "env": {"NCCL_DEBUG": "INFO", "NCCL_TUNING_TEST_MARK": "one"}},
        ],
        "ops": ["all_reduce"],
        "sizes": "1K:4K",
        "warmup": 1,
        "iters": 2,
        **changes,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(**more) -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU, also on a machine with GPUs
        "PYTHONPATH": str(ROOT),
        "CONTROLPLANE_NODE_RANK": "0",
        "CONTROLPLANE_NNODES": "1",
        "CONTROLPLANE_GPUS_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "CONTROLPLANE_JOB_UUID": str(uuid.uuid4()),
        **more,
    }


def driver(plan, tmp_path, env=None, **popen) -> subprocess.Popen:
    path = tmp_path / "tuning.json"
    path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    return subprocess.Popen(
        [sys.executable, "-m", "workers.trainer.tuning", "--plan", str(path)],
        env=env or node_env(),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def events_in(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"order": [[1, 0]]}, "each of the 2 rounds"),
        ({"order": [[1, 0], [0, 0]]}, "not a permutation"),
        ({"order": [[1, 0], [0, 2]]}, "not a permutation"),  # no candidate 2
        ({"order": [[1, 0], [0, True]]}, "not a list of candidate indices"),
        ({"candidates": [{"index": 1, "env": {}}, {"index": 0, "env": {}}]}, "out of place"),
        ({"candidates": [{"index": 0, "env": {"NCCL_ALGO": 1}}]}, "variable names to strings"),
        ({"candidates": [{"index": 0}]}, "exactly"),
        ({"candidates": []}, "non-empty"),
        ({"rounds": 0, "order": []}, "rounds must be"),
        ({"ops": ["all_reduce", "broadcast"]}, "broadcast"),
        ({"ops": "all_reduce"}, "ops must be a list"),
        ({"sizes": "4K:1K"}, "above the largest"),
        ({"sizes": []}, "sizes must be"),
        ({"iters": 0}, "iters must be"),
        ({"warmup": -1}, "warmup must be"),
        ({"dtype": "int8"}, "dtype must be"),
        ({"extra": 1}, "unknown: ['extra']"),
        ({"iters": None, "warmup": None}, None),  # missing below
    ],
)
def test_a_bad_plan_is_refused_with_its_reason(change, says):
    plan = a_plan(**change)
    if says is None:
        del plan["iters"], plan["warmup"]
        says = "missing: ['iters', 'warmup']"
    with pytest.raises(tuning.PlanError) as refused:
        tuning.plan_check(plan)
    assert says in str(refused.value)


def test_a_good_plan_reads_its_sizes_and_ops_for_the_benchmark():
    plan = tuning.plan_check(a_plan(sizes=["1K", 4096], ops=["all_reduce", "all_gather"]))
    assert plan["sizes"] == "1K,4096" and plan["ops"] == "all_reduce,all_gather"
    assert tuning.plan_check(a_plan(dtype="bfloat16"))["dtype"] == "bfloat16"


def test_the_driver_exits_2_on_a_bad_plan_or_environment(tmp_path):
    for plan, says in [
        ("{not json", "bad plan"),
        (a_plan(order=[[0, 1], [1, 1]]), "order[1] = [1, 1] is not a permutation of [0, 1]"),
    ]:
        done = driver(plan, tmp_path)
        out, err = done.communicate(timeout=30)
        assert done.returncode == 2 and says in err and out == ""
    env = node_env()
    del env["MASTER_PORT"]
    done = driver(a_plan(), tmp_path, env=env)
    _, err = done.communicate(timeout=30)
    assert done.returncode == 2 and "MASTER_PORT" in err


def test_a_launch_gets_its_candidates_environment_and_no_other():
    candidates = a_plan()["candidates"]
    base = {"PATH": "/bin", "NCCL_DEBUG": "TRACE", "NCCL_TUNING_TEST_MARK": "x", "NCCL_IB_HCA": "a"}
    assert tuning.launch_env(base, candidates, 0) == {
        "PATH": "/bin",
        "NCCL_IB_HCA": "a",  # no candidate names it: the job's own setting stays
        "NCCL_DEBUG": "WARN",
    }
    assert tuning.launch_env(base, candidates, 1) == {
        "PATH": "/bin",
        "NCCL_IB_HCA": "a",
        "NCCL_DEBUG": "INFO",
        "NCCL_TUNING_TEST_MARK": "one",
    }


def test_launches_follow_the_trainers_torchrun_flags():
    node = {"rank": 1, "nnodes": 2, "nproc": 8, "endpoint": "10.0.0.1:29500", "job": "u"}
    plan = tuning.plan_check(a_plan())
    argv = tuning.launch_argv(plan, node, round_=1, candidate=0)
    assert argv[1:11] == [
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--node-rank=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29500",
        "--rdzv-id=u-r1-c0",
        "--rdzv-conf=is_host=0",
        "-m",
    ]
    assert argv[11:] == [
        "workers.trainer.collectives",
        "--sizes=1K:4K",
        "--ops=all_reduce",
        "--warmup=1",
        "--iters=2",
        "--dtype=float32",
        "--label=candidate=0,round=1",
    ]


def stand_in_launches(monkeypatch, codes: dict[tuple[int, int], int]):
    """Launches that print a line and exit with codes[(round, candidate)]."""

    def argv(plan, node, *, round_, candidate):
        code = codes.get((round_, candidate), 0)
        return [sys.executable, "-c", f"print('launch r{round_} c{candidate}'); exit({code})"]

    monkeypatch.setattr(tuning, "launch_argv", argv)


def loop(plan, capfd, *, rank=0):
    node = {"rank": rank, "nnodes": 2, "nproc": 1, "endpoint": "127.0.0.1:1", "job": "u"}
    code = tuning.run(tuning.plan_check(plan), node, dict(os.environ), tuning.Driver())
    return code, capfd.readouterr().out.splitlines()


def test_a_launch_that_exits_1_is_recorded_and_the_run_goes_on(monkeypatch, capfd):
    stand_in_launches(monkeypatch, {(0, 0): 1})
    code, lines = loop(a_plan(), capfd)
    assert code == 0
    launches = [json.loads(line) for line in lines if '"tuning_launch"' in line]
    assert [(e["round"], e["candidate"], e["done"], e["rc"]) for e in launches] == [
        (0, 1, 1, 0),
        (0, 0, 2, 1),
        (1, 0, 3, 0),
        (1, 1, 4, 0),
    ]
    assert json.loads(lines[-1])["failed"] == 1
    assert lines[1] == "launch r0 c1"  # the launch's own output, before its event


def test_any_other_failure_stops_the_run_with_its_code(monkeypatch, capfd):
    stand_in_launches(monkeypatch, {(0, 0): 3})
    code, lines = loop(a_plan(), capfd)
    assert code == 3
    assert json.loads(lines[-1]) | {"elapsed_s": 0} == {
        "event": "tuning_launch",
        "round": 0,
        "candidate": 0,
        "done": 2,
        "of": 4,
        "rc": 3,
        "elapsed_s": 0,
    }


def test_only_node_rank_0_reports(monkeypatch, capfd):
    stand_in_launches(monkeypatch, {})
    code, lines = loop(a_plan(), capfd, rank=1)
    assert code == 0
    assert lines == ["launch r0 c1", "launch r0 c0", "launch r1 c0", "launch r1 c1"]


pytest.importorskip("torch")


@pytest.mark.slow
def test_a_tuning_run_on_a_node_of_two(tmp_path):
    plan = a_plan()
    env = node_env(NCCL_TUNING_TEST_MARK="driver", NCCL_SOCKET_NTHREADS="2")
    run = driver(plan, tmp_path, env=env)
    out, err = run.communicate(timeout=150)
    assert run.returncode == 0, out[-2000:] + err[-3000:]
    events = events_in(out)
    assert events[0] == {"event": "tuning_start", "rounds": 2, "candidates": 2, "launches": 4}
    end = events[-1]
    assert end["event"] == "tuning_end" and end["launches"] == 4 and end["failed"] == 0
    # Each launch's own events come before the driver's event for it.
    launches, current = [], []
    for event in events[1:-1]:
        if event["event"] == "tuning_launch":
            launches.append((event, current))
            current = []
        else:
            current.append(event)
    assert current == []
    order = [(0, 1), (0, 0), (1, 0), (1, 1)]
    assert [(e["round"], e["candidate"], e["done"], e["of"], e["rc"]) for e, _ in launches] == [
        (r, c, done, 4, 0) for done, (r, c) in enumerate(order, start=1)
    ]
    for (event, inner), (r, c) in zip(launches, order, strict=True):
        assert event["elapsed_s"] > 0
        kinds = [e["event"] for e in inner]
        assert kinds.count("env") == 2  # one from each rank
        benchmark = [e for e in inner if e["event"] != "env"]
        assert [e["event"] for e in benchmark] == [
            "collective_start",
            "collective",
            "collective",
            "collective",
            "collective_end",
        ]
        assert all(e["candidate"] == c and e["round"] == r for e in benchmark)
        assert benchmark[0]["world_size"] == 2 and benchmark[-1]["errors"] == 0
        for rank_env in (e["env"] for e in inner if e["event"] == "env"):
            # The candidate's settings, none of the other's, and the job's own kept.
            assert rank_env["NCCL_DEBUG"] == ("INFO" if c == 1 else "WARN")
            assert rank_env.get("NCCL_TUNING_TEST_MARK") == ("one" if c == 1 else None)
            assert rank_env["NCCL_SOCKET_NTHREADS"] == "2"


def running_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_text():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_sigterm_stops_the_running_launch_and_exits_143(tmp_path):
    env = node_env()
    job = env["CONTROLPLANE_JOB_UUID"]
    plan = a_plan(rounds=1, order=[[0, 1]], sizes="1K", iters=10**8)
    run = driver(plan, tmp_path, env=env)
    for line in run.stdout:  # the benchmark is under way
        if '"collective_start"' in line:
            break
    assert running_with(job)  # torchrun, with the job's rendezvous id
    began = time.monotonic()
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 143, err[-3000:]
    assert time.monotonic() - began < tuning.STOP_GRACE_S
    assert "stopped by SIGTERM" in err and "tuning_launch" not in out
    assert running_with(job) == []
