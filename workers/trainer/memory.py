"""How much GPU memory one rank of the bundled trainer needs: a model of it, with no torch.

The control plane imports this to say whether a job fits before it queues
(apps/jobs/advisor.py); bench/advisor.py checks it against the trainer's
measured peak on a GPU, and bench/RESULTS.md keeps that table.

The estimate is of the moment memory peaks, on the rank that peaks (the first
pipeline rank holds the most activations, the last the logits), as lines that
add up to the total:

- parameters: fp32 master weights, this rank's share (÷ tp, ÷ pp stages, ÷
  dp_shard under FSDP);
- copies: the bf16 weights the step computes with (autocast's cached casts, or
  the blocks FSDP gathers);
- gradients: fp32, this rank's share, as many as exist at the peak (at the start
  of the backward pass only the output head's; at the optimizer step all);
- optimizer: AdamW's two fp32 moments per parameter;
- activations: what the forward pass saves for the backward pass, per token and
  layer, for the microbatches in flight, under the activation-checkpointing mode
  (none saves everything, selective keeps the matrix products and attention and
  recomputes the rest, full keeps each block's input and recomputes one block
  at a time), the compiler fusing some of it away;
- output: the logits and the loss's working copies for one microbatch (the
  vocabulary is the widest tensor a step makes);
- buffers: DDP's gradient buckets, the cuBLAS workspaces;
- runtime: the CUDA context, NCCL's buffers and the allocator's fragmentation,
  which torch's max_memory_allocated does not count (so `allocated` leaves it
  out: that is the figure the trainer's `peak_mem_gib` measures).

The per-token byte counts follow the model's code (workers/trainer/model.py);
the factors in CALIBRATION scale them to what the H200 measured, row by row in
bench/RESULTS.md ("Memory model").
"""

from dataclasses import dataclass, field

from workers.trainer.config import RunConfig, microbatches, parse, stage_count
from workers.trainer.presets import ModelShape

GIB = 2**30
LINES = (
    "parameters",
    "copies",
    "gradients",
    "optimizer",
    "activations",
    "output",
    "buffers",
    "runtime",
)

# Usable memory per GPU type, GiB (what the driver reports as total on the SXM parts).
GPU_MEMORY_GIB = {"H100": 79.6, "H200": 139.8, "A100": 79.2}
TIGHT = 0.9  # a total above this share of the GPU's memory is "tight"

# Measured against estimated activations, per (mode, compiled): `python -m bench.advisor
# --fit rows.json` on the H200 rows of 2026-12-05 (bench/RESULTS.md, "Memory model") gives
# each mode the factor, in hundredths, with the least sum of squared relative errors
# over its rows (every row within 7.1%). Where the count and the measure part (eager
# saves 0.85 of the count without checkpointing, compiled 1.36) is not traced to a tensor.
CALIBRATION = {
    ("none", False): 0.85,
    ("none", True): 1.36,
    ("selective", False): 0.96,
    ("selective", True): 0.88,
    ("full", False): 0.92,
    ("full", True): 0.79,
}
CUDA_CONTEXT = 0.6 * GIB  # the context and its kernels' modules, per process
NCCL_BUFFERS = 0.5 * GIB  # per process in a world of several
CUBLAS_WORKSPACE = 32 * 2**20
FRAGMENTATION = 0.05  # of what is allocated: blocks the caching allocator cannot reuse


@dataclass(frozen=True)
class Estimate:
    """Bytes on one GPU at the peak, by line; `rank` says which rank that is."""

    lines: dict[str, int]
    rank: str = "the only rank"
    # The rank's whole share of the fp32 state (after the first update), which the trainer
    # reports as its "state_bytes" event: parameters, gradients, optimizer.
    states: dict[str, int] = field(default_factory=dict)

    @property
    def allocated(self) -> int:
        return sum(v for k, v in self.lines.items() if k != "runtime")

    @property
    def total(self) -> int:
        return sum(self.lines.values())

    def fit(self, gpu_memory_gib: float) -> str:
        """fits, tight (within 10% of the GPU's memory) or no."""
        total = self.total / GIB
        if total > gpu_memory_gib:
            return "no"
        return "tight" if total > TIGHT * gpu_memory_gib else "fits"

    def as_dict(self) -> dict:
        return {
            "lines": {k: round(v / GIB, 2) for k, v in self.lines.items()},
            "allocated_gib": round(self.allocated / GIB, 2),
            "total_gib": round(self.total / GIB, 2),
            "rank": self.rank,
        }


@dataclass(frozen=True)
class _Rank:
    """What one pipeline rank holds."""

    name: str
    blocks: int  # transformer blocks on this rank
    embedding: bool
    head: bool  # the final norm and the output head
    in_flight: float  # microbatches whose activations it holds at once


