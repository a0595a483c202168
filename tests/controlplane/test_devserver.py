"""`make run`'s var/: local nodes run jobs on this machine, so nothing of the control
plane's own there may be read by them; they pass through to their nodes and checkpoints."""

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from controlplane.devserver import close_var


@pytest.fixture
def var_dir():
    base = Path(tempfile.mkdtemp(prefix="cp-var-", dir="/tmp"))
    os.chmod(base, 0o711)  # noqa: S103 (pass through, as a checkout's directory is)
    var = base / "var"
    var.mkdir(mode=0o755)
    for name, text in (
        ("secret_key", "key"),
        ("controlplane.sqlite3", "db"),
        ("demo-logins.json", "{}"),
    ):
        (var / name).write_text(text)
        (var / name).chmod(0o644)
    for name in ("broker", "nodes", "checkpoints", "datasets"):
        (var / name).mkdir(mode=0o755)
    (var / "broker" / "message").write_text("task")
    (var / "broker" / "message").chmod(0o644)
    (var / "nodes" / "node-1").mkdir(mode=0o711)
    yield var
    subprocess.run(["rm", "-rf", str(base)], check=False)


def test_var_keeps_the_control_planes_files_from_jobs(var_dir):
    close_var(var_dir)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in var_dir.iterdir()}
    assert stat.S_IMODE(var_dir.stat().st_mode) == 0o711
    assert mode == {
        "secret_key": 0o600,
        "controlplane.sqlite3": 0o600,
        "demo-logins.json": 0o600,
        "broker": 0o700,
        "nodes": 0o711,
        "checkpoints": 0o711,
        "datasets": 0o711,
    }
    if os.geteuid() != 0:
        return  # reading as another user needs root to switch users
    probe = (
        "import os, sys\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        os.listdir(path) if os.path.isdir(path) else open(path).read()\n"
        "        print('READ', path)\n"
        "    except PermissionError:\n"
        "        print('refused')\n"
    )
    targets = [var_dir, *(var_dir / n for n in ("secret_key", "controlplane.sqlite3"))]
    targets += [var_dir / "demo-logins.json", var_dir / "broker" / "message", var_dir / "nodes"]
    done = subprocess.run(
        ["/usr/bin/python3", "-c", probe, *map(str, targets)],
        user=1_500_000_001,
        group=1_500_000_001,
        extra_groups=[],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split("\n")[:-1] == ["refused"] * len(targets)
    # ...while a job still reaches its node's directory through them.
    assert (
        subprocess.run(
            [
                "/usr/bin/python3",
                "-c",
                f"import os; os.stat({str(var_dir / 'nodes' / 'node-1')!r})",
            ],
            user=1_500_000_001,
            group=1_500_000_001,
            extra_groups=[],
            check=False,
        ).returncode
        == 0
    )


def test_make_run_prints_every_request_but_the_agents_polls_that_succeeded():
    import io

    from controlplane.devserver import print_all_but_agent_polls

    lines = [
        '[05/Dec/2026 06:30:00] "POST /api/v1/agent/heartbeat HTTP/1.1" 200 45\n',
        '[05/Dec/2026 06:30:00] "GET /api/v1/agent/runs/ HTTP/1.1" 200 2\n',
        '[05/Dec/2026 06:30:00] "GET /api/v1/agent/runs/?wait=5 HTTP/1.1" 304 0\n',
        '[05/Dec/2026 06:30:00] "GET /api/v1/agent/checkpoints/work HTTP/1.1" 200 2\n',
        '\x1b[32;1m[05/Dec/2026 06:30:01] "POST /api/v1/agent/heartbeat HTTP/1.1" 200 45\x1b[0m\n',
        '[05/Dec/2026 06:30:01] "POST /api/v1/agent/heartbeat HTTP/1.1" 401 80\n',
        '[05/Dec/2026 06:30:01] "GET /api/v1/agent/runs/ HTTP/1.1" 500 145\n',
        '[05/Dec/2026 06:30:02] "POST /api/v1/agent/runs/7/logs HTTP/1.1" 200 20\n',
        '[05/Dec/2026 06:30:02] "GET /jobs/7/ HTTP/1.1" 200 9123\n',
        "Traceback (most recent call last):\n",
        '  File "x.py", line 1, in heartbeat\n',
    ]
    printed = io.StringIO()

    print_all_but_agent_polls(io.StringIO("".join(lines)), printed)

    assert printed.getvalue().splitlines(keepends=True) == lines[5:]
