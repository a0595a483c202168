"""Checkpoints on this node: what the trainer committed, relayed so it is never lost, and the
checks, listings and deletions of checkpoint directories the control plane asks for.

The trainer prints a JSON line for each checkpoint it commits (workers/trainer/metrics.py).
Those lines travel with the run's output too, but output may be dropped when the buffer is
full, and the registry must not miss a commit: so each such line also goes as a report
through the outbox, retried until it arrives. Requests come from their own endpoint, asked
by a thread of their own, since hashing a large checkpoint takes minutes and heartbeats
must not wait for it:

    POST checkpoints/events                     {run, event}
    GET  checkpoints/work                       -> {"verify": [{copy, path, manifest_sha256,
                                                               requested_at}],
                                                    "delete": [{copy, path, manifest_sha256,
                                                               requested_at}],
                                                    "list":   [{sweep, path, tidy}],
                                                    "export": [{export, job, path, out,
                                                               manifest_sha256, dtype,
                                                               timeout_s}]}
    POST checkpoints/copies/{id}/verification   {ok, missing, problem}
    POST checkpoints/copies/{id}/deletion       {outcome, message}
    POST checkpoints/sweeps/{id}                {missing, entries, removed}
    POST checkpoints/exports/{id}               {ok, path, files: [{name, size}], problem}

Deletion outcomes: "deleted", "gone" (nothing there: done already), "elsewhere" (another
committed checkpoint now sits at that path: ours is not there to delete) or "failed".
Only directories named as the trainer names checkpoints are ever deleted, and a listing
tidies only the trainer's temporaries, so no request can remove anything else. Nothing is
checked, deleted or listed through a link: a job may plant one in its own directory to point
at another job's, and the trainer reports real paths (resolved), so a path that is not its
own real path is not one the registry recorded from the trainer.

An export (to Hugging Face) runs the trainer's exporter (`python3 -m workers.trainer.hf
export`, an argument list) as the job's own user, as its runs are: it reads what the job
wrote and writes into the job's directory, so nothing the job planted there can make the
agent's privileges read or write elsewhere. It writes only `<checkpoint>-hf` beside the
checkpoint, and only after the checkpoint's manifest is the one the registry recorded.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workers.agent.client import ControlPlane, Message, Outbox, Refused, Unreachable
from workers.agent.isolation import Isolation, open_plain

log = logging.getLogger("agent")
API = "/api/v1/agent/checkpoints"
MANIFEST = "manifest.json"
# The trainer's lines that the registry needs (workers/trainer/checkpoint.py, train.py).
RELAYED = frozenset(
    {
        "checkpoint",
        "checkpoint_copy",
        "checkpoint_copy_failed",
        "checkpoint_rejected",
        "checkpoint_fetched",
        "resume",
    }
)
# What a checkpoint directory is called: committed, moved aside when its step was saved
# again, or fetched beside a directory of the same name.
CHECKPOINT_NAME = re.compile(r"(step-\d+|\.replaced-step-\d+-\d+|\.fetched-step-\d+-\d+)\Z")
TEMPORARY_NAME = re.compile(r"(\.tmp-[\w.-]+|\.probe-[\w.-]+)\Z")
_STEP = re.compile(r"step-(\d+)")
EXPORT_SUFFIX = "-hf"  # beside step-00000060: step-00000060-hf (apps/checkpoints exports)
EXPORT_DTYPES = frozenset({"bfloat16", "float16", "float32"})


def event_of(text: str) -> dict | None:
    """The trainer's checkpoint line in `text`, or None (cheap for every other line)."""
    if not text.startswith("{") or '"event"' not in text[:40]:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, dict) and data.get("event") in RELAYED:
        return data
    return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open_plain(path) as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Verdict:
    ok: bool
    missing: bool = False
    problem: str = ""


def _linked(path: Path) -> bool:
    """Whether the path is relative or passes through a link (its real path is another)."""
    return not path.is_absolute() or os.path.realpath(path) != str(path)


