"""A prepared dataset directory: token shards of whole documents, with an index.

prepare.py writes one with a published model's tokenizer (`--tokenizer-file`);
the trainer reads its training or validation split as one run of windows.

    <dataset>/
      index.json               what is here (below); written last, so a directory
                               without it is not a dataset
      tokenizer.json           a copy of the tokenizer the tokens came from
      train-00000.bin          tokens: data.py's token file (256-byte header, then
      train-00000.docs.npy       uint16 or uint32); where each document starts in it
      …                          (int64 token offsets, numpy .npy)
      validation-00000.bin     the held-out documents, in shards of their own
      validation-00000.docs.npy

Every document is the tokenizer's encoding of its text (with the tokenizer's
own special tokens, e.g. a Llama BOS) followed by the end-of-text token, which
separates documents in the stream. A shard holds whole documents: it is closed
once it reaches `shard_tokens`, so only its last document can take it past that.

Which documents are held out: document i (counted from 0 in input order,
validation or not) is a validation document when the first 8 bytes of
blake2b("<seed>:<i>"), read as a big-endian integer over 2**64, are below the
fraction. Deterministic, independent of sharding, and about `fraction` of them.

index.json, version 1:

    {"format": "controlplane-dataset", "version": 1, "name": "web-en",
     "dtype": "uint16", "shard_tokens": 268435456, "created": 1767225600.0,
     "tokenizer": {"name": "Llama-3.2-1B", "file": "tokenizer.json", "sha256": "…",
                   "vocab_size": 128256, "eos_id": 128001, "eos_token": "<|end_of_text|>",
                   "add_special_tokens": true},
     "validation": {"fraction": 0.01, "seed": 0, "rule": "blake2b"},
     "splits": {"train": {"tokens": …, "documents": …, "shards": [
                   {"file": "train-00000.bin", "tokens": …, "documents": …, "sha256": "…",
                    "docs": "train-00000.docs.npy", "docs_sha256": "…"}, …]},
                "validation": {…}},
     "totals": {"tokens": …, "documents": …, "bytes": …}}

sha256 is of each whole file as stored (header included); `bytes` counts every
file the index names, tokenizer.json included.
"""

import hashlib
import json
import time
from bisect import bisect_right
from pathlib import Path

import numpy as np
import torch

from workers.trainer.checkpoint import sha256_of
from workers.trainer.data import (
    HEADER_BYTES,
    SYNTHETIC,
    SyntheticSource,
    TokenFile,
    read_header,
    write_header,
)

INDEX = "index.json"
FORMAT = "controlplane-dataset"
VERSION = 1
SPLITS = ("train", "validation")
TOKENIZER_COPY = "tokenizer.json"


def held_out(document: int, *, fraction: float, seed: int) -> bool:
    """Whether document `document` belongs to the validation split (see the module's rule)."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{document}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def is_dataset(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def read_index(directory: str | Path) -> dict:
    path = Path(directory) / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory} is not a prepared dataset: {e}") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ValueError(
            f"{path}: format {index.get('format')!r} version {index.get('version')!r}, "
            f"not {FORMAT!r} version {VERSION}"
        )
    return index


class SplitWriter:
    """Appends documents to one split's shards, closing each once it holds shard_tokens."""

    def __init__(self, directory: Path, split: str, *, dtype: str, vocab_size: int, shard_tokens):
        self.directory, self.split = directory, split
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.vocab_size, self.shard_tokens = vocab_size, shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._starts: list[int] = []
        self._tokens = 0

    def add(self, ids) -> None:
        if self._file is None:
            self._open()
        self._starts.append(self._tokens)
        self._file.write(np.asarray(ids, dtype=self.dtype).tobytes())
        self._tokens += len(ids)
        if self._tokens >= self.shard_tokens:
            self._close()

    def finish(self) -> dict:
        if self._file is not None:
            self._close()
        return {
            "tokens": sum(s["tokens"] for s in self.shards),
            "documents": sum(s["documents"] for s in self.shards),
            "shards": self.shards,
        }

    def _name(self) -> str:
        return f"{self.split}-{len(self.shards):05d}"

    def _header(self, tokens: int) -> None:
        write_header(
            self._file,
            dtype=self.dtype.name,
            vocab_size=self.vocab_size,
            tokens=tokens,
            tokenizer={"kind": "hf", "index": INDEX},
        )

    def _open(self) -> None:
        self._file = open(self.directory / f"{self._name()}.bin", "wb")  # noqa: SIM115
        self._header(0)
        self._starts, self._tokens = [], 0

    def _close(self) -> None:
        self._file.seek(0)
        self._header(self._tokens)
        self._file.close()
        self._file = None
        name = self._name()
        np.save(self.directory / f"{name}.docs.npy", np.asarray(self._starts, dtype=np.int64))
        self.shards.append(
            {
                "file": f"{name}.bin",
                "tokens": self._tokens,
                "documents": len(self._starts),
                "sha256": sha256_of(self.directory / f"{name}.bin"),
                "docs": f"{name}.docs.npy",
                "docs_sha256": sha256_of(self.directory / f"{name}.docs.npy"),
            }
        )


