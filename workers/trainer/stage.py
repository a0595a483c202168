"""Stage a job's datasets (and S3 starting weights) onto the node before the trainer
starts, reusing what is there.

    python -m workers.trainer.stage --plan stage.json [--then -- torchrun ...]

The plan, written by the control plane for each run, lists the datasets, and the
Hugging Face checkpoint the run starts from when it is on S3:
`{"datasets": [{"name", "uri", "dest"}], "hf": [{"name", "uri", "dest"}]}`. An
`s3://bucket/prefix/` dataset is copied into `dest` (a directory of the node's dataset
cache, kept across jobs): its `index.json` first, then every file the index names (any
JSON object in it with a `file` or `path` and a `sha256`). A file already in `dest`
whose SHA-256 matches is kept, not fetched again; a `.verified` file remembers (size,
mtime, sha256) of each file checked, so a shard that has not changed since is not read
again. A download goes to a temporary name, is checked, then renamed, so a cut-short
stage leaves nothing that passes for a shard. A shared path is used in place: it must
hold `index.json`. A checkpoint (`hf`) has no index of SHA-256s: its files are reused by
the S3 ETag and size they were fetched at (stage_hf_s3 says why and how).

`dest` is shared by every job of the team on the node, each its own user: the agent makes
it root's, of the team's group, setgid and group-writable (workers/agent/isolation.py,
team_directory). So what the stage writes there is the group's: directories 0770 (the umask
is 007 while staging), files 0640 (read by the team's jobs, replaced only by a rename). A
lock file held with flock makes a second stage of the same dataset wait for the first, then
reuse all it fetched: one download however many jobs start at once.

Progress is printed as JSON lines the agent relays (at most one a second per dataset
and one at its end): `{"event": "stage", "dataset", "files_done", "files",
"bytes_done", "bytes", "reused_bytes"}`, then `{"event": "stage_end", ...}` once all are
staged. Any failure (an S3 error, a checksum that does not match) prints
`{"event": "stage_failed", "dataset", "message"}` and exits 1; with `--then`, the
command after `--` replaces this process only when every dataset is staged.

Standard library only, and boto3 (imported when an S3 dataset is staged); no Django,
no torch. The endpoint and credentials come from the usual AWS variables
(`AWS_ENDPOINT_URL` for a non-AWS endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

INDEX = "index.json"
VERIFIED = ".verified"
LOCK = ".stage.lock"
CHUNK = 8 << 20
HF_CONFIG = "config.json"
HF_SUFFIXES = (".json", ".safetensors")  # config, weights and their index, tokenizer
FILE_MODE = 0o640  # the team's jobs read what another fetched; no one rewrites it in place
STAGE_UMASK = 0o007  # what the stage makes in `dest` is the team's group's, not one job's
PROGRESS_EVERY_S = 1.0


class StageError(Exception):
    """A dataset could not be staged; the message says which file and why."""


@dataclass(frozen=True)
class DatasetFile:
    name: str  # relative to the dataset's directory
    sha256: str


def emit(event: dict) -> None:
    print(json.dumps(event, separators=(",", ":")), flush=True)


# (name, digest) keys that name a file of the dataset: workers/trainer/shards.py writes a
# shard as {"file", "sha256", "docs", "docs_sha256"} (its tokens and its document offsets).
FILE_KEYS = (("file", "sha256"), ("path", "sha256"), ("docs", "docs_sha256"))


def index_files(index: dict) -> list[DatasetFile]:
    """Every file the index names, wherever in it: an object with a `file` (or `path`)
    and a `sha256`, or a `docs` and a `docs_sha256`. Names are plain relative paths,
    never `..` or absolute, so an index cannot make the stage write outside its directory."""
    found: dict[str, DatasetFile] = {}

    def walk(value) -> None:
        if isinstance(value, dict):
            for key, digest in FILE_KEYS:
                name = value.get(key)
                if isinstance(name, str) and isinstance(value.get(digest), str):
                    found.setdefault(safe_name(name), DatasetFile(safe_name(name), value[digest]))
            for child in value.values():
                walk(child)
        elif isinstance(value, list):
            for child in value:
                walk(child)

    walk(index)
    return list(found.values())


def safe_name(name: str) -> str:
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or any(p in (".", "..") for p in parts):
        raise StageError(f"index names {name!r}, which is not a plain relative path")
    if parts[-1] in (INDEX, VERIFIED, LOCK):
        raise StageError(f"index names {name!r}, a name the stage keeps for itself")
    return "/".join(parts)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


class VerifiedCache:
    """What is known of each file checked before, in `dest/.verified`: its size and mtime,
    and its sha256 (a dataset's file) or the S3 ETag it was fetched at (a checkpoint's)."""

    def __init__(self, dest: Path):
        self.path = dest / VERIFIED
        try:
            self.entries = json.loads(self.path.read_text())
            if not isinstance(self.entries, dict):
                self.entries = {}
        except (OSError, ValueError):
            self.entries = {}

    def unchanged(self, name: str, path: Path) -> dict:
        """The facts recorded for the file if its size and mtime are as they were, else {}."""
        try:
            info = path.stat()
        except FileNotFoundError:
            return {}
        entry = self.entries.get(name)
        if (
            isinstance(entry, dict)
            and entry.get("size") == info.st_size
            and entry.get("mtime_ns") == info.st_mtime_ns
        ):
            return entry
        return {}

    def sha256(self, name: str, path: Path) -> str | None:
        """The file's SHA-256: from the cache when its size and mtime are unchanged, else
        read (and remembered); None when it is missing."""
        if digest := self.unchanged(name, path).get("sha256"):
            return digest
        if not path.exists():
            return None
        digest = sha256_of(path)
        self.remember(name, path, sha256=digest)
        return digest

    def remember(self, name: str, path: Path, **facts: str) -> None:
        info = path.stat()
        self.entries[name] = {"size": info.st_size, "mtime_ns": info.st_mtime_ns, **facts}

    def save(self) -> None:
        atomic_write(self.path, json.dumps(self.entries, sort_keys=True).encode())


class Progress:
    """The `stage` events of one dataset: at most one a second, and one at the end."""

    def __init__(self, dataset: str, files: int, total: int, clock=time.monotonic):
        self.clock = clock
        self.state = {
            "event": "stage",
            "dataset": dataset,
            "files_done": 0,
            "files": files,
            "bytes_done": 0,
            "bytes": total,
            "reused_bytes": 0,
        }
        self.last = None

    def advance(self, nbytes: int = 0, *, files: int = 0, reused: int = 0) -> None:
        self.state["bytes_done"] += nbytes + reused
        self.state["reused_bytes"] += reused
        self.state["files_done"] += files
        now = self.clock()
        if self.last is None or now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            emit(dict(self.state))

    def finish(self) -> dict:
        emit(dict(self.state))
        return self.state


def s3_client():
    import boto3

    return boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL") or None)


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def stage_s3(name: str, uri: str, dest: Path, client) -> dict:
    """Copy one dataset from S3 into `dest`, reusing every file that already matches."""
    bucket, prefix = split_uri(uri)
    with team_writable(), locked(dest):
        body = client.get_object(Bucket=bucket, Key=prefix + INDEX)["Body"].read()
        try:
            index = json.loads(body)
        except ValueError as e:
            raise StageError(f"{uri}{INDEX} is not JSON: {e}") from e
        files = index_files(index)
        if not files:
            raise StageError(f"{uri}{INDEX} names no file with a sha256")
        listed = listing(client, bucket, prefix)
        missing = [f.name for f in files if f.name not in listed]
        if missing:
            raise StageError(f"{uri}{missing[0]} is named in {INDEX} but not in the bucket")
        cache = VerifiedCache(dest)
        progress = Progress(name, len(files), sum(listed[f.name].size for f in files))
        try:
            for item in files:
                target, size = dest / item.name, listed[item.name].size
                if cache.sha256(item.name, target) == item.sha256:
                    progress.advance(files=1, reused=size)
                    continue

                def check(fetched: Fetched, item=item) -> None:
                    if fetched.sha256 != item.sha256:
                        raise StageError(
                            f"{item.name}: sha256 {fetched.sha256} after download, "
                            f"the index says {item.sha256}"
                        )

                download(client, bucket, prefix + item.name, target, progress, check)
                cache.remember(item.name, target, sha256=item.sha256)
                progress.advance(files=1)
        finally:
            cache.save()
        atomic_write(dest / INDEX, body)
        return progress.finish()


def stage_hf_s3(name: str, uri: str, dest: Path, client) -> dict:
    """Copy a Hugging Face checkpoint directory from S3 into `dest`: config.json and every
    other JSON and safetensors file directly under the prefix (sharded files and their
    index, tokenizer files), nothing else (no pytorch_model.bin beside them).

    There is no index of SHA-256s to check against, and S3's ETag is not one (an MD5 for a
    plain upload, something else for a multipart or KMS-encrypted one). So a file is reused
    when `.verified` says it was fetched at the ETag and size S3 lists now and it has not
    changed on disk since (size, mtime); a download must bring the listed size and the
    listed ETag (a file replaced in between is refused, not mixed in). What the listing no
    longer has is removed, so a checkpoint re-uploaded from sharded to one file leaves no
    stale index behind."""
    bucket, prefix = split_uri(uri)
    with team_writable(), locked(dest):
        listed = {
            key: obj
            for key, obj in listing(client, bucket, prefix).items()
            if "/" not in key and key.endswith(HF_SUFFIXES)
        }
        if HF_CONFIG not in listed:
            raise StageError(f"{uri}{HF_CONFIG} is not in the bucket: not a checkpoint directory")
        cache = VerifiedCache(dest)
        progress = Progress(name, len(listed), sum(obj.size for obj in listed.values()))
        try:
            for key, obj in sorted(listed.items()):
                target = dest / safe_name(key)
                known = cache.unchanged(key, target)
                if known.get("etag") == obj.etag and known.get("size") == obj.size:
                    progress.advance(files=1, reused=obj.size)
                    continue

                def check(fetched: Fetched, key=key, obj=obj) -> None:
                    if (fetched.size, fetched.etag) != (obj.size, obj.etag):
                        raise StageError(
                            f"{key}: {fetched.size} bytes at ETag {fetched.etag} fetched, "
                            f"{obj.size} at {obj.etag} listed: it changed while staging"
                        )

                download(client, bucket, prefix + key, target, progress, check)
                cache.remember(key, target, etag=obj.etag)
                progress.advance(files=1)
            for path in dest.iterdir():
                kept = path.name in listed or path.name in (VERIFIED, LOCK)
                if not kept and (path.is_symlink() or path.is_file()):
                    cache.entries.pop(path.name, None)
                    path.unlink()
        finally:
            cache.save()
        return progress.finish()


@contextlib.contextmanager
def team_writable():
    """What is made meanwhile is the group's (the dataset directory's, setgid) as well."""
    previous = os.umask(STAGE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


@contextlib.contextmanager
def locked(dest: Path):
    """`dest` held by this stage alone: two runs of a node staging the same dataset (two
    jobs of the team), the second waits, then reuses. The lock file is opened to read, which
    is all flock needs, so a lock file another job's user made serves as well."""
    dest.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest / LOCK, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Listed:
    """What S3 lists of an object."""

    size: int
    etag: str


