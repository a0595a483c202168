"""Checkpoints: torch.distributed.checkpoint shards, committed atomically with a verified manifest.

A checkpoint is the directory `<dir>/step-00001200/`: the shards every rank
wrote with torch.distributed.checkpoint (DCP), its `.metadata`, and
`manifest.json`: the step, the layout and world size that wrote it, each
file's size and SHA-256, the data position (in all and per dataset of the
mixture), the RNG state, the loss and the latest evaluation ("eval": its step,
loss, perplexity, tokens and per-dataset figures; null before the first).

Writing: every rank saves its shards into `<dir>/.tmp-step-00001200/`; the
ranks hash the files between them; rank 0 writes the manifest last, fsyncs it
and renames the directory to its final name, which is the commit. A directory
without a manifest, or under a temporary name, is not a checkpoint.

Resuming: from the checkpoint run.json names (a directory, or an s3:// copy
that rank 0 first fetches into the directory), or else, unless run.json says
not to, the newest in the directory: the first whose files all match their
manifest (the ranks check the files between them); a corrupted or incomplete
one is reported and the next older tried. DCP reshards on load, so a
checkpoint written by one layout resumes on another: model and optimizer
state are keyed by parameter name.

A step saved again (a run that resumed from before it) moves the old
directory aside as `.replaced-step-…-<ns>` and says so in its record
("replaced"), so whoever keeps the registry knows where those files went.

Room: before each save the ranks agree whether the directory's filesystem has the
bytes the checkpoint needs (the larger of the state's tensors and the newest committed
checkpoint, plus a tenth); if not, no byte is written and StorageError says how much is
needed and free. A save that fails on storage part-way removes its own temporary
directory; a committed checkpoint is never removed to make room. Either way the run
ends with the exit reason "storage", which the control plane retries.

Multi-node jobs must checkpoint to a path every node sees: a probe file from
rank 0 checks that before training starts. Optionally rank 0 copies each
committed checkpoint to S3 (boto3) in the background, manifest last.
"""

import base64
import errno
import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from workers.trainer import metrics
from workers.trainer.config import ConfigError

MANIFEST = "manifest.json"
FORMAT = 1
# A failed S3 upload is tried again after these pauses (seconds), then reported failed; the
# checkpoint then stays unsecured, so retention keeps the older ones (apps/checkpoints).
UPLOAD_RETRY_DELAYS_S = (5.0, 30.0, 120.0)
# Optimizer state keyed by parameter name, so it reshards like the model's.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# What a save may need beyond its estimate: DCP's metadata, the manifest, serialisation.
ROOM_MARGIN = 1.1
# How storage failures read once DCP and torch.save have wrapped them: the zip writer's
# "unexpected pos" is a short write, the rest are the OS's words.
STORAGE_SIGNS = (
    "no space left",
    "disk quota exceeded",
    "read-only file system",
    "input/output error",
    "unexpected pos",
    "file write failed",
)


class StorageError(Exception):
    """The checkpoint directory's storage cannot take the save: the infrastructure's failure."""


