"""The training loop: build, resume, then step until done or asked to stop.

Each step: the learning rate for the step, forward and backward over this
rank's share of the batch (through the pipeline schedule when there is one),
clipping, the optimizer step, then one small all-reduce in which every rank
adds its part of the loss and its stop flag, so all ranks see the same loss
and agree, after the same step, whether to checkpoint and stop. The host reads
that vote one step late, once the next step is queued, so that the GPU does
not wait for it between steps; a stop asked for lands within two steps.
"""

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.trainer import hf, metrics, parallelize
from workers.trainer.checkpoint import Checkpointer
from workers.trainer.config import RunConfig, stage_count
from workers.trainer.data import Batches, Component, Mixture
from workers.trainer.evaluation import Evaluator, eval_sets
from workers.trainer.model import Transformer, use_attention_backend
from workers.trainer.optim import Optimizers
from workers.trainer.presets import flops_per_token
from workers.trainer.shards import open_source
from workers.trainer.stopping import StepWatchdog, StopSignal


@dataclass
class Outcome:
    reason: str  # finished or preempted
    step: int


@dataclass
class Progress:
    """Where the run is, for the exit status when something fails mid-step."""

    step: int = 0


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Model:
    """This rank's model parts, and how to run forward and backward over a batch with them."""

    def __init__(self, world: parallelize.World):
        self.world = world
        config = world.config
        with torch.device("meta"):
            whole = Transformer(config.model)
        one_graph = config.compile and config.kernels.compile_scope == "model"
        compiled_loss = config.compile and not one_graph
        self.loss_fn = torch.compile(cross_entropy) if compiled_loss else cross_entropy
        stages = parallelize.split_stages(whole, world)
        for _, part in stages:
            parallelize.parallelize(part, world)
            part.to_empty(device=world.device)
            part.init_weights(seed=config.seed, device=world.device)
        if config.init.hf:  # starting weights; a checkpoint resumed from later still wins
            hf.load_into([part for _, part in stages], config.init.hf, config.model)
        if world.data_parallel == "ddp":
            stages = [(index, parallelize.wrap_ddp(part, world)) for index, part in stages]
        self.parts = [part for _, part in stages]
        self.schedule = None
        if config.layout.pp > 1:
            self.schedule = parallelize.pipeline_schedule(stages, world, self.loss_fn)
            self.has_first = any(index == 0 for index, _ in stages)
            self.has_last = any(index == stage_count(config) - 1 for index, _ in stages)
        else:
            self.has_first = self.has_last = True
        self.forward_loss = self._forward_loss
        if one_graph:  # one graph from tokens to loss, so the compiler may fuse across blocks too
            self.forward_loss = torch.compile(self._forward_loss, mode=config.kernels.compile_mode)

    def train(self) -> None:
        for part in self.parts:
            part.train()

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Accumulate this batch's gradients; return its mean loss (0 where no loss is computed)."""
        device = self.world.device
        inputs, targets = (
            inputs.to(device, non_blocking=True),
            targets.to(device, non_blocking=True),
        )
        with self.world.autocast:
            if self.schedule is not None:
                return self._pipelined(inputs, targets)
            return self._accumulated(inputs, targets)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This batch's mean loss, forward only (0 where no loss is computed)."""
        device = self.world.device
        inputs, targets = inputs.to(device), targets.to(device)
        with self.world.autocast:
            if self.schedule is not None:
                return self._pipelined(inputs, targets, run=self.schedule.eval)
            micro = self.world.config.schedule.micro_batch or inputs.shape[0]
            chunks = zip(inputs.split(micro), targets.split(micro), strict=True)
            return torch.stack([self.forward_loss(i, t).float() for i, t in chunks]).mean()

    def _pipelined(self, inputs, targets, run=None) -> torch.Tensor:
        run = run or self.schedule.step
        # Inputs and targets are views of one window each (strides of seq_len + 1); the
        # stages' metadata was taken from contiguous tensors, which torch 2.11 checks.
        inputs, targets = inputs.contiguous(), targets.contiguous()
        losses: list[torch.Tensor] | None = [] if self.has_last else None
        if self.has_first:
            run(inputs, target=targets, losses=losses)
        else:
            run(target=targets, losses=losses)
        if not self.has_last:
            return torch.zeros((), device=self.world.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _accumulated(self, inputs, targets) -> torch.Tensor:
        micro = self.world.config.schedule.micro_batch or inputs.shape[0]
        chunks = list(zip(inputs.split(micro), targets.split(micro), strict=True))
        total = torch.zeros((), device=self.world.device)
        for index, (chunk_inputs, chunk_targets) in enumerate(chunks):
            self._sync_gradients(index == len(chunks) - 1)
            loss = self.forward_loss(chunk_inputs, chunk_targets) / len(chunks)
            loss.backward()
            total += loss.detach().float()
        return total

    def _forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.parts[0](inputs), targets)

    def _sync_gradients(self, sync: bool) -> None:
        """Reduce gradients only after the last microbatch of a step (FSDP2 and DDP)."""
        part = self.parts[0]
        if hasattr(part, "set_requires_gradient_sync"):
            part.set_requires_gradient_sync(sync)
        elif hasattr(part, "require_backward_grad_sync"):
            part.require_backward_grad_sync = sync


