"""Each job as its own user (workers/agent/isolation.py), against real processes and files.

Switching users needs root: the tests that start runs are skipped, saying so, where the
suite does not run as root (CI runs as root). No database.
"""

import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workers.agent import isolation
from workers.agent.isolation import DEFAULT_UID_BASE, Isolation, IsolationUnavailable
from workers.agent.runs import LogBuffer, Plan, PlanRefused, Run

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
ISOLATED = Isolation("user")
PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable


@pytest.fixture
def node_dir():
    """A node directory other users may pass through (pytest's tmp_path is closed to them)."""
    path = Path(tempfile.mkdtemp(prefix="cp-agent-", dir="/tmp"))
    os.chmod(path, 0o711)  # noqa: S103 (pass through, list nothing)
    yield path
    isolation.hand_over(path, 0, 0)  # so that rmtree below may remove what the jobs made
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _run(node_dir: Path, code: str, *, job: int = 42, run_id: int = 5, args=(), **plan) -> Run:
    return Run(
        Plan.from_json({"id": run_id, "job": job, "argv": [PY, "-c", code, *args], **plan}),
        runs_dir=node_dir / "runs",
        logs=LogBuffer(10_000),
        base_env={"PATH": "/usr/bin:/bin"},
        isolation=ISOLATED,
        code_dir=node_dir,
    )


def _finish(run: Run, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while (code := run.poll()) is None:
        assert time.monotonic() < deadline, "the run did not end"
        time.sleep(0.05)
    return run.exit_report(code)


def _stdout(run: Run) -> list[str]:
    return [
        x.text for lines in run._logs.take(10_000).values() for x in lines if x.stream == "stdout"
    ]


@as_root
def test_a_run_is_its_jobs_own_user_with_nothing_of_the_agents(node_dir):
    code = (
        "import os; print(os.getuid(), os.getgid(), os.getgroups(), os.environ['HOME'], "
        "os.environ['USER'], oct(os.umask(0)))\n"
        "try:\n    open('/proc/1/environ', 'rb').read(); print('read')\n"
        "except PermissionError:\n    print('refused')"
    )
    run = _run(node_dir, code, job=42)
    run.start()
    report = _finish(run)
    uid = DEFAULT_UID_BASE + 42
    assert report["exit_code"] == 0
    assert _stdout(run) == [f"{uid} {uid} [] {run.dir} job42 0o77", "refused"]
    info = run.dir.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (uid, 0o700)
    assert stat.S_IMODE((node_dir / "runs").stat().st_mode) == 0o711  # pass through, no list


@as_root
def test_two_jobs_cannot_read_each_others_files_or_environment(node_dir):
    holder = _run(
        node_dir,
        "import time; open('notes', 'w').write('mine'); time.sleep(30)",
        job=7,
        run_id=1,
        secrets={"TOKEN": "neighbour-secret"},
    )
    holder.start()
    time.sleep(0.5)
    prying = (
        "import os, sys\n"
        f"pid = {holder.pid}\n"
        "for path in (f'/proc/{pid}/environ', sys.argv[1]):\n"
        "    try:\n        open(path, 'rb').read(); print('READ', path)\n"
        "    except PermissionError:\n        print('refused')\n"
    )
    pry = _run(node_dir, prying, job=8, run_id=2, args=[str(holder.dir / "notes")])
    pry.start()
    _finish(pry)
    assert _stdout(pry) == ["refused", "refused"]
    holder.stop(reason="test over", grace_s=1)
    _finish(holder)


@as_root
def test_what_a_run_leaves_behind_is_killed_and_its_temporary_files_removed(node_dir):
    stray = Path("/tmp") / f"cp-stray-{os.getpid()}"
    daemon = (
        "import os, time, sys\n"
        f"open({str(stray)!r}, 'w').write('left')\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(300)\n"
        "    os._exit(0)\n"
        "print('parent done', flush=True)\n"
    )
    run = _run(node_dir, daemon, job=9)
    run.start()
    report = _finish(run)
    assert report["exit_code"] == 0
    assert run.leftovers_killed >= 1
    assert isolation.processes_of(DEFAULT_UID_BASE + 9) == []
    assert not stray.exists()


@as_root
def test_a_run_that_ends_spares_another_run_of_its_job_still_going(node_dir):
    """Two runs of one job on one machine (another attempt on this node; on local nodes,
    which share a machine, the job's run on another node): the first to end kills what it
    left behind, not the other run nor the workers it started in sessions of their own (as
    torchrun does), and leaves the temporary files to the last one."""
    uid = DEFAULT_UID_BASE + 12
    kept = Path("/tmp") / f"cp-kept-{os.getpid()}"
    worker = f"import time; open({str(kept)!r}, 'w').write('in use'); time.sleep(60)"
    going = _run(
        node_dir,
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {worker!r}], start_new_session=True).wait()",
        job=12,
        run_id=1,
    )
    going.start()
    deadline = time.monotonic() + 10
    while not kept.exists():
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.05)
    started = sorted(isolation.processes_of(uid))
    assert len(started) == 2  # the launcher and its worker
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(300)\n"
        "    os._exit(0)\n"
    )
    ending = _run(node_dir, daemon, job=12, run_id=2)
    ending.start()
    assert _finish(ending)["exit_code"] == 0
    assert ending.leftovers_killed >= 1  # its daemon
    assert going.process.poll() is None, "the other run was killed"
    assert sorted(isolation.processes_of(uid)) == started
    assert kept.read_text() == "in use"
    going.stop(reason="test over", grace_s=1)
    _finish(going)
    assert isolation.processes_of(uid) == []
    assert not kept.exists()


