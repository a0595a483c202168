"""Text files → a token file for the trainer, with a tokenizer that needs no download.

    python -m workers.trainer.prepare --out data/tokens.bin notes/ book.txt
    python -m workers.trainer.prepare --out tokens.bin --tokenizer bpe --vocab-size 4096 corpus/

Each input file (directories are walked, files taken in sorted order) is one
document, read as UTF-8; documents are separated in the token stream by the
ASCII record separator byte (0x1E). Tokenizers:

- bytes: the 256 byte values, vocabulary 256;
- bpe: byte-pair merges learned from the input itself up to --vocab-size
  (saved beside the token file as <out>.tokenizer.json, named in its header);
  words (runs of letters, of digits, of other symbols, with their leading
  space) are never merged across, as in GPT-2's tokenizer.

The file format is data.py's: a 256-byte header, then uint16 or uint32 tokens.
`--decode FILE` prints a token file's text back, documents separated by 0x1E.
"""

import argparse
import itertools
import json
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from workers.trainer.data import TokenFile, read_header, token_dtype, write_header

SEPARATOR = 0x1E
WORD = re.compile(r" ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def documents(inputs: Iterable[str | Path], *, skip: Iterable[Path] = ()) -> Iterator[str]:
    skip = {p.resolve() for p in skip}
    for item in inputs:
        path = Path(item)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if file.resolve() not in skip:  # our own output, when written among the inputs
                yield file.read_text(encoding="utf-8", errors="replace")


class ByteTokenizer:
    vocab_size = 256

    def describe(self) -> dict:
        return {"kind": "bytes"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BytePairTokenizer:
    """Byte-level BPE: ids 0..255 are bytes, each later id the merge of two earlier ones."""

    def __init__(self, merges: list[tuple[int, int]]):
        self.merges = merges
        self.vocab_size = 256 + len(merges)
        self._rank = {pair: 256 + i for i, pair in enumerate(merges)}
        self._pieces: list[bytes] = [bytes([b]) for b in range(256)]
        for left, right in merges:
            self._pieces.append(self._pieces[left] + self._pieces[right])
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "BytePairTokenizer":
        """Learn vocab_size - 256 merges, the most frequent adjacent pair first (ties: smallest)."""
        words = Counter()
        for text in texts:
            words.update(WORD.findall(text))
        sequences = [list(word.encode("utf-8")) for word in words]
        counts = list(words.values())
        pairs: Counter = Counter()
        where: dict[tuple[int, int], set[int]] = defaultdict(set)
        for index, seq in enumerate(sequences):
            for pair in itertools.pairwise(seq):
                pairs[pair] += counts[index]
                where[pair].add(index)
        merges = []
        while len(merges) < vocab_size - 256 and pairs:
            best = max(pairs.items(), key=lambda item: (item[1], (-item[0][0], -item[0][1])))[0]
            if pairs[best] < 2:
                break
            new_id = 256 + len(merges)
            merges.append(best)
            for index in list(where[best]):
                seq, count = sequences[index], counts[index]
                for pair in itertools.pairwise(seq):  # forget the word's old pairs
                    pairs[pair] -= count
                    if pairs[pair] <= 0:
                        del pairs[pair]
                    where[pair].discard(index)
                sequences[index] = seq = _merge(seq, best, new_id)
                for pair in itertools.pairwise(seq):
                    pairs[pair] += count
                    where[pair].add(index)
            where.pop(best, None)
        return cls(merges)

    def describe(self) -> dict:
        return {"kind": "bpe", "vocab_size": self.vocab_size}

    def encode(self, text: str) -> list[int]:
        out = []
        for word in WORD.findall(text):
            ids = self._cache.get(word)
            if ids is None:
                ids = self._encode_word(word)
                if len(self._cache) < 1_000_000:
                    self._cache[word] = ids
            out += ids
        return out

    def _encode_word(self, word: str) -> list[int]:
        ids = list(word.encode("utf-8"))
        while len(ids) > 1:
            ranked = [
                (self._rank[pair], pair) for pair in itertools.pairwise(ids) if pair in self._rank
            ]
            if not ranked:
                break
            new_id, pair = min(ranked)
            ids = _merge(ids, pair, new_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self._pieces[i] for i in ids).decode("utf-8", errors="replace")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"kind": "bpe", "merges": self.merges}))

    @classmethod
    def load(cls, path: Path) -> "BytePairTokenizer":
        return cls([tuple(pair) for pair in json.loads(path.read_text())["merges"]])


def _merge(ids: list[int], pair: tuple[int, int], new_id: int) -> list[int]:
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def tokenizer_file(out: Path) -> Path:
    return out.with_name(out.name + ".tokenizer.json")


def prepare(
    inputs: list[str | Path], out: str | Path, *, tokenizer: str = "bytes", vocab_size: int = 4096
) -> dict:
    """Write the token file; return its header (vocab_size, tokens, tokenizer)."""
    out = Path(out)
    temporary = out.with_name(out.name + ".partial")
    ours = (out, temporary, tokenizer_file(out))
    if tokenizer == "bpe":
        if vocab_size <= 256:
            raise ValueError("--vocab-size must be above 256 for bpe")
        coder = BytePairTokenizer.train(documents(inputs, skip=ours), vocab_size)
        coder.save(tokenizer_file(out))
        description = {**coder.describe(), "file": tokenizer_file(out).name}
    elif tokenizer == "bytes":
        coder = ByteTokenizer()
        description = coder.describe()
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r}: bytes or bpe")
    dtype = token_dtype(coder.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(temporary, "wb") as f:
        write_header(f, dtype=dtype, vocab_size=coder.vocab_size, tokens=0, tokenizer=description)
        for index, text in enumerate(documents(inputs, skip=ours)):
            ids = ([SEPARATOR] if index else []) + coder.encode(text)
            f.write(np.asarray(ids, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
            count += len(ids)
        f.seek(0)
        write_header(
            f, dtype=dtype, vocab_size=coder.vocab_size, tokens=count, tokenizer=description
        )
    temporary.replace(out)
    header = read_header(out)
    return {"vocab_size": header.vocab_size, "tokens": header.tokens, "tokenizer": description}


def load_tokenizer(path: Path):
    description = read_header(path).tokenizer
    if description["kind"] == "bpe":
        return BytePairTokenizer.load(path.with_name(description["file"]))
    return ByteTokenizer()


def decode_file(path: str | Path) -> list[str]:
    """A token file's documents, decoded."""
    path = Path(path)
    coder = load_tokenizer(path)
    tokens = TokenFile(path, seq_len=1).tokens
    ids = np.asarray(tokens, dtype=np.int64).tolist()
    documents, current = [], []
    for token in ids:
        if token == SEPARATOR:
            documents.append(coder.decode(current))
            current = []
        else:
            current.append(token)
    documents.append(coder.decode(current))
    return documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.trainer.prepare", description=__doc__)
    parser.add_argument("inputs", nargs="*", help="text files or directories of them")
    parser.add_argument("--out", help="the token file to write")
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes")
    parser.add_argument("--vocab-size", type=int, default=4096, help="bpe only (default 4096)")
    parser.add_argument("--decode", metavar="FILE", help="print a token file's text and exit")
    args = parser.parse_args(argv)
    if args.decode:
        sys.stdout.write(chr(SEPARATOR).join(decode_file(args.decode)))
        return 0
    if not args.inputs or not args.out:
        parser.error("give input files and --out")
    header = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    print(json.dumps({"out": str(args.out), **header}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