@dataclass(frozen=True)
class Fetched:
    """What a download brought, for its check."""

    size: int
    etag: str
    sha256: str


def listing(client, bucket: str, prefix: str) -> dict[str, Listed]:
    """Every object under the prefix, by its name relative to it."""
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix) :]] = Listed(item["Size"], item["ETag"])
    return found


def download(client, bucket, key, target: Path, progress, check) -> None:
    """Fetch one object to a temporary name beside `target`; `check` sees what came (its
    size, ETag and SHA-256) and raises StageError to refuse it, else it is renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    digest = hashlib.sha256()
    size = 0
    try:
        answer = client.get_object(Bucket=bucket, Key=key)
        stream = answer["Body"]
        with open(temporary, "wb") as f:
            os.fchmod(f.fileno(), FILE_MODE)
            while block := stream.read(CHUNK):
                f.write(block)
                digest.update(block)
                size += len(block)
                progress.advance(len(block))
            f.flush()
            os.fsync(f.fileno())
        check(Fetched(size, answer.get("ETag", ""), digest.hexdigest()))
        temporary.replace(target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()


def atomic_write(path: Path, content: bytes) -> None:
    temporary = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(temporary, "wb") as f:
        os.fchmod(f.fileno(), FILE_MODE)
        f.write(content)
    temporary.replace(path)


def stage_shared(name: str, uri: str) -> dict:
    if not (Path(uri) / INDEX).is_file():
        raise StageError(f"{uri} has no {INDEX}")
    event = {"event": "stage", "dataset": name, "in_place": True, "path": uri}
    emit(event)
    return event


def stage_all(plan: dict, client_factory=s3_client) -> int:
    """Stage every dataset and checkpoint of the plan; 0 when all are ready, 1 (with the
    reason) if not."""
    started = time.monotonic()
    client = None
    totals = {"bytes": 0, "reused_bytes": 0}
    datasets, checkpoints = plan.get("datasets") or [], plan.get("hf") or []
    # Each entry with how it is copied from S3 and how it is checked in place (a checkpoint on
    # a shared path is never in the plan: the trainer reads it where it is).
    entries = [(d, stage_s3, stage_shared) for d in datasets]
    entries += [(c, stage_hf_s3, None) for c in checkpoints]
    for entry, from_s3, in_place in entries:
        name, uri = entry["name"], entry["uri"]
        try:
            if uri.startswith("s3://"):
                client = client or client_factory()
                done = from_s3(name, uri, Path(entry["dest"]), client)
                totals["bytes"] += done["bytes"]
                totals["reused_bytes"] += done["reused_bytes"]
            elif in_place is not None:
                in_place(name, uri)
            else:
                raise StageError(f"{uri}: only an s3:// checkpoint is staged")
        except Exception as e:  # S3's errors, the disk's and ours: all end the stage
            message = f"{type(e).__name__}: {e}" if not isinstance(e, StageError) else str(e)
            emit({"event": "stage_failed", "dataset": name, "message": message})
            print(f"stage: {name}: {message}", file=sys.stderr, flush=True)
            return 1
    seconds = round(time.monotonic() - started, 3)
    counts = {"datasets": len(datasets), "hf": len(checkpoints)}
    emit({"event": "stage_end", **counts, **totals, "seconds": seconds})
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    then = []
    if "--then" in argv:
        at = argv.index("--then")
        argv, then = argv[:at], argv[at + 1 :]
        if then[:1] == ["--"]:
            then = then[1:]
        if not then:
            print("stage: --then needs a command after --", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="python -m workers.trainer.stage")
    parser.add_argument("--plan", required=True, help="the stage plan (JSON)")
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    code = stage_all(plan)
    if code or not then:
        return code
    os.execvp(then[0], then)  # noqa: S606 (an argument list from the run plan, not a shell)


if __name__ == "__main__":
    sys.exit(main())
