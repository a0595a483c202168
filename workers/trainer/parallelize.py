"""Every kind of parallelism the trainer uses, applied from outside the model, over one mesh.

The world is one DeviceMesh of four named dimensions, outermost first:
pp × dp_replicate × dp_shard × tp. Tensor parallelism is innermost, so its
ranks are neighbours on one node (the control plane makes tp divide a node's
GPUs); pipeline stages are outermost, so their point-to-point traffic is the
one that crosses the slowest links.

A model part (the whole model, or one pipeline stage of it) is transformed in
a fixed order, each step on what the previous one produced:

1. tensor parallelism with sequence parallelism (parallelize_module);
2. activation checkpointing of each block (none, selective or full);
3. torch.compile of each block;
4. data parallelism: FSDP2 (fully_shard), HSDP (fully_shard over
   dp_replicate × dp_shard), or DDP when data parallelism is pure replication
   without tensor parallelism.

Parameters stay on the meta device through all of it; train.py materialises
and initialises them afterwards (Transformer.init_weights), except under DDP,
whose wrapper wants real parameters and is applied last (wrap_ddp).
"""

import copy
import datetime as dt
import logging
import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from workers.trainer.config import ConfigError, RunConfig, microbatches, stage_count
from workers.trainer.model import Transformer

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
FLOAT8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper on


@dataclass
class World:
    """This process's place in the job: ranks, device, mesh and what the layout implies."""

    rank: int
    size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    config: RunConfig

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_logger(self) -> bool:
        return self.rank == 0

    def coordinate(self, dim: str) -> int:
        return self.mesh[dim].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp_replicate") * self.config.layout.dp_shard + self.coordinate(
            "dp_shard"
        )

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    @property
    def holds_loss(self) -> bool:
        """Whether this rank reports its data-parallel group's loss: the last pipeline stage
        computes it, and of a tensor-parallel group only the first rank counts it."""
        return self.coordinate("tp") == 0 and self.pp_rank == self.config.layout.pp - 1

    @property
    def compute_dtype(self) -> torch.dtype:
        """bf16 on GPUs when asked for (fp8 too, around its float8 products); CPUs (local
        nodes, tests) train in fp32."""
        mixed = self.config.mixed_precision
        return torch.bfloat16 if self.on_gpu and mixed else torch.float32

    @property
    def data_parallel(self) -> str:
        """none, ddp or fsdp (FSDP2; HSDP when dp_replicate > 1 too)."""
        layout = self.config.layout
        if layout.dp == 1:
            # On one GPU FSDP2 can still serve as the mixed-precision policy (bf16 compute
            # and activations, fp32 master weights and gradients) in place of autocast.
            single = self.config.kernels.single_gpu_fsdp and self.compute_dtype != torch.float32
            return "fsdp" if single else "none"
        if layout.dp_shard == 1 and layout.tp == 1:
            return "ddp"
        return "fsdp"

    @property
    def autocast(self):
        """Mixed precision where FSDP's policy does not provide it: autocast to bf16."""
        if self.compute_dtype == torch.float32 or self.data_parallel == "fsdp":
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


# The flight recorder's old names (what NCCL profiles set, so that torches from before the
# rename read them too) and the names this torch reads first; under the old ones it logs a
# deprecation warning on every rank.
FLIGHT_RECORDER_RENAMES = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_CPP_STACK": "TORCH_FR_CPP_STACK",
}


def use_current_flight_recorder_names(env=os.environ) -> None:
    """Pass the flight recorder's settings on under the names this torch reads first (a
    value already given under the new name wins, as it would in torch)."""
    for old, new in FLIGHT_RECORDER_RENAMES.items():
        if old in env:
            value = env.pop(old)
            env.setdefault(new, value)


def start_world(config: RunConfig) -> World:
    """Join the process group torchrun set up (or make a world of one) and build the mesh."""
    use_current_flight_recorder_names()  # before the process group makes the recorder
    rank, size, local_rank = world_of_one_unless_torchrun()
    layout = config.layout
    if layout.world_size != size:
        raise ValueError(
            f"the layout {layout.as_dict()} needs {layout.world_size} processes; "
            f"torchrun started {size}"
        )
    device, _ = join_process_group(local_rank, timeout_s=config.collective_timeout_s)
    mesh = init_device_mesh(
        device.type,
        (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp),
        mesh_dim_names=MESH_DIMS,
    )
    return World(rank, size, local_rank, device, mesh, config)


def world_of_one_unless_torchrun() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables; run directly, a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    return (
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", "0")),
    )


