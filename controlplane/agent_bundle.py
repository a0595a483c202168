"""The agent bundle: what a cloud node's user data downloads at first boot.

A tar.gz of workers/__init__.py, workers/agent and workers/trainer, laid out as
workers/providers/bundle.py lays out a node directory, so `python3 -m workers.agent`
runs from where it is unpacked. It holds code only: the node's settings and token
travel in its user data, never in here, and any settings file a developer's agent
left in the source tree is skipped. Served without authentication (curl in user
data has no credentials), built once per process and again when a file changes.
"""

import gzip
import hashlib
import io
import tarfile
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from django.http import StreamingHttpResponse
from django.views.decorators.http import condition, require_safe

from workers.providers.bundle import (
    AGENT_ENV_FILE,
    AGENT_LOG_FILE,
    AGENT_PACKAGE,
    AGENT_PID_FILE,
    TRAINER_PACKAGE,
    Bundle,
    bundle_files,
)

PACKAGES = (AGENT_PACKAGE, TRAINER_PACKAGE)
# What a node writes beside the packages; never shipped (agent.env holds a node token).
NEVER_SHIPPED = frozenset({AGENT_ENV_FILE, AGENT_PID_FILE, AGENT_LOG_FILE})
CHUNK_BYTES = 64 * 1024


def shipped(relative: str) -> bool:
    """Whether a file of the packages goes into the bundle: code, not a node's leftovers."""
    name = relative.rsplit("/", 1)[-1]
    return not (
        name in NEVER_SHIPPED
        or name.startswith(".")
        or name.endswith((".env", ".pid", ".log", ".pyc"))
    )


def _files(packages: Iterable[Path]) -> list[tuple[str, Path | bytes]]:
    bundle = Bundle(agent_argv=("python3",), packages=tuple(packages))
    return [(relative, source) for relative, source in bundle_files(bundle) if shipped(relative)]


def _signature(packages: tuple[Path, ...]) -> tuple:
    """What the archive depends on: every file's path, size and modification time."""
    return tuple(
        (relative, None)
        if isinstance(source, bytes)
        else (relative, source.stat().st_size, source.stat().st_mtime_ns)
        for relative, source in _files(packages)
    )


@lru_cache(maxsize=4)
def _archive(packages: tuple[Path, ...], signature: tuple) -> tuple[bytes, str]:
    """(the tar.gz, its SHA-256): the same files always give the same bytes."""
    raw = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for relative, source in _files(packages):
            data = source if isinstance(source, bytes) else source.read_bytes()
            info = tarfile.TarInfo(relative)
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
    data = raw.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def bundle_archive(packages: Iterable[Path] = PACKAGES) -> tuple[bytes, str]:
    packages = tuple(Path(p) for p in packages)
    return _archive(packages, _signature(packages))


def _etag(request) -> str:
    return bundle_archive()[1]


@require_safe
@condition(etag_func=_etag)
def download(request):
    data, digest = bundle_archive()
    response = StreamingHttpResponse(
        (data[start : start + CHUNK_BYTES] for start in range(0, len(data), CHUNK_BYTES)),
        content_type="application/gzip",
    )
    response["Content-Length"] = str(len(data))
    response["Content-Disposition"] = 'attachment; filename="agent-bundle.tar.gz"'
    response["Cache-Control"] = "no-cache"
    response["X-Content-SHA256"] = digest
    return response
