"""Drills on the control plane's own parts: gunicorn stopped mid-burst, PostgreSQL restarted,
Redis down, a Celery worker killed while dispatching or bootstrapping a node, and two beats
with two workers under a burst. Each asserts that no accepted submission is lost or made
twice, that no job is left stuck, and how long the product took to recover."""

import time

from tests.drills import checks
from tests.drills.jobs import Burst, all_succeed_once, command, exactly_once, submit
from tests.procs import wait_for


def test_gunicorn_stopped_mid_burst(drill, recovered):
    """SIGTERM to gunicorn while 60 submissions arrive; it is started again at once. Every
    201 was committed; the client's retries with the same keys make each job once."""
    burst = Burst(drill, [f"web-{n}" for n in range(60)])
    marks = {}

    def restart_web():
        marks["stopped"] = time.monotonic()
        drill.web.stop(timeout_s=30)  # graceful: requests in flight are answered first
        drill.web.start()
        wait_for("gunicorn to answer again", drill.web_answers, timeout_s=60)
        marks["back"] = time.monotonic()

    answers = dict(burst.run(every_s=0.1, after=20, fault=restart_web))
    accepted_before = {n: a[1] for n, a in answers.items() if a[0] == 201}
    assert not [a for a in answers.values() if a[0] == 500], answers
    ids = burst.until_all_accepted()
    assert all(ids[n] == i for n, i in accepted_before.items())
    exactly_once(drill, ids)
    all_succeed_once(drill, ids.values())
    unanswered = sum(1 for a in answers.values() if a[0] != 201)
    recovered(
        "gunicorn SIGTERM mid-burst",
        marks["back"] - marks["stopped"],
        f"stop → answering again ({unanswered} of 60 unanswered, then retried)",
    )


def test_postgres_restarted_mid_burst(drill, recovered):
    """PostgreSQL stopped (fast) for 3 s and started while 60 submissions arrive: each answer
    is a 201 or a 503 with Retry-After, never a 500; retries make each job once, and the
    worker and beat carry on."""
    burst = Burst(drill, [f"pg-{n}" for n in range(60)])
    marks = {}

    def restart_postgres():
        drill.postgres.stop("fast")
        marks["down"] = time.monotonic()
        time.sleep(3)
        drill.postgres.start()
        marks["up"] = time.monotonic()

    answers = dict(burst.run(every_s=0.1, after=15, fault=restart_postgres))
    statuses = {a[0] for a in answers.values()}
    assert statuses <= {201, 503}, answers
    assert all(a[2] for a in answers.values() if a[0] == 503), "a 503 without Retry-After"
    ids = burst.until_all_accepted()
    first_after = burst.first_accepted_after(marks["up"])
    exactly_once(drill, ids)
    all_succeed_once(drill, ids.values())
    refused = sum(1 for a in answers.values() if a[0] == 503)
    recovered(
        "PostgreSQL restart",
        first_after,
        f"database back → next 201 ({refused} of 60 answered 503, then retried)",
    )


def test_redis_down_for_ten_seconds(drill, recovered):
    """Redis (the broker, the cache and the locks) stopped for 10 s with jobs running and
    more submitted: submissions are still taken, and once Redis is back every job runs; no
    lock outlives the outage. (The Celery worker exits when it loses the broker while it
    holds a message, kombu 5.7 failing to put it back; its supervisor starts it again.)"""
    running = [
        submit(drill, command(drill, ["sleep", "12"], name=f"redis-run-{n}")) for n in range(2)
    ]
    for job_id in running:
        checks.in_state(drill, job_id, "running", timeout_s=60)
    drill.redis.stop()
    down = time.monotonic()
    during = [
        drill.api(
            "POST", "/api/v1/jobs/", command(drill, ["true"], name=f"redis-{n}"), key=f"redis-{n}"
        )
        for n in range(5)
    ]
    assert {a.status_code for a in during} <= {201, 503}, [a.text for a in during]
    time.sleep(max(0.0, 10 - (time.monotonic() - down)))
    drill.redis.start()
    back = time.monotonic()
    burst = Burst(drill, [f"redis-{n}" for n in range(5)])
    for n, answer in enumerate(during):
        if answer.status_code == 201:
            burst.answers[f"redis-{n}"] = (201, answer.json()["id"], None, down)
    ids = burst.until_all_accepted()
    wait_for(
        "the jobs submitted during the outage to start",
        lambda: (
            not drill.sql(
                "SELECT 1 FROM jobs_job WHERE id = ANY(%s) AND started_at IS NULL",
                list(ids.values()),
            )
        ),
        timeout_s=90,
    )
    started = time.monotonic() - back
    exactly_once(drill, ids)
    all_succeed_once(drill, [*ids.values(), *running], timeout_s=120)
    recovered("Redis down 10 s", started, "Redis back → every job submitted meanwhile started")