def write_index(directory: Path, *, name, dtype, shard_tokens, tokenizer, validation, splits):
    files = [TOKENIZER_COPY] + [
        f for split in splits.values() for s in split["shards"] for f in (s["file"], s["docs"])
    ]
    index = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "dtype": dtype,
        "shard_tokens": shard_tokens,
        "created": time.time(),
        "tokenizer": tokenizer,
        "validation": validation,
        "splits": splits,
        "totals": {
            "tokens": sum(s["tokens"] for s in splits.values()),
            "documents": sum(s["documents"] for s in splits.values()),
            "bytes": sum((directory / f).stat().st_size for f in files),
        },
    }
    (directory / INDEX).write_text(json.dumps(index, indent=1))
    return index


def verify(directory: str | Path) -> list[str]:
    """What does not match the index (sizes, then SHA-256s); empty when the dataset is whole."""
    directory = Path(directory)
    index = read_index(directory)
    itemsize = np.dtype(index["dtype"]).itemsize
    problems = []
    tokenizer = index["tokenizer"]
    copy = directory / tokenizer["file"]
    if not copy.is_file() or sha256_of(copy) != tokenizer["sha256"]:
        problems.append(f"{tokenizer['file']} is missing or does not match its SHA-256")
    for split in index["splits"].values():
        for shard in split["shards"]:
            file, docs = directory / shard["file"], directory / shard["docs"]
            if not file.is_file() or not docs.is_file():
                problems.append(f"{shard['file']} or its document offsets are missing")
            elif file.stat().st_size != HEADER_BYTES + shard["tokens"] * itemsize:
                problems.append(f"{shard['file']} is {file.stat().st_size} bytes long")
            elif sha256_of(file) != shard["sha256"]:
                problems.append(f"{shard['file']} does not match its SHA-256")
            elif sha256_of(docs) != shard["docs_sha256"]:
                problems.append(f"{shard['docs']} does not match its SHA-256")
    return problems


def documents(directory: str | Path, split: str = "train"):
    """Each document's tokens (its end-of-text token included), in order, as int64 arrays."""
    directory = Path(directory)
    index = read_index(directory)
    for shard in index["splits"][split]["shards"]:
        file = directory / shard["file"]
        dtype = np.dtype(read_header(file).dtype).newbyteorder("<")
        tokens = np.fromfile(file, dtype=dtype, offset=HEADER_BYTES).astype(np.int64)
        starts = np.load(directory / shard["docs"])
        yield from np.split(tokens, starts[1:])


class ShardedSource:
    """One split of a prepared dataset as windows of seq_len + 1 tokens, shard after shard.

    A window never crosses from one shard into the next (a shard's last few
    tokens, short of a window, go unused); within a shard windows run across
    document boundaries, which the end-of-text token marks.
    """

    def __init__(self, directory: str | Path, seq_len: int, split: str = "train"):
        self.directory = Path(directory)
        self.index = read_index(self.directory)
        if split not in self.index["splits"]:
            raise ValueError(f"{directory} has no {split} split")
        self.split, self.seq_len = split, seq_len
        self.vocab_size = self.index["tokenizer"]["vocab_size"]
        self.files: list[TokenFile] = []
        ends = []
        for shard in self.index["splits"][split]["shards"]:
            if (shard["tokens"] - 1) // seq_len < 1:
                continue
            self.files.append(TokenFile(self.directory / shard["file"], seq_len))
            ends.append((ends[-1] if ends else 0) + self.files[-1].windows)
        self._ends = ends
        self.windows = ends[-1] if ends else 0

    def window(self, index: int) -> torch.Tensor:
        shard = bisect_right(self._ends, index)
        first = self._ends[shard - 1] if shard else 0
        return self.files[shard].window(index - first)


def open_source(dataset: str, *, seq_len: int, vocab_size: int, split: str = "train"):
    """A token file, a prepared dataset's `split`, or the synthetic source, as windows."""
    if dataset == SYNTHETIC:
        return SyntheticSource(vocab_size, seq_len)
    if is_dataset(dataset):
        source = ShardedSource(dataset, seq_len, split)
    else:
        source = TokenFile(dataset, seq_len)
    if split == "train" and source.windows < 1:
        raise ValueError(f"{dataset} holds fewer tokens than one sequence of {seq_len}")
    if source.vocab_size > vocab_size:
        raise ValueError(
            f"{dataset} uses {source.vocab_size} token ids; the model's vocabulary has {vocab_size}"
        )
    return source
