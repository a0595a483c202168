"""The trainer's memory model (workers/trainer/memory.py): its properties, and its rows
against what the GPU measured (bench/RESULTS.md, "Memory model"). No torch needed."""

import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.advisor import Row
from workers.trainer import memory
from workers.trainer.config import RunConfig, parse
from workers.trainer.presets import PRESETS

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "RESULTS.md"
SHARDED = ("parameters", "gradients", "optimizer")


def run(
    *,
    preset="1b",
    batch=8,
    seq_len=2048,
    ac="none",
    compile=False,
    layout=None,
    micro_batch=None,
    sizes=None,
) -> RunConfig:
    model = {"sizes": sizes} if sizes else {"preset": preset}
    return parse(
        {
            "model": model,
            "data": {"seq_len": seq_len},
            "schedule": {"global_batch": batch, "micro_batch": micro_batch},
            "activation_checkpointing": ac,
            "compile": compile,
            "layout": layout or {},
        }
    )


modes = st.sampled_from(["none", "selective", "full"])
compiled = st.booleans()
presets = st.sampled_from(["tiny", "small", "1b", "8b", "70b"])
gpu = st.booleans()


@given(preset=presets, ac=modes, compile=compiled, gpu=gpu, batch=st.integers(1, 63))
def test_memory_never_decreases_as_the_batch_grows(preset, ac, compile, gpu, batch):
    seq = min(2048, PRESETS[preset].max_seq_len)
    smaller = memory.estimate(
        run(preset=preset, batch=batch, seq_len=seq, ac=ac, compile=compile), gpu=gpu
    )
    larger = memory.estimate(
        run(preset=preset, batch=batch + 1, seq_len=seq, ac=ac, compile=compile), gpu=gpu
    )
    assert larger.total >= smaller.total
    assert larger.allocated >= smaller.allocated


@given(preset=presets, ac=modes, compile=compiled, seq=st.integers(16, 511))
def test_memory_never_decreases_as_the_sequence_grows(preset, ac, compile, seq):
    shorter = memory.estimate(run(preset=preset, batch=2, seq_len=seq, ac=ac, compile=compile))
    longer = memory.estimate(run(preset=preset, batch=2, seq_len=seq + 1, ac=ac, compile=compile))
    assert longer.total >= shorter.total


@given(
    ac=modes,
    compile=compiled,
    layers=st.integers(1, 40),
    width=st.sampled_from([128, 256, 512, 1024]),
    ffn=st.integers(1, 8),
    vocab=st.integers(256, 65536),
    grow=st.sampled_from(["layers", "dim", "ffn_dim", "vocab_size"]),
    layout=st.sampled_from([{}, {"dp_shard": 4}, {"dp_shard": 2, "tp": 2}, {"dp_replicate": 2}]),
)
def test_memory_never_decreases_as_the_model_grows(
    ac, compile, layers, width, ffn, vocab, grow, layout
):
    sizes = {
        "layers": layers,
        "dim": width,
        "heads": width // 32,
        "kv_heads": width // 64,
        "ffn_dim": ffn * width,
        "vocab_size": vocab,
        "max_seq_len": 1024,
    }
    bigger = dict(sizes)
    bigger[grow] = sizes[grow] * 2 if grow == "dim" else sizes[grow] + 1
    if grow == "dim":
        bigger["heads"], bigger["kv_heads"] = sizes["heads"] * 2, sizes["kv_heads"] * 2
    small = memory.estimate(
        run(sizes=sizes, batch=4, seq_len=512, ac=ac, compile=compile, layout=layout)
    )
    large = memory.estimate(
        run(sizes=bigger, batch=4, seq_len=512, ac=ac, compile=compile, layout=layout)
    )
    assert large.total >= small.total


@given(
    preset=presets,
    ac=modes,
    compile=compiled,
    replicate=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    shards=st.sampled_from([(2, 4), (4, 8), (2, 8), (8, 16)]),
)
def test_more_sharding_never_increases_the_sharded_parts(
    preset, ac, compile, replicate, tp, shards
):
    fewer, more = shards
    batch = 64  # divides every data-parallel width here
    seq = min(1024, PRESETS[preset].max_seq_len)

    def estimate(shard):
        layout = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp}
        config = run(preset=preset, batch=batch, seq_len=seq, ac=ac, compile=compile, layout=layout)
        return memory.estimate(config)

    before, after = estimate(fewer), estimate(more)
    # The rank's share of each state, not the peak's `gradients` line: that one counts the
    # gradients made by the peak, and more shards (fewer sequences a rank, so fewer
    # activations) can move the peak from the backward pass's start, where only the
    # head's exist, to its end, where all of this rank's share do.
    for line in SHARDED:
        assert after.states[line] <= before.states[line], line
    assert after.allocated <= before.allocated


