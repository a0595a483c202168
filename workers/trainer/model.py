"""The model: a Llama-style decoder in plain PyTorch, with no parallelism in it.

RMSNorm before attention and before the feed-forward, rotary position
embeddings, SwiGLU, grouped-query attention through the fused
scaled-dot-product kernel. parallelize.py shards, pipelines, recomputes and
compiles it from outside; the code here only has to keep to habits that make
that possible:

- shapes come from the tensors, never from the configuration (`view(b, s, -1,
  head_dim)`), so a tensor-parallel shard with a fraction of the heads runs
  the same code;
- the blocks live in a ModuleDict keyed by their index, so a pipeline stage
  that keeps blocks 8 to 15 still names them `layers.8`..`layers.15` and
  checkpoints move between pipeline layouts;
- the embedding, the final norm and the output head may be None (a pipeline
  stage that does not own them), and forward skips what is missing.
"""

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from workers.trainer.presets import ModelShape


class Attention(nn.Module):
    # Kernel choices (Transformer.use_kernels); parameters and results are the same either way.
    fused_projections = False  # q, k and v from one matrix product over the concatenated weights
    native_gqa = False  # SDPA's own grouped-query attention instead of repeating k and v

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.head_dim = shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.dim, shape.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.fused_projections:
            weight = torch.cat([self.wq.weight, self.wk.weight, self.wv.weight])
            sizes = [self.wq.out_features, self.wk.out_features, self.wv.out_features]
            q, k, v = F.linear(x, weight).split(sizes, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(batch, seq, -1, self.head_dim)
        k = k.view(batch, seq, -1, self.head_dim)
        v = v.view(batch, seq, -1, self.head_dim)
        # The tables cover max_seq_len; the sequence is whatever arrived (under sequence
        # parallelism only q, after the gather, has the whole of it).
        cos, sin = cos[:seq], sin[:seq]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Grouped-query attention: each KV head serves heads/kv_heads query heads. SDPA
        # does that itself only in its flash and math kernels; expanding k and v here
        # keeps every backend (cuDNN, CPU) available.
        group = q.shape[1] // k.shape[1]
        if group > 1 and self.native_gqa:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    fused_projections = False  # w1 x and w3 x from one matrix product

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w1 = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.w3 = nn.Linear(shape.dim, shape.ffn_dim, bias=False)
        self.w2 = nn.Linear(shape.ffn_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_projections:
            gate, up = F.linear(x, torch.cat([self.w1.weight, self.w3.weight])).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, shape: ModelShape, norm_eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(shape.dim, eps=norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = nn.RMSNorm(shape.dim, eps=norm_eps)
        self.feed_forward = FeedForward(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        problems = shape.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleDict(
            {str(i): Block(shape, shape.norm_eps) for i in range(shape.layers)}
        )
        self.norm: nn.RMSNorm | None = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output: nn.Linear | None = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        # Rotary tables are derived, not learned: not saved, rebuilt by init_weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids in (first stage) or hidden states in (later stages); logits or hidden out."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def use_kernels(self, *, fused_projections: bool, native_gqa: bool) -> None:
        """Choose how blocks compute (not what): fused projections need whole, unsplit weights."""
        for block in self.layers.values():
            block.attention.fused_projections = fused_projections
            block.attention.native_gqa = native_gqa
            block.feed_forward.fused_projections = fused_projections

    @torch.no_grad()
    def init_weights(self, *, seed: int, device: torch.device) -> None:
        """Fill every parameter, wherever it lives and however it is sharded, the same way.

        Each parameter's full value comes from its own generator, seeded by the
        run's seed and the parameter's name, on the compute device; each rank
        keeps its own shard of it. So a model initialises identically on one
        process or sixty-four, under any layout, and a pipeline stage gets the
        same blocks it would have had in one piece. Generating the full tensor
        costs a moment per parameter on a GPU, and needs no collective.
        """
        self.rope_cos, self.rope_sin = rotary_tables(self.shape, device)
        depth_scale = 1 / math.sqrt(2 * self.shape.layers)
        for name, param in self.named_parameters():
            name = canonical_name(name)
            if name.endswith("norm.weight"):
                fill(param, torch.ones(param.shape, device=device))
                continue
            std = 0.02
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                std *= depth_scale  # residual branches: keep the stream's variance flat with depth
            elif name == "output.weight":
                std = self.shape.dim**-0.5
            generator = torch.Generator(device=device)
            generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full = torch.randn(param.shape, generator=generator, device=device) * std
            fill(param, full)


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers parallelize.py may have put around its module."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(wrapper, "")
    return name


def fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` (the whole tensor) into `param`, which may be one shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank cuts its own shard from its own copy, no scatter.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def rotary_tables(shape: ModelShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position × frequency, (max_seq_len, head_dim), halves repeated."""
    half = shape.head_dim // 2
    freqs = shape.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(shape.max_seq_len, device=device, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim), the two halves of each head paired.

    Dimension i turns with dimension i + head_dim/2 (the "rotate_half" layout of Hugging
    Face's Llama, not the adjacent pairs of Meta's original code), so q and k weights move
    between the two without a permutation (hf.py).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def use_attention_backend(name: str) -> None:
    """Restrict GPU attention to one fused SDPA kernel ("auto" leaves torch's own choice).

    On Hopper, cuDNN's attention is faster than the flash kernel torch ships for
    head dimension 64; the choice is global and must be made before compiling.
    """
    if name == "auto" or not torch.cuda.is_available():
        return
    backends = torch.backends.cuda
    backends.enable_flash_sdp(name == "flash")
    backends.enable_mem_efficient_sdp(name == "efficient")
    backends.enable_cudnn_sdp(name == "cudnn")
    backends.enable_math_sdp(name == "math")