def verify(path: Path, manifest_sha256: str) -> Verdict:
    """Every file against the manifest, the manifest against the registry; the first mismatch."""
    if _linked(path):
        return Verdict(False, problem=f"{path} is not its real path (a link): not checked")
    if not path.is_dir():
        return Verdict(False, missing=True, problem=f"{path} does not exist")
    manifest_path = path / MANIFEST
    if not _regular(manifest_path):
        return Verdict(False, problem=f"{MANIFEST} is missing")
    if sha256_of(manifest_path) != manifest_sha256:
        return Verdict(False, problem=f"{MANIFEST} does not match the SHA-256 the trainer reported")
    try:
        with open_plain(manifest_path) as f:
            files = json.loads(f.read())["files"]
        items = sorted(files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return Verdict(False, problem=f"unreadable {MANIFEST}: {exc}")
    for name, expected in items:
        file = path / name
        if "/" in name or name in (".", "..") or not _regular(file):
            return Verdict(False, problem=f"{name} is missing (or not a plain file)")
        try:
            size, digest = expected["size"], expected["sha256"]
        except (KeyError, TypeError):
            return Verdict(False, problem=f"{MANIFEST} has no size and SHA-256 for {name}")
        if file.lstat().st_size != size:
            return Verdict(False, problem=f"{name} has {file.lstat().st_size} bytes, not {size}")
        try:
            if sha256_of(file) != digest:
                return Verdict(False, problem=f"{name} does not match its SHA-256")
        except OSError as exc:
            return Verdict(False, problem=f"{name} cannot be read: {exc}")
    return Verdict(True)


def _regular(path: Path) -> bool:
    """A plain file itself, not a link to one."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _manifest_of(path: Path) -> dict | None:
    """The directory's manifest if it reads as one (a step and files), else None."""
    try:
        with open_plain(path / MANIFEST) as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("files"), dict) and "step" in data:
        return data
    return None


def delete(path: Path, manifest_sha256: str) -> tuple[str, str]:
    """Remove one checkpoint directory, if it is the one the registry means."""
    if not CHECKPOINT_NAME.match(path.name):
        return "failed", f"{path.name} is not a checkpoint directory's name: not deleted"
    if not path.exists():
        return "gone", ""
    if not path.is_dir() or path.is_symlink():
        return "failed", f"{path} is not a directory: not deleted"
    if _linked(path):
        return "failed", f"{path} is not its real path (a link): not deleted"
    if _manifest_of(path) is not None and sha256_of(path / MANIFEST) != manifest_sha256:
        return "elsewhere", f"another committed checkpoint is at {path}: not deleted"
    try:
        shutil.rmtree(path)
    except OSError as exc:
        return "failed", f"{type(exc).__name__}: {exc}"[:500]
    return ("failed", f"{path} is still there") if path.exists() else ("deleted", "")


def _size_of(path: Path, manifest: dict) -> int:
    total = (path / MANIFEST).stat().st_size
    for item in manifest["files"].values():
        size = item.get("size") if isinstance(item, dict) else None
        total += size if isinstance(size, int) else 0
    return total


def listing(directory: Path, *, tidy: bool) -> dict:
    """What a job's checkpoint directory holds; with `tidy`, the trainer's temporaries go."""
    if _linked(directory):
        problem = f"{directory} is not its real path (a link): not listed"
        return {"missing": False, "entries": [], "removed": [], "problem": problem}
    if not directory.is_dir():
        return {"missing": True, "entries": [], "removed": []}
    entries, removed = [], []
    for child in sorted(directory.iterdir()):
        name = child.name
        if CHECKPOINT_NAME.match(name) and child.is_dir() and not child.is_symlink():
            manifest = _manifest_of(child)
            if manifest is None:
                entries.append({"name": name, "kind": "incomplete"})
                continue
            step = _STEP.search(name)
            whose = manifest.get("job") if isinstance(manifest.get("job"), dict) else {}
            entries.append(
                {
                    "name": name,
                    "kind": "committed",
                    "path": str(child),
                    "step": int(step.group(1)) if step else None,
                    "manifest_sha256": sha256_of(child / MANIFEST),
                    "manifest_step": manifest.get("step"),
                    "world_size": manifest.get("world_size"),
                    "layout": manifest.get("layout"),
                    "loss": manifest.get("loss"),
                    "time": manifest.get("time"),
                    "files": len(manifest["files"]) + 1,
                    "size_bytes": _size_of(child, manifest),
                    "attempt": whose.get("attempt"),
                    "job_uuid": whose.get("uuid"),
                }
            )
        elif TEMPORARY_NAME.match(name) and tidy:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(name)
        else:
            kind = "temporary" if TEMPORARY_NAME.match(name) else "other"
            entries.append({"name": name, "kind": kind})
    return {"missing": False, "entries": entries, "removed": removed}


