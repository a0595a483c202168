"""The product in its production shape, started for real for the fault drills.

A PostgreSQL cluster and a Redis of the drills' own (so that a drill may stop, kill and
restart them without touching anything else on the machine), gunicorn with two workers,
a Celery worker and beat, and local and SSH nodes whose agents the worker starts. Every
part is a real process; a drill talks to the control plane only as its users and agents
do (HTTP) and reads what it must check straight from the database (SQL).

Thresholds are seconds, not minutes (`DRILL_SETTINGS`), so that each fault plays out in
a few seconds; the rules that use them are the production ones.
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import requests

from tests.procs import wait_for
from tests.workers.providers.servers import SshServer, free_port, keygen, public_key

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# Every threshold the drills lean on, short: a heartbeat a second, a node quiet after 3 s,
# SUSPECT after 4, DOWN after 12; a pass every 2 s; a lost dispatch re-sent after 4 s and
# a lost provisioning after 10. The meter stays 2 s behind now, not 0: its lag is what lets
# an allocation's end, stamped before its transaction commits, land before the meter passes
# it (production: 60 s); at 0 a busy drill metered a few hundredths of a second too many.
# DOWN stays above an agent's request timeout (10 s) plus a heartbeat, as production's 600 s
# is far above: at 8 s, one heartbeat queued behind a burst on two gunicorn workers cost a
# node its jobs (requeued: a second run), the control plane's slowness taken for the node's.
DRILL_SETTINGS = {
    "AGENT_HEARTBEAT_S": "1",
    "NODE_SWEEP_EVERY_S": "1",
    "NODE_QUIET_AFTER_S": "3",
    "NODE_SUSPECT_AFTER_S": "4",
    "NODE_DOWN_AFTER_S": "12",
    "SCHEDULE_EVERY_S": "2",
    "DISPATCH_REDRIVE_S": "4",
    "OWNED_REDRIVE_AFTER_S": "10",
    "PREEMPTION_GRACE_S": "10",
    "NODE_MIN_FREE_DISK_GB": "0",
    "COSTS_METER_EVERY_S": "5",
    "COSTS_METER_LAG_S": "2",
}


def postgres_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


def why_not() -> str:
    """Why the drills cannot run on this machine, or '' when they can."""
    if os.geteuid() != 0:
        return "the drills start PostgreSQL as its own user and jobs as theirs: run as root"
    if postgres_bin() is None:
        return "needs PostgreSQL's server binaries (/usr/lib/postgresql/*/bin)"
    if shutil.which("redis-server") is None:
        return "needs redis-server"
    from tests.sshd import _sshd_usable

    return _sshd_usable()


class Process:
    """One long-lived part: started in a session of its own (so that a kill takes its
    children too, as a crash of the machine's service would), output to a log file.

    Supervised, as production runs it (compose's `restart: unless-stopped`, systemd's
    `Restart=always`): if it exits while wanted, it is started again a second later. A
    drill's `crash()` leaves it wanted; `stop()` does not."""

    RESTART_AFTER_S = 1.0

    def __init__(self, name: str, argv: list[str], env: dict, logs: Path):
        self.name, self.argv, self.env = name, argv, env
        self.log = logs / f"{name}.log"
        self.popen: subprocess.Popen | None = None
        self.wanted = False
        self.started_at = 0.0  # monotonic
        self.restarts = 0
        self._exited_at: float | None = None

    def start(self) -> "Process":
        self.wanted = True
        self._exited_at = None
        self.started_at = time.monotonic()
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, signum: int, *, group: bool = True) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                if group:
                    os.killpg(self.popen.pid, signum)
                else:
                    self.popen.send_signal(signum)

    def crash(self) -> float:
        """SIGKILL to the part and every process of its session, at once; its supervisor
        starts it again. Returns when it was killed (monotonic)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait(timeout=10)
        return time.monotonic()

    def supervise(self) -> None:
        """Start the part again if it exited while wanted (called every moment)."""
        if not self.wanted or self.popen is None or self.popen.poll() is None:
            return
        now = time.monotonic()
        if self._exited_at is None:
            self._exited_at = now
            with open(self.log, "a") as out:
                out.write(f"[supervisor] exited with {self.popen.returncode}\n")
        elif now - self._exited_at >= self.RESTART_AFTER_S:
            self.restarts += 1
            self.start()

    def stop(self, timeout_s: float = 20) -> None:
        self.wanted = False
        if not self.alive:
            return
        self.signal(signal.SIGTERM, group=False)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.crash()
        self.signal(signal.SIGKILL)  # anything of its session still there

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class Postgres:
    """A cluster in the drill's folder, on a port of its own, run as the postgres user."""

    def __init__(self, root: Path):
        self.bin = postgres_bin()
        self.data = root / "pg"
        self.port = free_port()
        self.log = root / "logs" / "postgres.log"

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv],
            capture_output=True,
            text=True,
            check=check,
            cwd="/",
        )

    def init(self) -> None:
        self.data.mkdir(mode=0o700)
        shutil.chown(self.data, "postgres", "postgres")
        shutil.chown(self.log.parent, "postgres")
        self._as_postgres(
            str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "--no-sync", "-E", "UTF8",
        )  # fmt: skip
        self.start()
        self.sql("postgres", "CREATE DATABASE controlplane")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300"
        )
        self._as_postgres(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.log),
            "-w", "-t", "60", "start",
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "stop")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/controlplane"

    def sql(self, database: str, statement: str, *args):
        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{self.port}/{database}", autocommit=True
        ) as conn:
            cursor = conn.execute(statement, args or None)
            return cursor.fetchall() if cursor.description else None