def estimate(config: RunConfig, *, gpu: bool = True) -> Estimate:
    """The peak of the rank that needs the most, for a parsed run.json."""
    return max(estimate_ranks(config, gpu=gpu), key=lambda e: e.total)


def estimate_ranks(config: RunConfig, *, gpu: bool = True) -> list[Estimate]:
    """The first pipeline rank's estimate (global rank 0's), then the last's if pp > 1."""
    return [_rank_estimate(config, rank, gpu=gpu) for rank in _pipeline_ranks(config)]


def for_run(data: dict, *, gpu: bool = True) -> Estimate:
    """estimate() of a run.json's contents; ConfigError names what is wrong with it."""
    return estimate(parse(data), gpu=gpu)


def _pipeline_ranks(config: RunConfig) -> list[_Rank]:
    pp, layers = config.layout.pp, config.model.layers
    if pp == 1:
        return [_Rank("the only rank", layers, True, True, 1)]
    stages = stage_count(config)
    per_rank = stages // pp
    count = microbatches(config)
    if config.pipeline.schedule == "interleaved_1f1b":
        # Rank 0's warm-up runs (per_rank − 1)·pp + 2(pp − 1) forward chunks before its
        # first backward; each chunk is one stage (a 1/per_rank share of its blocks).
        chunks = min((per_rank - 1) * pp + 2 * (pp - 1) + 1, count * per_rank)
        first_in_flight = chunks / per_rank
    else:
        first_in_flight = min(pp, count)  # 1F1B: rank 0 runs pp forwards before a backward
    blocks = layers // pp
    return [
        _Rank("the first pipeline rank", blocks, True, False, first_in_flight),
        _Rank("the last pipeline rank", blocks, False, True, 1),
    ]


def _parallelism(config: RunConfig, *, gpu: bool) -> str:
    """none, ddp or fsdp, as parallelize.World.data_parallel decides."""
    layout = config.layout
    if layout.dp == 1:
        bf16 = gpu and config.mixed_precision
        return "fsdp" if config.kernels.single_gpu_fsdp and bf16 else "none"
    if layout.dp_shard == 1 and layout.tp == 1:
        return "ddp"
    return "fsdp"


def _rank_estimate(config: RunConfig, rank: _Rank, *, gpu: bool) -> Estimate:
    shape, layout = config.model, config.layout
    tp = layout.tp
    mode = _parallelism(config, gpu=gpu)
    # Bytes per element. fp8 counts as bf16: an upper bound, since its linear layers keep
    # their inputs for the backward in one byte.
    compute = 2 if gpu and config.mixed_precision else 4
    autocast = compute == 2 and mode != "fsdp"
    residual = 4 if autocast or compute == 4 else 2  # autocast keeps the residual stream fp32
    shard = layout.dp_shard if mode == "fsdp" else 1

    norms = 2 * shape.dim  # RMSNorm weights: whole on every tensor-parallel rank
    block_matrices = (shape.block_parameters() - norms) / tp
    block = block_matrices + norms
    embedding = shape.vocab_size * shape.dim / tp if rank.embedding else 0
    head = (shape.vocab_size * shape.dim / tp + shape.dim) if rank.head else 0
    held = rank.blocks * block + embedding + head  # this rank's parameters before sharding

    # Compute copies: autocast caches a bf16 cast of each matrix it multiplies (blocks' casts
    # live as long as the saved activations, so not under checkpointing); FSDP gathers
    # the root's parameters for the step and a block or two at a time (all of a stage's
    # under pipelining, which keeps them gathered between microbatches).
    copies = 0.0
    if autocast:
        copies = compute * (head - (shape.dim if rank.head else 0))
        if config.activation_checkpointing == "none":
            copies += compute * rank.blocks * block_matrices
    elif mode == "fsdp" and compute == 2:
        gathered = held if layout.pp > 1 else embedding + head + 2 * block
        copies = compute * gathered

    tokens = _micro_batch(config) * config.data.seq_len
    per_layer = _activation_bytes(config, shape, compute=compute, residual=residual) / tp
    acts = per_layer * tokens * rank.blocks * rank.in_flight
    if config.activation_checkpointing != "none":
        # The block being recomputed in the backward pass holds its activations whole.
        acts += _activation_bytes(config, shape, compute, residual, recompute=True) / tp * tokens
    output = _output_bytes(config, shape, compute=compute) * tokens if rank.head else 0.0

    params = 4 * held / shard
    all_grads = 4 * held / shard
    if rank.embedding and tp > 1 and mode != "fsdp":
        # Under TP without FSDP (which reduce-scatters it into shards) the embedding table's
        # gradient comes back whole on every rank, not in its 1/tp share (measured with gloo
        # in tests/workers/trainer/test_training.py).
        all_grads += 4 * embedding * (tp - 1)
    optimizer = 8 * held / shard
    head_grads = 4 * head / shard
    buffers = CUBLAS_WORKSPACE + (4 * held if mode == "ddp" else 0)

    # Two moments compete for the peak: the start of the backward pass (every activation
    # and the loss's copies held, only the head's gradients made) and its end (every
    # gradient made, the last block's still unreduced, the activations freed).
    end = all_grads + 2 * compute * block
    # Accumulating over microbatches (one rank, no pipeline): the first microbatch's backward
    # pass made every gradient, so each later one starts its backward pass holding them all.
    accumulating = layout.pp == 1 and config.local_batch > _micro_batch(config)
    start_grads = all_grads if accumulating else head_grads
    if acts + output + start_grads >= end:
        grads, moment = start_grads, "at the start of the backward pass"
    else:  # the activations are small beside the state: they are freed by then
        grads, acts, output = end, 0.0, 0.0
        moment = "at the end of the backward pass"

    lines = {
        "parameters": params,
        "copies": copies,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": acts,
        "output": output,
        "buffers": buffers,
    }
    allocated = sum(lines.values())
    runtime = CUDA_CONTEXT + (NCCL_BUFFERS if layout.world_size > 1 else 0)
    lines["runtime"] = runtime + FRAGMENTATION * allocated
    states = {"parameters": params, "gradients": all_grads, "optimizer": optimizer}
    return Estimate(
        {k: int(v) for k, v in lines.items()},
        rank=f"{rank.name}, {moment}",
        states={k: int(v) for k, v in states.items()},
    )


