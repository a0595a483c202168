"""Fine-tuning from a Hugging Face checkpoint on real text, on one GPU (issue 36).

The question: does a run that starts from imported weights start where that model
is, not where a random model is? Nothing can be downloaded on the GPU machines, so
the "published" model is made there, by transformers alone, from a real corpus:

1. corpus: the Python standard library's own source files (real text, on every
   machine; `test/`, `idlelib/` and `site-packages/` left out);
2. tokenizer: a byte-level BPE tokenizer.json trained on that corpus by the
   `tokenizers` library (--vocab, default 8,192; prepare's --train-tokenizer),
   standing in for a published model's tokenizer;
3. dataset: `python -m workers.trainer.prepare --tokenizer-file … --validation
   0.02`, as a team would prepare theirs (shards, index, held-out split);
4. the model: transformers' LlamaForCausalLM (--hf-size; untied embeddings) trained
   by a plain transformers loop for --hf-steps on the dataset's training split,
   then `save_pretrained` into sharded safetensors, as a checkpoint is published;
5. the fine-tuning run: the trainer as the control plane starts it
   (`python -m workers.trainer --config run.json`), `init.hf` naming that
   directory, on the same dataset, with evaluation on the held-out split;
6. the reference: the same run from the seeded random initialisation instead.

The Hugging Face model's own loss on the trainer's first batch is computed by
transformers; the trainer's first reported loss is its loss on that batch before
any update, so the two must agree within bf16 (under 1%), and be far below the
random run's first loss (about ln(vocabulary)). Last line:

    finetune: imported_loss=<x> first_loss=<x> random_first_loss=<x> last_loss=<x>
              eval_loss=<x> steps=<n> tokens_per_s=<n> hf_steps=<n>      (on one line)

Needs python3, torch, tokenizers, safetensors and transformers (transformers for
steps 4 and 6's reference only; the trainer itself never imports it). Without a GPU
it runs a tiny configuration on the CPU in fp32 (a check that the path works, not
a figure), so `make bench-finetune` stays harmless on a laptop.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Llama shapes for the "published" model: (hidden, layers, heads, kv heads, ffn).
HF_SIZES = {
    "tiny": (64, 2, 4, 2, 128),
    "small": (768, 12, 12, 4, 2048),
}
LEFT_OUT = ("test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3")


def corpus(limit: int | None) -> list[Path]:
    """The standard library's source files, sorted, without its tests and bundled apps."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if not any(part in LEFT_OUT for part in p.relative_to(stdlib).parts)
    )
    return files[:limit] if limit else files


def prepare(files: list[Path], vocab: int, tokenizer: Path, out: Path) -> dict:
    """Steps 2 and 3: prepare's --train-tokenizer writes `tokenizer`, then the dataset `out`."""
    command = [
        sys.executable,
        "-m",
        "workers.trainer.prepare",
        *("--train-tokenizer", str(vocab), "--tokenizer-file", str(tokenizer)),
        *("--out", str(out), "--validation", "0.02"),
        *map(str, files),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"prepare failed: {done.stderr[-2000:]}")
    return json.loads((out / "index.json").read_text())


def windows(path: Path, *, seq_len: int, vocab: int, split: str = "train"):
    from workers.trainer.shards import open_source

    return open_source(str(path), seq_len=seq_len, vocab_size=vocab, split=split)