@dataclass
class Agreement:
    loss: float
    grad_norm: float
    stop: bool
    save: bool


NO_VOTES = Agreement(loss=0.0, grad_norm=0.0, stop=False, save=False)


class Vote:
    """One all-reduce over the world: a step's figures and whether to stop or save after it.

    Every rank votes to stop (its signal flag); rank 0 alone decides time-based
    saves and contributes the gradient norm (the same on every rank). The loss
    comes from the ranks that hold it and lead their tensor-parallel group
    (last pipeline stage, tp rank 0), each adding its share of the mean.

    The all-reduce and the copy of its result to the host are queued behind the
    step; read() waits for them. The loop reads a step's vote only once the next
    step is queued, so the GPU never idles while the host catches up.
    """

    def __init__(
        self, world: parallelize.World, step: int, lr: float, loss, grad_norm, *, stop, save
    ):
        self.step, self.lr = step, lr
        device = world.device
        holds_loss = world.holds_loss
        zero = torch.zeros((), device=device)
        values = torch.stack(
            [
                loss.float() / world.config.layout.dp if holds_loss else zero,
                grad_norm.float() if world.is_logger else zero,
                # torch.full fills on the device; torch.tensor would copy from the host and wait.
                torch.full((), float(stop), device=device),
                torch.full((), float(save and world.is_logger), device=device),
            ]
        )
        dist.all_reduce(values)
        self._done = None
        # When the step's work was over: on a CPU the work ran in the calls above; on a
        # GPU it runs after they return, and read() learns when it is over.
        self.ended_at: float | None = None
        if device.type == "cuda":  # a pinned copy, made when the stream gets there
            self._values = values.to("cpu", non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._values = values
            self.ended_at = time.perf_counter()

    def read(self) -> Agreement:
        if self._done is not None:
            self._done.synchronize()
        if self.ended_at is None:
            self.ended_at = time.perf_counter()
        mean_loss, norm, stop_votes, save_votes = self._values.tolist()
        return Agreement(mean_loss, norm, stop_votes > 0, save_votes > 0)


@dataclass
class Training:
    """What a run trains with: its world, model parts, optimizers and batches."""

    world: parallelize.World
    model: Model
    optimizers: Optimizers
    batches: Batches
    evaluator: Evaluator

    def step(self, step: int, *, stop: bool = False, save: bool = False) -> Vote:
        """Queue one step (forward, backward, clip, update) and its vote; nothing is read."""
        lr = self.optimizers.set_lr(step)
        loss = self.model.forward_backward(*self.batches.at(step))
        grad_norm = self.optimizers.clip()
        gradients = self._gradient_bytes() if not self.states_told else 0
        self.optimizers.step()
        if not self.states_told:
            self._tell_states(step, gradients)
        return Vote(self.world, step, lr, loss, grad_norm, stop=stop, save=save)

    states_told: bool = False

    def _gradient_bytes(self) -> int:
        return local_bytes(p.grad for part in self.model.parts for p in part.parameters())

    def _tell_states(self, step: int, gradients: int) -> None:
        """Once, after the first update: the bytes this rank holds in its share of the
        parameters, gradients and optimizer state (the memory model's sharded lines, which
        tests check under every layout on the CPU)."""
        self.states_told = True
        if not self.world.is_logger:
            return
        moments = (
            value
            for optimizer in self.optimizers.optimizers
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() > 0
        )
        parameters = (p for part in self.model.parts for p in part.parameters())
        metrics.emit(
            {
                "event": "state_bytes",
                "step": step,
                "parameters": local_bytes(parameters),
                "gradients": gradients,
                "optimizer": local_bytes(moments),
            }
        )


def local_bytes(tensors) -> int:
    """Bytes of this rank's part of each tensor (its shard of a DTensor); None counts 0."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def build(config: RunConfig) -> Training:
    world = parallelize.start_world(config)
    torch.manual_seed(config.seed)
    use_attention_backend(config.attention_backend)
    model = Model(world)
    pp_group = world.mesh["pp"].get_group() if config.layout.pp > 1 else None
    optimizers = Optimizers(model.parts, config.schedule, pp_group=pp_group)
    components = [
        Component(
            part.label,
            open_source(part.path, seq_len=config.data.seq_len, vocab_size=config.model.vocab_size),
            part.weight,
            part.path,
        )
        for part in config.data.parts()
    ]
    batches = Batches(
        Mixture(components, seed=config.seed),
        seed=config.seed,
        global_batch=config.schedule.global_batch,
        dp_rank=world.dp_rank,
        dp_size=config.layout.dp,
    )
    evaluator = Evaluator(world, model, eval_sets(config))
    return Training(world, model, optimizers, batches, evaluator)


def run(config: RunConfig, progress: Progress) -> Outcome:
    stop = StopSignal()
    training = build(config)
    world = training.world
    checkpoints = Checkpointer(world, training.model.parts, training.optimizers, training.batches)
    checkpoints.prepare()
    step = checkpoints.resume()
    progress.step = step

    tokens_per_step = config.schedule.global_batch * config.data.seq_len
    meter = metrics.StepMeter(
        device=world.device,
        tokens_per_step=tokens_per_step,
        flops_per_token=flops_per_token(config.model, config.data.seq_len),
        gpus=world.size,
    )
    meter.resume_at(step)
    if world.is_logger:
        metrics.emit(_start_event(world, step, checkpoints.resumed_from))
    watchdog = StepWatchdog(config.collective_timeout_s, rank=world.rank)
    training.model.train()
    reason = "finished"
    before: Vote | None = None  # the step before's vote, read once this step is queued
    try:
        while step < config.schedule.steps:
            step += 1
            vote = training.step(step, stop=stop.requested, save=checkpoints.due_by_time())
            progress.step = step
            watchdog.beat(step)
            # Every rank reads the same votes at the same points, so all decide alike: a
            # stop or timed save voted at the step before lands after this one; a save
            # due by step count (known to all without a vote) lands after its own step.
            decided = _report(world, meter, before) if before else NO_VOTES
            before = vote
            last = step == config.schedule.steps
            stopping = decided.stop
            saving = decided.save or checkpoints.due_by_steps(step)
            evaluating = training.evaluator.due(step, last=last)
            if not (last or stopping or saving or evaluating):
                continue
            now = _report(world, meter, vote, last=last)  # wait for this step: it ends here
            before = None
            stopping = stopping or now.stop
            if evaluating:  # before the save, so the checkpoint keeps this step's figures
                checkpoints.evaluation = _evaluation_record(training.evaluator.run(step))
                meter.restart_clock()
            if checkpoints.enabled and (saving or stopping or now.save or last):
                watchdog.pause()
                record = checkpoints.save(step, now.loss)
                if record:
                    metrics.emit(record)
                meter.restart_clock()
            if stopping:
                reason = "preempted"
                break
    finally:
        watchdog.close()
    checkpoints.wait_for_copies()
    if world.is_logger:
        metrics.emit({"event": "end", "reason": reason, "step": step, "time": time.time()})
    dist.barrier()
    dist.destroy_process_group()
    return Outcome(reason, step)


def _evaluation_record(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("event", "time")}


def _report(world: parallelize.World, meter: metrics.StepMeter, vote: Vote, *, last=False):
    """Read a step's vote; rank 0 prints the step's figures when they are due."""
    agreed = vote.read()
    if world.is_logger and (vote.step % world.config.log_every == 0 or last):
        metrics.emit(
            meter.step(
                step=vote.step,
                ended_at=vote.ended_at,
                loss=agreed.loss,
                grad_norm=agreed.grad_norm,
                lr=vote.lr,
            )
        )
    return agreed


def _start_event(world: parallelize.World, step: int, resumed_from: str | None) -> dict:
    config = world.config
    return {
        "event": "start",
        "step": step,
        "resumed_from": resumed_from,
        "model": config.model_name,
        "parameters": config.model.parameters(),
        "layout": config.layout.as_dict(),
        "world_size": world.size,
        "device": torch.cuda.get_device_name(world.device) if world.on_gpu else "cpu",
        "precision": config.precision,
        "dtype": str(world.compute_dtype).removeprefix("torch."),
        "data_parallel": world.data_parallel,
        "pipeline": config.pipeline.schedule if config.layout.pp > 1 else None,
        "activation_checkpointing": config.activation_checkpointing,
        "compile": config.compile,
        "attention_backend": config.attention_backend,
        "kernels": dataclasses.asdict(config.kernels),
        "torch": torch.__version__,
        "time": time.time(),
    }