def join_process_group(local_rank: int, *, timeout_s: float) -> tuple[torch.device, str]:
    """This process's device and backend (NCCL on its GPU, else gloo), the group joined."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(
        backend, timeout=dt.timedelta(seconds=timeout_s), device_id=_device_id(device)
    )
    return device, backend


def _device_id(device: torch.device):
    # Binding NCCL to the device at init lets it set up communicators eagerly.
    return device if device.type == "cuda" else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- pipeline stages ------------------------------------------------------------------------


def split_stages(model: Transformer, world: World) -> list[tuple[int, Transformer]]:
    """This rank's pipeline stages as (stage index, the model with only that stage's parts).

    1F1B gives each rank one stage; interleaved 1F1B gives rank r the stages r,
    r + pp, r + 2·pp... (the "loop" assignment), each a slice of consecutive
    blocks. A stage is a copy of the (meta) model with the blocks and ends it
    does not own deleted, so parameter names are those of the whole model.
    """
    layout = world.config.layout
    if layout.pp == 1:
        return [(0, model)]
    stages = stage_count(world.config)
    per_stage = model.shape.layers // stages
    out = []
    for stage in range(world.pp_rank, stages, layout.pp):
        part = copy.deepcopy(model)
        keep = range(stage * per_stage, (stage + 1) * per_stage)
        for name in list(part.layers):
            if int(name) not in keep:
                del part.layers[name]
        if stage > 0:
            part.tok_embeddings = None
        if stage < stages - 1:
            part.norm = None
            part.output = None
        out.append((stage, part))
    return out


def pipeline_schedule(stages: list[tuple[int, nn.Module]], world: World, loss_fn):
    """The torch.distributed.pipelining schedule that drives this rank's stages."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    config = world.config
    count = stage_count(config)
    group = world.mesh["pp"].get_group()
    built = [
        PipelineStage(
            module,
            index,
            count,
            world.device,
            input_args=_stage_tensor(index == 0, False, world),
            output_args=_stage_tensor(False, index == count - 1, world),
            group=group,
        )
        for index, module in stages
    ]
    n = microbatches(config)
    # Each microbatch's loss is a mean over its tokens; the schedule divides the
    # summed gradients by the number of microbatches (scale_grads), so a step's
    # gradient is the mean over the whole batch, as without pipelining.
    if config.pipeline.schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(built, n_microbatches=n, loss_fn=loss_fn)
    return Schedule1F1B(built[0], n_microbatches=n, loss_fn=loss_fn)


