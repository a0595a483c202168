"""The memory model (workers/trainer/memory.py) against the trainer's measured peak on one GPU.

Each calibration row trains one configuration for a few steps with
`python -m workers.trainer` as the control plane starts it (a world of one),
reads the most memory its steps allocated (`peak_mem_gib`, torch's
max_memory_allocated, from the trainer's step lines) and sets it beside the
model's prediction of the same figure (every line but the runtime's, which
the allocator does not count):

    advisor[<row>]: {"predicted_gib": …, "measured_gib": …, "error_pct": …, "lines": {…}}
    advisor: rows=<n> max_abs_error_pct=<x>

The rows cover the presets `small`, `1b` and `8b`, batches 1 to 16, every
activation-checkpointing mode, compile on and off, a micro batch, a shorter
sequence and the one-GPU FSDP policy. Most train --parallel at a time, as
many as --gib of predicted memory allows (each process's peak is its own),
and report no speed; the last few (ALONE) train one
at a time, for 8 + 20 steps at least, and report tokens/s and MFU too
(apps/jobs/mfu.json takes those).
Without a GPU there is nothing to measure: it prints the model's predictions
for the same rows and says so. `--out FILE` keeps the rows as JSON.
"""

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Row:
    preset: str
    batch: int
    ac: str = "none"
    compile: bool = False
    seq_len: int = 2048
    micro_batch: int | None = None
    fsdp1: bool = False  # one GPU under FSDP2's bf16 policy instead of autocast

    @property
    def name(self) -> str:
        parts = [self.preset, f"b{self.batch}", f"s{self.seq_len}", f"ac-{self.ac}"]
        parts.append("compiled" if self.compile else "eager")
        if self.micro_batch:
            parts.append(f"mb{self.micro_batch}")
        if self.fsdp1:
            parts.append("fsdp1")
        return "/".join(parts)

    @classmethod
    def parse(cls, name: str) -> "Row":
        """The row a name stands for (`1b/b8/s2048/ac-none/compiled/mb4/fsdp1`)."""
        preset, batch, seq, ac, mode, *rest = name.split("/")
        micro = next((int(p[2:]) for p in rest if p.startswith("mb")), None)
        return cls(
            preset=preset,
            batch=int(batch[1:]),
            ac=ac.removeprefix("ac-"),
            compile=mode == "compiled",
            seq_len=int(seq[1:]),
            micro_batch=micro,
            fsdp1="fsdp1" in rest,
        )

    def run_json(self, *, steps: int) -> dict:
        return {
            "model": {"preset": self.preset},
            "data": {"dataset": "synthetic", "seq_len": self.seq_len},
            "schedule": {
                "steps": steps,
                "global_batch": self.batch,
                "micro_batch": self.micro_batch,
            },
            "precision": "bf16",
            "activation_checkpointing": self.ac,
            "compile": self.compile,
            "kernels": {"single_gpu_fsdp": self.fsdp1},
            "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1},
            "checkpoint": {"dir": None},
        }


CALIBRATION = [  # in the order they start: the first dozen cover every mode
    Row("1b", 8, compile=True),  # the reference: 37.8 GiB on the H200
    Row("small", 8),
    Row("1b", 2, ac="selective"),
    Row("small", 16, compile=True),
    Row("1b", 8, ac="full"),
    Row("small", 16, ac="selective"),
    Row("1b", 1),
    Row("small", 8, ac="full", compile=True),
    Row("1b", 8),
    Row("1b", 16, compile=True),
    Row("small", 4, ac="full"),
    Row("1b", 4, ac="full", compile=True),
    Row("small", 8, fsdp1=True),
    Row("1b", 16, ac="selective", compile=True),
    Row("1b", 16, micro_batch=4),
    Row("1b", 8, seq_len=1024),
    Row("1b", 8, compile=True, fsdp1=True),
    Row("1b", 8, ac="selective", fsdp1=True),
]
# Alone at the end, one at a time: their speed is the GPU's own (the MFU table in
# apps/jobs/mfu.json), and the `8b` row is near the card's size, so nothing may share it.
ALONE = [
    Row("1b", 8, ac="selective"),  # the control plane's defaults: selective, eager
    Row("1b", 8, ac="full", compile=True),
    Row("small", 16, compile=True, micro_batch=8),
    Row("8b", 1, ac="full", fsdp1=True),
]


def predict(row: Row) -> dict | None:
    try:
        from workers.trainer import memory
    except ImportError:
        return None
    return memory.for_run(row.run_json(steps=1)).as_dict()


# A row timed for speed (ALONE) trains at least as long as bench/trainer.py times: the
# step meter dates a step's end when the host reads it, after queueing the next, so a
# step queued while the host still compiles or allocates is timed from when the host got
# through and looks shorter than it ran (with 1 + 2 steps, 2026-12-05, the H200 showed
# the `1b` eager row at MFU 0.98 and the `small` one at 9.7).
SPEED_WARMUP, SPEED_STEPS = 8, 20


def measure(row: Row, args) -> dict:
    from bench.trainer import run_trainer

    if row in ALONE:
        args = argparse.Namespace(**vars(args))
        args.warmup, args.steps = max(args.warmup, SPEED_WARMUP), max(args.steps, SPEED_STEPS)
    got = run_trainer(args, "auto", gpu=True, config=row.run_json(steps=args.warmup + args.steps))
    keep = ("tokens_per_s", "mfu", "error")
    return {"measured_gib": got.get("peak_mem_gib"), **{k: got[k] for k in keep if k in got}}


