"""The collective benchmark: its bus-bandwidth factors and size parsing by hand, its result
checks on hand-built outputs, and whole runs under torchrun with gloo on the CPU.

The runs' figures mean nothing (processes sharing two cores); what they check is the
arithmetic of every event and that every result came back right.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.trainer import collectives
from workers.trainer.collectives import bus_factor, parse_ops, parse_size, parse_sizes

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("n", "all_reduce", "others"),
    [(1, 0.0, 0.0), (2, 1.0, 0.5), (4, 1.5, 0.75), (8, 1.75, 0.875)],
)
def test_bus_factors_are_nccl_tests_corrections(n, all_reduce, others):
    assert bus_factor("all_reduce", n) == all_reduce  # 2(n-1)/n
    for op in ("all_gather", "reduce_scatter", "all_to_all"):  # (n-1)/n
        assert bus_factor(op, n) == others
    assert bus_factor("copy", n) == 1.0


def test_bandwidths_count_bytes_over_seconds_in_gigabytes():
    # 1 GiB all-reduced in 10 ms over 8 ranks: 107.37 GB/s, bus 1.75 times that.
    algbw, busbw = collectives.bandwidths("all_reduce", size=2**30, seconds=0.01, world_size=8)
    assert algbw == pytest.approx(107.3741824)
    assert busbw == pytest.approx(107.3741824 * 1.75)


def test_sizes_parse_ranges_lists_and_units():
    assert parse_size("4096") == 4096
    assert parse_size("1K") == 1024
    assert parse_size("16m") == 16 * 2**20
    assert parse_size("1G") == 2**30
    assert parse_size("64KiB") == 65536
    assert parse_sizes("1K:64K") == [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    assert parse_sizes("1K:1G")[0] == 1024 and parse_sizes("1K:1G")[-1] == 2**30
    assert len(parse_sizes("1K:1G")) == 21
    assert parse_sizes("1K:3K") == [1024, 2048]  # doubling stops at the largest
    assert parse_sizes("4K,1K,1M") == [4096, 1024, 2**20]
    for bad in ("", "0", "1X", "K", "-4K", "2K:1K"):
        with pytest.raises(ValueError):
            parse_sizes(bad) or parse_size(bad)


def test_ops_parse():
    assert parse_ops("all") == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    assert parse_ops("all_to_all, copy") == ["all_to_all", "copy"]
    with pytest.raises(ValueError, match="broadcast"):
        parse_ops("all_reduce,broadcast")


def test_labels_parse_to_integers_where_they_can():
    assert collectives.parse_labels("candidate=3,round=0,fabric=ib,shift=-2,tag=3a") == {
        "candidate": 3,
        "round": 0,
        "fabric": "ib",
        "shift": -2,
        "tag": "3a",
    }
    for bad in ("candidate", "Candidate=1", "run-id=2", "=1", "op=all_reduce", "event=x"):
        with pytest.raises(ValueError):
            collectives.parse_labels(bad)
    assert collectives.parse_args([]).label == {}
    with pytest.raises(SystemExit) as refused:
        collectives.parse_args(["--label", "round"])
    assert refused.value.code == 2


def test_chunked_operations_round_to_whole_chunks():
    elements = collectives.elements_for
    assert elements("all_reduce", 1000, element_size=4, world_size=3) == 250
    assert elements("all_gather", 1000, element_size=4, world_size=3) == 249
    assert elements("all_to_all", 1024, element_size=4, world_size=4) == 256
    assert elements("reduce_scatter", 4, element_size=4, world_size=8) == 8  # one per rank


torch = pytest.importorskip("torch")


def case_on(op, *, rank, n, size=64):
    world = collectives.World(rank=rank, size=n, device=torch.device("cpu"), backend="gloo")
    return collectives.Case(op, size, world=world, dtype=torch.float32)


def test_results_are_checked_against_the_hand_computation():
    # Rank 1 of 4, float32: v(s) = s + 1, c(j) = j.
    gather = case_on("all_gather", rank=1, n=4)
    assert gather.input.tolist() == [2.0] * 4  # 16 elements gathered: 4 from each rank
    gather.output.copy_(torch.tensor([1.0] * 4 + [2.0] * 4 + [3.0] * 4 + [4.0] * 4))
    assert gather.errors() == 0
    gather.output[5] = 3.0
    assert gather.errors() == 1

    scatter = case_on("reduce_scatter", rank=1, n=4)
    assert scatter.input.view(4, -1)[:, 0].tolist() == [2.0, 3.0, 4.0, 5.0]  # v(1) + c(j)
    scatter.output.fill_(1 + 2 + 3 + 4 + 4 * 1)  # every rank's chunk 1
    assert scatter.errors() == 0
    scatter.output.fill_(1 + 2 + 3 + 4 + 4 * 2)  # chunk 2 landed here
    assert scatter.errors() == 4

    exchange = case_on("all_to_all", rank=1, n=4)
    exchange.output.view(4, -1).copy_(torch.tensor([[1.0 + 1], [2 + 1], [3 + 1], [4 + 1]]))
    assert exchange.errors() == 0
    exchange.output.view(4, -1)[2] = 3 + 2  # rank 2's chunk for rank 2
    assert exchange.errors() == 4

    reduce = case_on("all_reduce", rank=3, n=4)
    reduce.prepare()
    assert reduce.buffer.tolist() == [4.0] * 16
    reduce.buffer.fill_(10.0)  # 1 + 2 + 3 + 4
    assert reduce.errors() == 0


def test_bfloat16_values_stay_exact_in_big_worlds():
    m = collectives.exact_modulus(torch.bfloat16, 64)
    # Every partial sum of v(s) + c(j) over 64 ranks is an integer of at most 256.
    assert 64 * (m + m) <= 256
    assert collectives.exact_modulus(torch.float32, 8) == 8


def benchmark(nproc: int, *args: str) -> tuple[list[dict], str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",  # gloo on the CPU, also on a machine with GPUs
        "PYTHONPATH": str(ROOT),
    }
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone"]
    if nproc > 1:
        launcher.append(f"--nproc-per-node={nproc}")
    done = subprocess.run(
        [sys.executable, *launcher, "-m", "workers.trainer.collectives", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return events, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_on_the_cpu_reports_every_measurement(nproc):
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    sizes = [2**k for k in range(10, 17)]  # 1K .. 64K
    events, stderr = benchmark(
        nproc, "--sizes", "1K:64K", "--ops", ",".join(ops), "--warmup", "1", "--iters", "3"
    )
    assert len([e for e in events if e["event"] == "env"]) == nproc  # one from every rank
    (start,) = [e for e in events if e["event"] == "collective_start"]
    assert start["world_size"] == nproc and start["backend"] == "gloo"
    assert start["device"] == "cpu" and start["sizes"] == sizes and start["ops"] == ops
    measured = [e for e in events if e["event"] == "collective"]  # rank 0's only
    assert [(e["op"], e["bytes"]) for e in measured] == [(op, s) for op in ops for s in sizes]
    for event in measured:
        assert event["errors"] == 0 and event["iters"] == 3
        assert event["world_size"] == nproc and event["dtype"] == "float32"
        assert 0 < event["time_us"] <= event["time_us_max"]
        algbw = event["bytes"] / (event["time_us"] / 1e6) / 1e9
        assert event["algbw_gbps"] == pytest.approx(algbw, rel=1e-3, abs=1e-6)
        factor = 2 * (nproc - 1) / nproc if event["op"] == "all_reduce" else (nproc - 1) / nproc
        assert event["busbw_gbps"] == pytest.approx(event["algbw_gbps"] * factor, abs=2e-6)
    (end,) = [e for e in events if e["event"] == "collective_end"]
    assert end["measurements"] == len(measured) and end["errors"] == 0
    # A label may not take a field's name: the list of them is whole.
    assert all(e.keys() <= collectives.EVENT_FIELDS for e in events if e["event"] != "env")
    assert "deprecated" not in stderr


@pytest.mark.slow
def test_a_world_of_one_also_times_a_local_copy():
    events, _ = benchmark(1, "--sizes", "1K,4K", "--ops", "all_reduce", "--iters", "2")
    measured = [
        (e["op"], e["bytes"], e["busbw_gbps"]) for e in events if e["event"] == "collective"
    ]
    assert [(op, size) for op, size, _ in measured] == [
        ("all_reduce", 1024),
        ("all_reduce", 4096),
        ("copy", 1024),
        ("copy", 4096),
    ]
    assert [busbw for op, _, busbw in measured if op == "all_reduce"] == [0.0, 0.0]
    copies = [e for e in events if e.get("op") == "copy"]
    assert all(e["busbw_gbps"] == e["algbw_gbps"] > 0 and e["errors"] == 0 for e in copies)
