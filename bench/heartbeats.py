"""Heartbeats from 10,000 node agents against the real web server.

Set-up: a scratch PostgreSQL database on DATABASE_URL's server
(`controlplane_bench_heartbeats`, dropped after); Redis database BENCH_REDIS_DB (14)
on REDIS_URL's server as the cache, flushed before and after; BENCH_AGENTS (10,000)
READY nodes with 8 GPU rows each, made in bulk, each with a node token stored as its
SHA-256 digest the way `node_agent_token_issue` stores it; gunicorn with the
production settings (DJANGO_DEBUG=0), BENCH_WORKERS sync workers on 127.0.0.1,
serving BENCH_WSGI_APP (controlplane.wsgi:application, which puts the heartbeats'
short road of apps/fleet/api/agent.py in front of Django).

Load: an open-loop generator in this process (epoll, on loopback). Agent i of N
sends its k-th heartbeat (seq k) at t0 + (i / N + k - 1) * BENCH_EVERY_S, whatever
became of its earlier ones, for BENCH_SECONDS (60): the offered load stays at
N / EVERY per second (1000/s) however slow the server gets, and a latency is
measured from the scheduled send time, so a server that falls behind cannot hide
it by slowing the generator down (no coordinated omission). Like the real agent
(workers/agent/client.py, urllib), each heartbeat is one POST
/api/v1/agent/heartbeat on a new connection, with `Authorization: Bearer cpn_...`,
a body shaped like `Agent._heartbeat`'s (seq, version, 8 GPUs as nvidia-smi
reports them, free disk, NCCL version, one run) and a 10 s timeout. Before the
load, every token is looked up once (as each agent's registration would), so the
token cache is warm, and every node is marked heard from. After the last answer,
a second process runs the `fleet.heartbeat_sweep` task (the flush, then the sweep);
with BENCH_SWEEP_EVERY_S set (beat's interval is 15 s) it also runs it that often
during the load, competing for the same CPUs as a Celery worker on the host would.

Figures (last line `heartbeats: per_s=<n> p99_ms=<n> lost=<n>`):

  per_s   heartbeats answered 200, divided by the time from the first scheduled
          send to the last answer;
  p99_ms  99th percentile, over every heartbeat sent, of (answer received, or
          failure, minus scheduled send time);
  lost    heartbeats the control plane did not keep: every heartbeat not answered
          200 (refused, reset, timed out, any other status), plus every node whose
          last heartbeat answered 200 (seq s, sent at wall-clock time t) is missing
          after the final flush, i.e. the cache holds no heartbeat for the node with
          seq >= s, or the node's last_heartbeat_at in PostgreSQL is earlier than t.
          (Only the newest heartbeat of a node is kept, by design: an older one
          superseded by a newer one that was kept is not lost.)

Context, in the same run, since the machine is shared and noisy: the machine's load
and CPU use, the CPU the generator itself used, the sweeps' durations, and, with
Debian's wrk after the measured run, the heartbeat endpoint's closed-loop capacity
and the server's floor (a 404: no view, no query), so figures can be read as ratios.
"""

import collections
import datetime as dt
import errno
import hashlib
import json
import os
import platform
import re
import resource
import secrets
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse, urlunparse

from bench import cpu

ROOT = Path(__file__).resolve().parents[1]
DATABASE = "controlplane_bench_heartbeats"
AGENTS = int(os.environ.get("BENCH_AGENTS", "10000"))
EVERY_S = float(os.environ.get("BENCH_EVERY_S", "10"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "60"))
SWEEP_EVERY_S = float(os.environ.get("BENCH_SWEEP_EVERY_S", "0"))
WORKERS = int(os.environ.get("BENCH_WORKERS", str(2 * (os.cpu_count() or 1))))
PORT = int(os.environ.get("BENCH_PORT", "8148"))
REDIS_DB = int(os.environ.get("BENCH_REDIS_DB", "14"))
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "16"))
# What gunicorn serves: the control plane as controlplane/wsgi.py builds it.
WSGI_APP = os.environ.get("BENCH_WSGI_APP", "controlplane.wsgi:application")
TIMEOUT_S = 10.0  # the agent's (ControlPlane.timeout_s)
PATH = "/api/v1/agent/heartbeat"
SEQ_MARK = 918273645546372819  # stands for the seq in a body template