def print_table(measured: list[dict]) -> int:
    """bench/RESULTS.md's calibration table: each measured row beside today's prediction."""
    print("| row | predicted GiB | measured GiB | error % |")
    print("| --- | ---: | ---: | ---: |")
    errors = []
    for result in measured:
        if not result.get("measured_gib"):
            continue
        row = Row.parse(result["row"])
        predicted = predict(row)["allocated_gib"]
        error = (predicted / result["measured_gib"] - 1) * 100
        errors.append(abs(error))
        print(f"| `{row.name}` | {predicted:.2f} | {result['measured_gib']:.2f} | {error:+.1f} |")
    print(f"\nadvisor: rows={len(errors)} max_abs_error_pct={max(errors):.1f}")
    return 0


def fit(measured: list[dict]) -> dict:
    """The CALIBRATION factor of each (mode, compiled) the measured rows cover.

    The factor scales one line, the activations, of its mode's rows, so each row's
    relative error moves with it in one direction: we try every factor from 0.50 to
    2.00 in steps of 0.01 and keep the one with the least sum of squared relative
    errors over the mode's rows (the whole model each time, so a row whose peak
    moves to the end of the backward pass, where no activations are held, counts as
    it would be predicted). Rows skipped or failed are left out.
    """
    from workers.trainer import memory

    rows: dict[tuple[str, bool], list[tuple[Row, float]]] = {}
    for result in measured:
        if result.get("measured_gib"):
            row = Row.parse(result["row"])
            rows.setdefault((row.ac, row.compile), []).append((row, result["measured_gib"]))

    def squared_error(key: tuple[str, bool], factor: float) -> float:
        memory.CALIBRATION[key] = factor
        return sum((predict(row)["allocated_gib"] / got - 1) ** 2 for row, got in rows[key])

    saved = dict(memory.CALIBRATION)
    factors = {}
    try:
        for key in sorted(rows):
            factors[key] = min((f / 100 for f in range(50, 201)), key=partial(squared_error, key))
    finally:
        memory.CALIBRATION.clear()
        memory.CALIBRATION.update(saved)
    return factors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="steps not counted")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per row")
    parser.add_argument("--parallel", type=int, default=3, help="rows trained at once at most")
    parser.add_argument(
        "--gib", type=float, default=120, help="GPU memory the rows trained at once may share"
    )
    parser.add_argument("--rows", default="", help="only rows whose name contains this")
    parser.add_argument("--alone", action="store_true", help="only the rows trained alone")
    parser.add_argument("--shared", action="store_true", help="only the rows trained in pairs")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument(
        "--table",
        metavar="ROWS_JSON",
        help="no training: the markdown table of measured rows (from --out) beside the model now",
    )
    parser.add_argument(
        "--fit",
        metavar="ROWS_JSON",
        help="no training: the CALIBRATION factors that fit the measured rows (from --out)",
    )
    args = parser.parse_args(argv)
    if args.fit:
        for (mode, compiled), factor in fit(json.loads(Path(args.fit).read_text())).items():
            print(f"    ({mode!r}, {compiled}): {factor},")
        return 0
    if args.table:
        return print_table(json.loads(Path(args.table).read_text()))

    import torch

    gpu = torch.cuda.is_available()
    rows = [r for r in CALIBRATION * (not args.alone) + ALONE * (not args.shared)]
    rows = [r for r in rows if args.rows in r.name]
    print(
        f"bench.advisor: {torch.cuda.get_device_name() if gpu else 'no GPU: predictions only'}; "
        f"{len(rows)} rows, {args.warmup} warm-up + {args.steps} measured steps each",
        flush=True,
    )

    def one(row: Row) -> dict:
        result = {"row": row.name, **asdict(row)}
        prediction = predict(row)
        if prediction:
            result["predicted_gib"] = prediction["allocated_gib"]
            result["lines"] = prediction["lines"]
        card = torch.cuda.mem_get_info()[1] / 2**30 if gpu else 0
        if gpu and prediction and prediction["allocated_gib"] > 0.95 * card:
            result["skipped"] = (
                f"predicted {prediction['allocated_gib']} GiB; the card has {card:.0f}"
            )
        elif gpu:
            result.update(measure(row, args))
            if row not in ALONE:
                result.pop("tokens_per_s", None), result.pop("mfu", None)
        if result.get("measured_gib") and result.get("predicted_gib"):
            error = (result["predicted_gib"] / result["measured_gib"] - 1) * 100
            result["error_pct"] = round(error, 1)
        print(f"advisor[{row.name}]: {json.dumps(result)}", flush=True)
        if args.out:
            with open(args.out + "l", "a") as lines:  # each row as it comes: FILE + "l"
                lines.write(json.dumps(result) + "\n")
        return result

    shared = [r for r in rows if r not in ALONE]
    room = threading.Condition()
    free = [args.gib]

    def sharing(row: Row) -> dict:
        """one(row) once the GPU has room for it beside the rows already running."""
        guess = predict(row)
        need = min(args.gib, max(4.0, 1.4 * guess["allocated_gib"] + 2 if guess else args.gib))
        with room:
            room.wait_for(lambda: free[0] >= need)
            free[0] -= need
        try:
            return one(row)
        finally:
            with room:
                free[0] += need
                room.notify_all()

    with ThreadPoolExecutor(max_workers=args.parallel if gpu else 1) as pool:
        results = list(pool.map(sharing, shared))
    results += [one(r) for r in rows if r in ALONE]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    errors = [abs(r["error_pct"]) for r in results if "error_pct" in r]
    worst = f"{max(errors):.1f}" if errors else "n/a"
    print(f"advisor: rows={len(errors)} max_abs_error_pct={worst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
