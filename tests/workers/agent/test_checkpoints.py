"""The agent's checkpoint code on real files and a real process: the trainer's lines picked out
of a run's output, directories checked, listed and deleted. No database here."""

import hashlib
import json
import os
import sys
import time

import pytest

from workers.agent import checkpoints
from workers.agent.client import Message
from workers.agent.runs import LogBuffer, Plan, Run


def _checkpoint(directory, step: int, *, name: str = "", job_uuid: str = "u-1"):
    path = directory / (name or f"step-{step:08d}")
    path.mkdir(parents=True)
    files = {}
    for file_name, body in {"__0_0.distcp": b"a" * 300, ".metadata": b"meta"}.items():
        (path / file_name).write_bytes(body)
        files[file_name] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    manifest = json.dumps(
        {"format": 1, "step": step, "files": files, "job": {"uuid": job_uuid, "attempt": 2}}
    ).encode()
    (path / "manifest.json").write_bytes(manifest)
    return path, hashlib.sha256(manifest).hexdigest()


def test_a_good_checkpoint_verifies(tmp_path):
    path, digest = _checkpoint(tmp_path, 5)
    assert checkpoints.verify(path, digest) == checkpoints.Verdict(True)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda p: (p / "__0_0.distcp").write_bytes(b"a" * 299), "__0_0.distcp has 299 bytes"),
        (lambda p: (p / "__0_0.distcp").write_bytes(b"b" * 300), "does not match its SHA-256"),
        (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
        (lambda p: (p / "manifest.json").write_text("{}"), "does not match the SHA-256"),
        (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
    ],
)
def test_the_first_mismatch_is_named(tmp_path, damage, problem):
    path, digest = _checkpoint(tmp_path, 5)
    damage(path)
    verdict = checkpoints.verify(path, digest)
    assert not verdict.ok and not verdict.missing
    assert problem in verdict.problem


def test_a_directory_that_is_gone_is_missing(tmp_path):
    verdict = checkpoints.verify(tmp_path / "step-00000005", "0" * 64)
    assert not verdict.ok and verdict.missing


def test_delete_removes_ours_treats_gone_as_done_and_leaves_anothers(tmp_path):
    path, digest = _checkpoint(tmp_path, 5)
    assert checkpoints.delete(path, "f" * 64) == (
        "elsewhere",
        f"another committed checkpoint is at {path}: not deleted",
    )
    assert path.exists()
    assert checkpoints.delete(path, digest) == ("deleted", "")
    assert not path.exists()
    assert checkpoints.delete(path, digest) == ("gone", "")


def test_delete_refuses_anything_not_named_like_a_checkpoint(tmp_path):
    (tmp_path / "precious").mkdir()
    outcome, message = checkpoints.delete(tmp_path / "precious", "0" * 64)
    assert outcome == "failed" and "not a checkpoint" in message
    assert (tmp_path / "precious").exists()


def test_a_deletion_that_fails_says_why(tmp_path, monkeypatch):
    path, digest = _checkpoint(tmp_path, 5)

    def refuse(target):  # a read-only mount, say (chmod would not stop root)
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(checkpoints.shutil, "rmtree", refuse)
    outcome, message = checkpoints.delete(path, digest)
    assert outcome == "failed" and "PermissionError" in message
    assert path.exists()


def test_listing_reports_committed_ones_and_tidies_only_temporaries(tmp_path):
    kept, digest = _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 5, name=".replaced-step-00000005-17")
    (tmp_path / ".tmp-step-00000015").mkdir()
    (tmp_path / ".probe-1-2").write_text("probe")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "step-00000020").mkdir()  # no manifest: never committed

    found = checkpoints.listing(tmp_path, tidy=False)
    assert not found["removed"] and (tmp_path / ".tmp-step-00000015").exists()
    tidied = checkpoints.listing(tmp_path, tidy=True)

    assert sorted(tidied["removed"]) == [".probe-1-2", ".tmp-step-00000015"]
    by_name = {e["name"]: e for e in tidied["entries"]}
    assert by_name["step-00000010"]["manifest_sha256"] == digest
    assert by_name["step-00000010"]["size_bytes"] == 304 + (kept / "manifest.json").stat().st_size
    assert (by_name["step-00000010"]["attempt"], by_name["step-00000010"]["job_uuid"]) == (
        2,
        "u-1",
    )
    assert by_name[".replaced-step-00000005-17"]["kind"] == "committed"
    assert by_name["step-00000020"]["kind"] == "incomplete"
    assert by_name["notes.txt"]["kind"] == "other" and (tmp_path / "notes.txt").exists()
    assert checkpoints.listing(tmp_path / "nope", tidy=True)["missing"]