@given(preset=presets, ac=modes, compile=compiled, gpu=gpu, batch=st.sampled_from([1, 4, 16]))
def test_the_lines_add_up_to_the_total(preset, ac, compile, gpu, batch):
    seq = min(2048, PRESETS[preset].max_seq_len)
    estimate = memory.estimate(
        run(preset=preset, batch=batch, seq_len=seq, ac=ac, compile=compile), gpu=gpu
    )
    assert set(estimate.lines) == set(memory.LINES)
    assert sum(estimate.lines.values()) == estimate.total
    assert estimate.allocated + estimate.lines["runtime"] == estimate.total
    figures = estimate.as_dict()
    assert sum(figures["lines"].values()) == pytest.approx(
        figures["total_gib"], abs=0.01 * len(memory.LINES)
    )
    assert all(value >= 0 for value in estimate.lines.values())


def test_a_pipeline_s_first_rank_holds_more_activations_than_one_stage_alone():
    one = memory.estimate(run(preset="8b", batch=16, layout={"pp": 4, "dp_shard": 2}))
    assert one.rank.startswith(("the first pipeline rank, at", "the last pipeline rank, at"))
    interleaved = parse(
        {
            "model": {"preset": "8b"},
            "schedule": {"global_batch": 16},
            "layout": {"pp": 4, "dp_shard": 2},
            "pipeline": {"schedule": "interleaved_1f1b", "stages_per_rank": 2},
        }
    )
    assert memory.estimate(interleaved).lines["activations"] > 0


def test_seventy_b_on_one_h100_does_not_fit_and_tiny_does():
    huge = memory.estimate(run(preset="70b", batch=1, ac="full"))
    assert huge.fit(memory.gpu_memory_gib("H100")) == "no"
    assert huge.total > 16 * PRESETS["70b"].parameters()  # 16 bytes a parameter, then more
    tiny = memory.estimate(run(preset="tiny", batch=8, seq_len=512))
    assert tiny.fit(memory.gpu_memory_gib("H100")) == "fits"


def test_tight_means_within_ten_percent_of_the_gpu():
    estimate = memory.Estimate({"parameters": int(75 * memory.GIB), "runtime": 0})
    assert estimate.fit(80) == "tight"
    assert estimate.fit(90) == "fits"
    assert estimate.fit(70) == "no"


def test_on_a_cpu_everything_is_fp32_and_no_weight_copies_are_made():
    config = run(preset="small", batch=4, seq_len=512)
    assert memory.estimate(config, gpu=False).lines["copies"] == 0
    assert memory.estimate(config, gpu=True).lines["copies"] > 0


def test_fsdp_on_one_gpu_keeps_bf16_activations():
    plain = run(preset="1b", batch=8)
    fsdp1 = replace(plain, kernels=replace(plain.kernels, single_gpu_fsdp=True))
    assert memory.estimate(fsdp1).lines["activations"] < memory.estimate(plain).lines["activations"]


# --- against the GPU -------------------------------------------------------------------------


def calibration_rows() -> tuple[list[tuple[str, float, float]], str]:
    """(row, predicted, measured) from bench/RESULTS.md's "Memory model" table, and its
    closing `advisor:` line."""
    text = RESULTS.read_text(encoding="utf-8")
    section = text.split("## Memory model", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"[a-z0-9]+/b\d+/s\d+/.+", cells[0].strip("`")):
            rows.append((cells[0].strip("`"), float(cells[1]), float(cells[2])))
    closing = re.search(r"advisor: rows=(\d+) max_abs_error_pct=([\d.]+)", section)
    return rows, closing.group(0) if closing else ""


def test_the_calibration_table_closes_with_its_figures():
    rows, closing = calibration_rows()
    assert rows
    worst = max(abs(predicted / measured - 1) * 100 for _, predicted, measured in rows)
    assert closing == f"advisor: rows={len(rows)} max_abs_error_pct={worst:.1f}"


def test_the_calibration_table_has_the_rows_the_issue_asks_for():
    rows, closing = calibration_rows()
    if len(rows) < 8:
        pytest.skip(
            f"bench/RESULTS.md holds {len(rows)} measured rows: the H200 calibration "
            "(make bench-advisor, issue 34) has not run yet"
        )
    names = [name for name, _, _ in rows]
    assert {n.split("/")[0] for n in names} >= {"small", "1b"}
    assert {n.split("/")[3] for n in names} == {"ac-none", "ac-selective", "ac-full"}
    assert {n.split("/")[4] for n in names} == {"compiled", "eager"}
    assert closing.startswith(f"advisor: rows={len(rows)} ")


def test_the_model_predicts_every_measured_row_within_ten_percent():
    rows, _ = calibration_rows()
    for name, _, measured in rows:
        predicted = memory.for_run(Row.parse(name).run_json(steps=1)).allocated / memory.GIB
        error = predicted / measured - 1
        assert abs(error) <= 0.10, f"{name}: predicted {predicted:.2f} GiB, measured {measured}"
