"""Fleet benchmarks: the heartbeat sweep at the design size, and what a token costs a request.

Goals (the scale the fleet is designed for): 10,000 nodes swept in one pass of
bulk queries, well inside the sweep interval; token authentication a small
fraction of a slow password hash (the reason tokens are SHA-256, not PBKDF2).

Runs on a scratch test database: SQLite in memory, or PostgreSQL when DATABASE_URL is set.
Last line: `fleet: nodes=... sweep_s=... token_auth_us=... pbkdf2_us=... ratio=...`.
"""

import datetime as dt
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.contrib.auth.hashers import PBKDF2PasswordHasher  # noqa: E402
from django.db import connection  # noqa: E402
from django.test.utils import setup_test_environment  # noqa: E402
from django.utils import timezone  # noqa: E402

NODES = int(os.environ.get("BENCH_NODES", "10000"))


def main() -> None:
    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True)
    try:
        figures = run()
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"database {connection.vendor}, {os.cpu_count()} CPUs"
    )
    print(
        f"fleet: nodes={NODES} sweep_s={figures['sweep_s']:.3f} "
        f"sweep_queries={figures['queries']} token_auth_us={figures['token_us']:.0f} "
        f"pbkdf2_us={figures['pbkdf2_us']:.0f} "
        f"ratio={figures['pbkdf2_us'] / figures['token_us']:.0f}"
    )


def run() -> dict:
    from django.contrib.auth import get_user_model
    from django.test.utils import CaptureQueriesContext

    from apps.accounts import services as accounts
    from apps.fleet import services as fleet
    from apps.fleet.models import Node, NodeState

    pool = fleet.pool_create(
        name="bench", slug="bench", kind="owned", gpu_type="H100", max_nodes=NODES, by=None
    )
    stale = timezone.now() - dt.timedelta(hours=1)
    Node.objects.bulk_create(
        (
            Node(
                name=f"bench-{i:05d}",
                pool=pool,
                provider="local",
                capacity_type="owned",
                gpu_type="H100",
                gpu_count=8,
                state=NodeState.READY,
                last_heartbeat_at=stale,
            )
            for i in range(NODES)
        ),
        batch_size=2000,
    )
    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        counts = fleet.nodes_heartbeat_sweep()
        sweep_s = time.perf_counter() - started
    assert counts["suspect"] == NODES, counts

    user = get_user_model().objects.create_user(username="bench")
    _, secret = accounts.api_token_create(user=user, name="bench", scopes=["read"], by=user)
    token_us = _median_us(lambda: accounts.api_token_use(raw=secret), 300)
    hasher = PBKDF2PasswordHasher()  # Django's default password hash
    encoded = hasher.encode("a password", hasher.salt())
    pbkdf2_us = _median_us(lambda: hasher.verify("a password", encoded), 5)
    return {
        "sweep_s": sweep_s,
        "queries": len(queries.captured_queries),
        "token_us": token_us,
        "pbkdf2_us": pbkdf2_us,
    }


def _median_us(operation, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        operation()
        samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


if __name__ == "__main__":
    sys.exit(main())