def test_nothing_is_deleted_checked_or_listed_through_a_link(tmp_path):
    """A job may plant links in its own directory pointing at another job's: the registry
    records only real paths (the trainer reports them resolved), so a link is never followed."""
    theirs, digest = _checkpoint(tmp_path / "beta" / "job-2", 5)
    (theirs.parent / ".tmp-step-00000006").mkdir()
    mine = tmp_path / "alpha" / "job-1"
    mine.mkdir(parents=True)
    (mine / "sub").symlink_to(theirs.parent)
    (mine / "step-00000005").symlink_to(theirs)
    linked = mine / "sub" / "step-00000005"

    outcome, message = checkpoints.delete(linked, digest)
    assert outcome == "failed" and "a link" in message
    verdict = checkpoints.verify(linked, digest)
    assert not verdict.ok and not verdict.missing and "a link" in verdict.problem
    listed = checkpoints.listing(mine / "sub", tidy=True)
    assert listed["entries"] == [] and "a link" in listed["problem"]
    own = checkpoints.listing(mine, tidy=True)
    assert {e["name"]: e["kind"] for e in own["entries"]} == {
        "step-00000005": "other",
        "sub": "other",
    }
    assert (theirs / "manifest.json").is_file() and (theirs.parent / ".tmp-step-00000006").is_dir()
    assert checkpoints.verify(theirs, digest).ok  # its own real path: checked as ever


def test_a_fifo_or_a_link_inside_a_checkpoint_neither_hangs_nor_misleads_the_agent(tmp_path):
    """The agent reads a job's checkpoint as root: a FIFO would block it forever, and a
    link would have it hash (or parse) a file the job cannot read."""
    outside = tmp_path / "root-only.json"
    outside.write_text(json.dumps({"step": 99, "files": {}}))
    step, digest = _checkpoint(tmp_path / "job-1", 3)
    shard = next(p for p in step.iterdir() if p.name != "manifest.json")
    shard.unlink()
    os.mkfifo(shard)
    started = time.monotonic()
    verdict = checkpoints.verify(step, digest)
    assert not verdict.ok and "not a plain file" in verdict.problem
    other, _ = _checkpoint(tmp_path / "job-1", 4)
    (other / "manifest.json").unlink()
    os.mkfifo(other / "manifest.json")
    linked, _ = _checkpoint(tmp_path / "job-1", 5)
    (linked / "manifest.json").unlink()
    (linked / "manifest.json").symlink_to(outside)
    listed = checkpoints.listing(tmp_path / "job-1", tidy=False)
    kinds = {e["name"]: e["kind"] for e in listed["entries"]}
    assert kinds["step-00000004"] == kinds["step-00000005"] == "incomplete"
    assert time.monotonic() - started < 10


class _Outbox:
    def __init__(self):
        self.messages: list[Message] = []

    def put(self, message):
        self.messages.append(message)


def test_a_runs_checkpoint_lines_become_reports_and_its_other_lines_do_not(tmp_path):
    outbox = _Outbox()
    keeper = checkpoints.CheckpointKeeper(control=None, outbox=outbox)
    lines = [
        '{"event":"step","step":1,"loss":4.2}',
        '{"event":"checkpoint","step":2,"path":"/c/step-00000002","manifest_sha256":"ab"}',
        "plain text",
        '{"event": "checkpoint_copy", "step": 2, "uri": "s3://b/p/step-00000002"}',
    ]
    code = "import sys; [print(line, flush=True) for line in sys.argv[1:]]"
    logs = LogBuffer(1000)
    run = Run(
        Plan.from_json({"id": 9, "argv": [sys.executable, "-c", code, *lines]}),
        runs_dir=tmp_path,
        logs=logs,
        base_env={"PATH": os.environ["PATH"]},
        on_stdout=lambda text: keeper.relay(9, text),
    )
    run.start()
    deadline = time.monotonic() + 20
    while run.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    run.exit_report(0)  # waits for the reader threads
    assert [(m.path, m.body["event"]["event"]) for m in outbox.messages] == [
        ("/api/v1/agent/checkpoints/events", "checkpoint"),
        ("/api/v1/agent/checkpoints/events", "checkpoint_copy"),
    ]
    assert all(m.body["run"] == 9 for m in outbox.messages)
    assert len(logs) == 4  # every line is still relayed as output


class _Control:
    def __init__(self, work):
        self.work = work
        self.calls = 0

    def call(self, method, path, body=None):
        self.calls += 1
        return self.work


def test_each_request_is_answered_once_while_its_answer_waits_in_the_outbox(tmp_path):
    path, digest = _checkpoint(tmp_path, 5)
    gone = tmp_path / "step-00000001"
    work = {
        "verify": [{"copy": 1, "path": str(path), "manifest_sha256": digest, "requested_at": "t"}],
        "delete": [{"copy": 2, "path": str(gone), "manifest_sha256": digest, "requested_at": "t"}],
        "list": [{"sweep": 3, "path": str(tmp_path), "tidy": True}],
    }
    outbox = _Outbox()
    keeper = checkpoints.CheckpointKeeper(_Control(work), outbox)
    assert keeper.poll_once() == 3
    assert keeper.poll_once() == 0  # asked again before the answers arrived: not redone
    verify, delete, sweep = outbox.messages
    assert verify.path.endswith("/copies/1/verification") and verify.body["ok"] is True
    assert delete.path.endswith("/copies/2/deletion") and delete.body["outcome"] == "gone"
    assert sweep.path.endswith("/sweeps/3") and len(sweep.body["entries"]) == 1