def _failed(problem: str) -> dict:
    return {"ok": False, "problem": problem[:500]}


def export(
    path: Path,
    out: Path,
    manifest_sha256: str,
    dtype: str,
    *,
    run_as: dict,
    env: dict[str, str],
    timeout_s: float,
) -> dict:
    """Write the checkpoint at `path` as a Hugging Face directory at `out` (beside it), by the
    trainer's exporter run with `run_as` (the job's user); what is there once it is done."""
    if not CHECKPOINT_NAME.match(path.name) or out != path.with_name(path.name + EXPORT_SUFFIX):
        return _failed(f"{out} is not {path}'s export directory: not written")
    if dtype not in EXPORT_DTYPES:
        return _failed(f"{dtype!r} is not a dtype the exporter writes")
    if _linked(path) or _linked(out.parent):
        return _failed(f"{path} is not its real path (a link): not exported")
    if not path.is_dir():
        return _failed(f"{path} does not exist")
    if not _regular(path / MANIFEST) or sha256_of(path / MANIFEST) != manifest_sha256:
        return _failed(f"the checkpoint at {path} is not the one the registry recorded")
    try:  # an earlier export's files would linger beside a new one's: it is written afresh
        if out.is_symlink() or out.is_file():
            out.unlink()
        elif out.exists():
            shutil.rmtree(out)
    except OSError as exc:
        return _failed(f"an earlier export at {out} could not be removed: {exc}")
    argv = ["python3", "-m", "workers.trainer.hf", "export"]
    argv += ["--checkpoint", str(path), "--out", str(out), "--dtype", dtype]
    try:
        done = subprocess.run(
            argv,
            cwd=path.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            start_new_session=True,
            **run_as,
        )
    except subprocess.TimeoutExpired:
        return _failed(f"the export took longer than {timeout_s:.0f} s")
    except (OSError, subprocess.SubprocessError) as exc:
        return _failed(f"the exporter could not start: {exc}")
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if line.strip()]
        return _failed(said[-1] if said else f"the exporter exited {done.returncode}")
    if _linked(out) or not out.is_dir():
        return _failed(f"the exporter wrote no directory at {out}")
    files = [
        {"name": child.name, "size": child.lstat().st_size}
        for child in sorted(out.iterdir())
        if _regular(child)
    ]
    return {"ok": True, "path": str(out), "files": files}


