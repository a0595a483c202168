"""The optimizer: AdamW (fused where the device has it), gradient clipping, warmup and cosine.

One AdamW per model part (a pipeline rank may hold several stages), so each
optimizer's state belongs to one module and checkpoints can name it by the
parameters' names. Matrices decay; norms and nothing else are exempt.
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from workers.trainer.config import Schedule


def learning_rate(schedule: Schedule, step: int) -> float:
    """Linear warmup to the peak over warmup_steps, then cosine decay to min_lr_ratio × peak."""
    peak = schedule.lr
    if step <= schedule.warmup_steps:
        return peak * step / max(schedule.warmup_steps, 1)
    decay_steps = max(schedule.steps - schedule.warmup_steps, 1)
    progress = min((step - schedule.warmup_steps) / decay_steps, 1.0)
    floor = peak * schedule.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class Optimizers:
    """The optimizers of this rank's model parts, stepped, clipped and scheduled together."""

    def __init__(self, parts: list[nn.Module], schedule: Schedule, *, pp_group=None, fused=None):
        self.parts = parts
        self.schedule = schedule
        self.pp_group = pp_group
        # Fused AdamW is one kernel for all parameters on CUDA; foreach elsewhere.
        on_gpu = next(parts[0].parameters()).device.type == "cuda"
        self.fused = on_gpu if fused is None else fused
        self.optimizers = [self._adamw(part) for part in parts]
        # Fused AdamW divides each gradient by a scale as it reads it (GradScaler's hook):
        # clipping through that scale saves a pass over every gradient. Plain tensors only;
        # sharded (DTensor) parameters are clipped the ordinary way.
        self.clip_in_step = self.fused and not any(
            isinstance(p, DTensor) for part in parts for p in part.parameters()
        )

    def _adamw(self, part: nn.Module) -> torch.optim.AdamW:
        decay, exempt = [], []
        for param in part.parameters():
            (decay if param.ndim >= 2 else exempt).append(param)
        groups = [
            {"params": decay, "weight_decay": self.schedule.weight_decay},
            {"params": exempt, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(
            groups,
            lr=self.schedule.lr,
            betas=self.schedule.betas,
            eps=self.schedule.eps,
            fused=self.fused or None,
            foreach=None if self.fused else True,
        )

    def set_lr(self, step: int) -> float:
        lr = learning_rate(self.schedule, step)
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        return lr

    def clip(self) -> float:
        """Clip the gradients of every part to grad_clip in total; return the norm before."""
        params = [p for part in self.parts for p in part.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # partial sums of squares over the shards, reduced
        if self.pp_group is not None:
            # Each pipeline rank holds other parameters: add their squared norms up.
            squared = norm**2
            dist.all_reduce(squared, group=self.pp_group)
            norm = squared.sqrt()
        if self.schedule.grad_clip > 0 and self.clip_in_step:
            # grads × min(1, clip / norm), as clip_grads_with_norm_ does, applied by the step.
            scale = torch.clamp((norm + 1e-6) / self.schedule.grad_clip, min=1.0)
            for optimizer in self.optimizers:
                optimizer.grad_scale = scale
        elif self.schedule.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.schedule.grad_clip, norm)
        return norm

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer.__dict__.pop("grad_scale", None)
