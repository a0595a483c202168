"""Staging a dataset from S3 (a moto server on 127.0.0.1, through boto3) onto the node:
everything fetched the first time, nothing the second, a corrupt object refused."""

import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from tests.workers.agent.test_isolation import _finish, _stdout
from workers.agent import isolation
from workers.agent.isolation import Isolation
from workers.agent.runs import LogBuffer, Plan, Run
from workers.trainer import stage

REPOSITORY = Path(__file__).resolve().parents[3]

boto3 = pytest.importorskip("boto3")


def _index(shards: dict[str, bytes]) -> dict:
    """An index shaped like prepare's: shards and a validation split, each naming a file."""
    names = sorted(shards)
    entry = lambda n: {  # noqa: E731
        "file": n,
        "tokens": len(shards[n]) // 2,
        "documents": 1,
        "sha256": hashlib.sha256(shards[n]).hexdigest(),
    }
    return {
        "format": 1,
        "tokenizer": {"name": "bytes", "sha256": "0" * 64, "vocab_size": 256},
        "shards": [entry(n) for n in names[:-1]],
        "validation": entry(names[-1]),
    }


@pytest.fixture
def dataset(aws_endpoint, request, monkeypatch):
    """A bucket holding a three-file dataset under `wiki/`; the client every stage uses
    counts the shard objects it GETs."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    bucket = f"data-{abs(hash(request.node.name)) % 10**8}"
    client.create_bucket(Bucket=bucket)
    shards = {f"shard-{i:05d}.bin": bytes([i]) * (3000 + i) for i in range(2)}
    shards["validation.bin"] = b"v" * 500
    for name, body in shards.items():
        client.put_object(Bucket=bucket, Key=f"wiki/{name}", Body=body)
    client.put_object(Bucket=bucket, Key="wiki/index.json", Body=json.dumps(_index(shards)))
    gets = []
    real = stage.s3_client

    def counting_client():
        made = real()
        original = made.get_object

        def get_object(**kwargs):
            gets.append(kwargs["Key"])
            return original(**kwargs)

        made.get_object = get_object
        return made

    return {
        "client": client,
        "bucket": bucket,
        "shards": shards,
        "gets": gets,
        "factory": counting_client,
    }


def _plan(dataset, dest):
    return {
        "datasets": [{"name": "wiki", "uri": f"s3://{dataset['bucket']}/wiki/", "dest": str(dest)}]
    }


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_the_first_stage_fetches_everything_and_the_second_reuses_it(
    dataset, tmp_path, capsys, monkeypatch
):
    dest = tmp_path / "cache" / "wiki"
    total = sum(len(b) for b in dataset["shards"].values())

    assert stage.stage_all(_plan(dataset, dest), dataset["factory"]) == 0
    first = _events(capsys.readouterr().out)
    for name, body in dataset["shards"].items():
        assert (dest / name).read_bytes() == body
    assert json.loads((dest / "index.json").read_text())["format"] == 1
    assert not [p for p in dest.iterdir() if p.name.startswith(".tmp-")]
    last = [e for e in first if e["event"] == "stage"][-1]
    assert last == {
        "event": "stage",
        "dataset": "wiki",
        "files_done": 3,
        "files": 3,
        "bytes_done": total,
        "bytes": total,
        "reused_bytes": 0,
    }
    assert first[-1]["event"] == "stage_end" and first[-1]["bytes"] == total
    assert sorted(k for k in dataset["gets"] if k != "wiki/index.json") == sorted(
        f"wiki/{n}" for n in dataset["shards"]
    )

    # The second time: no shard is fetched, and none is read again (the .verified cache).
    dataset["gets"].clear()
    monkeypatch.setattr(stage, "sha256_of", lambda path: pytest.fail(f"{path} was hashed again"))
    assert stage.stage_all(_plan(dataset, dest), dataset["factory"]) == 0
    second = _events(capsys.readouterr().out)
    assert dataset["gets"] == ["wiki/index.json"]
    last = [e for e in second if e["event"] == "stage"][-1]
    assert last["reused_bytes"] == last["bytes"] == last["bytes_done"] == total
    assert second[-1] == {**second[-1], "event": "stage_end", "reused_bytes": total}


def test_a_changed_local_file_is_fetched_again(dataset, tmp_path, capsys):
    dest = tmp_path / "wiki"
    assert stage.stage_all(_plan(dataset, dest), dataset["factory"]) == 0
    (dest / "shard-00000.bin").write_bytes(b"tampered")
    dataset["gets"].clear()
    assert stage.stage_all(_plan(dataset, dest), dataset["factory"]) == 0
    assert dataset["gets"] == ["wiki/index.json", "wiki/shard-00000.bin"]
    assert (dest / "shard-00000.bin").read_bytes() == dataset["shards"]["shard-00000.bin"]


def test_a_corrupt_object_fails_the_stage_naming_the_file(dataset, tmp_path, capsys):
    dataset["client"].put_object(Bucket=dataset["bucket"], Key="wiki/shard-00001.bin", Body=b"rot")
    dest = tmp_path / "wiki"
    assert stage.stage_all(_plan(dataset, dest), dataset["factory"]) == 1
    captured = capsys.readouterr()
    failed = _events(captured.out)[-1]
    assert failed["event"] == "stage_failed" and "shard-00001.bin" in failed["message"]
    assert "shard-00001.bin" in captured.err
    assert not (dest / "shard-00001.bin").exists()
    assert not [p for p in dest.iterdir() if p.name.startswith(".tmp-")]


def test_an_s3_error_exits_1_with_the_reason(dataset, tmp_path, capsys):
    plan = {
        "datasets": [
            {"name": "gone", "uri": f"s3://{dataset['bucket']}/nothing/", "dest": str(tmp_path)}
        ]
    }
    assert stage.stage_all(plan, dataset["factory"]) == 1
    assert "NoSuchKey" in capsys.readouterr().err


def test_an_index_cannot_write_outside_its_directory():
    with pytest.raises(stage.StageError, match="plain relative path"):
        stage.index_files({"shards": [{"file": "../../etc/passwd", "sha256": "x"}]})
    assert [f.name for f in stage.index_files({"a": {"path": "x/y.bin", "sha256": "s"}})] == [
        "x/y.bin"
    ]


def test_a_shared_path_is_used_in_place(tmp_path, capsys):
    (tmp_path / "index.json").write_text("{}")
    plan = {"datasets": [{"name": "books", "uri": str(tmp_path), "dest": ""}]}
    assert stage.stage_all(plan) == 0
    events = _events(capsys.readouterr().out)
    assert events[0] == {
        "event": "stage",
        "dataset": "books",
        "in_place": True,
        "path": str(tmp_path),
    }
    assert (
        stage.stage_all({"datasets": [{"name": "x", "uri": str(tmp_path / "no"), "dest": ""}]}) == 1
    )


def test_then_runs_the_command_only_after_staging(tmp_path, monkeypatch):
    (tmp_path / "index.json").write_text("{}")
    plan = tmp_path / "stage.json"
    plan.write_text(json.dumps({"datasets": [{"name": "b", "uri": str(tmp_path), "dest": ""}]}))
    ran = []
    monkeypatch.setattr(stage.os, "execvp", lambda file, args: ran.append(args))
    stage.main(["--plan", str(plan), "--then", "--", sys.executable, "-c", "pass"])
    assert ran == [[sys.executable, "-c", "pass"]]
    plan.write_text(
        json.dumps({"datasets": [{"name": "b", "uri": str(tmp_path / "no"), "dest": ""}]})
    )
    ran.clear()
    assert stage.main(["--plan", str(plan), "--then", "--", "torchrun"]) == 1
    assert ran == []


def test_a_prepared_dataset_stages_whole_and_the_registry_reads_its_index(
    aws_endpoint, tmp_path, monkeypatch, capsys
):
    """The real format end to end: prepared with a tokenizer.json (tokenizers), uploaded,
    summarised as the registry does, staged from S3, and whole again on the node."""
    from apps.jobs.datasets import index_summary
    from tests.workers.trainer.test_datasets import make_tokenizer, texts, write_jsonl
    from workers.trainer import shards
    from workers.trainer.prepare import prepare_sharded

    corpus = texts(300)
    index = prepare_sharded(
        [write_jsonl(tmp_path / "in.jsonl", corpus)],
        tmp_path / "web",
        tokenizer_file=make_tokenizer(tmp_path / "model", corpus),
        validation=0.1,
        shard_tokens=700,
    )
    summary = index_summary(index)
    assert (summary["tokens"], summary["documents"]) == (
        index["totals"]["tokens"],
        index["totals"]["documents"],
    )
    assert summary["shards"] == sum(len(s["shards"]) for s in index["splits"].values()) > 2

    monkeypatch.setenv("AWS_ENDPOINT_URL", aws_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=aws_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="prepared")
    for path in (tmp_path / "web").rglob("*"):
        if path.is_file():
            key = f"web/{path.relative_to(tmp_path / 'web')}"
            client.put_object(Bucket="prepared", Key=key, Body=path.read_bytes())
    dest = tmp_path / "node" / "web"
    plan = {"datasets": [{"name": "web", "uri": "s3://prepared/web/", "dest": str(dest)}]}
    assert stage.stage_all(plan, stage.s3_client) == 0, capsys.readouterr()
    assert shards.verify(dest) == []  # every shard, its document offsets and the tokenizer


# --- a team's cache on a node, shared by its jobs' users ----------------------------------------


@pytest.fixture
def cache_root():
    """A node's dataset cache that other users may pass through (tmp_path is closed to them)."""
    path = Path(tempfile.mkdtemp(prefix="cp-datasets-", dir="/tmp"))
    os.chmod(path, 0o711)  # noqa: S103 (pass through, list nothing)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stage_run(cache_root, dataset, *, job, team, dest: Path | None, code="", args=()):
    """A run of `job` (its own user, of `team`'s group) that stages the dataset into `dest`
    as dispatch plans it, through the agent's Run, then runs `code`."""
    plan = {"datasets": [{"name": "wiki", "uri": f"s3://{dataset['bucket']}/wiki/", "dest": ""}]}
    if dest is not None:
        plan["datasets"][0]["dest"] = str(dest)
    program = (
        f"import sys; sys.path.insert(0, {str(REPOSITORY)!r})\n"
        "from workers.trainer import stage\n"
        + (code or "sys.exit(stage.main(['--plan', 'stage.json']))")
    )
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    return Run(
        Plan.from_json(
            {
                "id": job,
                "job": job,
                "team": team,
                "team_dirs": [str(dest)] if dest is not None else [],
                "argv": [sys.executable, "-c", program, *args],
                "env": {k: os.environ[k] for k in keys},
                "files": [{"path": "stage.json", "content": json.dumps(plan)}],
            }
        ),
        runs_dir=cache_root / "runs",
        logs=LogBuffer(10_000),
        base_env={"PATH": "/usr/bin:/bin"},
        isolation=Isolation("user"),
        code_dir=cache_root,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_two_jobs_of_a_team_share_one_download_and_another_team_cannot_read_it(dataset, cache_root):
    dest = cache_root / "datasets" / "foundation" / "7-0123456789abcdef"
    first = _stage_run(cache_root, dataset, job=71, team=5, dest=dest)
    second = _stage_run(cache_root, dataset, job=72, team=5, dest=dest)
    first.start()
    second.start()  # at once: the second waits on the lock, then reuses what the first fetched
    reports = [_finish(first), _finish(second)]
    assert [r["exit_code"] for r in reports] == [0, 0], [_stdout(first), _stdout(second)]

    total = sum(len(b) for b in dataset["shards"].values())
    ends = [_events("\n".join(_stdout(run)))[-1] for run in (first, second)]
    assert all(e["event"] == "stage_end" and e["bytes"] == total for e in ends)
    # One download between them: one stage fetched every byte, the other reused them all.
    assert sorted(e["reused_bytes"] for e in ends) == [0, total]
    team_gid = Isolation("user").gid_for_team(5)
    uids = {Isolation("user").uid_for(job) for job in (71, 72)}
    for name, body in dataset["shards"].items():
        info = (dest / name).stat()
        assert (dest / name).read_bytes() == body
        assert info.st_uid in uids and info.st_gid == team_gid
        assert stat.S_IMODE(info.st_mode) == stage.FILE_MODE
    # The agent's, of the team's group: setgid, the group writes the dataset, lists the team.
    for path, mode in ((dest, 0o2770), (dest.parent, 0o2750)):
        info = path.stat()
        assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, team_gid, mode)

    # A job of another team on the same node reaches none of it.
    probe = (
        "import os\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        open(path, 'rb').read() if path.endswith('.bin') else os.listdir(path)\n"
        "        print('read', path)\n"
        "    except PermissionError:\n"
        "        print('denied', path)\n"
    )
    targets = [str(dest / "shard-00000.bin"), str(dest), str(dest.parent)]
    other = _stage_run(cache_root, dataset, job=73, team=6, dest=None, code=probe, args=targets)
    other.start()
    assert _finish(other)["exit_code"] == 0
    assert _stdout(other) == [f"denied {t}" for t in targets]


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_cache_an_older_agent_gave_to_one_job_is_made_afresh_for_the_team(cache_root):
    dest = cache_root / "datasets" / "foundation" / "7-0123456789abcdef"
    dest.mkdir(parents=True)
    os.chmod(dest.parent, 0o711)  # noqa: S103 (as an older agent left it: traversable)
    (dest / "shard-00000.bin").write_bytes(b"one job's")
    isolation.hand_over(dest, 1_500_000_071, 1_500_000_071)
    os.chmod(dest, 0o700)
    isolation.team_directory(dest, 1_999_999_999)
    info = dest.stat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (0, 1_999_999_999, 0o2770)
    assert list(dest.iterdir()) == []
    # A plan cannot make the agent give any other directory of root's to a team.
    system = cache_root / "system"
    system.mkdir(mode=0o755)
    (system / "keep").write_text("root's")
    with pytest.raises(PermissionError, match="not a team directory"):
        isolation.team_directory(system / "keep", 1_999_999_999)
    assert (system / "keep").read_text() == "root's"
    assert (system.stat().st_gid, stat.S_IMODE(system.stat().st_mode)) == (0, 0o755)
