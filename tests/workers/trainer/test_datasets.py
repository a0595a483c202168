"""Prepared datasets and mixtures, in one process: the format, the sampler's promises, run.json.

The tokenizer is a real `tokenizers` one, trained here on a few strings and saved
as tokenizer.json (nothing is downloaded); the mixture's datasets are stand-ins
whose windows say which dataset and window they are.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from workers.trainer import config as run_config  # noqa: E402
from workers.trainer import shards  # noqa: E402
from workers.trainer.data import (  # noqa: E402
    Batches,
    Component,
    Mixture,
    TokenFile,
)
from workers.trainer.shards import open_source  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORDS = ["pack", "my", "box", "with", "five", "dozen", "liquor", "jugs", "sphinx", "of", "quartz"]


def texts(count: int, offset: int = 0) -> list[str]:
    """Documents of different lengths, so shards close at different places."""
    return [
        f"{i % 97} " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + (i * 5) % 23))
        for i in range(offset, offset + count)
    ]


def make_tokenizer(path: Path, corpus: list[str]) -> Path:
    """A word-level tokenizer with an end-of-text token, as a model's tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=250, special_tokens=["[UNK]", "</s>"])
    tokenizer.train_from_iterator(corpus, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def write_jsonl(path: Path, documents: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in documents))
    return path


@pytest.fixture
def prepared(tmp_path):
    from workers.trainer.prepare import prepare_sharded

    corpus = texts(400)
    tokenizer_file = make_tokenizer(tmp_path / "tiny-model", corpus)
    inputs = write_jsonl(tmp_path / "in" / "part-0.jsonl", corpus)
    index = prepare_sharded(
        [inputs], tmp_path / "web", tokenizer_file=tokenizer_file, validation=0.1, shard_tokens=900
    )
    return tmp_path / "web", index, corpus, tokenizer_file


def test_a_dataset_is_whole_documents_in_shards_with_a_held_out_split(prepared):
    from tokenizers import Tokenizer

    directory, index, corpus, tokenizer_file = prepared
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id("</s>")

    assert (index["format"], index["version"], index["dtype"]) == (shards.FORMAT, 1, "uint16")
    assert index == json.loads((directory / "index.json").read_text())
    assert index["tokenizer"]["name"] == "tiny-model"
    assert index["tokenizer"]["eos_id"] == eos and index["tokenizer"]["eos_token"] == "</s>"
    assert index["tokenizer"]["sha256"] == shards.sha256_of(tokenizer_file)
    assert index["tokenizer"]["vocab_size"] == tokenizer.get_vocab_size()
    held = [i for i in range(len(corpus)) if shards.held_out(i, fraction=0.1, seed=0)]
    assert 15 < len(held) < 70  # about a tenth of 400
    train, validation = index["splits"]["train"], index["splits"]["validation"]
    assert (train["documents"], validation["documents"]) == (len(corpus) - len(held), len(held))
    assert len(train["shards"]) > 3  # 900 tokens a shard
    assert index["totals"]["tokens"] == train["tokens"] + validation["tokens"]
    for shard in train["shards"]:
        # Whole documents: a shard closes once it reaches 900 tokens, never mid-document.
        starts = np.load(directory / shard["docs"])
        assert (len(starts), starts[0]) == (shard["documents"], 0)
        assert starts[-1] < 900 <= shard["tokens"] or shard is train["shards"][-1]

    # Every document comes back, each ending with the end-of-text token, in order.
    trained = sorted(set(range(len(corpus))) - set(held))
    for split, numbers in (("train", trained), ("validation", held)):
        decoded = list(shards.documents(directory, split))
        assert len(decoded) == len(numbers)
        for tokens, number in zip(decoded, numbers, strict=True):
            assert tokens.tolist() == [*tokenizer.encode(corpus[number]).ids, eos]
            assert tokenizer.decode(tokens[:-1].tolist()) == corpus[number]

    assert shards.verify(directory) == []


