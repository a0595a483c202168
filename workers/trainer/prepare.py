"""Text files → tokens for the trainer: a sharded dataset, or one token file.

    python -m workers.trainer.prepare --tokenizer-file llama/tokenizer.json \
        --out data/web-en --validation 0.01 corpus/ more.jsonl
    python -m workers.trainer.prepare --out data/tokens.bin notes/ book.txt
    python -m workers.trainer.prepare --out tokens.bin --tokenizer bpe --vocab-size 4096 corpus/

Inputs: directories are walked, files taken in sorted order; a `.jsonl` file
holds one document a line (its "text" field, or --text-field), any other file
is one document, read as UTF-8.

With --tokenizer-file (a published model's tokenizer.json, read by the
`tokenizers` library, which only this mode needs) --out is a dataset
directory: shards of whole documents, each document followed by the
tokenizer's end-of-text token (--eos names it when it is not one of the usual
ones), a held-out validation split, and an index; shards.py describes the
format. `--verify DIR` checks such a directory against its index. For text
with no published model behind it, `--train-tokenizer VOCAB` first learns a
byte-level BPE tokenizer.json from the inputs and writes it to --tokenizer-file.

Otherwise --out is one token file, and documents are separated in the token
stream by the ASCII record separator byte (0x1E). Tokenizers:

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
import shutil
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from workers.trainer import shards
from workers.trainer.data import TokenFile, read_header, token_dtype, write_header

SEPARATOR = 0x1E
WORD = re.compile(r" ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def documents(
    inputs: Iterable[str | Path], *, skip: Iterable[Path] = (), text_field: str = "text"
) -> Iterator[str]:
    skip = {p.resolve() for p in skip}
    for item in inputs:
        path = Path(item)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if any(p in skip for p in (file.resolve(), *file.resolve().parents)):
                continue  # our own output, when written among the inputs
            if file.suffix == ".jsonl":
                with open(file, encoding="utf-8", errors="replace") as lines:
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)[text_field]
            else:
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


# End-of-text tokens of the usual published tokenizers, tried in order when --eos is not given.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")
SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 tokens
ENCODE_BATCH = 512  # documents per call into the tokenizer's (parallel) batch encoder


def train_tokenizer(
    inputs: list[str | Path],
    out: str | Path,
    *,
    vocab_size: int,
    eos: str,
    text_field: str = "text",
) -> Path:
    """Learn a byte-level BPE tokenizer.json (GPT-2's scheme: every byte is a token, so no text
    is unknown) of `vocab_size` tokens from the inputs' documents, with `eos` as its one
    special token, and write it to `out`, which must not exist yet.

    For corpora without a published model to borrow a tokenizer from: the demo's and the
    benchmarks' own text. The result is an ordinary tokenizer.json, so everything after
    (prepare_sharded, the trainer, export to transformers) treats it as a published one.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: a trained tokenizer is written to a new file")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents(inputs, text_field=text_field), trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def prepare_sharded(
    inputs: list[str | Path],
    out: str | Path,
    *,
    tokenizer_file: str | Path,
    tokenizer_name: str | None = None,
    eos: str | None = None,
    validation: float = 0.0,
    split_seed: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    text_field: str = "text",
    add_special_tokens: bool = True,
) -> dict:
    """Write the dataset directory `out` (shards.py's format); return its index.

    The directory is written under a temporary name and renamed when its index
    is complete, so a preparation cut short leaves nothing that looks finished;
    one that fails removes what it wrote.
    """
    from tokenizers import Tokenizer  # only this mode needs it; nodes may lack it

    out, tokenizer_file = Path(out), Path(tokenizer_file)
    if out.exists():
        raise ValueError(f"{out} exists: prepare a dataset into a new directory")
    if not 0 <= validation < 1:
        raise ValueError("--validation is a fraction of the documents, from 0 up to 1")
    coder = Tokenizer.from_file(str(tokenizer_file))
    eos_token = eos or next((t for t in EOS_CANDIDATES if coder.token_to_id(t) is not None), None)
    eos_id = coder.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        raise ValueError(f"{tokenizer_file} has no end-of-text token {eos or ''}: give --eos")
    vocab_size = coder.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab_size)
    temporary = out.with_name(f".{out.name}.partial")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        shutil.copyfile(tokenizer_file, temporary / shards.TOKENIZER_COPY)
        writers = {
            split: shards.SplitWriter(
                temporary, split, dtype=dtype, vocab_size=vocab_size, shard_tokens=shard_tokens
            )
            for split in shards.SPLITS
        }
        texts = documents(inputs, skip=(out, temporary, tokenizer_file), text_field=text_field)
        number = 0
        while batch := list(itertools.islice(texts, ENCODE_BATCH)):
            encoded = coder.encode_batch(batch, add_special_tokens=add_special_tokens)
            for encoding in encoded:
                held = shards.held_out(number, fraction=validation, seed=split_seed)
                writers["validation" if held else "train"].add([*encoding.ids, eos_id])
                number += 1
        splits = {split: writer.finish() for split, writer in writers.items()}
        index = shards.write_index(
            temporary,
            name=out.name,
            dtype=dtype,
            shard_tokens=shard_tokens,
            tokenizer={
                "name": tokenizer_name or tokenizer_file.resolve().parent.name,
                "file": shards.TOKENIZER_COPY,
                "sha256": shards.sha256_of(tokenizer_file),
                "vocab_size": vocab_size,
                "eos_id": eos_id,
                "eos_token": eos_token,
                "add_special_tokens": add_special_tokens,
            },
            validation={"fraction": validation, "seed": split_seed, "rule": "blake2b"},
            splits=splits,
        )
    except BaseException:  # a bad input, a full disk, ^C: no half-written dataset is left
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    temporary.rename(out)
    return index


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
    parser.add_argument("--out", help="the token file (or, with --tokenizer-file, directory)")
    parser.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes")
    parser.add_argument("--vocab-size", type=int, default=4096, help="bpe only (default 4096)")
    parser.add_argument("--decode", metavar="FILE", help="print a token file's text and exit")
    parser.add_argument("--text-field", default="text", help="a .jsonl line's text (default text)")
    sharded = parser.add_argument_group("a sharded dataset, with a published model's tokenizer")
    sharded.add_argument("--tokenizer-file", help="the model's tokenizer.json")
    sharded.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="first learn a byte-level BPE tokenizer of VOCAB tokens from the inputs and write "
        "it to --tokenizer-file (a new file); its end-of-text token is --eos or <|endoftext|>",
    )
    sharded.add_argument("--tokenizer-name", help="what to call it (default: its folder's name)")
    sharded.add_argument("--eos", help="the end-of-text token (default: the usual ones, tried)")
    sharded.add_argument("--validation", type=float, default=0.0, help="held-out fraction")
    sharded.add_argument("--split-seed", type=int, default=0, help="seeds the held-out choice")
    sharded.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS)
    sharded.add_argument("--verify", metavar="DIR", help="check a dataset against its index")
    args = parser.parse_args(argv)
    if args.decode:
        sys.stdout.write(chr(SEPARATOR).join(decode_file(args.decode)))
        return 0
    if args.verify:
        problems = shards.verify(args.verify)
        print(json.dumps({"dataset": args.verify, "problems": problems}))
        return 1 if problems else 0
    if not args.inputs or not args.out:
        parser.error("give input files and --out")
    if not 0 <= args.validation < 1:
        parser.error("--validation is a fraction of the documents, from 0 up to 1")
    try:
        return _prepare(args, parser)
    except (ValueError, OSError) as exc:  # what the input is wrong about, said plainly
        parser.error(str(exc))


def _prepare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.train_tokenizer is not None:
        if not args.tokenizer_file:
            parser.error("--train-tokenizer writes the tokenizer to --tokenizer-file: give it")
        if args.train_tokenizer < 257:
            parser.error("--train-tokenizer: a byte-level vocabulary has more than 256 tokens")
        if Path(args.out).exists():  # prepare_sharded's refusal, before the tokenizer is written
            parser.error(f"--train-tokenizer: {args.out} exists")
        args.eos = args.eos or "<|endoftext|>"
        train_tokenizer(
            args.inputs,
            args.tokenizer_file,
            vocab_size=args.train_tokenizer,
            eos=args.eos,
            text_field=args.text_field,
        )
    if args.tokenizer_file:
        index = prepare_sharded(
            args.inputs,
            args.out,
            tokenizer_file=args.tokenizer_file,
            tokenizer_name=args.tokenizer_name,
            eos=args.eos,
            validation=args.validation,
            split_seed=args.split_seed,
            shard_tokens=args.shard_tokens,
            text_field=args.text_field,
        )
        print(json.dumps({"out": str(args.out), **index["totals"]}))
        return 0
    header = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size)
    print(json.dumps({"out": str(args.out), **header}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
