"""Model presets as plain data: the trainer builds them, the control plane validates against them.

No torch here (README, "Design"): the web and worker images import this module to
check a job's layout (tp divides heads and KV heads, pp divides layers).

`8b` and `70b` have the shapes Meta published with the Llama 3.1 weights
(layers, model width, heads, KV heads, FFN width, a 128,256-token vocabulary).
`1b` is the 1.1-billion-parameter shape the trainer's benchmark measures
(bench/trainer.py): 22 layers of width 2048, 32 heads sharing 4 KV
heads, FFN 5632, a 32,000-token vocabulary and sequences of 2048. `tiny` and
`small` are ours, for CPU tests and demos.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    dim: int
    heads: int
    kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int = 8192
    # Llama's published values differ in these two (Llama 2: 1e-5 and 10,000; Llama 3:
    # 1e-5 and 500,000), so a model imported from Hugging Face carries its own.
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def block_parameters(self) -> int:
        """One transformer block's parameters: attention, SwiGLU and its two RMSNorms."""
        kv_dim = self.kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2  # q, o and k, v
        feed_forward = 3 * self.dim * self.ffn_dim  # SwiGLU: gate, up, down
        return attention + feed_forward + 2 * self.dim

    def parameters(self) -> int:
        """Parameter count: embeddings and output head untied, RMSNorm weights included."""
        return self.layers * self.block_parameters() + 2 * self.vocab_size * self.dim + self.dim

    def problems(self) -> list[str]:
        out = []
        if self.dim % self.heads:
            out.append("dim must be a multiple of heads")
        if self.heads % self.kv_heads:
            out.append("heads must be a multiple of kv_heads")
        if (self.dim // max(self.heads, 1)) % 2:
            out.append("the head dimension must be even (rotary embeddings)")
        return out


PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(
        layers=4, dim=64, heads=4, kv_heads=2, ffn_dim=192, vocab_size=256, max_seq_len=512
    ),
    "small": ModelShape(
        layers=8, dim=512, heads=8, kv_heads=4, ffn_dim=1536, vocab_size=32000, max_seq_len=2048
    ),
    "1b": ModelShape(
        layers=22, dim=2048, heads=32, kv_heads=4, ffn_dim=5632, vocab_size=32000, max_seq_len=2048
    ),
    "8b": ModelShape(layers=32, dim=4096, heads=32, kv_heads=8, ffn_dim=14336, vocab_size=128256),
    "70b": ModelShape(layers=80, dim=8192, heads=64, kv_heads=8, ffn_dim=28672, vocab_size=128256),
}


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matrices, 12·L·d·S for attention (PaLM's count)."""
    return 6 * shape.parameters() + 12 * shape.layers * shape.dim * seq_len


def preset(name: str) -> ModelShape:
    return PRESETS[name]
