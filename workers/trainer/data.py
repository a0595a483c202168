"""Training data: token files, prepared datasets or a synthetic source, mixed and sampled by step.

Which sequences make up step s's global batch is a pure function of the seed,
the mixture and the data position a run started from: sample g = s·global_batch
+ j (counted over the whole run) goes to dataset d by a weighted choice seeded
by (seed, g), and is that dataset's k-th sample, k counting the samples it got
before g; its k-th sample is window perm_e[k mod W] of epoch e = k div W, where
the dataset is cut into W windows of seq_len + 1 tokens and perm_e is a
permutation seeded by (seed, the dataset's name, e). Each data-parallel rank
takes its contiguous slice of the global batch. So a run resumed at step s, on
any number of data-parallel ranks, sees exactly the batches an uninterrupted
run would have seen. A checkpoint records the samples consumed in all and from
each dataset (by name), so a run resumed with another global batch carries on
from the same place in the data, and one resumed with other weights (or more
datasets) takes up each dataset where it was, repeating nothing.

One dataset alone (run.json's data.dataset) is a mixture of one: its k is g
and its permutations are seeded by (seed, e) alone, as before mixtures.

Token file format (what prepare.py writes): a 256-byte header, `CPTOKENS` then
JSON {"version", "dtype", "vocab_size", "tokens", "tokenizer"} padded with
spaces, followed by the tokens as little-endian uint16 (vocabularies up to
65,536) or uint32. A prepared dataset is a directory of such files with an
index (shards.py).
"""

import json
import zlib
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
        self.vocab_size = self.info.vocab_size
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


@dataclass(frozen=True)
class Component:
    """One dataset of a mixture: its name (its position in checkpoints), windows and weight."""

    name: str
    source: object
    weight: float = 1.0
    path: str | None = None


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each value (uint64 arithmetic wraps, as meant)."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Mixture:
    """Datasets with weights: which dataset each sample of the run comes from."""

    def __init__(self, components: list[Component], *, seed: int):
        if not components:
            raise ValueError("a mixture needs at least one dataset")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise ValueError(f"the mixture's datasets need distinct names: {names}")
        if any(not c.weight > 0 for c in components):
            raise ValueError("every dataset's weight must be above 0")
        self.components = components
        self.seed = seed
        weights = np.asarray([c.weight for c in components], dtype=np.float64)
        self._bounds = np.cumsum(weights / weights.sum())[:-1]
        self._salt = np.uint64((seed * 0x9E3779B1 + 0x632BE5AB) % 2**64)

    @classmethod
    def single(cls, source, *, seed: int, name: str = "dataset") -> "Mixture":
        return cls([Component(name, source)], seed=seed)

    def __len__(self) -> int:
        return len(self.components)

    def assign(self, start: int, stop: int) -> np.ndarray:
        """The dataset of each sample start … stop - 1: a weighted choice seeded by (seed, g)."""
        if len(self.components) == 1:
            return np.zeros(stop - start, dtype=np.int64)
        hashed = _splitmix64(np.arange(start, stop, dtype=np.uint64) ^ self._salt)
        uniform = (hashed >> np.uint64(11)).astype(np.float64) / 2.0**53
        return np.searchsorted(self._bounds, uniform, side="right").astype(np.int64)

    def counts(self, start: int, stop: int) -> np.ndarray:
        """How many of samples start … stop - 1 each dataset gets."""
        if len(self.components) == 1:
            return np.asarray([max(stop - start, 0)], dtype=np.int64)
        counts = np.zeros(len(self.components), dtype=np.int64)
        for chunk in range(start, stop, 1 << 22):  # bounded memory for long replays
            counts += np.bincount(
                self.assign(chunk, min(chunk + (1 << 22), stop)), minlength=len(counts)
            )
        return counts


