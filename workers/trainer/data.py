"""Training data: a memory-mapped token file or a synthetic source, sampled by step.

Which sequences make up step s's global batch is a pure function of the seed,
the global batch size and s: sample g = s·global_batch + j is window
perm_e[g mod W] of epoch e = g div W, where the token file is cut into W
windows of seq_len + 1 tokens and perm_e is a permutation seeded by (seed, e).
Each data-parallel rank takes its contiguous slice of the global batch. So a run
resumed at step s, on any number of data-parallel ranks, sees exactly the
batches an uninterrupted run would have seen. A checkpoint records the number
of samples consumed, so a run resumed with another global batch carries on
from the same place in the data.

Token file format (what prepare.py writes): a 256-byte header, `CPTOKENS` then
JSON {"version", "dtype", "vocab_size", "tokens", "tokenizer"} padded with
spaces, followed by the tokens as little-endian uint16 (vocabularies up to
65,536) or uint32.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"CPTOKENS"
HEADER_BYTES = 256
SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class TokenFileInfo:
    dtype: str
    vocab_size: int
    tokens: int
    tokenizer: dict


def write_header(f, *, dtype: str, vocab_size: int, tokens: int, tokenizer: dict) -> None:
    meta = json.dumps(
        {
            "version": 1,
            "dtype": dtype,
            "vocab_size": vocab_size,
            "tokens": tokens,
            "tokenizer": tokenizer,
        },
        separators=(",", ":"),
    ).encode()
    if len(MAGIC) + len(meta) > HEADER_BYTES:
        raise ValueError("the token file header is too long (tokenizer description too large)")
    f.write(MAGIC + meta.ljust(HEADER_BYTES - len(MAGIC), b" "))


def read_header(path: Path) -> TokenFileInfo:
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head.startswith(MAGIC):
        raise ValueError(
            f"{path} is not a token file (python -m workers.trainer.prepare makes one)"
        )
    meta = json.loads(head[len(MAGIC) :].decode().strip())
    return TokenFileInfo(meta["dtype"], meta["vocab_size"], meta["tokens"], meta["tokenizer"])


def token_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TokenFile:
    """Windows of seq_len + 1 tokens from a memory-mapped file (only the touched pages are read)."""

    def __init__(self, path: str | Path, seq_len: int):
        self.path = Path(path)
        self.info = read_header(self.path)
        self.seq_len = seq_len
        self.tokens = np.memmap(
            self.path,
            dtype=np.dtype(self.info.dtype).newbyteorder("<"),
            mode="r",
            offset=HEADER_BYTES,
            shape=(self.info.tokens,),
        )
        self.windows = (self.info.tokens - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"{path} holds {self.info.tokens} tokens: fewer than one sequence")

    def window(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        chunk = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(chunk)


class SyntheticSource:
    """Learnable sequences without a file: arithmetic progressions modulo the vocabulary.

    Each window has its own start and stride (from its index), so the next token
    follows from the two before it: a model learns it within a few dozen steps,
    and a benchmark gets realistic shapes without reading a disk.
    """

    def __init__(self, vocab_size: int, seq_len: int, windows: int = 1 << 30):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.windows = windows

    def window(self, index: int) -> torch.Tensor:
        start = (index * 7919) % self.vocab_size
        stride = 1 + (index * 104729) % max(self.vocab_size // 8, 1)
        positions = torch.arange(self.seq_len + 1, dtype=torch.int64)
        return (start + stride * positions) % self.vocab_size


class Batches:
    """Step s → this rank's (inputs, targets), each (local_batch, seq_len), on the CPU."""

    def __init__(self, source, *, seed: int, global_batch: int, dp_rank: int, dp_size: int):
        if global_batch % dp_size:
            raise ValueError(f"global_batch {global_batch} does not split over {dp_size} ranks")
        self.source = source
        self.seed = seed
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank = dp_rank
        self._epoch = -1
        self._order: torch.Tensor | None = None
        self._base_step = 0
        self._base_samples = 0

    def _window_of(self, sample: int) -> int:
        epoch, position = divmod(sample, self.source.windows)
        if isinstance(self.source, SyntheticSource):
            return sample  # endless and already varied: no shuffling needed
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = torch.randperm(self.source.windows, generator=generator)
            self._epoch = epoch
        return int(self._order[position])

    def rebase(self, step: int, samples_seen: int) -> None:
        """Continue after `step` with `samples_seen` consumed (a checkpoint's data position).

        Counting from the recorded sample count rather than step × batch keeps the
        order of the data when a resumed job runs with another global batch.
        """
        self._base_step, self._base_samples = step, samples_seen

    def samples_before(self, step: int) -> int:
        return self._base_samples + (step - 1 - self._base_step) * self.global_batch

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of step `step` (steps count from 1): inputs and next-token targets."""
        first = self.samples_before(step) + self.dp_rank * self.local_batch
        rows = torch.stack(
            [self.source.window(self._window_of(first + j)) for j in range(self.local_batch)]
        )
        return rows[:, :-1], rows[:, 1:]

    def position(self, step: int) -> dict:
        """What a checkpoint taken after `step` records about the data."""
        seen = self.samples_before(step + 1)
        return {
            "samples_seen": seen,
            "epoch": seen // self.source.windows,
            "seed": self.seed,
            "global_batch": self.global_batch,
        }


def open_source(dataset: str, *, seq_len: int, vocab_size: int):
    if dataset == SYNTHETIC:
        return SyntheticSource(vocab_size, seq_len)
    source = TokenFile(dataset, seq_len)
    if source.info.vocab_size > vocab_size:
        raise ValueError(
            f"{dataset} uses {source.info.vocab_size} token ids; "
            f"the model's vocabulary has {vocab_size}"
        )
    return source
