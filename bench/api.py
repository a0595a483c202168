"""The submit road as CI pipelines use it: POST /api/v1/jobs/ through gunicorn.

gunicorn serves the control plane on 127.0.0.1 against a scratch PostgreSQL database
(DATABASE_URL's server; its database if the name ends in `bench`, else
`controlplane_bench`; dropped after), and a service account's bearer token posts job
specs from threads of this process:

- open loop: one web process, BENCH_RATE (100) submissions a second on a fixed schedule
  for BENCH_SECONDS (30); latency counts from each one's scheduled time, so a slow answer
  delays none after it, and the jobs in the database are counted (lost = sent - made);
- closed loop: 1, 2 and 4 web processes (BENCH_PROCESSES), each with as many clients as
  twice its processes posting back to back for BENCH_CLOSED_SECONDS (10): how throughput
  grows with processes.

Set REDIS_URL too to measure the production set-up (Redis as the cache).

Last line: `api: open_loop_per_s=<n> p99_ms=<x> lost=<n> closed_loop_per_s=<x>
processes=<n>` (the closed loop's figures for the most processes; the line before has
each count's).
"""

import contextlib
import http.client
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from bench import interpreter_ms

ROOT = Path(__file__).resolve().parents[1]
RATE = int(os.environ.get("BENCH_RATE", "100"))
SECONDS = int(os.environ.get("BENCH_SECONDS", "30"))
CLOSED_SECONDS = int(os.environ.get("BENCH_CLOSED_SECONDS", "10"))
PROCESSES = [int(n) for n in os.environ.get("BENCH_PROCESSES", "1,2,4").split(",")]
PORT = int(os.environ.get("BENCH_PORT", "8147"))
PATH = "/api/v1/jobs/"


def bench_database_url() -> str:
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith(("postgres://", "postgresql://")):
        sys.exit("bench.api measures on PostgreSQL: set DATABASE_URL (postgres://...)")
    parsed = urlparse(base)
    name = parsed.path.strip("/")
    return urlunparse(
        parsed._replace(path="/" + (name if name.endswith("bench") else "controlplane_bench"))
    )


def run(args, env, **kwargs):
    return subprocess.run(args, env=env, cwd=ROOT, check=True, **kwargs)


def main() -> None:
    url = bench_database_url()
    name = urlparse(url).path.strip("/")
    speed = interpreter_ms()
    var = Path(tempfile.mkdtemp(prefix="controlplane-bench-"))
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "SECRET_KEY": "bench-only-" + "x" * 40,
        "DJANGO_DEBUG": "0",
        "ALLOWED_HOSTS": "127.0.0.1",
        "SECURE_COOKIES": "0",
        "CONTROLPLANE_VAR_DIR": str(var),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    admin = urlunparse(urlparse(url)._replace(path="/postgres"))
    python = sys.executable
    run([python, "-c", _DROP_CREATE, admin, name], env)
    try:
        run([python, "manage.py", "migrate", "-v0"], env)
        run([python, "manage.py", "createcachetable"], env)
        token, team_id = run(
            [python, "-c", _SEED], env, capture_output=True, text=True
        ).stdout.split()
        body = json.dumps(
            {
                "name": "ci-smoke",
                "team": int(team_id),
                "time_limit_s": 3600,
                "command": {"argv": ["python", "eval.py"], "path": "/shared/eval"},
                "resources": {"gpu_type": "H100", "gpus": 8},
                "placement": {"where": "owned"},
            }
        ).encode()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}

        def jobs() -> int:
            return int(run([python, "-c", _COUNT], env, capture_output=True, text=True).stdout)

        with _server(env, processes=1):
            before = jobs()
            latencies, refused = _open_loop(body, headers)
            lost = RATE * SECONDS - (jobs() - before)
        closed = {}
        for processes in PROCESSES:
            with _server(env, processes=processes):
                closed[processes] = _closed_loop(body, headers, clients=2 * processes)
    finally:
        run([python, "-c", _DROP, admin, name], env)
    p99 = statistics.quantiles(latencies, n=100)[98] if len(latencies) > 1 else float("nan")
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (sum(range(10**6)) in "
        f"{speed:.1f} ms); open loop {RATE}/s for {SECONDS} s on 1 web process: "
        f"p50 {statistics.median(latencies):.1f} ms, p99 {p99:.1f} ms, non-2xx {refused}; cache: "
        f"{'Redis' if os.environ.get('REDIS_URL') else 'database'}"
    )
    print(
        "closed loop, submits per second by web processes: "
        + ", ".join(f"{n}: {rate:.0f}" for n, rate in closed.items())
    )
    most = max(closed)
    print(
        f"api: open_loop_per_s={RATE} p99_ms={p99:.1f} lost={lost} "
        f"closed_loop_per_s={closed[most]:.0f} processes={most}"
    )