class Batches:
    """Step s → this rank's (inputs, targets), each (local_batch, seq_len), on the CPU."""

    def __init__(self, source, *, seed: int, global_batch: int, dp_rank: int, dp_size: int):
        if global_batch % dp_size:
            raise ValueError(f"global_batch {global_batch} does not split over {dp_size} ranks")
        self.mixture = source if isinstance(source, Mixture) else Mixture.single(source, seed=seed)
        self.seed = seed
        self.global_batch = global_batch
        self.local_batch = global_batch // dp_size
        self.dp_rank = dp_rank
        self._orders: dict[int, tuple[int, torch.Tensor]] = {}  # dataset → (epoch, permutation)
        self.rebase(0, 0)

    @property
    def source(self):
        """The first dataset's windows (the only one, without a mixture)."""
        return self.mixture.components[0].source

    def _window_of(self, dataset: int, sample: int) -> int:
        """The window of `dataset`'s sample number `sample` (counted over the run)."""
        component = self.mixture.components[dataset]
        if isinstance(component.source, SyntheticSource):
            return sample  # endless and already varied: no shuffling needed
        epoch, position = divmod(sample, component.source.windows)
        known = self._orders.get(dataset)
        if known is None or known[0] != epoch:
            seed = self.seed * 1_000_003 + epoch
            if len(self.mixture) > 1:  # each dataset its own order
                seed += zlib.crc32(component.name.encode()) << 24
            generator = torch.Generator().manual_seed(seed)
            known = (epoch, torch.randperm(component.source.windows, generator=generator))
            self._orders[dataset] = known
        return int(known[1][position])

    def rebase(self, step: int, samples_seen: int, datasets: list[dict] | None = None) -> None:
        """Continue after `step` with `samples_seen` consumed (a checkpoint's data position).

        Counting from the recorded sample count rather than step × batch keeps the
        order of the data when a resumed job runs with another global batch. Each
        dataset's own count comes from `datasets` (the checkpoint's, by name; one
        not named there starts from its beginning) or, for a checkpoint without
        them, from replaying the mixture's choices up to `samples_seen`.
        """
        self._base_step, self._base_samples = step, samples_seen
        if datasets is not None:
            recorded = {d["name"]: int(d["samples"]) for d in datasets}
            counts = [recorded.get(c.name, 0) for c in self.mixture.components]
            self._base_counts = np.asarray(counts, dtype=np.int64)
        else:
            self._base_counts = self.mixture.counts(0, samples_seen)
        self._cursor = (samples_seen, self._base_counts.copy())

    def samples_before(self, step: int) -> int:
        return self._base_samples + (step - 1 - self._base_step) * self.global_batch

    def _counts_before(self, sample: int) -> np.ndarray:
        """Samples each dataset gave before global sample `sample` (steps mostly go forward)."""
        at, counts = self._cursor
        if sample < at:
            at, counts = self._base_samples, self._base_counts
        counts = counts + self.mixture.counts(at, sample)
        self._cursor = (sample, counts)
        return counts

    def draws(self, first: int, count: int) -> list[tuple[int, int]]:
        """(dataset, its sample number) of global samples first … first + count - 1."""
        counts = self._counts_before(first).copy()
        out = []
        for dataset in self.mixture.assign(first, first + count).tolist():
            out.append((dataset, int(counts[dataset])))
            counts[dataset] += 1
        return out

    def at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of step `step` (steps count from 1): inputs and next-token targets."""
        first = self.samples_before(step) + self.dp_rank * self.local_batch
        rows = torch.stack(
            [
                self.mixture.components[dataset].source.window(self._window_of(dataset, sample))
                for dataset, sample in self.draws(first, self.local_batch)
            ]
        )
        return rows[:, :-1], rows[:, 1:]

    def position(self, step: int) -> dict:
        """What a checkpoint taken after `step` records about the data."""
        seen = self.samples_before(step + 1)
        counts = self._counts_before(seen)
        datasets = [
            {
                "name": c.name,
                "path": c.path,
                "weight": c.weight,
                "samples": int(n),
                "epoch": int(n) // c.source.windows,
            }
            for c, n in zip(self.mixture.components, counts.tolist(), strict=True)
        ]
        return {
            "samples_seen": seen,
            "epoch": datasets[0]["epoch"] if len(datasets) == 1 else None,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "datasets": datasets,
        }