class CheckpointKeeper:
    """Relays the trainer's checkpoint lines, and does what the control plane asks of this
    node's checkpoint directories (one thing at a time, in a thread of its own): checks,
    deletions, listings and exports."""

    def __init__(
        self,
        control: ControlPlane,
        outbox: Outbox,
        *,
        every_s: float = 2.0,
        isolation: Isolation | None = None,
        code_dir: Path | None = None,
    ):
        self.control = control
        self.outbox = outbox
        self.every_s = every_s
        # Exports run as the job's user (isolation), importing the bundled trainer (code_dir).
        self.isolation = isolation
        self.code_dir = code_dir
        # Requests done whose answer is still in the outbox: not done twice meanwhile.
        self._answered: dict[tuple, float] = {}
        self._lock = threading.Lock()

    def relay(self, run_id: int, text: str) -> None:
        """Called with every stdout line of a run (by its reader thread)."""
        event = event_of(text)
        if event is None:
            return
        what = f"run {run_id} {event['event']} {event.get('step', '')}".strip()
        self.outbox.put(Message("POST", f"{API}/events", {"run": run_id, "event": event}, what))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.poll_once()
            except Exception:  # one bad request must not end the thread
                log.exception("checkpoint work failed; asking again later")
            stop.wait(self.every_s)

    def poll_once(self) -> int:
        """Fetch the requests for this node and answer each; how many were answered."""
        try:
            work = self.control.call("GET", f"{API}/work")
        except (Unreachable, Refused) as exc:
            log.warning("could not fetch checkpoint work: %s", exc)
            return 0
        self._forget_old()
        done = 0
        for item in work.get("verify", []):
            done += self._once(("verify", item.get("copy"), item.get("requested_at")), item)
        for item in work.get("delete", []):
            done += self._once(("delete", item.get("copy"), item.get("requested_at")), item)
        for item in work.get("list", []):
            done += self._once(("list", item.get("sweep"), None), item)
        for item in work.get("export", []):
            done += self._once(("export", item.get("export"), None), item)
        return done

    def _once(self, key: tuple, item: dict) -> int:
        with self._lock:
            if key in self._answered:
                return 0
        try:
            message = self._answer(key[0], item)
        except (KeyError, TypeError, ValueError) as exc:
            log.error("a checkpoint request this agent cannot read: %s (%s)", item, exc)
            return 0
        with self._lock:
            self._answered[key] = time.monotonic()
        self.outbox.put(message)
        return 1

    def _answer(self, kind: str, item: dict) -> Message:
        if kind == "verify":
            copy_id, path = int(item["copy"]), Path(str(item["path"]))
            verdict = verify(path, str(item["manifest_sha256"]))
            body = {"ok": verdict.ok, "missing": verdict.missing, "problem": verdict.problem}
            what = f"checkpoint copy {copy_id} {'verified' if verdict.ok else 'corrupt'}"
            return Message("POST", f"{API}/copies/{copy_id}/verification", body, what)
        if kind == "delete":
            copy_id, path = int(item["copy"]), Path(str(item["path"]))
            outcome, message = delete(path, str(item["manifest_sha256"]))
            body = {"outcome": outcome, "message": message}
            what = f"checkpoint copy {copy_id} {outcome}"
            return Message("POST", f"{API}/copies/{copy_id}/deletion", body, what)
        if kind == "export":
            export_id, job_id = int(item["export"]), int(item["job"])
            body = export(
                Path(str(item["path"])),
                Path(str(item["out"])),
                str(item["manifest_sha256"]),
                str(item["dtype"]),
                run_as=self._as_job(job_id),
                env=self._export_env(job_id, Path(str(item["path"])).parent),
                timeout_s=float(item.get("timeout_s") or 4 * 3600),
            )
            what = f"checkpoint export {export_id} {'done' if body['ok'] else 'failed'}"
            return Message("POST", f"{API}/exports/{export_id}", body, what)
        sweep_id = int(item["sweep"])
        body = listing(Path(str(item["path"])), tidy=bool(item.get("tidy")))
        return Message("POST", f"{API}/sweeps/{sweep_id}", body, f"checkpoint sweep {sweep_id}")

    def _as_job(self, job_id: int) -> dict:
        """subprocess' arguments that start the exporter as the job's own user (as runs.Run)."""
        if self.isolation is None or not self.isolation.on:
            return {}
        uid = self.isolation.uid_for(job_id)
        return {"user": uid, "group": uid, "extra_groups": [], "umask": 0o077}

    def _export_env(self, job_id: int, home: Path) -> dict[str, str]:
        """The exporter's environment: the agent's Python first on PATH (as runs get it) and
        the bundled packages, then the agent's own, on its import path; nothing else."""
        env = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL")}
        env["PATH"] = os.pathsep.join(
            [os.path.dirname(sys.executable), os.environ.get("PATH", os.defpath)]
        )
        paths = [str(self.code_dir)] if self.code_dir is not None else []
        paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        name = f"job{job_id}"
        env.update(HOME=str(home), USER=name, LOGNAME=name)
        return env

    def _forget_old(self, keep_s: float = 600.0) -> None:
        cutoff = time.monotonic() - keep_s
        with self._lock:
            for key in [k for k, at in self._answered.items() if at < cutoff]:
                del self._answered[key]
