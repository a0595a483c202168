"""The bundled trainer against the fastest peer a user would pick, on one GPU.

All train the `1b` preset's shape (hidden 2048, 22 layers, 32 heads sharing 4
KV heads, FFN 5632, vocabulary 32,000) on sequences of 2048 with the same batch,
bf16 compute, fused AdamW, gradient clipping at 1.0 and no activation
checkpointing, on the same synthetic token windows:

- the trainer: `python -m workers.trainer --config run.json` as the control
  plane would start it (a world of one, no torchrun), with compile on; its
  tokens/s, MFU and peak memory are read from the step lines it prints;
- the peers (--peers, PEERS): Hugging Face transformers' LlamaForCausalLM of
  exactly that shape (untied embeddings, SDPA attention), fp32 weights under
  bf16 autocast, fused AdamW, loss from `labels=`; `hf-compile` runs it under
  `torch.compile(model)`, `hf-liger` eager with the Liger kernels (RMSNorm,
  RoPE, SwiGLU and the fused linear cross-entropy that never makes the logits)
  patched into transformers before the model is built. A peer whose package is
  missing reports why and is left out.

Each runs in its own process (its own compile caches and allocator); the
first --warmup steps are not counted; figures are medians of the per-step
rates that follow. Variants of the trainer (--variants, comma-separated names
from VARIANTS, "a+b" for both) run one after another, and the last line
sets the fastest against the fastest peer:

    trainer: tokens_per_s=<n> fastest_peer=<name> peer_tokens_per_s=<n>
             ratio=<x> mfu=<x> peak_mem_gib=<n> layout=<...>     (on one line)

`--long` trains the trainer alone on one long sequence (default 32,768, batch
1, activation checkpointing "full", compile on; the preset's shape with its
rotary tables stretched to the sequence) and sets its peak memory beside what
workers/trainer/memory.py predicts for the same run.json; the last line:

    long: tokens_per_s=<n> mfu=<x> peak_mem_gib=<n> predicted_gib=<n>
          seq_len=<n> batch=<n> checkpointing=<mode>     (on one line)

`--scaling` trains each of --presets (default `1b,8b`) on every GPU of
the host under torchrun, once per layout: FSDP over all of them, HSDP (2
replicas), FSDP × TP (TP 2 and 4) and PP 2 × FSDP, with --batch sequences per
GPU per step (the global batch grows with the GPUs), and on one GPU alone as
the reference. Per layout it prints tokens/s per GPU, MFU and scaling
efficiency (tokens/s per GPU over the one-GPU figure); the last line:

    scaling: best_layout=<preset>/<layout> efficiency=<x> mfu=<x>
             fsdp_efficiency=<x> gpus=<n>          (on one line)

for the largest preset's fastest layout, and FSDP's efficiency on the first
preset (the issue's goal). NVLink multicast stays off in every process
(NCCL_NVLS_ENABLE=0 and its siblings, as the device's machines require).
Without a GPU it runs the same layouts on the CPU with gloo and 8 processes on
the `small` preset (a check that every layout trains, not a speed figure).

Needs only python3 and torch (transformers and liger-kernel for the peers): no Django, no
.venv, no network. Without a GPU it says so and runs a tiny smoke configuration
on the CPU instead, so `make bench-trainer` stays harmless on a laptop.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.trainer.presets import PRESETS  # noqa: E402  (torch-free, as the control plane uses it)

PEAK_BF16 = 989e12  # H100 and H200 SXM, dense

# NVLink multicast off in NCCL, PyTorch and NVSHMEM: the shared GPU hosts require it.
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Trainer variants: run.json settings over the defaults; "a+b" applies both.
VARIANTS = {
    "auto": {},
    "cudnn": {"attention_backend": "cudnn"},
    "flash": {"attention_backend": "flash"},
    "gqa": {"kernels": {"native_gqa": True}},  # the default since 2026-12-01
    "repeat": {"kernels": {"native_gqa": False}},  # k and v repeated for every query head
    "fused": {"kernels": {"fused_projections": True}},
    "fsdp1": {"kernels": {"single_gpu_fsdp": True}},
    "cdt": {"kernels": {"coordinate_descent_tuning": True}},
    "autotune": {"kernels": {"compile_mode": "max-autotune-no-cudagraphs"}},
    "whole": {"kernels": {"compile_scope": "model"}},
    # One graph from tokens to loss, replayed as CUDA graphs (forward and backward).
    "graphs": {"kernels": {"compile_scope": "model", "compile_mode": "reduce-overhead"}},
    # The blocks' linear layers multiply in float8 (torchao): other numerics than the peers'
    # bf16, so bench.fp8 checks its loss against bf16 on real text.
    "fp8": {"precision": "fp8"},
    "fp8-rowwise": {"precision": "fp8", "kernels": {"float8_recipe": "rowwise"}},
}


def variant_settings(name: str) -> dict:
    settings: dict = {"kernels": {}}
    for part in name.split("+"):
        for key, value in VARIANTS[part].items():
            if key == "kernels":
                settings["kernels"].update(value)
            else:
                settings[key] = value
    return settings


# --- the trainer ----------------------------------------------------------------------------------


def trainer_config(args, variant: str, *, gpu: bool) -> dict:
    return {
        "model": model_spec(args),
        "data": {"dataset": "synthetic", "seq_len": args.seq_len},
        "schedule": {
            "steps": args.warmup + args.steps,
            "global_batch": args.batch,
            "lr": 3e-4,
            "warmup_steps": 10,
            "grad_clip": 1.0,
        },
        "precision": "bf16",
        "activation_checkpointing": args.checkpointing,
        "compile": gpu,
        **variant_settings(variant),
        "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1},
        "checkpoint": {"dir": None},
    }


def model_spec(args) -> dict:
    """The preset, or its sizes with the rotary tables stretched to a longer --seq-len."""
    shape = PRESETS[args.preset]
    if args.seq_len <= shape.max_seq_len:
        return {"preset": args.preset}
    return {"sizes": {**asdict(shape), "max_seq_len": args.seq_len}}


def run_trainer(args, variant: str, *, gpu: bool, config=None, nproc: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        config_path = Path(scratch) / "run.json"
        config = config or trainer_config(args, variant, gpu=gpu)
        config_path.write_text(json.dumps(config))
        env = {
            **os.environ,
            **NO_MULTICAST,
            "CONTROLPLANE_STATUS_FILE": str(Path(scratch) / "status.json"),
        }
        launcher = []  # one process runs the trainer directly; more go through torchrun
        if nproc > 1:
            launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command = [sys.executable, *launcher, "-m", "workers.trainer", "--config", str(config_path)]
        if not gpu:
            env.update({"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
        started = time.monotonic()
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=args.timeout,
            )
        except subprocess.TimeoutExpired as e:
            return {"error": f"timed out after {e.timeout:.0f} s"}
        wall = time.monotonic() - started
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if e.get("event") == "step" and e["step"] > args.warmup]
    if done.returncode or not steps:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    mfus = [e["mfu"] for e in steps if e["mfu"] is not None]
    return {
        "tokens_per_s": statistics.median(e["tokens_per_s"] for e in steps),
        "mfu": statistics.median(mfus) if mfus else None,
        "peak_mem_gib": max(e["peak_mem_gib"] for e in steps),
        "first_loss": events[1]["loss"] if len(events) > 1 and "loss" in events[1] else None,
        "last_loss": steps[-1]["loss"],
        "wall_s": round(wall, 1),
    }


# --- the peers (each its own process: python -m bench.trainer --peer NAME ...) -------------------

PEERS = {  # name: the packages it needs beside torch
    "hf-compile": ("transformers",),
    "hf-liger": ("transformers", "liger_kernel"),
}


def peer_step(args, peer: str):
    """One step of the peer a user would write: HF's Llama, autocast to bf16, compiled or
    with Liger's kernels."""
    import torch

    if peer == "hf-liger":
        # Liger replaces the classes and the forward modeling_llama builds from, so it must
        # patch before the model exists; the fused linear cross-entropy runs inside the
        # forward when it is given labels in training mode.
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True,
            rms_norm=True,
            swiglu=True,
            cross_entropy=False,
            fused_linear_cross_entropy=True,
        )
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.trainer.data import Batches, SyntheticSource

    shape = PRESETS[args.preset]
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.dim,
        intermediate_size=shape.ffn_dim,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    model.train()
    step_fn = torch.compile(model) if gpu and peer == "hf-compile" else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=gpu or None
    )
    batches = Batches(
        SyntheticSource(shape.vocab_size, args.seq_len),
        seed=0,
        global_batch=args.batch,
        dp_rank=0,
        dp_size=1,
    )

    def step(number: int) -> float:
        inputs, _ = batches.at(number)
        inputs = inputs.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = step_fn(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()  # a user logs the loss: one sync per step, as the trainer

    return step


def peer(args) -> dict:
    import torch

    from workers.trainer.presets import flops_per_token

    gpu = torch.cuda.is_available()
    step = peer_step(args, args.peer)
    rates, losses = [], []
    for number in range(1, args.warmup + args.steps + 1):
        started = time.perf_counter()
        losses.append(step(number))
        if number > args.warmup:
            rates.append(args.batch * args.seq_len / (time.perf_counter() - started))
    tokens_per_s = statistics.median(rates)
    shape = PRESETS[args.preset]
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(shape, args.seq_len) / PEAK_BF16 if gpu else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "transformers": __import__("transformers").__version__,
        **({"liger_kernel": metadata.version("liger-kernel")} if args.peer == "hf-liger" else {}),
    }