def publish(args, data: Path, vocab: int, out: Path, device) -> tuple[Path, float]:
    """Train transformers' Llama on the training split and save it sharded; its seconds."""
    import torch
    import transformers

    hidden, layers, heads, kv_heads, ffn = HF_SIZES[args.hf_size]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    with device:
        model = transformers.LlamaForCausalLM(config)
    source = windows(data, seq_len=args.seq_len, vocab=vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.hf_lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 50) * (0.1 + 0.9 * (1 - s / args.hf_steps))
    )
    order = torch.Generator().manual_seed(99)  # not the trainer's sampling order
    gpu = device.type == "cuda"
    started = time.perf_counter()
    model.train()
    for step in range(args.hf_steps):
        picks = torch.randint(0, source.windows, (args.batch,), generator=order).tolist()
        rows = torch.stack([source.window(i) for i in picks]).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = model(input_ids=rows[:, :-1], labels=rows[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % max(1, args.hf_steps // 5) == 0 or step == args.hf_steps - 1:
            print(f"publish: step {step + 1}/{args.hf_steps} loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - started
    model.save_pretrained(out, max_shard_size=args.shard_size)
    return out, seconds


def reference_loss(published: Path, data: Path, args, vocab: int, device) -> float:
    """Transformers' loss of the published model on the trainer's first batch, in fp32."""
    import torch
    import transformers

    from workers.trainer.data import Batches, Mixture

    model = transformers.AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32)
    model = model.to(device).eval()
    source = windows(data, seq_len=args.seq_len, vocab=vocab)
    # The trainer's own batches: seed 0, one data-parallel rank, the first step.
    batches = Batches(
        Mixture.single(source, seed=0, name=data.name),
        seed=0,
        global_batch=args.batch,
        dp_rank=0,
        dp_size=1,
    )
    inputs, targets = batches.at(1)
    with torch.no_grad():
        logits = model(input_ids=inputs.to(device)).logits.float()
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.to(device).flatten()
    ).item()


def run_config(args, data: Path, published: Path, *, init: bool, steps: int, gpu: bool) -> dict:
    """The run of the published model's shape, from its weights or (init False) random ones."""
    from workers.trainer import hf

    shape = hf.HFCheckpoint(published).shape
    return {
        "model": {"sizes": hf.sizes_of(shape)},
        **({"init": {"hf": str(published)}} if init else {}),
        "data": {"dataset": str(data), "seq_len": args.seq_len},
        "eval": {"every": max(1, steps // 2), "batches": 4},
        "schedule": {
            "steps": steps,
            "global_batch": args.batch,
            "lr": args.lr,
            "warmup_steps": min(10, steps // 4),
        },
        "precision": "bf16" if gpu else "fp32",
        "compile": gpu and args.compile and init,  # the random run's 2 steps: not worth it
        "activation_checkpointing": "none",
        "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1},
        "log_every": 1,
    }


def train(config: dict, workdir: Path) -> list[dict]:
    """The trainer as the control plane starts it (a world of one); its events."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.json").write_text(json.dumps(config))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "workers.trainer", "--config", "run.json"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"trainer failed: {(done.stdout + done.stderr)[-3000:]}")
    return [json.loads(x) for x in done.stdout.splitlines() if x.startswith('{"event"')]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.finetune", description=__doc__)
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    parser.add_argument("--vocab", type=int, help="tokenizer vocabulary (GPU 8192, CPU 512)")
    parser.add_argument("--hf-size", choices=sorted(HF_SIZES), help="GPU small, CPU tiny")
    parser.add_argument("--hf-steps", type=int, help="the published model's steps (GPU 600)")
    parser.add_argument("--hf-lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, help="fine-tuning steps (GPU 100, CPU 4)")
    parser.add_argument("--batch", type=int, help="sequences per step (GPU 32, CPU 4)")
    parser.add_argument("--seq-len", type=int, help="GPU 1024, CPU 64")
    parser.add_argument("--lr", type=float, default=1e-4, help="fine-tuning peak lr")
    parser.add_argument("--files", type=int, help="use only the first N corpus files")
    parser.add_argument("--shard-size", help="safetensors shard size (GPU 150MB, CPU 100KB)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    args = parser.parse_args(argv)

    import torch

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    defaults = (
        {"vocab": 8192, "hf_size": "small", "hf_steps": 600, "steps": 100, "batch": 32}
        | {"seq_len": 1024, "files": None, "shard_size": "150MB"}
        if gpu
        else {"vocab": 512, "hf_size": "tiny", "hf_steps": 40, "steps": 4, "batch": 4}
        | {"seq_len": 64, "files": 300, "shard_size": "100KB"}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not gpu:
        print("bench.finetune: no CUDA GPU; a tiny fp32 run on the CPU (not a figure)")

    with tempfile.TemporaryDirectory(prefix="finetune-") as scratch:
        work = Path(args.out or scratch)
        files = corpus(args.files)
        started = time.perf_counter()
        data = work / "stdlib-py"
        index = prepare(files, args.vocab, work / "tokenizer" / "tokenizer.json", data)
        vocab = index["tokenizer"]["vocab_size"]
        print(
            f"dataset: {len(files)} files, {index['splits']['train']['tokens']:,} training "
            f"tokens, {index['splits']['validation']['tokens']:,} held out, vocabulary {vocab}, "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
        published, publish_s = publish(args, data, vocab, work / "published", device)
        shards = sorted(p.name for p in published.glob("*.safetensors"))
        print(f"published: {published} ({len(shards)} safetensors files) in {publish_s:.0f} s")
        imported_loss = reference_loss(published, data, args, vocab, device)
        if gpu:
            torch.cuda.empty_cache()

        tuned = run_config(args, data, published, init=True, steps=args.steps, gpu=gpu)
        tuned = train(tuned, work / "ft")
        random = run_config(args, data, published, init=False, steps=2, gpu=gpu)
        random = train(random, work / "random")

    steps = [e for e in tuned if e["event"] == "step"]
    evals = [e for e in tuned if e["event"] == "eval"]
    rates = sorted(e["tokens_per_s"] for e in steps[len(steps) // 4 :] if e.get("tokens_per_s"))
    random_first = next(e["loss"] for e in random if e["event"] == "step")
    first, last = steps[0]["loss"], steps[-1]["loss"]
    print(
        f"imported model's loss on batch 1 (transformers, fp32): {imported_loss:.4f}; "
        f"the trainer's first step: {first:.4f} ({(first - imported_loss) / imported_loss:+.2%}); "
        f"a random model's first step: {random_first:.4f} (ln V = {math.log(vocab):.4f})"
    )
    for e in evals:
        print(f"eval at step {e['step']}: loss {e['loss']:.4f}, perplexity {e['perplexity']:.2f}")
    print(
        f"finetune: imported_loss={imported_loss:.4f} first_loss={first:.4f} "
        f"random_first_loss={random_first:.4f} last_loss={last:.4f} "
        f"eval_loss={evals[-1]['loss'] if evals else float('nan'):.4f} steps={len(steps)} "
        f"tokens_per_s={rates[len(rates) // 2] if rates else 0:.0f} hf_steps={args.hf_steps}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