def test_the_same_input_gives_the_same_shards_and_a_changed_byte_is_caught(prepared, tmp_path):
    from workers.trainer.prepare import prepare_sharded

    directory, index, _, tokenizer_file = prepared
    again = prepare_sharded(
        [tmp_path / "in"],
        tmp_path / "again",
        tokenizer_file=tokenizer_file,
        validation=0.1,
        shard_tokens=900,
    )
    assert again["splits"] == index["splits"]

    shard = directory / index["splits"]["train"]["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert shards.verify(directory) == [f"{shard.name} does not match its SHA-256"]
    with pytest.raises(ValueError, match="exists"):
        prepare_sharded([tmp_path / "in"], directory, tokenizer_file=tokenizer_file)


def test_a_tokenizer_without_an_end_of_text_token_must_name_one(tmp_path):
    from workers.trainer.prepare import prepare_sharded

    tokenizer_file = make_tokenizer(tmp_path / "tok", texts(20))
    data = json.loads(tokenizer_file.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "</s>"]
    data["model"]["vocab"].pop("</s>")
    tokenizer_file.write_text(json.dumps(data))
    inputs = write_jsonl(tmp_path / "in.jsonl", texts(5))

    with pytest.raises(ValueError, match="--eos"):
        prepare_sharded([inputs], tmp_path / "out", tokenizer_file=tokenizer_file)
    index = prepare_sharded([inputs], tmp_path / "out", tokenizer_file=tokenizer_file, eos="box")
    assert index["tokenizer"]["eos_token"] == "box"


def test_the_trainer_reads_a_split_as_windows_shard_after_shard(prepared):
    directory, index, _, _ = prepared
    source = open_source(str(directory), seq_len=16, vocab_size=256)
    validation = open_source(str(directory), seq_len=16, vocab_size=256, split="validation")
    shards_ = index["splits"]["train"]["shards"]

    assert source.windows == sum((s["tokens"] - 1) // 16 for s in shards_)
    # A window never runs from one shard into the next.
    first_of_second = (shards_[0]["tokens"] - 1) // 16
    second = TokenFile(directory / shards_[1]["file"], seq_len=16)
    assert torch.equal(source.window(first_of_second), second.window(0))
    assert torch.equal(
        source.window(first_of_second - 1),
        TokenFile(directory / shards_[0]["file"], 16).window(first_of_second - 1),
    )
    assert validation.windows == (index["splits"]["validation"]["tokens"] - 1) // 16
    with pytest.raises(ValueError, match="vocabulary"):
        open_source(str(directory), seq_len=16, vocab_size=64)


def test_a_token_file_and_training_need_no_tokenizers_library(tmp_path):
    """Nodes may lack `tokenizers`: only preparing a sharded dataset imports it."""
    (tmp_path / "a.txt").write_text("hello there " * 20)
    code = (
        "import sys; sys.modules['tokenizers'] = None\n"
        "from workers.trainer import train, evaluation\n"
        "from workers.trainer.prepare import prepare\n"
        f"prepare([{str(tmp_path / 'a.txt')!r}], {str(tmp_path / 't.bin')!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    assert (tmp_path / "t.bin").stat().st_size > 256


# --- mixtures ------------------------------------------------------------------------------------


class Numbered:
    """A dataset whose window i is (tag, i, 0): inputs [tag, i] say where a sample came from."""

    def __init__(self, tag: int, windows: int):
        self.tag, self.windows = tag, windows

    def window(self, index: int) -> torch.Tensor:
        assert 0 <= index < self.windows
        return torch.tensor([self.tag, index, 0])


def mixture(weights: list[float], windows: list[int], seed: int) -> Mixture:
    parts = [
        Component(f"d{tag}", Numbered(tag, w), weight)
        for tag, (weight, w) in enumerate(zip(weights, windows, strict=True))
    ]
    return Mixture(parts, seed=seed)


def rows(batches: Batches, steps) -> list[tuple[int, int]]:
    return [tuple(row.tolist()) for step in steps for row in batches.at(step)[0]]


weights_ = st.lists(st.floats(0.05, 10), min_size=1, max_size=4)


@given(
    weights=weights_,
    seed=st.integers(0, 2**20),
    ranks=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 4),
    step=st.integers(1, 40),
)
def test_ranks_take_disjoint_slices_whose_union_is_the_single_rank_batch(
    weights, seed, ranks, per_rank, step
):
    mix = mixture(weights, [7 + 5 * i for i in range(len(weights))], seed)
    global_batch = ranks * per_rank
    whole = Batches(mix, seed=seed, global_batch=global_batch, dp_rank=0, dp_size=1)
    parts = [
        Batches(mix, seed=seed, global_batch=global_batch, dp_rank=r, dp_size=ranks)
        for r in range(ranks)
    ]
    draws = [p.draws(p.samples_before(step) + r * per_rank, per_rank) for r, p in enumerate(parts)]
    flat = [d for rank in draws for d in rank]
    assert len(set(flat)) == len(flat)  # no (dataset, sample) twice within the step
    assert torch.equal(torch.cat([p.at(step)[0] for p in parts]), whole.at(step)[0])


@given(
    weights=weights_,
    seed=st.integers(0, 2**20),
    stop=st.integers(0, 12),
    batch=st.sampled_from([2, 4, 6]),
    new_batch=st.sampled_from([1, 2, 3, 6]),
    new_ranks=st.sampled_from([1, 2]),
)
def test_a_run_resumed_at_any_step_continues_with_the_same_samples(
    weights, seed, stop, batch, new_batch, new_ranks
):
    """Also with another global batch and another number of ranks: the same samples follow."""
    mix = mixture(weights, [5, 9, 11, 13][: len(weights)], seed)
    uninterrupted = Batches(mix, seed=seed, global_batch=batch, dp_rank=0, dp_size=1)
    expected = rows(uninterrupted, range(1, stop + 1 + 24 // batch))[stop * batch :][:12]
    position = json.loads(json.dumps(uninterrupted.position(stop)))  # through a manifest
    new_batch *= new_ranks
    resumed = [
        Batches(mix, seed=seed, global_batch=new_batch, dp_rank=r, dp_size=new_ranks)
        for r in range(new_ranks)
    ]
    for part in resumed:
        part.rebase(stop, position["samples_seen"], position["datasets"])
    got = []
    step = stop
    while len(got) < 12:
        step += 1
        got += [tuple(row.tolist()) for part in resumed for row in part.at(step)[0]]
    assert got[:12] == expected
    assert position["samples_seen"] == stop * batch
    assert sum(d["samples"] for d in position["datasets"]) == stop * batch


@given(seed=st.integers(0, 2**20), stop=st.integers(1, 10))
def test_new_weights_on_resume_take_up_each_dataset_where_it_was(seed, stop):
    before = mixture([1, 1], [50, 50], seed)
    run = Batches(before, seed=seed, global_batch=4, dp_rank=0, dp_size=1)
    seen = rows(run, range(1, stop + 1))
    position = run.position(stop)

    after = Batches(
        mixture([1, 9], [50, 50], seed), seed=seed, global_batch=4, dp_rank=0, dp_size=1
    )
    after.rebase(stop, position["samples_seen"], position["datasets"])
    later = rows(after, range(stop + 1, stop + 6))
    assert not set(seen) & set(later)  # nothing repeated (each has 50 windows: one epoch)
    for tag in (0, 1):
        taken = [i for t, i in seen if t == tag]
        followed = [i for t, i in later if t == tag]
        assert sorted(taken + followed) == sorted(set(taken + followed))


@given(weights=weights_, seed=st.integers(0, 2**32))
def test_realised_proportions_approach_the_weights(weights, seed):
    mix = mixture(weights, [10] * len(weights), seed)
    samples = 20_000
    counts = mix.counts(0, samples)
    for weight, count in zip(weights, counts.tolist(), strict=True):
        # The standard error of a proportion over 20,000 draws is at most 0.0036.
        assert abs(count / samples - weight / sum(weights)) < 0.02


def test_a_mixture_position_without_per_dataset_counts_is_replayed():
    """A checkpoint written before mixtures records only samples_seen."""
    mix = mixture([1, 3], [40, 40], seed=3)
    run = Batches(mix, seed=3, global_batch=4, dp_rank=0, dp_size=1)
    rows(run, range(1, 6))
    resumed = Batches(mix, seed=3, global_batch=4, dp_rank=0, dp_size=1)
    resumed.rebase(5, run.position(5)["samples_seen"])
    assert rows(resumed, [6, 7]) == rows(run, [6, 7])


# --- run.json ------------------------------------------------------------------------------------


def test_a_mixture_and_evaluation_parse():
    config = run_config.parse(
        {
            "model": {"preset": "tiny"},
            "data": {
                "mixture": [{"path": "/d/web-en/", "weight": 3}, {"path": "/d/code", "name": "c"}],
                "eval": "/d/held",
                "seq_len": 32,
            },
            "eval": {"every": 50, "batches": 4},
        }
    )
    assert [(p.label, p.weight) for p in config.data.parts()] == [("web-en", 3), ("c", 1.0)]
    assert (config.data.eval, config.eval.every, config.eval.batches) == ("/d/held", 50, 4)
    plain = run_config.parse(
        {"model": {"preset": "tiny"}, "data": {"dataset": "/d/t.bin", "seq_len": 32}}
    )
    assert [(p.path, p.weight) for p in plain.data.parts()] == [("/d/t.bin", 1.0)]
    assert plain.eval.every == 0


@pytest.mark.parametrize(
    "data,evaluation,message",
    [
        ({"dataset": "/a", "mixture": [{"path": "/b"}]}, None, "not both"),
        ({"mixture": [{"path": "/a/x"}, {"path": "/b/x"}]}, None, "distinct names"),
        ({"mixture": [{"path": "/a", "weight": 0}]}, None, "above 0"),
        ({"mixture": [{"path": "/a", "share": 1}]}, None, "unknown field"),
        ({"mixture": []}, None, "list"),
        ({}, {"every": -1}, "eval.every"),
        ({}, {"often": 3}, "unknown field"),
    ],
)
def test_impossible_mixtures_and_evaluations_are_refused(data, evaluation, message):
    with pytest.raises(run_config.ConfigError, match=message):
        run_config.parse(
            {"model": {"preset": "tiny"}, "data": {**data, "seq_len": 32}, "eval": evaluation}
        )


def test_the_command_line_prepares_and_verifies(prepared, tmp_path, capsys):
    from workers.trainer.prepare import main

    _, index, _, tokenizer_file = prepared
    out = tmp_path / "cli"
    arguments = [str(tmp_path / "in"), "--out", str(out), "--tokenizer-file", str(tokenizer_file)]
    assert main([*arguments, "--validation", "0.1", "--shard-tokens", "900"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == index["totals"]["tokens"]
    assert main(["--verify", str(out)]) == 0
    (out / "validation-00000.docs.npy").write_bytes(b"")
    assert main(["--verify", str(out)]) == 1
    assert "validation-00000.docs.npy" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"out": "existing"}, "exists: prepare a dataset into a new directory"),
        ({"validation": "1.5"}, "--validation is a fraction"),
        ({"inputs": "missing.jsonl"}, "missing.jsonl"),
        ({"eos": "<none>"}, "has no end-of-text token <none>"),
    ],
)
def test_the_command_line_says_what_is_wrong_and_writes_nothing(
    prepared, tmp_path, capsys, change, message
):
    """A wrong input is a one-line error and exit status 2, not a traceback."""
    from workers.trainer.prepare import main

    _, _, _, tokenizer_file = prepared
    (tmp_path / "existing").mkdir()
    given = {"inputs": str(tmp_path / "in"), "out": "new", "validation": "0.1", "eos": None}
    given.update(change)
    argv = [str(tmp_path / given["inputs"]), "--out", str(tmp_path / given["out"])]
    argv += ["--tokenizer-file", str(tokenizer_file), "--validation", given["validation"]]
    argv += ["--eos", given["eos"]] if given["eos"] else []
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert not (tmp_path / "new").exists() and not list((tmp_path / "existing").iterdir())
    assert not list(tmp_path.glob(".new.partial"))


def test_the_command_line_can_learn_the_tokenizer_first(tmp_path, capsys):
    """--train-tokenizer: a byte-level BPE tokenizer.json learnt from the inputs themselves,
    written where --tokenizer-file says (and not itself read as a document when it lies among
    the inputs), then the dataset prepared with it, as for a published one."""
    from tokenizers import Tokenizer

    from workers.trainer.prepare import main

    corpus = texts(300)
    write_jsonl(tmp_path / "in" / "part-0.jsonl", corpus)
    learnt = tmp_path / "in" / "tokenizer.json"
    out = tmp_path / "data"
    arguments = ["--train-tokenizer", "300", "--tokenizer-file", str(learnt), "--eos", "</s>"]
    assert main([str(tmp_path / "in"), "--out", str(out), *arguments]) == 0
    totals = json.loads(capsys.readouterr().out)

    tokenizer = Tokenizer.from_file(str(learnt))
    assert tokenizer.get_vocab_size() == 300  # 256 bytes, </s>, and merges learnt from the words
    assert tokenizer.token_to_id("</s>") is not None
    assert len(tokenizer.encode("liquor jugs").ids) < len("liquor jugs")  # merges, not bytes
    assert tokenizer.decode(tokenizer.encode("zebra ünïcode").ids) == "zebra ünïcode"
    index = json.loads((out / "index.json").read_text())
    assert index["tokenizer"]["sha256"] == shards.sha256_of(learnt)
    assert index["tokenizer"]["eos_token"] == "</s>"
    assert totals["documents"] == len(corpus)  # the tokenizer.json among the inputs is not one
    assert shards.verify(out) == []


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--train-tokenizer", "300"], "--tokenizer-file"),
        (["--train-tokenizer", "200", "--tokenizer-file", "{new}"], "more than 256"),
        (["--train-tokenizer", "300", "--tokenizer-file", "{old}"], "exists"),
        (["--train-tokenizer", "300", "--tokenizer-file", "{new}", "--out", "{old}"], "exists"),
    ],
)
def test_learning_a_tokenizer_is_refused_without_a_new_file_for_it(
    tmp_path, capsys, arguments, message
):
    from workers.trainer.prepare import main

    inputs = write_jsonl(tmp_path / "in.jsonl", texts(20))
    old = tmp_path / "published" / "tokenizer.json"
    old.parent.mkdir()
    old.write_text("a published tokenizer, never overwritten")
    names = {"new": str(tmp_path / "new.json"), "old": str(old)}
    # The last --out counts: in the fourth case, one that exists.
    argv = [str(inputs), "--out", str(tmp_path / "out"), *(a.format(**names) for a in arguments)]
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
    assert old.read_text() == "a published tokenizer, never overwritten"
    assert not (tmp_path / "out").exists() and not (tmp_path / "new.json").exists()


