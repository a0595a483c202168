"""`cpctl` against the live server, as a CI job would run it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.accounts import services
from apps.fleet.models import Node, NodeState
from tests import factories
from tests.apps.fleet.test_services import ready_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def cpctl(live_server, token, *args):
    env = {**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "cpctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def token_of(user, scopes=("admin",)):
    return services.api_token_create(user=user, name="cli", scopes=list(scopes), by=user)[1]


def test_whoami_nodes_and_drain(live_server, ops_user):
    ready_node(name="cli-n1")
    token = token_of(ops_user)
    who = cpctl(live_server, token, "whoami")
    assert who.returncode == 0, who.stderr
    assert ops_user.username in who.stdout and "ops" in who.stdout
    listed = cpctl(live_server, token, "-o", "json", "nodes", "--state", "ready")
    assert [n["name"] for n in json.loads(listed.stdout)] == ["cli-n1"]
    drained = cpctl(live_server, token, "drain", "cli-n1", "--reason", "firmware")
    assert drained.returncode == 0, drained.stderr
    assert Node.objects.get(name="cli-n1").state == NodeState.DRAINED


def test_the_api_saying_no_is_exit_1_with_its_message(live_server, researcher):
    ready_node(name="cli-n2")
    result = cpctl(live_server, token_of(researcher), "drain", "cli-n2", "--reason", "mine")
    assert result.returncode == 1
    assert "Only ops may change the fleet." in result.stderr
    bad = cpctl(live_server, "cp_not-a-token", "whoami")
    assert bad.returncode == 1 and "Invalid token" in bad.stderr


def test_no_server_is_exit_2():
    env = {**os.environ, "CPCTL_URL": "http://127.0.0.1:9", "CPCTL_TOKEN": "x"}
    result = subprocess.run(
        [sys.executable, "-m", "cpctl", "whoami"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot reach" in result.stderr


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("name: [unclosed\n", "is not valid YAML"),
        (None, "cannot read"),
    ],
)
def test_a_spec_file_that_cannot_be_read_is_exit_2_with_its_problem(text, problem, tmp_path):
    spec = tmp_path / "job.yaml"
    if text is not None:
        spec.write_text(text)
    env = {**os.environ, "CPCTL_URL": "http://127.0.0.1:9", "CPCTL_TOKEN": "x"}
    result = subprocess.run(
        [sys.executable, "-m", "cpctl", "submit", str(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert problem in result.stderr and "Traceback" not in result.stderr
    assert "cannot reach" not in result.stderr  # nothing was sent


def test_ctrl_c_is_exit_130_without_a_traceback():
    import signal
    import socket
    import time

    with socket.socket() as silent:  # a server that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {
            **os.environ,
            "CPCTL_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "CPCTL_TOKEN": "x",
        }
        waiting = subprocess.Popen(
            [sys.executable, "-m", "cpctl", "whoami"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        silent.settimeout(30)
        connection, _ = silent.accept()  # the request is waiting for its answer
        time.sleep(0.2)
        waiting.send_signal(signal.SIGINT)
        _, err = waiting.communicate(timeout=30)
        connection.close()
    assert waiting.returncode == 130
    assert "interrupted" in err and "Traceback" not in err


def test_a_date_like_yaml_value_stays_a_string(tmp_path):
    from cpctl.cli import _load_spec

    spec = tmp_path / "job.yml"
    spec.write_text("name: 2026-12-01\nteam: ml\nplacement: {spot: yes}\n")
    assert _load_spec(str(spec)) == {
        "name": "2026-12-01",
        "team": "ml",
        "placement": {"spot": True},
    }


def test_submit_status_queue_and_wait_until_cancelled(live_server, team, researcher, tmp_path):
    from apps.accounts import services as accounts
    from apps.jobs import services as jobs
    from apps.jobs.models import Job

    pool = factories.make_owned_pool(slug="cli-pool")
    ready_node(pool=pool, name="cli-gpu-node")
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: nightly-eval\nteam: {team.slug}\ntime_limit_s: 600\n"
        "command:\n  argv: [python, eval.py]\n  path: /shared/eval\n"
        "resources:\n  gpu_type: H100\n  gpus: 4\n"
    )
    token = token_of(researcher, scopes=("submit",))
    env = {**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token}
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cpctl",
            "submit",
            str(spec),
            "--wait",
            "--poll",
            "0.2",
            "--idempotency-key",
            "pipeline-1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    job = _wait_for_job(Job, "nightly-eval")
    again = cpctl(live_server, token, "submit", str(spec), "--idempotency-key", "pipeline-1")
    assert again.returncode == 0 and f"job {job.pk} " in again.stdout
    assert Job.objects.count() == 1
    status = cpctl(live_server, token, "status", str(job.pk))
    assert "pending" in status.stdout and "submitted" in status.stdout
    queue = cpctl(live_server, token, "queue")
    assert "nightly-eval" in queue.stdout
    jobs.job_cancel(job=job, by=None, reason="pipeline aborted")
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 4, (out, err)
    assert "cancelled" in out


def _wait_for_job(model, name, timeout_s=20.0):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = model.objects.filter(name=name).first()
        if job is not None:
            return job
        time.sleep(0.1)
    raise AssertionError(f"no job {name} was submitted")


def test_queue_shows_its_front_filtered_and_says_how_much_is_left_out(
    live_server, team, other_team, researcher
):
    from apps.accounts import services as accounts
    from apps.jobs import services as jobs
    from tests.apps.jobs.conftest import command_spec

    ready_node(pool=factories.make_owned_pool(slug="cli-queue-pool"), name="cli-queue-node")
    for slug in (team, other_team):
        accounts.team_quota_set(team=slug, gpu_type="H100", max_gpus=8, by=None)
    for n in range(3):
        jobs.job_submit(team=team, spec=command_spec(team, name=f"q-{n}"), submitted_by=researcher)
    stranger = factories.make_member(team=other_team, role="researcher")
    jobs.job_submit(team=other_team, spec=command_spec(other_team), submitted_by=stranger)
    token = token_of(researcher)

    front = cpctl(live_server, token, "-o", "json", "queue", "--limit", "2")
    assert front.returncode == 0, front.stderr
    assert [row["name"] for row in json.loads(front.stdout)] == ["q-0", "q-1"]  # by age
    assert "the first 2 of 4 jobs" in front.stderr
    whole = cpctl(live_server, token, "-o", "json", "queue", "--limit", "0")
    assert len(json.loads(whole.stdout)) == 4 and whole.stderr == ""
    theirs = cpctl(live_server, token, "-o", "json", "queue", "--team", other_team.slug)
    assert [(r["team"], r["name"]) for r in json.loads(theirs.stdout)] == [
        (other_team.slug, "(another team's job)")
    ]
    refused = cpctl(live_server, token, "queue", "--state", "finished")
    assert refused.returncode == 1 and "state" in refused.stderr


def test_jobs_lists_finished_ones_newest_first_with_why_they_ended(
    live_server, team, other_team, researcher
):
    from apps.accounts import services as accounts
    from apps.jobs import services as jobs
    from apps.jobs.models import Job, JobState
    from tests.apps.jobs.conftest import command_spec

    ready_node(pool=factories.make_owned_pool(slug="cli-jobs-pool"), name="cli-jobs-node")
    for slug in (team, other_team):
        accounts.team_quota_set(team=slug, gpu_type="H100", max_gpus=8, by=None)
    made = [
        jobs.job_submit(team=team, spec=command_spec(team, name=f"j-{n}"), submitted_by=researcher)[
            0
        ]
        for n in range(3)
    ]
    Job.objects.filter(pk=made[0].pk).update(state=JobState.FAILED, state_reason="rank 1 exited 2")
    stranger = factories.make_member(team=other_team, role="researcher")
    jobs.job_submit(team=other_team, spec=command_spec(other_team), submitted_by=stranger)
    token = token_of(researcher)

    latest = cpctl(live_server, token, "-o", "json", "jobs", "--limit", "2")
    assert latest.returncode == 0, latest.stderr
    assert [row["name"] for row in json.loads(latest.stdout)] == ["j-2", "j-1"]
    assert "the latest 2 of 3 jobs" in latest.stderr  # another team's job is not listed

    failed = cpctl(live_server, token, "jobs", "--state", "failed")
    assert failed.returncode == 0, failed.stderr
    header, row = failed.stdout.splitlines()
    assert header.split()[:5] == ["ID", "TEAM", "NAME", "STATE", "REASON"]
    assert row.split()[:4] == [str(made[0].pk), team.slug, "j-0", "failed"]
    assert "rank 1 exited 2" in row
    assert cpctl(live_server, token, "jobs", "--user", "nobody").stdout.count("\n") == 1


def test_importing_cpctl_imports_no_django():
    """CI images install cpctl without Django: importing it must not reach for it."""
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, cpctl.cli; print(*sorted(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ).stdout.split()
    assert "cpctl.cli" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("django", "controlplane", "apps")]


def _lines_of(stream):
    """`next_line()`: the stream's next line, read on a thread so that a line that never
    comes fails the test in 30 s instead of hanging it."""
    import queue
    import threading

    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in stream], daemon=True).start()

    def next_line() -> str:
        try:
            return lines.get(timeout=30).rstrip("\n")
        except queue.Empty:
            raise AssertionError("no line from cpctl within 30 s") from None

    return next_line, lines


@pytest.mark.parametrize(
    ("exit_code", "outcome", "cpctl_exit"), [(0, "succeeded", 0), (3, "failed", 3)]
)
def test_submit_wait_follow_streams_the_output_and_exits_with_the_outcome(
    live_server, team, researcher, tmp_path, exit_code, outcome, cpctl_exit
):
    from apps.accounts import services as accounts
    from apps.jobs.dispatch import job_dispatch, run_logs_append, run_report
    from apps.jobs.models import Job, Run
    from apps.jobs.scheduler.run import scheduling_pass

    pool = factories.make_owned_pool(slug="follow-pool")
    ready_node(pool=pool, name="follow-node", gpu_count=8)
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=8, by=None)
    spec = tmp_path / "job.json"
    spec.write_text(
        json.dumps(
            {
                "name": "followed",
                "team": team.slug,
                "time_limit_s": 600,
                "command": {"argv": ["python3", "train.py"], "path": "/shared/code"},
                "resources": {"gpu_type": "H100", "gpus": 8},
                "placement": {"where": "owned"},
            }
        )
    )
    env = {**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token_of(researcher)}
    following = subprocess.Popen(
        [sys.executable, "-m", "cpctl", "submit", str(spec), "--wait", "--follow", "--poll", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    next_line, rest = _lines_of(following.stdout)
    try:
        job = _wait_for_job(Job, "followed")
        scheduling_pass()
        job_dispatch(job_id=job.pk)
        run = Run.objects.get(job=job)
        run_report(node_id=run.node_id, run_id=run.pk, report={"state": "running", "pid": 5})
        for seq in range(3):
            line = {"seq": seq, "stream": "stdout", "at": 1.7e9 + seq, "text": f"step {seq}"}
            run_logs_append(node_id=run.node_id, run_id=run.pk, lines=[line])
            time.sleep(0.3)  # lines arrive over time, as the agent relays them
        # Streamed while the job runs: its lines are out before it ends.
        shown = [next_line() for _ in range(4)]
        oops = {"seq": 3, "stream": "stderr", "at": 1.7e9 + 3, "text": "last words"}
        run_logs_append(node_id=run.node_id, run_id=run.pk, lines=[oops])
        report = {"state": "exited", "exit_code": exit_code}
        run_report(node_id=run.node_id, run_id=run.pk, report=report)
        following.wait(timeout=60)
        err = following.stderr.read()
    finally:
        following.kill()
    time.sleep(0.2)  # the reader thread takes the last lines
    out = []
    while not rest.empty():
        out.append(rest.get().rstrip("\n"))
    assert following.returncode == cpctl_exit, (shown, out, err)
    assert Job.objects.get(pk=job.pk).state == outcome
    # stdout: what submit says, then the job's own output, every line in order.
    assert shown + out == [
        f"job {job.pk} pending: followed (1 × 8 H100)",
        "step 0",
        "step 1",
        "step 2",
    ]
    states = [line for line in err.splitlines() if line.startswith(f"job {job.pk}: ")]
    assert states[-1] == f"job {job.pk}: {outcome}" and f"job {job.pk}: running" in states
    assert len(states) == len(set(states))  # each state once, as it moves
    assert "last words" in err  # stderr lines go to stderr


def test_logs_filters_by_rank_attempt_and_text(live_server, team, researcher):
    """`cpctl logs --rank --attempt --grep` asks the logs API with its filters: only the lines
    they keep are printed, prefixed by their rank (the job has two nodes)."""
    from apps.accounts import services as accounts
    from apps.jobs import services as jobs
    from apps.jobs.models import LogLine, Run
    from tests.apps.jobs.conftest import command_spec

    pool = factories.make_owned_pool(slug="logs-pool")
    nodes = [ready_node(pool=pool, name=f"logs-node-{i}", gpu_count=8) for i in range(2)]
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=16, by=None)
    spec = command_spec(team, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8})
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=researcher)
    for attempt, rank, texts in [
        (1, 0, ["a1 r0 hello", "a1 r0 Loss 3.0"]),
        (1, 1, ["a1 r1 hello", "a1 r1 loss 3.1"]),
        (2, 0, ["a2 r0 hello", "a2 r0 LOSS 2.0"]),
    ]:
        run = Run.objects.create(
            job=job, node=nodes[rank], attempt=attempt, node_rank=rank, plan={"argv": ["x"]}
        )
        for seq, text in enumerate(texts):
            LogLine.objects.create(
                run=run, job=job, seq=seq, stream="stdout", at=run.created_at, text=text
            )
    token = token_of(researcher, scopes=("read",))

    def logs(*args) -> list[str]:
        result = cpctl(live_server, token, "logs", str(job.pk), *args)
        assert result.returncode == 0, result.stderr
        return result.stdout.splitlines()

    assert len(logs()) == 6
    assert logs("--rank", "1") == ["[1] a1 r1 hello", "[1] a1 r1 loss 3.1"]
    assert logs("--attempt", "2") == ["[0] a2 r0 hello", "[0] a2 r0 LOSS 2.0"]
    assert logs("--grep", "loss", "--rank", "0") == ["[0] a1 r0 Loss 3.0", "[0] a2 r0 LOSS 2.0"]
    refused = cpctl(live_server, token, "logs", str(job.pk), "--rank", "-1")
    assert refused.returncode == 1 and "rank" in refused.stderr


def test_estimate_prints_each_layouts_fit_time_and_cost_and_the_suggested_one(
    live_server, team, researcher, tmp_path
):
    from apps.jobs.models import Job
    from tests.apps.costs.conftest import owned_price

    pool = factories.make_owned_pool(slug="cli-pool")
    for number in range(4):
        ready_node(pool=pool, name=f"cli-est-{number}", gpu_count=8)
    owned_price(pool)
    token = token_of(researcher, scopes=("submit",))
    spec = tmp_path / "job.yaml"
    spec.write_text(
        f"name: big\nteam: {team.slug}\ntime_limit_s: 86400\n"
        "trainer:\n  preset: 70b\n  dataset: synthetic\n  steps: 100\n"
        "  global_batch: 64\n  seq_len: 2048\n"
        "resources:\n  gpu_type: H100\n  nodes: 1\n  gpus_per_node: 1\n"
    )
    one = cpctl(live_server, token, "estimate", str(spec))
    assert one.returncode == 0, one.stderr
    assert "H100, 1 GPUs:" in one.stdout
    assert "FSDP 1" in one.stdout and "does not fit" in one.stdout
    assert "needs" in one.stdout and "GiB per GPU; an H100 has 80." in one.stdout
    assert "suggested: none" in one.stdout
    assert "basis: MFU" in one.stdout

    # Over 32 GPUs, one sequence of 512 at a time, recomputing activations: it fits.
    text = spec.read_text().replace("nodes: 1\n  gpus_per_node: 1", "nodes: 4\n  gpus_per_node: 8")
    text = text.replace(
        "seq_len: 2048", "seq_len: 512\n  micro_batch: 1\n  activation_checkpointing: full"
    )
    spec.write_text(text)
    many = cpctl(live_server, token, "estimate", str(spec))
    assert many.returncode == 0, many.stderr
    table = many.stdout.splitlines()
    assert table[1].split()[:4] == ["LAYOUT", "FIT", "GIB_PER_GPU", "RUN_TIME"]
    suggested = next(line for line in table if line.startswith("suggested: "))
    label = suggested.removeprefix("suggested: ").split(" (")[0]
    (row,) = [line for line in table if line.startswith(label + "  ")]
    assert "does not fit" not in row and "$" in row and row.rstrip().endswith("suggested")
    assert "per GPU-hour in cli-pool" in many.stdout
    assert Job.objects.count() == 0


def test_dataset_register_and_list(live_server, researcher, team, tmp_path):
    index = {
        "tokenizer": {"name": "bytes", "vocab_size": 256},
        "shards": [{"file": "a.bin", "sha256": "0" * 64, "tokens": 10}],
    }
    (tmp_path / "index.json").write_text(json.dumps(index))
    token = token_of(researcher, scopes=("submit",))
    made = cpctl(
        live_server, token, "dataset", "register", "wiki-en", "--team", team.slug,
        "--uri", "s3://data-bucket/wiki/", "--index", str(tmp_path / "index.json"),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert "wiki-en: 1 shards, 10 tokens, vocabulary 256" in made.stdout
    listed = cpctl(live_server, token, "-o", "json", "datasets")
    assert [(d["name"], d["team"]) for d in json.loads(listed.stdout)] == [("wiki-en", team.slug)]
    again = cpctl(
        live_server, token, "dataset", "register", "wiki-en", "--team", team.slug,
        "--uri", "/shared/x", "--index", str(tmp_path / "index.json"),
    )  # fmt: skip
    assert again.returncode == 1 and "already has a dataset named wiki-en" in again.stderr