def _causes(error: BaseException) -> list[tuple[int | None, BaseException]]:
    """The ranks' own errors inside DCP's CheckpointException, or the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        # Each failure is (the exception, its traceback summary).
        return [
            (rank, wrapped[0] if isinstance(wrapped, tuple) else wrapped)
            for rank, wrapped in failures.items()
        ]
    return [(None, error)]


def is_storage_failure(error: BaseException) -> bool:
    return any(_is_storage(cause) for _, cause in _causes(error))


def _is_storage(error: BaseException) -> bool:
    if isinstance(error, StorageError):
        return True
    if isinstance(error, OSError) and error.errno in (
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EIO,
    ):
        return True
    text = str(error).lower()
    return any(sign in text for sign in STORAGE_SIGNS)


def _gb(size: float) -> str:
    return f"{size / 1e9:.1f} GB"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def committed(directory: Path) -> list[Path]:
    """Committed checkpoints in `directory`, newest first (a manifest makes one)."""
    if not directory.is_dir():
        return []
    found = [
        p
        for p in directory.iterdir()
        if p.name.startswith("step-") and p.name[5:].isdigit() and (p / MANIFEST).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def file_problem(path: Path, name: str, expected: dict) -> str | None:
    """What is wrong with one file of a checkpoint against its manifest entry, or None."""
    file = path / name
    if not file.is_file():
        return f"{name} is missing"
    if file.stat().st_size != expected["size"]:
        return f"{name} has {file.stat().st_size} bytes, not {expected['size']}"
    if sha256_of(file) != expected["sha256"]:
        return f"{name} does not match its SHA-256"
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    def __init__(self, world, parts, optimizers, batches):
        self.world = world
        self.config = world.config
        self.settings = world.config.checkpoint
        self.parts = parts
        self.optimizers = optimizers
        self.batches = batches
        self.directory = Path(self.settings.dir) if self.settings.dir else None
        self.resumed_from: str | None = None
        self._last_saved_at = time.monotonic()
        self._copies: list[threading.Thread] = []
        # The latest evaluation's figures (evaluation.py), kept with each checkpoint.
        self.evaluation: dict | None = None

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    # --- what is saved -------------------------------------------------------------------

    def _state(self) -> tuple[dict, list[tuple[list[str], list[str]]]]:
        """The merged state of every part, and each part's keys (to hand back after loading)."""
        model, optimizer, keys = {}, {}, []
        for part, opt in zip(self.parts, self.optimizers.optimizers, strict=True):
            part_model = get_model_state_dict(part)
            part_optimizer = get_optimizer_state_dict(part, opt, options=OPTIONS)
            model.update(part_model)
            optimizer.update(part_optimizer)
            keys.append((list(part_model), list(part_optimizer)))
        return {"model": model, "optimizer": optimizer}, keys

    # --- saving --------------------------------------------------------------------------

    def due_by_steps(self, step: int) -> bool:
        """Whether every_steps asks for a checkpoint after `step` (every rank knows alike)."""
        every = self.settings.every_steps
        return bool(self.enabled and every and step % every == 0)

    def due_by_time(self) -> bool:
        """Whether every_minutes asks for one now (rank 0's clock decides; ranks vote)."""
        minutes = self.settings.every_minutes
        return bool(
            self.enabled and minutes and time.monotonic() - self._last_saved_at >= minutes * 60
        )

    def prepare(self) -> None:
        """Before training: make the directory, clear abandoned temporaries, check it is shared."""
        if not self.enabled:
            return
        if self.world.is_logger:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(".tmp-*"):  # steps and fetches never finished
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world.size))
        if local < self.world.size:
            self._check_shared()

    def _check_shared(self) -> None:
        name = [f".probe-{os.getpid()}-{time.time_ns()}" if self.world.is_logger else None]
        dist.broadcast_object_list(name, src=0)
        probe = self.directory / name[0]
        if self.world.is_logger:
            probe.write_text("probe\n")
        dist.barrier()
        missing = torch.tensor([0 if probe.exists() else 1], device=self.world.device)
        dist.all_reduce(missing)
        dist.barrier()
        if self.world.is_logger:
            probe.unlink(missing_ok=True)
        if missing.item():
            raise ConfigError(
                f"checkpoint.dir {self.directory} is not shared by every node: a multi-node job "
                "needs a shared path (or S3), since shards on one node's disk cannot be resumed "
                "elsewhere"
            )

    def save(self, step: int, loss: float) -> dict | None:
        """Write, verify-hash and commit the checkpoint of `step`; rank 0 returns its record."""
        final = self.directory / step_dir_name(step)
        temporary = self.directory / f".tmp-{step_dir_name(step)}"
        if self.world.is_logger and temporary.exists():
            shutil.rmtree(temporary)
        dist.barrier()
        state, _ = self._state()
        self._check_room(step, state)
        try:
            dcp.save(state, checkpoint_id=str(temporary))
            files = self._hash_files(temporary)
            record = None
            if self.world.is_logger:
                record = self._commit(step, loss, temporary, final, files)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            if not is_storage_failure(error):
                raise
            # Every rank sees the failure (DCP gathers the ranks' outcomes); whichever gets
            # here first removes the partial save, which no one will finish.
            shutil.rmtree(temporary, ignore_errors=True)
            rank, cause = next(c for c in _causes(error) if _is_storage(c[1]))
            where = f" (rank {rank})" if rank is not None else ""
            message = (
                f"checkpoint: step {step} could not be written to {self.directory}{where}: "
                f"{type(cause).__name__}: {cause}"
            )
            self._say_storage(step, message)
            raise StorageError(message) from error
        dist.barrier()
        self._last_saved_at = time.monotonic()
        if self.world.is_logger:
            self._keep_newest()
            if self.settings.s3:
                self._copy_to_s3(final, step)
        return record

    def _check_room(self, step: int, state: dict) -> None:
        """Refuse the save, on every rank alike, when the directory lacks the room for it.

        The ranks gather the whole size of each tensor they hold, by name (DCP writes a
        replicated tensor once, so a name counts once), with rank 0's view of the newest
        committed checkpoint and of the free space (the directory is one filesystem for
        all ranks: multi-node jobs need a shared one); every rank then decides alike.
        """
        newest, free = 0, 0
        if self.world.is_logger:
            found = committed(self.directory)
            if found:
                newest = sum(p.stat().st_size for p in found[0].iterdir() if p.is_file())
            stats = os.statvfs(self.directory)
            free = stats.f_bavail * stats.f_frsize
        gathered: list = [None] * self.world.size
        dist.all_gather_object(gathered, (_tensor_sizes(state), newest, free))
        sizes = {}
        for part, _, _ in gathered:
            sizes.update(part)
        _, newest, free = gathered[0]
        written = sum(sizes.values())
        needed = max(written, newest) * ROOM_MARGIN
        if needed <= free:
            return
        message = f"checkpoint: needs {_gb(needed)} at {self.directory}, {_gb(free)} free"
        self._say_storage(step, message)
        raise StorageError(message)

    def _say_storage(self, step: int, message: str) -> None:
        if self.world.is_logger:
            metrics.emit(
                {
                    "event": "checkpoint_failed",
                    "step": step,
                    "reason": "storage",
                    "message": message,
                    "time": time.time(),
                }
            )

    def _hash_files(self, temporary: Path) -> dict:
        """Every file's size and SHA-256, the ranks taking turns through the sorted list."""
        names = sorted(p.name for p in temporary.iterdir() if p.is_file())
        mine = {
            name: {"size": (temporary / name).stat().st_size, "sha256": sha256_of(temporary / name)}
            for name in names[self.world.rank :: self.world.size]
        }
        gathered: list = [None] * self.world.size
        dist.all_gather_object(gathered, mine)
        files = {}
        for part in gathered:
            files.update(part)
        return files

    def _commit(self, step, loss, temporary: Path, final: Path, files: dict) -> dict:
        manifest = {
            "format": FORMAT,
            "step": step,
            "loss": loss,
            "time": time.time(),
            "world_size": self.world.size,
            "layout": self.config.layout.as_dict(),
            "model": {"name": self.config.model_name, "shape": asdict(self.config.model)},
            "data": {
                "dataset": self.config.data.dataset,
                "seq_len": self.config.data.seq_len,
                **self.batches.position(step),
            },
            "rng": _rng_state(self.config.seed),
            "eval": self.evaluation,
            "files": files,
            "resumed_from": self.resumed_from,
            "job": self.config.job,
            "torch": torch.__version__,
        }
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        with open(temporary / MANIFEST, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(temporary)
        replaced = None
        if final.exists():
            # A step saved again (an attempt that resumed before it): keep the old one aside.
            replaced = self.directory / f".replaced-{final.name}-{time.time_ns()}"
            final.rename(replaced)
        temporary.rename(final)
        _fsync_dir(self.directory)
        record = {
            "event": "checkpoint",
            "step": step,
            "path": str(final.resolve()),
            "manifest_sha256": hashlib.sha256(body).hexdigest(),
            "size_bytes": sum(f["size"] for f in files.values()) + len(body),
            "world_size": self.world.size,
            "layout": self.config.layout.as_dict(),
            "loss": loss,
            "eval": self.evaluation,
            "time": manifest["time"],
            "files": len(files) + 1,
        }
        if replaced is not None:
            record["replaced"] = str(replaced.resolve())
        return record

    def _keep_newest(self) -> None:
        keep = self.settings.keep
        if not keep or keep < 1:
            return
        for old in committed(self.directory)[keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def _copy_to_s3(self, path: Path, step: int) -> None:
        thread = threading.Thread(
            target=copy_to_s3, args=(path, self.settings.s3, step), name="s3-copy", daemon=True
        )
        thread.start()
        self._copies.append(thread)

    def wait_for_copies(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self._copies:
            thread.join(max(deadline - time.monotonic(), 0))

    # --- resuming ------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        """Paths to try, best first; rank 0 lists them so every rank tries the same ones."""
        paths = []
        if self.world.is_logger:
            named = self.settings.resume_from
            if named and named.startswith("s3://"):
                fetched = self._fetch(named)
                paths = [str(fetched)] if fetched else []
                older = committed(self.directory) if self.enabled else []
                paths += [str(p) for p in older if _step_of(p) < _step_of(Path(named))]
            elif named:
                named_path = Path(named)
                paths.append(str(named_path))
                older = committed(named_path.parent)
                paths += [str(p) for p in older if _step_of(p) < _step_of(named_path)]
            elif self.enabled and self.settings.resume_newest:
                paths = [str(p) for p in committed(self.directory)]
        box = [paths]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _fetch(self, uri: str) -> Path | None:
        """Rank 0: download an S3 copy into the directory; None (reported) if it cannot."""
        if not self.enabled:
            metrics.emit(
                {"event": "checkpoint_rejected", "path": uri, "reason": "no checkpoint.dir"}
            )
            return None
        try:
            path = fetch_from_s3(uri, self.directory, self.settings.s3)
        except Exception as e:  # reported; older local checkpoints are tried next
            metrics.emit({"event": "checkpoint_rejected", "path": uri, "reason": f"fetch: {e}"})
            return None
        manifest = path / MANIFEST
        metrics.emit(
            {
                "event": "checkpoint_fetched",
                "step": _step_of(Path(uri)),
                "uri": uri,
                "path": str(path.resolve()),
                "manifest_sha256": sha256_of(manifest) if manifest.is_file() else None,
                "time": time.time(),
            }
        )
        return path

    def verify(self, path: Path) -> str | None:
        """None if every file matches its manifest, else what is wrong (ranks share the work)."""
        problem = None
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            if manifest.get("format") != FORMAT:
                raise ValueError(f"manifest format {manifest.get('format')}")
            names = sorted(manifest["files"])
            for name in names[self.world.rank :: self.world.size]:
                problem = file_problem(path, name, manifest["files"][name])
                if problem:
                    break
        except (OSError, ValueError, KeyError, TypeError) as e:
            problem = f"unreadable manifest: {e}"
        problems: list = [None] * self.world.size
        dist.all_gather_object(problems, problem)
        found = [p for p in problems if p]
        return found[0] if found else None

    def resume(self) -> int:
        """Load the newest checkpoint that verifies; the step it was taken after (0: none)."""
        for candidate in self._candidates():
            path = Path(candidate)
            problem = self.verify(path)
            if problem:
                if self.world.is_logger:
                    metrics.emit(
                        {"event": "checkpoint_rejected", "path": str(path), "reason": problem}
                    )
                continue
            return self._load(path)
        return 0

    def _load(self, path: Path) -> int:
        manifest = json.loads((path / MANIFEST).read_text())
        state, keys = self._state()
        dcp.load(state, checkpoint_id=str(path))
        for (part, opt), (model_keys, optimizer_keys) in zip(
            zip(self.parts, self.optimizers.optimizers, strict=True), keys, strict=True
        ):
            set_model_state_dict(part, {k: state["model"][k] for k in model_keys})
            set_optimizer_state_dict(
                part, opt, {k: state["optimizer"][k] for k in optimizer_keys}, options=OPTIONS
            )
        _restore_rng(manifest.get("rng") or {})
        step = int(manifest["step"])
        data = manifest["data"]
        self.batches.rebase(step, int(data["samples_seen"]), data.get("datasets"))
        self.evaluation = manifest.get("eval")
        self.resumed_from = str(path.resolve())
        if self.world.is_logger:
            metrics.emit(
                {
                    "event": "resume",
                    "step": step,
                    "path": self.resumed_from,
                    "from_layout": manifest.get("layout"),
                    "from_world_size": manifest.get("world_size"),
                    "layout": self.config.layout.as_dict(),
                    "time": time.time(),
                }
            )
        return step


def _tensor_sizes(state, prefix: str = "") -> dict[str, int]:
    """Each tensor's whole size in bytes (a sharded one's, not this rank's shard), by name."""
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    elif isinstance(state, torch.Tensor):  # a DTensor's numel is the whole tensor's
        return {prefix: state.numel() * state.element_size()}
    else:
        return {}
    sizes = {}
    for key, value in items:
        sizes.update(_tensor_sizes(value, f"{prefix}/{key}"))
    return sizes


def _step_of(path: Path) -> int:
    name = path.name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else 1 << 62


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_state(seed: int) -> dict:
    state = {"seed": seed, "torch_cpu": _encode(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["torch_cuda"] = _encode(torch.cuda.get_rng_state())
    return state


def _restore_rng(state: dict) -> None:
    if "torch_cpu" in state:
        torch.set_rng_state(_decode(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_decode(state["torch_cuda"]))


def _split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key.strip("/")


def fetch_from_s3(uri: str, directory: Path, s3=None) -> Path:
    """Download the checkpoint at `uri` (a prefix holding its files) into `directory`.

    Under its own name (`step-…`) when that is free, else beside it as
    `.fetched-step-…-<ns>`; through a temporary directory, renamed when complete, so a
    fetch cut short leaves nothing that looks like a checkpoint.
    """
    import boto3

    bucket, key = _split_uri(uri)
    name = key.rsplit("/", 1)[-1]
    if not name.startswith("step-"):
        raise ValueError(f"{uri} does not name a checkpoint (step-…)")
    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint_url if s3 else None,
        region_name=s3.region if s3 else None,
    )
    temporary = directory / f".tmp-fetch-{name}-{time.time_ns()}"
    temporary.mkdir(parents=True)
    count = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
        for item in page.get("Contents", []):
            relative = item["Key"][len(key) + 1 :]
            if not relative or "/" in relative or relative in (".", ".."):
                continue
            client.download_file(bucket, item["Key"], str(temporary / relative))
            count += 1
    if not count:
        shutil.rmtree(temporary, ignore_errors=True)
        raise FileNotFoundError(f"nothing under {uri}")
    final = directory / name
    if final.exists():
        final = directory / f".fetched-{name}-{time.time_ns()}"
    temporary.rename(final)
    _fsync_dir(directory)
    return final


def copy_to_s3(
    path: Path, s3, step: int, *, delays=UPLOAD_RETRY_DELAYS_S, sleep=time.sleep
) -> None:
    """Upload one committed checkpoint, the manifest last, and report the outcome. A failed
    upload is tried again after each of `delays` (seconds) before it is reported failed;
    each try uploads every file again, so a half-written copy never stays half-written."""
    uri = f"s3://{s3.bucket}/{s3.prefix.strip('/') + '/' if s3.prefix else ''}{path.name}"
    for attempt, pause in enumerate([*delays, None], start=1):
        outcome = {"step": step, "uri": uri, "attempts": attempt}
        try:
            _upload(path, s3, uri)
        except Exception as e:  # a failed copy must not stop training
            if pause is None:
                metrics.emit({"event": "checkpoint_copy_failed", **outcome, "message": str(e)})
                return
            sleep(pause)
        else:
            metrics.emit({"event": "checkpoint_copy", **outcome, "time": time.time()})
            return


def _upload(path: Path, s3, uri: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.endpoint_url, region_name=s3.region)
    key_prefix = uri.removeprefix(f"s3://{s3.bucket}/")
    names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
    for name in [*names, MANIFEST]:
        client.upload_file(str(path / name), s3.bucket, f"{key_prefix}/{name}")
