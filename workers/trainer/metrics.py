"""What the trainer reports: one JSON object per line on stdout, from rank 0.

The node agent relays every output line to the control plane, which picks out
the lines that parse as JSON objects with an "event" key:

    {"event": "step", "step", "loss", "grad_norm", "lr", "tokens_per_s", "mfu",
     "peak_mem_gib", "time", "step_time_s", "tokens"}
    {"event": "checkpoint", "step", "path", "manifest_sha256", "size_bytes",
     "world_size", "layout", "loss", "eval", "time", "files"}
    {"event": "eval", "step", "loss", "perplexity", "tokens", "time", "datasets"}

and, less often, "start", "resume", "checkpoint_rejected", "checkpoint_copy",
"checkpoint_copy_failed", "end" and, once after the first update, "state_bytes"
(rank 0's share of the parameters, gradients and optimizer state, in bytes)
(see train.py and checkpoint.py). One event
comes from every rank, not only rank 0, as the process starts:

    {"event": "env", "rank", "local_rank", "node_rank", "world_size", "env"}

with "env" every NCCL, PyTorch-NCCL and EFA variable the process started with,
so that the control plane can compare what each rank got with what it rendered.
tokens_per_s counts the whole job's tokens; mfu is per GPU, with training
FLOPs per token = 6N + 12·L·d·S against the GPU's dense bf16 peak (null on
CPUs and on GPUs not in the table); peak_mem_gib is the most memory the
allocator held on rank 0's GPU since the previous report (on a CPU, the
process's peak resident set).
"""

import json
import math
import resource
import sys
import threading
import time
from collections.abc import Mapping

import torch

# Dense bf16 tensor-core peaks (vendor datasheets), matched against the device name.
PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
}

_lock = threading.Lock()


def finite(value):
    """`value` with every NaN or infinity in it as None: JSON has no such numbers, and the
    control plane's strict parser would refuse the whole line (a checkpoint's report with
    it) for one diverged loss."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def emit(event: dict) -> None:
    """Print one event as a JSON line (threads may report too: one line at a time); a
    number that is not finite is printed as null."""
    line = json.dumps(finite(event), separators=(",", ":"), allow_nan=False)
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


# The names an NCCL profile or a job's overrides may set (the control plane's catalogue
# covers the same prefixes; this package cannot import it).
NCCL_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_", "OFI_NCCL_", "RDMAV_")


def environment_event(env: Mapping[str, str]) -> dict:
    """The "env" event for a process that started with `env` (torchrun's variables name the
    rank; without torchrun the trainer is a world of one)."""

    def number(*names: str) -> int:
        for name in names:
            value = env.get(name, "")
            if value.isdigit():
                return int(value)
        return 0

    return {
        "event": "env",
        "rank": number("RANK"),
        "local_rank": number("LOCAL_RANK"),
        "node_rank": number("GROUP_RANK", "CONTROLPLANE_NODE_RANK"),
        "world_size": number("WORLD_SIZE") or 1,
        "env": {name: env[name] for name in sorted(env) if name.startswith(NCCL_PREFIXES)},
    }


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    # PCIe and NVL variants have lower clocks and peaks; count only the SXM parts we know.
    if any(variant in name for variant in ("PCIe", "NVL")):
        return None
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return peak / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class StepMeter:
    """Throughput and utilisation on rank 0, over the steps since the last report.

    Each report covers every step since the one before (log_every of them, or fewer
    after a resume or at the end), timed from the end of the last reported step to the
    end of this one: when its work was over (the vote's `ended_at`), not when it was
    reported. The loop reports a step once the next one is queued, so on a CPU, where a
    step's work runs in the call that queues it, the report comes after the next step's
    work too; a clock read at report time would give that work to this step and next to
    nothing to the last step of a run.
    """

    def __init__(self, *, device, tokens_per_step: int, flops_per_token: int, gpus: int):
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.gpus = gpus
        self.peak = peak_flops(device)
        self.tokens = 0
        self._step = 0  # the last step reported (or resumed from)
        self._last = time.perf_counter()

    def resume_at(self, step: int) -> None:
        """Count from `step`, the step a run resumes after (0 for a fresh run)."""
        self._step = step
        self.tokens = step * self.tokens_per_step
        self.restart_clock()

    def restart_clock(self) -> None:
        """Leave out what happened since the last step (a checkpoint's save)."""
        self._last = time.perf_counter()

    def step(
        self, *, step: int, loss: float, grad_norm: float, lr: float, ended_at: float | None = None
    ) -> dict:
        ended_at = time.perf_counter() if ended_at is None else ended_at
        steps = max(1, step - self._step)
        # A step that ended before the clock restarted (reported after a save): no time.
        elapsed = max(ended_at - self._last, 1e-9)
        self._step, self._last = step, max(ended_at, self._last)
        tokens = steps * self.tokens_per_step
        self.tokens += tokens
        tokens_per_s = tokens / elapsed
        mfu = None
        if self.peak:
            mfu = round(tokens_per_s * self.flops_per_token / (self.gpus * self.peak), 4)
        return {
            "event": "step",
            "step": step,
            "loss": round(loss, 6),
            "grad_norm": round(grad_norm, 6),
            "lr": lr,
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": mfu,
            "peak_mem_gib": round(peak_memory_gib(self.device), 3),
            "time": time.time(),
            "step_time_s": round(elapsed / steps, 4),
            "tokens": self.tokens,
        }