def _stage_tensor(tokens: bool, logits: bool, world: World) -> torch.Tensor:
    """What passes into or out of a stage for one microbatch, as a meta tensor.

    Stating it spares the pipeline from inferring shapes at the first step
    (under torch 2.11 on the CPU, pipelines left to infer them failed there).
    Between stages flows the residual stream: its local sequence shard under
    tensor parallelism, in bf16 where FSDP gathers bf16 parameters and in fp32
    under autocast or on CPUs. The last stage returns whole logits.
    """
    config = world.config
    micro = config.local_batch // microbatches(config)
    seq = config.data.seq_len
    if tokens:
        return torch.empty((micro, seq), dtype=torch.int64, device="meta")
    if logits:
        shape, dtype = (micro, seq, config.model.vocab_size), world.compute_dtype
    else:
        hidden = world.compute_dtype if world.data_parallel == "fsdp" else torch.float32
        shape, dtype = (micro, seq // config.layout.tp, config.model.dim), hidden
    # requires_grad: gradients flow back through it (the stage before gets them).
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


# --- the transforms, in order ---------------------------------------------------------------


def parallelize(model: Transformer, world: World) -> Transformer:
    """Apply float8, TP, activation checkpointing, compile and FSDP to one model part, in
    that order."""
    config = world.config
    kernels = config.kernels
    float8 = config.precision == "fp8"
    model.use_kernels(
        # Fused projections concatenate whole weights, which tensor parallelism splits, and
        # multiply them outside the linear layers that float8 replaces.
        fused_projections=kernels.fused_projections and config.layout.tp == 1 and not float8,
        # Only the flash and math kernels of SDPA group queries themselves.
        native_gqa=kernels.native_gqa and config.attention_backend in ("auto", "flash", "math"),
    )
    if float8:
        apply_float8(model, world)
    if config.layout.tp > 1:
        apply_tensor_parallel(model, world.mesh["tp"])
    if config.activation_checkpointing != "none":
        apply_activation_checkpointing(model, config.activation_checkpointing)
    if config.compile and kernels.coordinate_descent_tuning:
        import torch._inductor.config as inductor

        inductor.coordinate_descent_tuning = True
    if config.compile and kernels.compile_scope == "blocks":  # else train.Model compiles it all
        for block in model.layers.values():
            block.compile(fullgraph=True, mode=kernels.compile_mode)
    if world.data_parallel == "fsdp":
        apply_fsdp(model, world)
    return model


def apply_float8(model: Transformer, world: World) -> None:
    """The blocks' linear layers multiply in float8: torchao's Float8Linear, with dynamic
    scales as kernels.float8_recipe says (by default one per tensor: inputs and weights
    in e4m3, output gradients in e5m2), the results in bf16. Weights, gradients and
    optimizer state keep their dtypes and names, so a checkpoint resumes under any
    precision. The embedding, norms, attention and output head stay in bf16. On CPUs
    (tests) torch's own float8 products serve, in fp32.
    """
    if world.on_gpu:
        capability = torch.cuda.get_device_capability(world.device)
        if capability < FLOAT8_CAPABILITY:
            name = torch.cuda.get_device_name(world.device)
            raise ConfigError(
                f"precision fp8 needs FP8 tensor cores (compute capability "
                f"{'.'.join(map(str, FLOAT8_CAPABILITY))} on); {name} has "
                f"{'.'.join(map(str, capability))}"
            )
    # At import torchao warns about compiled extensions it cannot load on this machine, and
    # torch about how torchao registers an enum; float8 training needs neither.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as error:
        raise ConfigError(f"precision fp8 needs the torchao package: {error}") from error
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)
    recipe = Float8LinearConfig.from_recipe_name(world.config.kernels.float8_recipe)
    for block in model.layers.values():
        convert_to_float8_training(block, config=recipe)


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism.

    Between blocks the residual stream is split along the sequence (Shard(1)),
    so norms and residual adds run on 1/tp of the tokens. Attention and the
    feed-forward gather the sequence at their input, split heads (column-wise
    q, k, v, w1, w3) and reduce-scatter back to sequence shards at their output
    (row-wise wo, w2). The embedding is split by vocabulary rows and the output
    head by vocabulary columns, its logits gathered whole for the loss.
    """
    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(
        model, tp_mesh, {name: style for name, style in ends.items() if getattr(model, name)}
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None),
                    desired_input_layouts=(Replicate(), None, None),
                    use_local_output=True,
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


# Selective checkpointing keeps what is expensive to recompute (matrix products,
# attention, the collectives of tensor parallelism) and recomputes the rest
# (norms, rotary embeddings, activations, residual adds): most of the memory of
# full recomputation is saved for a few per cent of the time.
_aten = torch.ops.aten
_KEEP = {
    _aten.mm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}
for _name in ("_scaled_dot_product_cudnn_attention",):
    if hasattr(_aten, _name):
        _KEEP.add(getattr(_aten, _name).default)
if hasattr(torch.ops, "_c10d_functional"):
    _KEEP.add(torch.ops._c10d_functional.reduce_scatter_tensor.default)


def _keep_expensive(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, mode: str) -> None:
    """Recompute each block's activations in the backward pass, all of them or the cheap ones.

    The block's forward is replaced rather than the block wrapped in another
    module, so parameter names (and checkpoints) do not depend on this setting.
    """
    context_fn = (
        partial(create_selective_checkpoint_contexts, _keep_expensive)
        if mode == "selective"
        else None
    )
    for block in model.layers.values():
        forward = block.forward
        kwargs = {"use_reentrant": False, "preserve_rng_state": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn

        def recomputed(*args, _forward=forward, _kwargs=kwargs):
            return checkpoint(_forward, *args, **_kwargs)

        block.forward = recomputed


def apply_fsdp(model: Transformer, world: World) -> None:
    """FSDP2 per block and at the root; HSDP when dp_replicate > 1 as well.

    On GPUs parameters are gathered in bf16 and gradients reduced in fp32; on
    CPUs everything stays fp32. Pipeline stages keep their gathered parameters
    between forward and backward, since each runs several microbatches.
    """
    layout = world.config.layout
    if layout.dp_replicate > 1:
        mesh = world.mesh["dp_replicate", "dp_shard"]
    else:
        mesh = world.mesh["dp_shard"]
    policy = MixedPrecisionPolicy(param_dtype=world.compute_dtype, reduce_dtype=torch.float32)
    reshard = layout.pp == 1
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)


def wrap_ddp(model: nn.Module, world: World) -> nn.Module:
    """DDP over dp_replicate, for layouts whose data parallelism is replication alone."""
    from torch.nn.parallel import DistributedDataParallel

    group = world.mesh["dp_replicate"].get_group()
    device_ids = [world.device.index] if world.on_gpu else None
    return DistributedDataParallel(model, process_group=group, device_ids=device_ids)
