"""The exit watch on real processes: the kernel's process events say which process of a run
died by a signal, with its rank; what the agent did itself is not evidence; the kernel's
log names the OOM killer's victims."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.agent.exits import ExitWatch, kmsg_record, oom_kill_in
from workers.agent.runs import LogBuffer, Plan, Run

PY = sys.executable

# A parent (the run's top process, as torchrun is) that starts one worker with RANK=1 in
# its environment, says its pid, and exits 1 when it dies, as torchrun does.
TREE = (
    "import os, subprocess, sys\n"
    "env = dict(os.environ, RANK='1', LOCAL_RANK='1')\n"
    "worker = subprocess.Popen([sys.executable, '-c', WORKER], env=env)\n"
    "print(worker.pid, flush=True)\n"
    "sys.exit(1 if worker.wait() else 0)\n"
)


def _tree(worker: str) -> str:
    return f"WORKER = {worker!r}\n" + TREE


@pytest.fixture(scope="module")
def watch():
    watch = ExitWatch().start()
    if not watch.on:
        pytest.skip(f"the proc connector cannot run here: {watch.reason}")
    yield watch
    watch.close()


def _run(tmp_path, watch, argv, run_id=7) -> Run:
    run = Run(
        Plan.from_json({"id": run_id, "argv": argv}),
        runs_dir=tmp_path,
        logs=LogBuffer(10_000),
        base_env={"PATH": "/usr/bin:/bin"},
        exits=watch,
    )
    run.start()
    return run


def _worker_pid(run: Run, timeout: float = 20.0) -> int:
    """The worker's pid, from the first line its parent prints."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for lines in run._logs.take(100).values():
            for line in lines:
                if line.stream == "stdout" and line.text.isdigit():
                    return int(line.text)
        time.sleep(0.05)
    raise AssertionError("the worker did not start")