class Redis:
    """A Redis with an append-only file, as production runs it: stopped and started again
    by a drill, it comes back with what it held."""

    def __init__(self, root: Path, env: dict):
        self.port = free_port()
        self.dir = root / "redis"
        self.dir.mkdir()
        self.process = Process(
            "redis",
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.dir), "--appendonly", "yes", "--save", ""],
            env,
            root / "logs",
        )  # fmt: skip

    def start(self) -> None:
        self.process.start()
        wait_for("Redis to answer", self.answers, timeout_s=20)

    def answers(self) -> bool:
        done = subprocess.run(
            ["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True
        )
        return done.stdout.strip() == "PONG"

    def stop(self) -> None:
        self.process.wanted = False
        self.process.crash()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


class Stack:
    """Everything a drill needs, started once for the whole suite; a drill that stops a
    part starts it again before it ends (`ensure_up` checks)."""

    def __init__(self, root: Path):
        self.root = root
        os.chmod(root, 0o711)  # noqa: S103 (jobs' users pass through to their run folders)
        self.logs = root / "logs"
        self.logs.mkdir()
        self.var = root / "var"
        self.var.mkdir(mode=0o711)
        self.checkpoints = root / "checkpoints"
        self.checkpoints.mkdir(mode=0o711)
        self.web_port = free_port()
        self.postgres = Postgres(root)
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(root),
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "SECRET_KEY": "drills-only-" + "k" * 40,
            "DJANGO_DEBUG": "0",
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            "SECURE_COOKIES": "0",
            "CONTROLPLANE_VAR_DIR": str(self.var),
            "CONTROLPLANE_URL": f"http://127.0.0.1:{self.web_port}",
            "CHECKPOINT_ROOT": str(self.checkpoints),
            "LOG_LEVEL": "INFO",
            **DRILL_SETTINGS,
        }
        self.redis = Redis(root, self.env)
        self.env["DATABASE_URL"] = self.postgres.url
        self.env["REDIS_URL"] = self.redis.url
        self.web = self._python("web", "-m", "gunicorn", "controlplane.wsgi:application",
                                "--bind", f"127.0.0.1:{self.web_port}", "--workers", "2",
                                "--timeout", "60", "--graceful-timeout", "10")  # fmt: skip
        self.workers = [self._worker(1)]
        self.beats = [self._beat(1)]
        self.sshd: SshServer | None = None
        self.seed: dict = {}
        self._supervising = threading.Event()

    @property
    def parts(self) -> list[Process]:
        return [self.redis.process, self.web, *self.workers, *self.beats]

    def _supervise(self) -> None:
        while self._supervising.is_set():
            for part in self.parts:
                part.supervise()
            time.sleep(0.2)

    def _python(self, name: str, *argv: str) -> Process:
        return Process(name, [PYTHON, *argv], self.env, self.logs)

    def _worker(self, n: int) -> Process:
        return self._python(
            f"worker{n}", "-m", "celery", "-A", "controlplane", "worker", "--concurrency", "2",
            "--loglevel", "INFO", "-n", f"drill{n}@%h", "--without-gossip", "--without-mingle",
        )  # fmt: skip

    def _beat(self, n: int) -> Process:
        return self._python(
            f"beat{n}", "-m", "celery", "-A", "controlplane", "beat", "--loglevel", "INFO",
            "--schedule", str(self.root / f"beat{n}-schedule"),
        )  # fmt: skip

    # --- bringing it up -----------------------------------------------------------------

    def start(self) -> None:
        self.postgres.init()
        self.redis.start()
        subprocess.run(
            [PYTHON, "manage.py", "migrate", "--no-input", "-v", "0"],
            env=self.env, cwd=ROOT, check=True,
        )  # fmt: skip
        subprocess.run(
            [PYTHON, "manage.py", "createcachetable", "-v", "0"], env=self.env, cwd=ROOT, check=True
        )
        self._start_sshd()
        seeded = subprocess.run(
            [PYTHON, "-m", "tests.drills.seed", json.dumps(self._ssh_for_seed())],
            env=self.env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        self.seed = json.loads(seeded.stdout.strip().splitlines()[-1])
        self.web.start()
        for part in (*self.workers, *self.beats):
            part.start()
        self._supervising.set()
        threading.Thread(target=self._supervise, daemon=True).start()
        wait_for("gunicorn to answer", self.web_answers, timeout_s=60)

    def _start_sshd(self) -> None:
        client_key = keygen(self.root / "client_key")
        self.sshd = SshServer(directory=self.root / "sshd", client_key=client_key)
        self.sshd.directory.mkdir()
        self.sshd.start()
        from tests.workers.providers.servers import FAKE_NVIDIA_SMI
        from workers.providers.bundle import NODE_UUID_VARIABLE

        fake = self.sshd.fakebin / "nvidia-smi"
        # Each SSH node's agent reports GPUs of its own (UUIDs are unique across the fleet).
        fake.write_text(FAKE_NVIDIA_SMI.replace("-e2e,", "-${" + NODE_UUID_VARIABLE + ":-x},"))
        fake.chmod(0o755)
        ssh_root = self.root / "ssh-nodes"
        ssh_root.mkdir(mode=0o711)
        self.env.update(
            SSH_KEY_FILE=str(client_key), SSH_NODE_ROOT=str(ssh_root), SSH_NODE_PYTHON=PYTHON
        )

    def _ssh_for_seed(self) -> dict:
        return {
            "port": self.sshd.port,
            "user": self.sshd.user,
            "host_key": public_key(self.sshd.host_key),
        }

    def web_answers(self) -> bool:
        try:
            return requests.get(self.url("/healthz"), timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        self._supervising.clear()
        for part in (*self.beats, *self.workers, self.web):
            part.stop(timeout_s=10)
        self._stop_agents()
        if self.sshd is not None:
            self.sshd.stop()
        self.redis.stop()
        with contextlib.suppress(subprocess.CalledProcessError):
            self.postgres.stop("immediate")

    def _stop_agents(self) -> None:
        """Every agent and job process the drills started (found by the drill's folder in
        their command lines or working directories)."""
        mine = str(self.root)
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
                cwd = os.readlink(proc / "cwd")
            except OSError:
                continue
            if mine in cmdline or cwd.startswith(mine):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)

    # --- talking to it ------------------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.web_port}{path}"

    def api(self, method: str, path: str, body=None, *, key: str = "", timeout_s: float = 30):
        headers = {"Authorization": f"Bearer {self.seed['token']}"}
        if key:
            headers["Idempotency-Key"] = key
        return requests.request(
            method, self.url(path), json=body, headers=headers, timeout=timeout_s
        )

    def sql(self, statement: str, *args):
        return self.postgres.sql("controlplane", statement, *args)

    def ensure_up(self) -> None:
        """Start again whatever a drill left stopped."""
        if not self.redis.answers():
            self.redis.start()
        if not self.web.alive:
            self.web.start()
        for part in (*self.workers, *self.beats):
            if not part.alive:
                part.start()
        wait_for("gunicorn to answer", self.web_answers, timeout_s=60)

    def diagnosis(self) -> str:
        """The newest lines of every part's log: what a failed drill prints."""
        parts = [self.web, *self.workers, *self.beats]
        return "\n".join(f"--- {p.name} ---\n{p.tail(40)}" for p in parts)