def _micro_batch(config: RunConfig) -> int:
    """Sequences in one forward pass on one rank."""
    local = config.local_batch
    if config.layout.pp > 1:
        return max(1, local // microbatches(config))
    return config.schedule.micro_batch or local


def _activation_bytes(
    config: RunConfig, shape: ModelShape, compute: int, residual: int, *, recompute: bool = False
) -> float:
    """Bytes one block saves for the backward pass, per token (before tp divides them).

    d is the model width, f the feed-forward width, kv the key/value width; c the
    compute dtype's bytes and r the residual stream's. Eager, nothing recomputed:
    each RMSNorm keeps its input and normalised output (2r·d); autocast casts the
    normalised input once per projection (3c·d for q, k, v and 2c·d for the gate and
    up projections; once each, c·d, without autocast); attention keeps the rotated q
    and k and v (c·(d + 2kv)) and its output (c·d); SwiGLU keeps the gate, the up
    projection, silu of the gate and their product (4c·f). Compiled, the norms, casts,
    rotations and SwiGLU's elementwise work are fused and recomputed: the block input
    and the middle of the residual stream (2r·d), attention's inputs and output
    (c·(2d + 2kv)), gate and up (2c·f). Selective checkpointing keeps what the matrix
    products and attention returned and the block input. Full keeps the block input.
    """
    d, f = shape.dim, shape.ffn_dim
    kv = shape.kv_heads * shape.head_dim
    c, r = compute, residual
    mode = "none" if recompute else config.activation_checkpointing
    compiled = config.compile
    casts = (5 if c != r else 2) * c * d
    if mode == "none" and not compiled:
        saved = 4 * r * d + casts + c * (2 * d + 2 * kv) + 4 * c * f
    elif mode == "none":
        saved = 2 * r * d + c * (2 * d + 2 * kv) + 2 * c * f
    elif mode == "selective":
        # q, k, v, attention's output, wo's and w2's outputs, gate and up; the block input.
        saved = r * d + c * (4 * d + 2 * kv) + 2 * c * f
    else:
        saved = r * d
    if recompute:
        return saved
    return saved * CALIBRATION[mode, compiled]


def _output_bytes(config: RunConfig, shape: ModelShape, compute: int) -> float:
    """Per token of one microbatch: the logits and the loss's copies at the loss's backward.

    Eager: the logits (c·V) are upcast (4V) and log-softmax keeps its fp32 result
    (4V), the upcast freed; the peak is log-softmax's backward, which holds that
    result, the gradient nll_loss gave it and the gradient it makes (3 × 4V); the
    bf16 logits and the cast of their gradient (c·V) come and go outside it.
    Compiled, the loss is one kernel each way: the logits and their gradient (2c·V).
    The H200 rows of the `small` preset, where the logits outweigh the blocks,
    measured these (bench/RESULTS.md, "Memory model": the model counted 4V more
    each way until 2026-12-05).
    """
    vocab = shape.vocab_size
    if config.compile:
        return 2 * compute * vocab
    return 12 * vocab


def gpu_memory_gib(gpu_type: str) -> float | None:
    return GPU_MEMORY_GIB.get(gpu_type)