def _ended(run: Run, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while (code := run.poll()) is None:
        assert time.monotonic() < deadline, "the run did not end"
        time.sleep(0.05)
    return run.exit_report(code)


def test_a_worker_killed_by_sigkill_is_named_with_its_pid_rank_and_signal(tmp_path, watch):
    run = _run(tmp_path, watch, [PY, "-c", _tree("import time; time.sleep(60)")])
    worker = _worker_pid(run)
    time.sleep(0.3)  # its exec, and so its RANK, seen
    os.kill(worker, signal.SIGKILL)
    report = _ended(run)
    assert report["exit_code"] == 1
    assert report["evidence"] == {
        "kind": "signal",
        "signal": 9,
        "pid": worker,
        "rank": 1,
        "local_rank": 1,
        "command": Path(PY).name[:15],  # the kernel keeps 15 characters of it
    }


def test_a_run_the_agent_stopped_itself_has_no_evidence(tmp_path, watch):
    # Parent and worker both ignore SIGTERM: only the agent's SIGKILL after the grace ends them.
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    tree = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + _tree(stubborn)
    run = _run(tmp_path, watch, [PY, "-c", tree])
    _worker_pid(run)
    run.stop(reason="cancelled", grace_s=0.5)
    report = _ended(run)
    assert report["signal"] == signal.SIGKILL
    assert report["evidence"] is None


def test_a_process_that_crashes_on_its_own_is_not_the_nodes_doing(tmp_path, watch):
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    run = _run(tmp_path, watch, [PY, "-c", _tree(crash)])
    report = _ended(run)
    assert report["exit_code"] == 1
    assert report["evidence"] is None


# Two ranks, as torchrun runs them: rank 0 fails on its own (exit 1), and then the parent
# stops rank 1 with SIGTERM, as torchrun stops the ranks left when one fails.
ONE_FAILS = (
    "import os, signal, subprocess, sys, time\n"
    "def rank(n, code):\n"
    "    env = dict(os.environ, RANK=str(n), LOCAL_RANK=str(n))\n"
    "    return subprocess.Popen([sys.executable, '-c', code], env=env)\n"
    "left = rank(1, 'import time; time.sleep(60)')\n"
    "failing = rank(0, 'import time, sys; time.sleep(0.5); sys.exit(1)')\n"
    "failing.wait()\n"
    "left.send_signal(signal.SIGTERM)\n"
    "left.wait()\n"
    "sys.exit(1)\n"
)


def test_a_rank_stopped_because_another_failed_on_its_own_is_not_evidence(tmp_path, watch):
    run = _run(tmp_path, watch, [PY, "-c", ONE_FAILS])
    report = _ended(run)
    assert report["exit_code"] == 1
    assert report["evidence"] is None


def test_a_run_that_ends_well_has_no_evidence_and_is_forgotten(tmp_path, watch):
    run = _run(tmp_path, watch, [PY, "-c", _tree("print('done')")])
    report = _ended(run)
    assert report["exit_code"] == 0 and report["evidence"] is None
    assert 7 not in watch._trees and run.pid not in watch._run_of


def test_events_lost_to_a_full_buffer_make_the_evidence_say_it_is_incomplete(tmp_path, request):
    """A watch with the smallest receive buffer the kernel allows, kept from reading (its
    lock held) while the run starts a few hundred processes: the kernel drops events."""
    small = ExitWatch(receive_buffer=1).start()
    if not small.on:
        pytest.skip(f"the proc connector cannot run here: {small.reason}")
    request.addfinalizer(small.close)
    burst = (
        "import subprocess, sys, time\n"
        "while not open(sys.argv[1]).read(): time.sleep(0.01)\n"
        "for _ in range(300): subprocess.run(['/bin/true'])\n"
    )
    go = tmp_path / "go"
    go.write_text("")
    run = _run(tmp_path, small, [PY, "-c", burst, str(go)])
    with small._lock:
        go.write_text("go")
        deadline = time.monotonic() + 30
        while run.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    report = _ended(run)
    assert report["exit_code"] == 0
    assert report["evidence"] == {"incomplete": True}
    notes = [line.text for lines in run._logs.take(100_000).values() for line in lines]
    assert "some process events were lost: how its processes died may be partial" in notes


def _memory_cgroup() -> Path | None:
    """A cgroup v1 memory group of our own, below the one this process is in."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / f"exits-test-{os.getpid()}"
            try:
                group.mkdir()
                (group / "memory.limit_in_bytes").write_text(str(64 << 20))
            except OSError:
                return None
            return group
    return None


def test_a_worker_the_oom_killer_chose_is_named_as_such(tmp_path, watch):
    """A real OOM kill, kept to a memory cgroup of 64 MiB of its own, so nothing else on the
    machine is at risk: the worker joins it, then asks for 512 MiB."""
    if watch._kmsg is None:
        pytest.skip("the kernel log (/dev/kmsg) cannot be read here")
    group = _memory_cgroup()
    if group is None:
        pytest.skip("no cgroup v1 memory controller to make a small group in")
    try:
        hog = (
            f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "block = bytearray(512 << 20)\n"
        )
        run = _run(tmp_path, watch, [PY, "-c", _tree(hog)])
        worker = _worker_pid(run)
        report = _ended(run)
    finally:
        for _ in range(50):  # empty once its last process is reaped
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert report["exit_code"] == 1
    evidence = report["evidence"]
    assert (evidence["kind"], evidence["signal"]) == ("oom", 9)
    assert (evidence["pid"], evidence["rank"]) == (worker, 1)


def test_the_kernels_oom_lines_name_the_pid_and_command():
    # Records as /dev/kmsg gives them, copied from a kernel's log.
    system = (
        b"3,1523,608532547,-;Out of memory: Killed process 8962 (python) total-vm:539652kB, "
        b"anon-rss:70016kB, file-rss:5544kB, shmem-rss:0kB, UID:1001 pgtables:200kB "
        b"oom_score_adj:0\n"
    )
    memcg = (
        b"3,1524,608532547,-;Memory cgroup out of memory: Killed process 8962 (python) "
        b"total-vm:539652kB, anon-rss:70016kB, file-rss:5544kB, shmem-rss:0kB, UID:0\n"
    )
    summary = (
        b"6,1522,608532521,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,"
        b"mems_allowed=0,oom_memcg=/probe,task_memcg=/probe,task=pt_main_thread,pid=8963,"
        b"uid=1001\n SUBSYSTEM=memory\n"
    )
    assert kmsg_record(system) == (608532547, system[19:-1].decode())
    assert oom_kill_in(kmsg_record(system)[1]) == (8962, "python")
    assert oom_kill_in(kmsg_record(memcg)[1]) == (8962, "python")
    assert oom_kill_in(kmsg_record(summary)[1]) == (8963, "pt_main_thread")
    assert oom_kill_in("python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0") is None


def test_a_watch_without_the_right_to_listen_is_off_and_says_why():
    """Run as an unprivileged user, as an agent without root would be."""
    probe = (
        "from workers.agent.exits import ExitWatch; w = ExitWatch().start(); print(w.on, w.reason)"
    )
    if os.geteuid() != 0:
        done = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=60)
    else:
        done = subprocess.run(
            [PY, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            user=65534,
            group=65534,
            extra_groups=[],
            env={"PYTHONPATH": str(Path(__file__).resolve().parents[3]), "PATH": os.defpath},
            cwd="/",
        )
    assert done.returncode == 0, done.stderr
    on, _, reason = done.stdout.strip().partition(" ")
    assert on == "False"
    assert "cannot be read here" in reason