def run_peer(args, name: str) -> dict:
    missing = [package for package in PEERS[name] if not importlib.util.find_spec(package)]
    if missing:
        return {"error": f"{', '.join(missing)} not installed"}
    command = [
        sys.executable,
        "-m",
        "bench.trainer",
        *("--peer", name),
        *("--preset", args.preset, "--batch", str(args.batch), "--seq-len", str(args.seq_len)),
        *("--steps", str(args.steps), "--warmup", str(args.warmup)),
    ]
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {e.timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    return {**json.loads(lines[-1]), "wall_s": round(time.monotonic() - started, 1)}


# --- scaling over the GPUs of one host (--scaling) -------------------------------------------


def scaling_layouts(gpus: int) -> dict[str, dict]:
    """The issue's layouts for a world of `gpus`, named as the report prints them."""
    layouts = {f"fsdp{gpus}": {"dp_shard": gpus}}
    if gpus >= 4 and gpus % 2 == 0:
        layouts[f"hsdp2x{gpus // 2}"] = {"dp_replicate": 2, "dp_shard": gpus // 2}
    for tp in (2, 4):
        if gpus > tp and gpus % tp == 0:
            layouts[f"fsdp{gpus // tp}xtp{tp}"] = {"dp_shard": gpus // tp, "tp": tp}
    if gpus >= 4 and gpus % 2 == 0:
        layouts[f"pp2xfsdp{gpus // 2}"] = {"pp": 2, "dp_shard": gpus // 2}
    return layouts


def scaling_config(args, preset: str, layout: dict, *, gpus: int, gpu: bool) -> dict:
    """--batch sequences per GPU per step, the same on every layout: a TP group's ranks share
    their data-parallel rank's batch, a forward at a time of --batch sequences; a pipeline
    splits it into one microbatch per stage."""
    full = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, **layout}
    config = trainer_config(args, "auto", gpu=gpu)
    config["model"] = {"preset": preset}
    config["layout"] = full
    config["schedule"]["global_batch"] = args.batch * gpus
    if full["tp"] > 1:
        config["schedule"]["micro_batch"] = args.batch
    return config


def scaling(args, *, gpu: bool) -> int:
    import torch

    gpus = torch.cuda.device_count() if gpu else args.cpu_processes
    presets = args.presets.split(",")
    layouts = scaling_layouts(gpus)
    print(
        f"bench.trainer --scaling: {describe_machine()}; {gpus} "
        f"{'GPUs' if gpu else 'CPU processes (gloo)'}; presets {', '.join(presets)}; "
        f"{args.batch} sequences of {args.seq_len} per GPU per step; "
        f"{args.warmup} warm-up + {args.steps} measured steps",
        flush=True,
    )
    table = {}
    for preset in presets:
        one = run_trainer(
            args,
            "auto",
            gpu=gpu,
            config=scaling_config(args, preset, {}, gpus=1, gpu=gpu),
        )
        print(f"scaling[{preset}/1]: {json.dumps(one)}", flush=True)
        single = one.get("tokens_per_s")
        for name, layout in layouts.items():
            config = scaling_config(args, preset, layout, gpus=gpus, gpu=gpu)
            got = run_trainer(args, "auto", gpu=gpu, config=config, nproc=gpus)
            if "tokens_per_s" in got:
                got["tokens_per_s_per_gpu"] = round(got["tokens_per_s"] / gpus, 1)
                got["efficiency"] = (
                    round(got["tokens_per_s_per_gpu"] / single, 3) if single else None
                )
            table[preset, name] = got
            print(f"scaling[{preset}/{name}]: {json.dumps(got)}", flush=True)
    print(f"{'preset':<7}{'layout':<14}{'tok/s/GPU':>11}{'MFU':>7}{'efficiency':>12}")
    for (preset, name), got in table.items():
        if "tokens_per_s" not in got:
            print(f"{preset:<7}{name:<14}{'failed':>11}  {got['error'][:100]}")
            continue
        mfu = f"{got['mfu']:.3f}" if got["mfu"] is not None else "n/a"
        eff = f"{got['efficiency']:.3f}" if got["efficiency"] is not None else "n/a"
        print(f"{preset:<7}{name:<14}{got['tokens_per_s_per_gpu']:>11.0f}{mfu:>7}{eff:>12}")
    last = presets[-1]
    measured = {n: g for (p, n), g in table.items() if p == last and "tokens_per_s" in g}
    if not measured:
        print(f"scaling: every layout of {last} failed")
        return 1
    best_name, best = max(measured.items(), key=lambda item: item[1]["tokens_per_s"])
    fsdp = table.get((presets[0], f"fsdp{gpus}"), {})

    def figure(value) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    print(
        f"scaling: best_layout={last}/{best_name} efficiency={figure(best['efficiency'])} "
        f"mfu={figure(best['mfu'])} fsdp_efficiency={figure(fsdp.get('efficiency'))} "
        f"gpus={gpus}"
    )
    return 0


# --- where a step's GPU time goes (python -m bench.trainer --profile VARIANT) ---------------------

KERNEL_KINDS = (  # (kind, substrings of the kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "matmul")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "norm_kernel", "lpnorm")),
    ("fused (inductor)", ("triton",)),
    ("copies", ("memcpy", "memset", "copy", "fill")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KERNEL_KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def profile(args) -> int:
    """Train the variant (or a peer) here and break a few steps' GPU time down by kernel."""
    import torch

    if not torch.cuda.is_available():
        print("bench.trainer --profile: needs a CUDA GPU")
        return 1
    variant = args.profile
    step = peer_step(args, variant) if variant in PEERS else trainer_step(args, variant)
    for number in range(1, args.warmup + 1):
        step(number)
    torch.cuda.synchronize()
    return kernel_breakdown(step, args, first=args.warmup + 1)


def trainer_step(args, variant: str):
    """One step of the trainer's loop (train.run's, without its metrics and checkpoints)."""
    from workers.trainer import config as run_config
    from workers.trainer import train

    training = train.build(run_config.parse(trainer_config(args, variant, gpu=True)))
    votes: list = []  # read a step late, as train.run does

    def step(number: int) -> None:
        votes.append(training.step(number))
        if len(votes) > 1:
            votes.pop(0).read()

    return step


def kernel_breakdown(step, args, *, first: int, measured: int = 3) -> int:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    started = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for number in range(first, first + measured):
            step(number)
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1000 / measured
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels) / 1000 / measured  # ms per step
    kinds: dict[str, float] = {}
    for event in kernels:
        kind = kernel_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + event.device_time_total / 1000 / measured
    print(f"profile[{args.profile}]: {describe_machine()}; wall {wall_ms:.1f} ms per step")
    for kind, ms in sorted(kinds.items(), key=lambda item: -item[1]):
        print(f"  {kind:<18}{ms:8.1f} ms  {ms / total:6.1%}")
    print("  top kernels (ms per step, calls per step, kind, name):")
    for event in sorted(kernels, key=lambda e: -e.device_time_total)[:30]:
        ms = event.device_time_total / 1000 / measured
        calls = event.count // measured
        print(f"  {ms:8.2f} {calls:5d}  {kernel_kind(event.key):<10} {event.key[:100]}")
    idle_ms = report_idle(prof, measured)
    print(
        f"profile: variant={args.profile} wall_ms={wall_ms:.1f} gpu_ms={total:.1f} "
        f"idle_ms={idle_ms:.1f} "
        + " ".join(f"{kind.split()[0]}_ms={ms:.1f}" for kind, ms in sorted(kinds.items()))
    )
    return 0


def report_idle(prof, measured: int) -> float:
    """The GPU's idle time per step between the first and last kernel, and its longest gaps."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    if not spans:
        return 0.0
    gaps, reach, before = [], spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start > reach:
            gaps.append((start - reach, before, name))
        if end >= reach:
            reach, before = end, name
    idle_ms = sum(gap for gap, _, _ in gaps) / 1000 / measured
    print(f"  GPU idle {idle_ms:.2f} ms per step in {len(gaps) // measured} gaps; the longest:")
    for gap, after, next_kernel in sorted(gaps, reverse=True)[:12]:
        print(f"  {gap / 1000:8.3f} ms after {after[:55]!r} before {next_kernel[:55]!r}")
    return idle_ms


# --- one long sequence on one GPU (--long) ----------------------------------------------------


def long_sequence(args, *, gpu: bool) -> int:
    """The trainer alone on --seq-len tokens, its peak beside the memory model's prediction."""
    from workers.trainer import memory

    config = trainer_config(args, "auto", gpu=gpu)
    predicted = memory.for_run(config, gpu=gpu)
    print(f"long: the memory model predicts {json.dumps(predicted.as_dict())}", flush=True)
    got = run_trainer(args, "auto", gpu=gpu, config=config)
    print(f"long[trainer]: {json.dumps(got)}", flush=True)
    if "tokens_per_s" not in got:
        print(f"long: failed ({got['error'][:300]})")
        return 1
    mfu = f"{got['mfu']:.3f}" if got["mfu"] is not None else "n/a"
    peak = f"{got['peak_mem_gib']:.1f}" if got["peak_mem_gib"] is not None else "n/a"
    print(
        f"long: tokens_per_s={got['tokens_per_s']:.0f} mfu={mfu} peak_mem_gib={peak} "
        f"predicted_gib={predicted.allocated / memory.GIB:.1f} seq_len={args.seq_len} "
        f"batch={args.batch} checkpointing={args.checkpointing}"
    )
    return 0


# --- the report -----------------------------------------------------------------------------------


def describe_machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"torch {torch.__version__}, {gpu}, Python {sys.version.split()[0]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trainer", description=__doc__)
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--batch", type=int, help="sequences per step (default 8; --long 1)")
    parser.add_argument(
        "--seq-len", type=int, help="tokens per sequence (default 2048; --long 32768)"
    )
    parser.add_argument(
        "--checkpointing",
        choices=("none", "selective", "full"),
        help="the trainer's activation checkpointing (default none; --long full)",
    )
    parser.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    parser.add_argument("--warmup", type=int, default=8, help="steps not counted (default 8)")
    parser.add_argument(
        "--variants", default="auto", help=f"trainer variants, a+b combined: {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help=f"peers to measure, comma-separated ({', '.join(PEERS)}), or none",
    )
    parser.add_argument("--long", action="store_true", help="the trainer on one long sequence")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per process")
    parser.add_argument("--peer", choices=tuple(PEERS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        metavar="VARIANT",
        help="GPU time of a few steps of VARIANT (or a peer), by kernel",
    )
    parser.add_argument("--scaling", action="store_true", help="every GPU of the host, per layout")
    parser.add_argument("--presets", default="1b,8b", help="--scaling: presets, comma-separated")
    parser.add_argument(
        "--cpu-processes", type=int, default=8, help="--scaling without a GPU: gloo processes"
    )
    args = parser.parse_args(argv)
    defaults = (1, 32768, "full") if args.long else (8, 2048, "none")
    for name, default in zip(("batch", "seq_len", "checkpointing"), defaults, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)

    if args.peer:
        print(json.dumps(peer(args)), flush=True)
        return 0
    if args.profile:
        return profile(args)

    import torch

    gpu = torch.cuda.is_available()
    if args.scaling:
        if not gpu:
            print("bench.trainer: no CUDA GPU here; the layouts on the CPU (gloo), small preset")
            args.presets, args.batch, args.seq_len, args.steps, args.warmup = "small", 2, 64, 4, 2
        return scaling(args, gpu=gpu)
    if not gpu:
        print("bench.trainer: no CUDA GPU here; running the CPU smoke configuration (tiny preset)")
        # --long: one sequence twice the tiny preset's own length, to try the stretched tables.
        args.preset, args.batch, args.seq_len = ("tiny", 1, 1024) if args.long else ("tiny", 4, 64)
        args.steps, args.warmup, args.variants = 4, 2, "auto"
    print(
        f"bench.trainer: {describe_machine()}; preset {args.preset}, batch {args.batch}, "
        f"sequence {args.seq_len}, checkpointing {args.checkpointing}, "
        f"{args.warmup} warm-up + {args.steps} measured steps",
        flush=True,
    )
    if args.long:
        return long_sequence(args, gpu=gpu)

    results = {}
    for variant in args.variants.split(","):
        results[variant] = run_trainer(args, variant, gpu=gpu)
        print(f"trainer[{variant}]: {json.dumps(results[variant])}", flush=True)
    peers = {}
    for name in [p for p in args.peers.split(",") if p and p != "none"]:
        if name not in PEERS:
            parser.error(f"--peers: {name} is not one of {', '.join(PEERS)}")
        peers[name] = run_peer(args, name)
        print(f"peer[{name}]: {json.dumps(peers[name])}", flush=True)

    print_table(results, peers)
    measured = {k: v for k, v in results.items() if "tokens_per_s" in v}
    if not measured:
        print("trainer: every variant failed")
        return 1
    best_name, best = max(measured.items(), key=lambda item: item[1]["tokens_per_s"])
    ran = {k: v for k, v in peers.items() if "tokens_per_s" in v}
    fastest, rate = max(
        ((k, v["tokens_per_s"]) for k, v in ran.items()), key=lambda i: i[1], default=("n/a", 0)
    )
    ratio = f"{best['tokens_per_s'] / rate:.3f}" if rate else "n/a"
    mfu = f"{best['mfu']:.3f}" if best["mfu"] is not None else "n/a"
    print(
        f"trainer: tokens_per_s={best['tokens_per_s']:.0f} fastest_peer={fastest} "
        f"peer_tokens_per_s={f'{rate:.0f}' if rate else 'n/a'} ratio={ratio} "
        f"mfu={mfu} peak_mem_gib={best['peak_mem_gib']:.1f} "
        f"layout=dp_replicate1.dp_shard1.tp1.pp1{'+compile' if gpu else ''}+{best_name}"
        f"+batch{args.batch}x{args.seq_len}"
    )
    return 0


def print_table(results: dict, peers: dict) -> None:
    """Every trainer variant and peer, one line each, before the verdict."""
    print(f"{'who':<22}{'tokens/s':>10}{'MFU':>7}{'peak GiB':>10}")
    rows = [(f"trainer[{k}]", v) for k, v in results.items()] + list(peers.items())
    for name, got in rows:
        if "tokens_per_s" not in got:
            print(f"{name:<22}{'failed':>10}  {got['error'][:100]}")
            continue
        mfu = f"{got['mfu']:.3f}" if got.get("mfu") is not None else "n/a"
        peak = f"{got['peak_mem_gib']:.1f}" if got.get("peak_mem_gib") is not None else "n/a"
        print(f"{name:<22}{got['tokens_per_s']:>10.0f}{mfu:>7}{peak:>10}")


if __name__ == "__main__":
    sys.exit(main())