class _server:
    """gunicorn with this many sync worker processes, for the length of a with block."""

    def __init__(self, env, *, processes: int):
        self.env, self.processes = env, processes

    def __enter__(self):
        gunicorn = str(Path(sys.executable).with_name("gunicorn"))
        self.process = subprocess.Popen(
            [
                gunicorn,
                "controlplane.wsgi:application",
                "--bind",
                f"127.0.0.1:{PORT}",
                "--workers",
                str(self.processes),
                "--log-level",
                "warning",
            ],
            env=self.env,
            cwd=ROOT,
        )
        _wait_for(f"http://127.0.0.1:{PORT}/healthz")
        return self

    def __exit__(self, *exc):
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)


def _post(body: bytes, headers: dict) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
    try:
        connection.request("POST", PATH, body=body, headers=headers)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def _open_loop(body: bytes, headers: dict) -> tuple[list[float], int]:
    """Each submission sent at its scheduled time; its latency counted from that time."""
    start = time.monotonic() + 0.5
    latencies, refused = [], 0
    lock = threading.Lock()

    def send(i: int) -> None:
        nonlocal refused
        due = start + i / RATE
        time.sleep(max(0.0, due - time.monotonic()))
        try:
            ok = 200 <= _post(body, headers) < 300
        except OSError:
            ok = False
        with lock:
            latencies.append(1000 * (time.monotonic() - due))
            refused += not ok

    with ThreadPoolExecutor(max_workers=64) as pool:
        list(pool.map(send, range(RATE * SECONDS)))
    return latencies, refused


def _closed_loop(body: bytes, headers: dict, *, clients: int) -> float:
    """Submissions per second from clients that each post again as soon as answered."""
    end = time.monotonic() + CLOSED_SECONDS
    counts = [0] * clients

    def client(n: int) -> None:
        while time.monotonic() < end:
            with contextlib.suppress(OSError):  # a refused connection counts as no submit
                counts[n] += 200 <= _post(body, headers) < 300

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, range(clients)))
    return sum(counts) / (time.monotonic() - started)


def _wait_for(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):  # noqa: S310 (our own server)
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not answer at {url}")


_DROP_CREATE = """
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as c:
    c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[2]}"')
    c.execute(f'CREATE DATABASE "{sys.argv[2]}"')
"""
_DROP = """
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as c:
    c.execute(f'DROP DATABASE IF EXISTS "{sys.argv[2]}" WITH (FORCE)')
"""
_SEED = """
import django; django.setup()
from apps.accounts import services as a
from apps.fleet import services as f
from apps.fleet.models import Node
team = a.team_create(name="Bench", slug="bench", by=None)
a.team_quota_set(team=team, gpu_type="H100", max_gpus=10**6, by=None)
pool = f.pool_create(name="bench", slug="bench", kind="owned", gpu_type="H100", max_nodes=64,
                     by=None)
for i in range(16):
    f.node_create(name=f"bench-{i}", pool=pool, provider="local", capacity_type="owned",
                  gpu_count=8, by=None)
account = a.service_account_create(team=team, name="ci", by=None)
_, secret = a.api_token_create(user=account.user, name="bench", scopes=["submit"], by=None)
print(secret, team.pk)
"""
_COUNT = """
import django; django.setup()
from apps.jobs.models import Job
print(Job.objects.count())
"""

if __name__ == "__main__":
    main()