def test_worker_killed_while_dispatching(drill, recovered):
    """kill -9 of the Celery worker (and its pool) while 20 jobs are being dispatched; its
    supervisor starts it again a second later. No job stays ADMITTED past the re-drive, and
    each runs once."""
    ids = [submit(drill, command(drill, ["sleep", "2"], name=f"dispatch-{n}")) for n in range(20)]
    wait_for(
        "a job to be admitted",
        lambda: drill.sql("SELECT 1 FROM jobs_job WHERE id = ANY(%s) AND state <> 'pending'", ids),
        timeout_s=30,
        every_s=0.05,
    )
    worker = drill.workers[0]
    before = worker.restarts
    worker.crash()
    wait_for("the worker to be started again", lambda: worker.restarts > before, timeout_s=10)
    restarted = worker.started_at
    wait_for(
        "no job admitted and not dispatched",
        lambda: (
            not drill.sql("SELECT 1 FROM jobs_job WHERE id = ANY(%s) AND state = 'admitted'", ids)
        ),
        timeout_s=60,
        every_s=0.2,
    )
    cleared = time.monotonic() - restarted
    all_succeed_once(drill, ids)
    assert cleared < 15, f"admitted jobs waited {cleared:.0f} s for their dispatch"
    recovered("worker killed mid-dispatch", cleared, "new worker → no job left ADMITTED")


def test_worker_killed_while_bootstrapping_a_node(drill, recovered):
    """kill -9 of the worker while it brings a new local node up (its supervisor starts it
    again). The provisioning sweep takes the node up again and it reaches READY."""
    pool = drill.sql("SELECT id FROM fleet_nodepool WHERE slug = %s", drill.seed["pools"]["local"])
    answer = drill.api(
        "POST",
        "/api/v1/nodes/",
        {"name": "local-late", "pool": pool[0][0], "provider": "local", "gpu_count": 2,
         "capacity_type": "owned"},
    )  # fmt: skip
    assert answer.status_code == 201, answer.text
    node_id = answer.json()["id"]
    assert drill.api("POST", f"/api/v1/nodes/{node_id}/provision/").status_code == 200
    wait_for(
        "the worker to start on the node",
        lambda: checks.node_state(drill, node_id) in ("provisioning", "bootstrapping"),
        timeout_s=30,
        every_s=0.05,
    )
    killed = drill.workers[0].crash()
    wait_for(
        "the node to be READY",
        lambda: checks.node_state(drill, node_id) == "ready",
        timeout_s=90,
    )
    recovered("worker killed mid-bootstrap", time.monotonic() - killed, "kill → node READY")
    drain = drill.api("POST", f"/api/v1/nodes/{node_id}/drain/", {"reason": "drill over"})
    assert drain.status_code == 200, drain.text


def test_two_beats_two_workers_under_a_burst(drill, recovered):
    """A second beat and a second worker, and 200 submissions from 8 clients at once: every
    job is made once and runs once, though every periodic task is sent twice."""
    extra = [drill._worker(2), drill._beat(2)]
    for part in extra:
        part.start()
    try:
        started = time.monotonic()
        burst = Burst(drill, [f"two-{n}" for n in range(200)])
        answers = burst.run()
        assert {a[0] for a in answers.values()} == {201}, answers
        ids = burst.until_all_accepted()
        exactly_once(drill, ids)
        all_succeed_once(drill, ids.values(), timeout_s=300)
        recovered("200 jobs, two beats and workers", time.monotonic() - started, "burst → all ran")
    finally:
        for part in extra:
            part.stop()