# --- the run -----------------------------------------------------------------------------------


def main() -> None:
    if not shutil.which("wrk"):
        sys.exit("bench.heartbeats needs wrk: apt-get install wrk")
    database_url, redis_url = _urls()
    var = Path(tempfile.mkdtemp(prefix="controlplane-bench-heartbeats-"))
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "SECRET_KEY": "bench-only-" + "x" * 40,
        "DJANGO_DEBUG": "0",
        "ALLOWED_HOSTS": "127.0.0.1",
        "SECURE_COOKIES": "0",
        "CONTROLPLANE_VAR_DIR": str(var),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    python = sys.executable
    admin = urlunparse(urlparse(database_url)._replace(path="/postgres"))
    _redis_flush(redis_url)
    _postgres(admin, f"DROP DATABASE IF EXISTS {DATABASE}", f"CREATE DATABASE {DATABASE}")
    load_before = os.getloadavg()
    try:
        _run([python, "manage.py", "migrate", "-v0"], env)
        started = time.perf_counter()
        _run([python, "-m", "bench.heartbeats", "seed", str(var / "agents.txt")], env)
        seed_s = time.perf_counter() - started
        agents = [line.split() for line in (var / "agents.txt").read_text().splitlines()]
        (var / "tokens.txt").write_text("".join(token + "\n" for _, token in agents))
        server_log = (var / "gunicorn.log").open("w")  # the floor's 404s each log a warning
        server = subprocess.Popen(
            [
                str(Path(python).with_name("gunicorn")),
                WSGI_APP,
                "--bind",
                f"127.0.0.1:{PORT}",
                "--workers",
                str(WORKERS),
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=ROOT,
            stderr=server_log,
        )
        try:
            _wait_for(f"http://127.0.0.1:{PORT}/healthz")
            sweeper = subprocess.Popen(
                [python, "-m", "bench.heartbeats", "sweep", str(var / "tokens.txt")],
                env=env,
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                ready = sweeper.stdout.readline().split()
                if not ready or ready[0] != "ready":
                    raise SystemExit("the sweeper did not start")
                warm_s = float(ready[1])
                servers = [server.pid, *cpu.children(server.pid), cpu.redis_pid(redis_url)]
                cpu_before, used_before = cpu.machine_times(), cpu.process_cpu_s(servers)
                load = _drive([token for _, token in agents])
                machine_busy = cpu.busy_share(cpu_before, cpu.machine_times())
                used = [b - a for a, b in zip(used_before, cpu.process_cpu_s(servers), strict=True)]
                sweeper.stdin.write("stop\n")
                sweeper.stdin.close()
                sweeps = json.loads(sweeper.stdout.read().strip().splitlines()[-1])
                sweeper.wait(timeout=60)
            finally:
                if sweeper.poll() is None:
                    sweeper.kill()
            acks = {agents[i][0]: last for i, last in load["last_acked"].items()}
            (var / "acks.json").write_text(json.dumps(acks))
            check = json.loads(
                _run(
                    [python, "-m", "bench.heartbeats", "check", str(var / "acks.json")],
                    env,
                    capture_output=True,
                    text=True,
                ).stdout
            )
            # After the measured run (once the server has caught up with what queued):
            # the endpoint's closed-loop capacity, and the floor.
            _wait_for(f"http://127.0.0.1:{PORT}/healthz", quick_s=0.2)
            seconds = max(3, int(SECONDS) // 6)
            script = var / "heartbeat.lua"
            script.write_text(_lua(var / "tokens.txt"))
            capacity = _wrk(f"http://127.0.0.1:{PORT}{PATH}", seconds, script)
            floor = _wrk(f"http://127.0.0.1:{PORT}/no-such-page", seconds)
        except BaseException:
            server_log.flush()
            print((var / "gunicorn.log").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
            server_log.close()
    finally:
        _postgres(admin, f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        _redis_flush(redis_url)
        shutil.rmtree(var, ignore_errors=True)

    failed = load["sent"] - load["acked"]
    answered = max(1, load["acked"])
    short = set(check["unlanded"]) | set(check["unwritten"])
    lost = failed + len(short)
    capacity_rate, capacity_non2xx = _wrk_figures(capacity)
    floor_rate, _ = _wrk_figures(floor)
    sweep_s = [s["seconds"] for s in sweeps]
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
        f"{load_before[0]:.2f} before the run; gunicorn {WORKERS} sync workers serving "
        f"{WSGI_APP}; "
        f"{AGENTS} agents every {EVERY_S:g} s for {SECONDS:g} s "
        f"(offered {AGENTS / EVERY_S:.0f}/s); seed {seed_s:.1f} s, token cache warmed "
        f"in {warm_s:.1f} s"
    )
    print(
        f"sent {load['sent']}, answered 200: {load['acked']}, statuses {load['statuses']}; "
        f"latency from the scheduled send: p50 {load['p50_ms']:.1f} ms, p90 "
        f"{load['p90_ms']:.1f} ms, p99 {load['p99_ms']:.1f} ms, max {load['max_ms']:.1f} ms; "
        f"generator's start lag p99 {load['lag_p99_ms']:.1f} ms"
    )
    print(
        f"CPU during the load: machine {100 * machine_busy:.0f}% busy of {os.cpu_count()} "
        f"CPUs; per heartbeat answered, gunicorn {1000 * sum(used[:-1]) / answered:.2f} ms, "
        f"Redis {1000 * used[-1] / answered:.2f} ms, the generator "
        f"{1000 * load['cpu_s'] / answered:.2f} ms"
    )
    print(
        f"heartbeat_sweep task (flush, then sweep): {len(sweeps)} passes, "
        f"{' '.join(f'{s:.2f}' for s in sweep_s)} s; written "
        f"{sum(s['counts'].get('written', 0) for s in sweeps)}, suspect "
        f"{sum(s['counts'].get('suspect', 0) for s in sweeps)}, resumed "
        f"{sum(s['counts'].get('resumed', 0) for s in sweeps)}"
    )
    print(
        f"lost: {failed} not answered 200; nodes whose last answered heartbeat is not in "
        f"the cache {len(check['unlanded'])}, not written {len(check['unwritten'])}"
    )
    print(
        f"closed loop (wrk, {CONNECTIONS} connections, {seconds} s): heartbeats "
        f"{capacity_rate:.0f}/s (non-2xx {capacity_non2xx}), a 404 (no view, no query) "
        f"{floor_rate:.0f}/s, ratio {capacity_rate / floor_rate:.2f}"
    )
    print(f"heartbeats: per_s={load['per_s']:.0f} p99_ms={load['p99_ms']:.1f} lost={lost}")


def _urls() -> tuple[str, str]:
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith(("postgres://", "postgresql://")):
        sys.exit("bench.heartbeats measures on PostgreSQL: set DATABASE_URL (postgres://...)")
    redis = os.environ.get("REDIS_URL", "")
    if not redis.startswith(("redis://", "rediss://")):
        sys.exit("bench.heartbeats measures with Redis: set REDIS_URL (redis://...)")
    return (
        urlunparse(urlparse(base)._replace(path=f"/{DATABASE}")),
        urlunparse(urlparse(redis)._replace(path=f"/{REDIS_DB}")),
    )


def _run(args, env, **kwargs):
    return subprocess.run(args, env=env, cwd=ROOT, check=True, **kwargs)


def _postgres(url: str, *statements: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def _redis_flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _wait_for(url: str, timeout_s: float = 120, quick_s: float | None = None) -> None:
    """Until the server answers `url` (within `quick_s` seconds, if given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=5):  # noqa: S310 (our own server)
                if quick_s is None or time.monotonic() - started <= quick_s:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer at {url}")


# --- the agents ----------------------------------------------------------------------------------


def _request_parts(index: int, token: str) -> tuple[bytes, bytes, bytes]:
    """(headers up to Content-Length's value, body before the seq, body after it)."""
    from workers.agent import VERSION

    body = {
        "seq": SEQ_MARK,
        "version": VERSION,
        "metrics": {
            "source": "nvidia-smi",
            "gpus": [
                {
                    "index": g,
                    "uuid": f"GPU-{index:08x}-{g:04x}-4bd2-9c1e-{secrets.token_hex(6)}",
                    "name": "NVIDIA H100 80GB HBM3",
                    "utilization": 97.0,
                    "memory_used_mib": 71234.0,
                    "memory_total_mib": 81559.0,
                    "power_w": 612.37,
                    "temperature_c": 61.0,
                    "ecc_errors": 0,
                    "driver_version": "550.90.07",
                }
                for g in range(8)
            ],
            "message": "",
        },
        "disk_free_bytes": 1_734_567_890_123,
        "nccl_version": "2.21.5",
        "runs": [{"id": 100_000 + index, "pid": 4242}],
    }
    before, after = json.dumps(body).split(str(SEQ_MARK))
    headers = (
        f"POST {PATH} HTTP/1.1\r\n"
        "Accept-Encoding: identity\r\n"
        "Content-Type: application/json\r\n"
        "Accept: application/json\r\n"
        f"Authorization: Bearer {token}\r\n"
        f"Host: 127.0.0.1:{PORT}\r\n"
        "User-Agent: Python-urllib/3.11\r\n"
        "Connection: close\r\n"
        "Content-Length: "
    )
    return headers.encode(), before.encode(), after.encode()


class _Heartbeat:
    """One heartbeat in flight: its socket, its schedule, what came back so far."""

    __slots__ = ("at", "chunks", "connected", "k", "payload", "sent_at", "sock")

    def __init__(self, k: int, sock: socket.socket, at: float, sent_at: float, payload: bytes):
        self.k = k
        self.sock = sock
        self.at = at
        self.sent_at = sent_at
        self.payload = payload
        self.connected = False
        self.chunks: list[bytes] = []


def _drive(tokens: list[str]) -> dict:
    """Send every agent's heartbeats on the fixed schedule; see the module's docstring.

    One thread and epoll, no asyncio: what an agent's heartbeat costs here (a socket,
    a connect, a send, reads until the server closes) is a few system calls and tens
    of microseconds of Python, so the generator keeps to its schedule on a busy machine.
    """
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    parts = [_request_parts(i, token) for i, token in enumerate(tokens)]
    agents = len(tokens)
    gap = EVERY_S / agents
    total = round(SECONDS * agents / EVERY_S)
    latencies = [0.0] * total
    lags = [0.0] * total
    statuses: dict[str, int] = {}
    last_acked: dict[int, list] = {}
    flying: dict[int, _Heartbeat] = {}
    deadlines: collections.deque = collections.deque()  # (deadline, fd, k), in send order
    poller = select.epoll()
    address = ("127.0.0.1", PORT)
    linger_0 = struct.pack("ii", 1, 0)
    clock = time.monotonic
    state = {"finished": 0, "last_answer": 0.0}

    def finish(beat: _Heartbeat, status: str, *, reset: bool = False) -> None:
        fd = beat.sock.fileno()
        if flying.pop(fd, None) is not None:
            poller.unregister(fd)
        if reset:  # no TIME_WAIT left behind on this side: the ports would run out
            beat.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_0)
        beat.sock.close()
        now = clock()
        latencies[beat.k] = now - beat.at
        statuses[status] = statuses.get(status, 0) + 1
        if status == "200":
            agent, seq = beat.k % agents, beat.k // agents + 1
            last = last_acked.get(agent)
            if last is None or last[0] < seq:
                last_acked[agent] = [seq, beat.sent_at]
        state["last_answer"] = max(state["last_answer"], now)
        state["finished"] += 1

    def launch(k: int, at: float) -> None:
        agent, seq = k % agents, k // agents + 1
        headers, before, after = parts[agent]
        body = before + str(seq).encode() + after
        payload = headers + str(len(body)).encode() + b"\r\n\r\n" + body
        lags[k] = clock() - at
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        beat = _Heartbeat(k, sock, at, time.time(), payload)
        error = sock.connect_ex(address)
        if error not in (0, errno.EINPROGRESS):
            finish(beat, errno.errorcode.get(error, str(error)))
            return
        fd = sock.fileno()
        flying[fd] = beat
        poller.register(fd, select.EPOLLOUT)
        deadlines.append((at + TIMEOUT_S, fd, k))

    def ready(fd: int) -> None:
        beat = flying.get(fd)
        if beat is None:
            return
        try:
            if not beat.connected:
                error = beat.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    finish(beat, errno.errorcode.get(error, str(error)))
                    return
                beat.connected = True
            if beat.payload:
                sent = beat.sock.send(beat.payload)
                beat.payload = beat.payload[sent:]
                if not beat.payload:
                    poller.modify(fd, select.EPOLLIN)
                return
            data = beat.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            finish(beat, errno.errorcode.get(exc.errno, type(exc).__name__), reset=True)
            return
        if data:
            beat.chunks.append(data)
            return
        answer = b"".join(beat.chunks)
        finish(beat, answer[9:12].decode() if answer.startswith(b"HTTP/1.") else "garbled")

    cpu = resource.getrusage(resource.RUSAGE_SELF)
    t0 = clock() + 1.0
    k = 0
    while state["finished"] < total:
        now = clock()
        while k < total and t0 + k * gap <= now:
            launch(k, t0 + k * gap)
            k += 1
        while deadlines and deadlines[0][0] <= now:
            _, fd, late = deadlines.popleft()
            beat = flying.get(fd)
            if beat is not None and beat.k == late:
                finish(beat, "timeout", reset=True)
        wake = t0 + k * gap if k < total else now + 0.05
        if deadlines:
            wake = min(wake, deadlines[0][0])
        for fd, _ in poller.poll(max(0.0, wake - clock())):
            ready(fd)
    poller.close()
    used = resource.getrusage(resource.RUSAGE_SELF)
    acked = statuses.get("200", 0)
    ordered = sorted(latencies)
    elapsed = state["last_answer"] - t0
    return {
        "sent": total,
        "acked": acked,
        "statuses": dict(sorted(statuses.items())),
        "per_s": acked / elapsed,
        "elapsed_s": elapsed,
        "p50_ms": 1000 * _percentile(ordered, 0.50),
        "p90_ms": 1000 * _percentile(ordered, 0.90),
        "p99_ms": 1000 * _percentile(ordered, 0.99),
        "max_ms": 1000 * ordered[-1],
        "lag_p99_ms": 1000 * _percentile(sorted(lags), 0.99),
        "cpu_s": (used.ru_utime + used.ru_stime) - (cpu.ru_utime + cpu.ru_stime),
        "last_acked": last_acked,
    }


def _percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


# --- wrk: closed-loop capacity and the floor ------------------------------------------------------

LUA = """
local tokens = {}
local before, after = [==[%(before)s]==], [==[%(after)s]==]
local threads = 0
local i = 0

function setup(thread)
  thread:set("offset", threads * 3001)
  threads = threads + 1
end

function init(args)
  for line in io.lines("%(tokens)s") do tokens[#tokens + 1] = line end
  i = offset or 0
end

function request()
  i = i + 1
  return wrk.format("POST", "%(path)s", {
    ["Authorization"] = "Bearer " .. tokens[(i %% #tokens) + 1],
    ["Content-Type"] = "application/json",
  }, before .. tostring(1000000 + i) .. after)
end
"""


def _lua(tokens: Path) -> str:
    _, before, after = _request_parts(0, "unused")
    return LUA % {
        "before": before.decode(),
        "after": after.decode(),
        "tokens": tokens,
        "path": PATH,
    }


def _wrk(url: str, seconds: int, script: Path | None = None) -> str:
    args = ["wrk", "--latency", "-t", "2", "-c", str(CONNECTIONS), "-d", f"{seconds}s"]
    if script is not None:
        args += ["-s", str(script)]
    return subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout


def _wrk_figures(output: str) -> tuple[float, int]:
    rate = float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    return rate, int(errors.group(1)) if errors else 0


# --- steps run in their own processes, with the bench's Django settings -------------------------


def _seed(path: str) -> None:
    """BENCH_AGENTS READY nodes with 8 GPUs and a node token each; writes `id token` lines."""
    import django

    django.setup()
    from django.utils import timezone

    from apps.fleet import services as fleet
    from apps.fleet.agents import NODE_TOKEN_PREFIX
    from apps.fleet.models import Gpu, GpuHealth, Node, NodeState
    from workers.agent import VERSION

    pool = fleet.pool_create(
        name="bench", slug="bench", kind="owned", gpu_type="H100", max_nodes=AGENTS, by=None
    )
    now = timezone.now()
    tokens = [NODE_TOKEN_PREFIX + secrets.token_urlsafe(32) for _ in range(AGENTS)]
    nodes = Node.objects.bulk_create(
        (
            Node(
                name=f"hb-{i:05d}",
                pool=pool,
                provider="local",
                capacity_type="owned",
                gpu_type="H100",
                gpu_count=8,
                state=NodeState.READY,
                # As node_agent_token_issue stores it: the SHA-256 of the secret, in hex.
                agent_token_digest=hashlib.sha256(raw.encode("utf-8")).hexdigest(),
                agent_version=VERSION,
                agent_registered_at=now,
                last_heartbeat_at=now,
                nccl_version="2.21.5",
            )
            for i, raw in enumerate(tokens)
        ),
        batch_size=2000,
    )
    Gpu.objects.bulk_create(
        (
            Gpu(
                node_id=node.pk,
                index=g,
                model="NVIDIA H100 80GB HBM3",
                memory_mib=81559,
                health=GpuHealth.HEALTHY,
                reported_at=now,
            )
            for node in nodes
            for g in range(8)
        ),
        batch_size=5000,
    )
    Path(path).write_text("".join(f"{n.pk} {raw}\n" for n, raw in zip(nodes, tokens, strict=True)))


def _sweep(tokens_path: str) -> None:
    """The heartbeat_sweep task every BENCH_SWEEP_EVERY_S, and once more when told to stop
    (a line on stdin); prints each pass's duration and counts as JSON.

    First, as though every agent had just registered (registration looks its token up,
    which caches it): every node heard from now, every token in the cache."""
    import django

    django.setup()
    from django.utils import timezone

    from apps.fleet.agents import agent_identity
    from apps.fleet.models import Node
    from workers.tasks.fleet import heartbeat_sweep

    warm = time.perf_counter()
    for token in Path(tokens_path).read_text().split():
        if agent_identity(token) is None:
            raise SystemExit("a seeded node token is not valid")
    Node.objects.update(last_heartbeat_at=timezone.now())
    print(f"ready {time.perf_counter() - warm:.1f}", flush=True)
    passes = []
    started = time.monotonic()
    due = started + SWEEP_EVERY_S if SWEEP_EVERY_S > 0 else None
    while True:
        wait = None if due is None else max(0.0, due - time.monotonic())
        stopping = bool(select.select([sys.stdin], [], [], wait)[0])
        begun = time.perf_counter()
        counts = heartbeat_sweep()
        passes.append(
            {
                "at_s": round(time.monotonic() - started, 2),
                "seconds": time.perf_counter() - begun,
                "counts": counts,
            }
        )
        if stopping:
            break
        due += SWEEP_EVERY_S
    print(json.dumps(passes))


def _check(path: str) -> None:
    """Which nodes' last answered heartbeat is not in the cache, or not written (JSON)."""
    import django

    django.setup()
    from django.core.cache import cache

    from apps.fleet.agents import _heartbeat_key
    from apps.fleet.models import Node

    acks = {int(node_id): last for node_id, last in json.loads(Path(path).read_text()).items()}
    landed = cache.get_many([_heartbeat_key(node_id) for node_id in acks])
    written = dict(Node.objects.filter(pk__in=list(acks)).values_list("id", "last_heartbeat_at"))
    unlanded, unwritten = [], []
    for node_id, (seq, sent_at) in acks.items():
        entry = landed.get(_heartbeat_key(node_id))
        if entry is None or (entry[1].get("seq") or 0) < seq:
            unlanded.append(node_id)
        at = written.get(node_id)
        if at is None or at < dt.datetime.fromtimestamp(sent_at, tz=dt.UTC):
            unwritten.append(node_id)
    print(json.dumps({"unlanded": unlanded, "unwritten": unwritten}))


if __name__ == "__main__":
    step = sys.argv[1] if len(sys.argv) > 1 else ""
    if step == "seed":
        _seed(sys.argv[2])
    elif step == "sweep":
        _sweep(sys.argv[2])
    elif step == "check":
        _check(sys.argv[2])
    else:
        main()
