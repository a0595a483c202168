"""Sustained job submissions through the REST API, as CI pipelines make them.

gunicorn serves the control plane on 127.0.0.1 against a scratch PostgreSQL
database (DATABASE_URL's server, database `controlplane_bench`, dropped after);
Debian's `wrk` posts job specs with a service account's bearer token for
BENCH_SECONDS (20) over BENCH_CONNECTIONS (16) connections. There is no throughput
goal: CI pipelines submit a few jobs a minute, and more web processes behind a load
balancer serve more.

Set REDIS_URL too to measure the production set-up (Redis as the cache), and
BENCH_GUNICORN_ARGS to try other gunicorn settings (e.g. `--worker-class gthread
--threads 1`). The same run measures the server's floor, a 404 that runs no view and
no query, so figures from a noisy machine can be read as a ratio.

The line before the last says how many ms of CPU each submit cost gunicorn, PostgreSQL,
Redis and wrk (from /proc during the submits).

Last line: `api: submits_per_s=<n> p99_ms=<n> floor_404_per_s=<n> ratio=<x> cpu_ms=<x>`.
"""

import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from bench import cpu, interpreter_ms

ROOT = Path(__file__).resolve().parents[1]
SECONDS = int(os.environ.get("BENCH_SECONDS", "20"))
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "16"))
WORKERS = int(os.environ.get("BENCH_WORKERS", str(2 * (os.cpu_count() or 1))))
PORT = int(os.environ.get("BENCH_PORT", "8147"))

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(token)s"
wrk.body = [[%(body)s]]
"""


def bench_database_url() -> str:
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith(("postgres://", "postgresql://")):
        sys.exit("bench.api measures on PostgreSQL: set DATABASE_URL (postgres://...)")
    return urlunparse(urlparse(base)._replace(path="/controlplane_bench"))


def run(args, env, **kwargs):
    return subprocess.run(args, env=env, cwd=ROOT, check=True, **kwargs)


def main() -> None:
    if not shutil.which("wrk"):
        sys.exit("bench.api needs wrk: apt-get install wrk")
    url = bench_database_url()
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
    parsed = urlparse(url)
    admin = urlunparse(parsed._replace(path="/postgres"))
    python = sys.executable
    run([python, "-c", _DROP_CREATE, admin], env)
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
        )
        script = var / "submit.lua"
        script.write_text(LUA % {"token": token, "body": body})
        server = subprocess.Popen(
            [
                str(Path(python).with_name("gunicorn")),
                "controlplane.wsgi:application",
                "--bind",
                f"127.0.0.1:{PORT}",
                "--workers",
                str(WORKERS),
                "--log-level",
                "warning",
                *os.environ.get("BENCH_GUNICORN_ARGS", "").split(),
            ],
            env=env,
            cwd=ROOT,
        )
        try:
            _wait_for(f"http://127.0.0.1:{PORT}/healthz")
            # The floor: what this server answers per second when no view runs (a 404),
            # measured in the same run, since the machine is shared and noisy.
            floor = _wrk(f"http://127.0.0.1:{PORT}/no-such-page", seconds=max(3, SECONDS // 4))
            # Where the submits' CPU goes: the server, PostgreSQL, Redis and wrk itself.
            before, wrk_before = _serving_cpu_s(server.pid), _children_cpu_s()
            result = _wrk(f"http://127.0.0.1:{PORT}/api/v1/jobs/", script=script)
            after = _serving_cpu_s(server.pid)
            used = {name: seconds - before[name] for name, seconds in after.items()}
            used["wrk"] = _children_cpu_s() - wrk_before
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        print(result)
        made = int(run([python, "-c", _COUNT], env, capture_output=True, text=True).stdout)
    finally:
        run([python, "-c", _DROP, admin], env)
        shutil.rmtree(var, ignore_errors=True)
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", result).group(1))
    floor_rate = float(re.search(r"Requests/sec:\s+([\d.]+)", floor).group(1))
    p99 = _ms(re.search(r"99%\s+([\d.]+\w+)", result).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", result)
    answered = int(re.search(r"(\d+) requests in", result).group(1))
    per_submit = {name: 1000 * seconds / max(1, answered) for name, seconds in used.items()}
    cpu_ms = sum(per_submit.values())
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs (sum(range(10**6)) in "
        f"{speed:.1f} ms), gunicorn {WORKERS} "
        f"workers, {CONNECTIONS} connections, {SECONDS} s; jobs made: {made}; "
        f"non-2xx: {errors.group(1) if errors else 0}; cache: "
        f"{'Redis' if os.environ.get('REDIS_URL') else 'database'}; a 404 (no view, no "
        f"query) answers {floor_rate:.0f}/s on the same server"
    )
    print(
        "CPU per submit: "
        + ", ".join(f"{name} {ms:.2f} ms" for name, ms in per_submit.items())
        + f"; {cpu_ms:.2f} ms in all"
    )
    print(
        f"api: submits_per_s={rate:.0f} p99_ms={p99:.1f} "
        f"floor_404_per_s={floor_rate:.0f} ratio={rate / floor_rate:.2f} cpu_ms={cpu_ms:.2f}"
    )


def _wrk(url: str, *, script: Path | None = None, seconds: int = SECONDS) -> str:
    args = ["wrk", "--latency", "-t", "2", "-c", str(CONNECTIONS), "-d", f"{seconds}s"]
    if script is not None:
        args += ["-s", str(script)]
    return subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout


def _serving_cpu_s(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by what serves a submit: gunicorn's master and workers,
    every PostgreSQL process (its backends, those that have exited through the
    postmaster, and the WAL writer the commits wait on), and Redis when it is the cache."""
    groups = {
        "gunicorn": [server_pid, *cpu.children(server_pid)],
        "PostgreSQL": cpu.named("postgres"),
    }
    if os.environ.get("REDIS_URL"):
        groups["Redis"] = [cpu.redis_pid(os.environ["REDIS_URL"])]
    return {name: sum(cpu.process_cpu_s(pids)) for name, pids in groups.items()}


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited and been waited for (wrk)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


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
    c.execute("DROP DATABASE IF EXISTS controlplane_bench")
    c.execute("CREATE DATABASE controlplane_bench")
"""
_DROP = """
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as c:
    c.execute("DROP DATABASE IF EXISTS controlplane_bench WITH (FORCE)")
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