@as_root
def test_a_status_file_that_is_a_link_is_not_followed(node_dir):
    secret = node_dir / "agent.env"
    secret.write_text("CONTROLPLANE_NODE_TOKEN=cpn_not_for_jobs\n")
    secret.chmod(0o600)
    code = f"import os; p = os.environ['CONTROLPLANE_STATUS_FILE']; os.symlink({str(secret)!r}, p)"
    run = _run(node_dir, code, job=10)
    run.start()
    report = _finish(run)
    assert "cpn_not_for_jobs" not in str(report)
    assert report["status"] == {"unreadable": "a link, not followed"}


@as_root
def test_a_fifo_status_file_does_not_hang_the_agent(node_dir):
    run = _run(node_dir, "import os; os.mkfifo(os.environ['CONTROLPLANE_STATUS_FILE'])", job=11)
    run.start()
    started = time.monotonic()
    report = _finish(run)
    assert time.monotonic() - started < 10
    assert report["status"] == {"unreadable": "not a regular file"}


@as_root
def test_a_run_directory_left_with_a_planted_link_is_made_afresh(node_dir):
    target = node_dir / "precious"
    target.write_text("untouched")
    run_dir = node_dir / "runs" / "run-12"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").symlink_to(target)
    run = _run(node_dir, "print('ok')", run_id=12, files=[{"path": "run.json", "content": "{}"}])
    run.start()
    _finish(run)
    assert target.read_text() == "untouched"
    assert not (run_dir / "run.json").is_symlink()


@as_root
def test_owned_directories_are_handed_over_without_following_links(node_dir):
    outside = node_dir / "outside"
    outside.write_text("root's")
    ckpt = node_dir / "checkpoints" / "team" / "job-13"
    ckpt.mkdir(parents=True)
    (ckpt / "step-1").mkdir()
    (ckpt / "step-1" / "shard").write_text("x")
    (ckpt / "escape").symlink_to(outside)
    fresh = node_dir / "elsewhere" / "team" / "job-13"
    run = _run(node_dir, "print('ok')", job=13, owned_dirs=[str(ckpt), str(fresh)])
    run.start()
    _finish(run)
    uid = DEFAULT_UID_BASE + 13
    assert (ckpt / "step-1" / "shard").stat().st_uid == uid
    assert (ckpt / "escape").lstat().st_uid == uid  # the link itself
    assert outside.stat().st_uid == 0  # not what it points at
    assert (fresh.stat().st_uid, stat.S_IMODE(fresh.stat().st_mode)) == (uid, 0o700)
    # The parents it made: other jobs pass through to their own, and list nothing.
    assert stat.S_IMODE(fresh.parent.stat().st_mode) == 0o711


def test_a_plan_without_a_job_cannot_choose_its_user(tmp_path):
    with pytest.raises(PlanRefused, match="names no job"):
        Run(
            Plan.from_json({"id": 1, "argv": ["true"]}),
            runs_dir=tmp_path,
            logs=LogBuffer(10),
            base_env={},
            isolation=ISOLATED,
        )


def test_owned_directories_must_be_absolute_and_plain():
    for bad in (["relative/dir"], ["/a/../etc"], ["/"], "not-a-list"):
        with pytest.raises(PlanRefused):
            Plan.from_json({"id": 1, "argv": ["true"], "owned_dirs": bad})


def test_an_unprivileged_agent_says_why_it_cannot_isolate():
    no_caps = "Name:\tagent\nCapEff:\t0000000000000000\n"
    assert isolation.missing_capabilities(no_caps) == [
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FOWNER",
        "CAP_KILL",
        "CAP_SETGID",
        "CAP_SETUID",
    ]
    assert isolation.missing_capabilities("CapEff:\t00000000000000eb\n") == []


def test_a_node_directory_behind_a_closed_one_cannot_be_isolated(node_dir):
    closed = node_dir / "closed"
    closed.mkdir(mode=0o700)
    assert str(closed) in isolation.blocked_by(closed / "node")
    found = isolation.detect("auto", work_dir=closed / "node" / "x")
    assert not found.on and str(closed) in found.reason
    with pytest.raises(IsolationUnavailable):
        isolation.detect("required", work_dir=closed / "node" / "x")
    assert isolation.detect("off").mode == "none"
    with pytest.raises(IsolationUnavailable):
        isolation.detect("sometimes")


def test_a_jobs_uid_is_the_same_everywhere_and_its_own():
    one = Isolation("user")
    assert one.uid_for(5) == one.uid_for(5) == DEFAULT_UID_BASE + 5
    assert one.uid_for(5) != one.uid_for(6)
    assert one.uid_for(5) < 2**32 - 1
