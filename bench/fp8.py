"""precision fp8 against bf16 on real text, on one GPU: the same loss, for how much speed?

fp8 (workers/trainer/parallelize.py apply_float8) multiplies the blocks' linear layers
in float8 with per-tensor scales. That is other arithmetic than bf16, so its speed
(bench.trainer's fp8 variant) counts only if it learns as bf16 does. This bench trains
the `1b` preset's shape from the same seeded random weights twice, in bf16 and in fp8,
on the same real text, and sets their losses side by side:

1. corpus, tokenizer and dataset as bench.finetune makes them: the Python standard
   library's sources, a BPE tokenizer.json trained on them (--vocab, default 8,192),
   `prepare --validation 0.02`;
2. runs of the trainer as the control plane starts it, `precision` bf16 and fp8 (once
   for each of --recipes),
   compile on, batch 8 × 2048 (bench.trainer's), --steps steps at lr 3e-4, evaluating
   on the held-out split half-way and at the end.

Figures: the mean training loss over the last fifth of the steps (each run sees the
same batches in the same order), the last held-out loss, and the median tokens/s after
the first quarter. The last line:

    fp8: bf16_loss=<x> fp8_loss=<x> loss_gap=<x> bf16_eval=<x> fp8_eval=<x>
         eval_gap=<x> speedup=<x> steps=<n> recipe=<name>   (on one line; gaps relative
                                                             to bf16)

for the first of --recipes (default tensorwise, what precision fp8 uses unless
kernels.float8_recipe says otherwise), after a line like it for each other recipe.

Needs python3, torch, tokenizers and torchao. Without a GPU it runs a tiny
configuration on the CPU, fp32 against fp8 (a check that the path works, not a figure).
"""

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.finetune import corpus, prepare, train  # noqa: E402
from workers.trainer.presets import PRESETS  # noqa: E402


def run_config(args, data: Path, vocab: int, precision: str, *, gpu: bool) -> dict:
    """precision: bf16, fp32, or fp8 with a recipe ("fp8:rowwise")."""
    precision, _, recipe = precision.partition(":")
    sizes = dataclasses.asdict(PRESETS[args.preset]) | {"vocab_size": vocab}
    return {
        **({"kernels": {"float8_recipe": recipe}} if recipe else {}),
        "model": {"sizes": sizes},
        "data": {"dataset": str(data), "seq_len": args.seq_len},
        "eval": {"every": max(1, args.steps // 2), "batches": 8},
        "schedule": {
            "steps": args.steps,
            "global_batch": args.batch,
            "lr": 3e-4,
            "warmup_steps": max(1, args.steps // 10),
        },
        "precision": precision,
        "compile": gpu,
        "activation_checkpointing": "none",
        "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1},
        "log_every": 1,
    }


def summary(events: list[dict]) -> dict:
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    tail = steps[-max(1, len(steps) // 5) :]
    rates = [e["tokens_per_s"] for e in steps[len(steps) // 4 :] if e.get("tokens_per_s")]
    return {
        "loss": statistics.fmean(e["loss"] for e in tail),
        "eval": evals[-1]["loss"] if evals else float("nan"),
        "tokens_per_s": statistics.median(rates) if rates else 0.0,
        "peak_mem_gib": max((e.get("peak_mem_gib") or 0) for e in steps),
        "curve": {e["step"]: e["loss"] for e in steps},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8", description=__doc__)
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    parser.add_argument("--preset", help="the model's shape (GPU 1b, CPU tiny)")
    parser.add_argument("--vocab", type=int, help="tokenizer vocabulary (GPU 8192, CPU 256)")
    parser.add_argument("--steps", type=int, help="GPU 300, CPU 3")
    parser.add_argument("--batch", type=int, help="sequences per step (GPU 8, CPU 4)")
    parser.add_argument("--seq-len", type=int, help="GPU 2048, CPU 64")
    parser.add_argument("--files", type=int, help="use only the first N corpus files")
    parser.add_argument(
        "--recipes",
        default="tensorwise",
        help="fp8 recipes to run, comma-separated (kernels.float8_recipe); the first is the "
        "last line's",
    )
    args = parser.parse_args(argv)

    import torch

    gpu = torch.cuda.is_available()
    defaults = (
        {"preset": "1b", "vocab": 8192, "steps": 300, "batch": 8, "seq_len": 2048, "files": None}
        if gpu
        else {"preset": "tiny", "vocab": 320, "steps": 3, "batch": 4, "seq_len": 64, "files": 100}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    reference = "bf16" if gpu else "fp32"
    if not gpu:
        print("bench.fp8: no CUDA GPU; a tiny run on the CPU, fp32 against fp8 (not a figure)")

    with tempfile.TemporaryDirectory(prefix="fp8-") as scratch:
        work = Path(args.out or scratch)
        started = time.perf_counter()
        files = corpus(args.files)
        data = work / "stdlib-py"
        index = prepare(files, args.vocab, work / "tokenizer" / "tokenizer.json", data)
        vocab = index["tokenizer"]["vocab_size"]
        print(
            f"dataset: {len(files)} files, {index['splits']['train']['tokens']:,} training "
            f"tokens, vocabulary {vocab}, {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        runs = {}
        recipes = [f"fp8:{name}" for name in args.recipes.split(",")]
        for precision in (reference, *recipes):
            config = run_config(args, data, vocab, precision, gpu=gpu)
            runs[precision] = summary(train(config, work / precision))
            got = runs[precision]
            print(
                f"{precision}: last-fifth loss {got['loss']:.4f}, eval {got['eval']:.4f}, "
                f"{got['tokens_per_s']:,.0f} tokens/s, peak {got['peak_mem_gib']:.1f} GiB",
                flush=True,
            )

    base = runs[reference]
    marks = sorted({1, *range(0, args.steps + 1, max(1, args.steps // 6))} - {0})
    for step in marks:
        losses = " ".join(f"{name} {got['curve'][step]:.4f}" for name, got in runs.items())
        print(f"step {step}: {losses}")
    lines = []
    for recipe in recipes:
        fp8 = runs[recipe]
        speedup = fp8["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
        lines.append(
            f"fp8: {reference}_loss={base['loss']:.4f} fp8_loss={fp8['loss']:.4f} "
            f"loss_gap={(fp8['loss'] - base['loss']) / base['loss']:+.4f} "
            f"{reference}_eval={base['eval']:.4f} fp8_eval={fp8['eval']:.4f} "
            f"eval_gap={(fp8['eval'] - base['eval']) / base['eval']:+.4f} "
            f"speedup={speedup:.3f} steps={args.steps} recipe={recipe.partition(':')[2]}"
        )
    print("\n".join(reversed(lines)))  # the first recipe's last
    return 0


if __name__ == "__main__":
    sys.exit(main())