def test_what_is_evaluated(prepared, tmp_path):
    from workers.trainer.evaluation import eval_sets
    from workers.trainer.prepare import prepare

    directory, _, _, _ = prepared
    (tmp_path / "held.txt").write_text("held out text " * 40)
    prepare([tmp_path / "held.txt"], tmp_path / "held.bin")

    def sets(data, every=10):
        config = {"model": {"preset": "tiny"}, "data": {"seq_len": 16, **data}}
        return eval_sets(run_config.parse({**config, "eval": {"every": every}}))

    mixed = sets({"mixture": [{"path": str(directory), "weight": 2}, {"path": "/t.bin"}]})
    assert [(s.name, s.weight, s.source.split) for s in mixed] == [("web", 2, "validation")]
    (named,) = sets({"dataset": str(directory), "eval": str(tmp_path / "held.bin")})
    assert (named.name, named.source.windows) == ("held.bin", (40 * 14 - 1) // 16)
    assert sets({"dataset": "/t.bin"}, every=0) == []
    with pytest.raises(run_config.ConfigError, match="nothing to evaluate"):
        sets({"dataset": str(tmp_path / "held.bin")})


@pytest.fixture
def reachable_dir():
    """A directory any user may pass through (pytest's own are closed to all but root)."""
    base = Path(tempfile.mkdtemp(prefix="cp-reach-"))
    os.chmod(base, 0o755)  # noqa: S103 (reached by the job's user in the test below)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_an_export_run_as_its_job_gets_no_tokenizer_its_job_cannot_read(reachable_dir):
    """A checkpoint's manifest is written by its job: one that names another team's dataset
    must not get that dataset's tokenizer.json copied into its export. The agent runs the
    exporter as the job's own user (workers/agent/checkpoints.py), so the lookup reads only
    what that user may: a dataset open to it is found, the same dataset closed is not."""
    from workers.agent.isolation import DEFAULT_UID_BASE
    from workers.trainer.prepare import prepare_sharded

    corpus = texts(40)
    places = {}
    for name, mode in (("open", 0o755), ("theirs", 0o700)):  # theirs: another team's
        place = reachable_dir / name
        place.mkdir()
        tokenizer_file = make_tokenizer(place / "model", corpus)
        inputs = write_jsonl(place / "in.jsonl", corpus)
        prepare_sharded([inputs], place / "data", tokenizer_file=tokenizer_file)
        os.chmod(place, mode)
        places[name] = place / "data"
    probe = (
        "import json, sys\nfrom workers.trainer import hf\n"
        "print(hf.trained_tokenizer(json.loads(sys.argv[1])))"
    )

    def lookup(data: Path, **who) -> str:
        manifest = {"data": {"datasets": [{"name": "borrowed", "path": str(data)}]}}
        done = subprocess.run(
            [sys.executable, "-c", probe, json.dumps(manifest)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": os.defpath},
            check=False,
            **who,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    job_user = {"user": DEFAULT_UID_BASE + 4242, "group": DEFAULT_UID_BASE + 4242}
    assert lookup(places["theirs"]) == str(places["theirs"] / "tokenizer.json")  # as root
    assert lookup(places["open"], **job_user) == str(places["open"] / "tokenizer.json")
    assert lookup(places["theirs"], **job_user) == "None"
