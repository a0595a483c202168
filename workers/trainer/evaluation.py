"""Evaluation: the loss on held-out data, every N steps and at the end of a run.

What is evaluated: data.eval when run.json names it (a token file, or a
prepared dataset's validation split, or its training split when it has no
validation split), else the validation split of each prepared dataset trained
on. Each is read as `eval.batches` global batches of its first windows, in
order, so every evaluation of a run sees the same sequences and its losses
compare; each data-parallel rank takes its slice of each batch, as in training.

The forward runs as training's does under every layout (through the pipeline
schedule's forward-only pass under pipeline parallelism); as for the training
loss, the ranks that hold a loss (last stage, first tensor-parallel rank) add
their share of the mean in one all-reduce. Rank 0 reports

    {"event": "eval", "step", "loss", "perplexity", "tokens", "time",
     "datasets": {name: {"loss", "perplexity", "tokens"}}}

where loss is the mean of the datasets' losses weighted as the mixture weighs
them, perplexity is exp(loss) and tokens counts the predicted tokens evaluated;
the checkpoint taken after the step keeps the same figures (checkpoint.py).
"""

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.trainer import metrics, shards
from workers.trainer.config import ConfigError, RunConfig
from workers.trainer.shards import open_source


@dataclass(frozen=True)
class EvalSet:
    name: str
    source: object
    weight: float


def eval_sets(config: RunConfig) -> list[EvalSet]:
    """What this run evaluates on; none when evaluation is off."""
    if not config.eval.every:
        return []
    data = config.data

    def opened(path: str, split: str):
        return open_source(
            path, seq_len=data.seq_len, vocab_size=config.model.vocab_size, split=split
        )

    if data.eval:
        split = "train"
        if shards.is_dataset(data.eval) and opened(data.eval, "validation").windows:
            split = "validation"
        source = opened(data.eval, split)
        if source.windows < 1:
            raise ConfigError(f"data.eval {data.eval} holds fewer tokens than one sequence")
        return [EvalSet(data.eval.rstrip("/").rsplit("/", 1)[-1], source, 1.0)]
    sets = []
    for part in data.parts():
        if shards.is_dataset(part.path):
            source = opened(part.path, "validation")
            if source.windows:
                sets.append(EvalSet(part.label, source, part.weight))
    if not sets:
        raise ConfigError(
            "eval: nothing to evaluate on: name data.eval, or train on a prepared dataset "
            "with a validation split (prepare --validation)"
        )
    return sets


def perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class Evaluator:
    def __init__(self, world, model, sets: list[EvalSet]):
        self.world, self.model, self.sets = world, model, sets
        config = world.config
        self.every, self.batches = config.eval.every, config.eval.batches
        self.global_batch = config.schedule.global_batch
        self.local_batch = config.local_batch
        self.tokens_per_set = self.batches * self.global_batch * config.data.seq_len

    def due(self, step: int, *, last: bool) -> bool:
        """Every rank knows alike: every `every` steps, and after the last."""
        return bool(self.sets) and (step % self.every == 0 or last)

    def _batch(self, source, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = number * self.global_batch + self.world.dp_rank * self.local_batch
        rows = torch.stack(
            [source.window((first + j) % source.windows) for j in range(self.local_batch)]
        )
        return rows[:, :-1], rows[:, 1:]

    def run(self, step: int) -> dict:
        """Evaluate every set; every rank returns the event, rank 0 also reports it."""
        zero = torch.zeros((), device=self.world.device)
        share = self.batches * self.world.config.layout.dp
        losses = []
        for evaluated in self.sets:
            total = zero.clone()
            for number in range(self.batches):
                total += self.model.evaluate(*self._batch(evaluated.source, number))
            losses.append(total / share if self.world.holds_loss else zero)
        values = torch.stack(losses)
        dist.all_reduce(values)
        per_set = values.tolist()
        weighted = sum(s.weight * v for s, v in zip(self.sets, per_set, strict=True))
        loss = round(weighted / sum(s.weight for s in self.sets), 6)
        event = {
            "event": "eval",
            "step": step,
            "loss": loss,
            "perplexity": perplexity(loss),
            "tokens": self.tokens_per_set * len(self.sets),
            "datasets": {
                s.name: {
                    "loss": round(v, 6),
                    "perplexity": perplexity(round(v, 6)),
                    "tokens": self.tokens_per_set,
                }
                for s, v in zip(self.sets, per_set, strict=True)
            },
            "time": time.time(),
        }
        if self.world.is_logger:
            metrics.emit(event)
        return event
