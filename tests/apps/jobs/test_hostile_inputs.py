"""Hostile submissions and job output: counts that would make the layout search
spin, variables a job's `env` may not set, names that are not text, JSON nested past Python's
limit. Each is a quick 400 in the API's error shape and on the Submit page, and writes nothing.
"""

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.accounts import services as accounts
from apps.jobs import specs
from apps.jobs.models import Job
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db

JOBS = "/api/v1/jobs/"
QUICK_S = 0.5  # the layout search over a billion GPUs took 9 s, over 10**20 forever


@pytest.fixture
def token(researcher):
    return accounts.api_token_create(user=researcher, name="ci", scopes=["submit"], by=None)[1]


@pytest.fixture
def submit(client, token):
    """submit(body) → (status, JSON answer) of a submission of these bytes, answered quickly."""

    def post(body: bytes):
        return client.post(
            JOBS, data=body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
        )

    post(b"{}")  # the first request imports and builds what later ones reuse

    def submitted(body: bytes) -> tuple[int, dict]:
        started = time.perf_counter()
        response = post(body)
        assert time.perf_counter() - started < QUICK_S
        assert response["Content-Type"] == "application/json"
        return response.status_code, response.json()

    return submitted


def warmed(client, *paths):
    """The client, logged-in pages' first-request work (imports, templates) done."""
    for path in paths:
        client.get(path)
    return client


# --- counts the layout search would spin on ----------------------------------------------------


@given(st.integers(min_value=1, max_value=5000))
def test_divisors_are_every_divisor_in_order(n):
    assert specs._divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize(
    "resources",
    [
        {"gpus": 10**20},
        {"gpus": 1_000_000_000, "gpus_per_node": 8, "nodes": 125_000_000},
        {"nodes": 2, "gpus_per_node": 10**12},
        {"gpus": 8, "layout": {"dp_shard": 10**20}},
        {"nodes": specs.MAX_NODES, "gpus_per_node": specs.MAX_GPUS_PER_NODE},
    ],
)
def test_the_api_refuses_huge_counts_quickly(submit, fleet_pool, quota, team, resources):
    spec = command_spec(team, resources={"gpu_type": "H100", **resources})
    status, answer = submit(json.dumps(spec).encode())
    assert status == 400 and answer["error"]["code"] == "invalid"
    assert any(field.startswith("resources") for field in answer["error"]["details"])
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("gpus", "per_node", "refused"),
    [
        ("1000000000", "8", specs.COUNTS_LIMIT),
        (str(specs.MAX_GPUS + 8), "8", specs.COUNTS_LIMIT),
        ("4096", "1", ""),  # 4096 one-GPU nodes are within a job's limits...
        ("8192", "1", specs.COUNTS_LIMIT),  # ...8192 are past MAX_NODES
        ("128", "128", specs.COUNTS_LIMIT),  # past MAX_GPUS_PER_NODE
        ("9" * 5000, "8", "whole numbers"),
    ],
)
def test_the_submit_pages_refuse_counts_past_a_jobs_limits_quickly(
    client, researcher, gpus, per_node, refused
):
    client.force_login(researcher)
    paths = ("/jobs/submit/layouts/", "/jobs/submit/")
    warmed(client, *paths)
    for path in paths:
        started = time.perf_counter()
        response = client.get(path, {"preset": "tiny", "gpus": gpus, "gpus_per_node": per_node})
        assert time.perf_counter() - started < QUICK_S
        if refused:
            assert response.status_code == 400, path
            assert refused in response.content.decode()
        else:
            assert response.status_code == 200, path
            assert specs.COUNTS_LIMIT not in response.content.decode()


def test_the_submit_form_refuses_a_billion_gpus_quickly_and_submits_nothing(
    client, fleet_pool, quota, team, researcher
):
    client.force_login(researcher)
    warmed(client, "/jobs/submit/")
    form = {
        "name": "huge",
        "team": team.pk,
        "kind": "command",
        "gpu_type": "H100",
        "gpus": "1000000000",
        "gpus_per_node": "8",
        "priority": "normal",
        "placement": "owned",
        "time_limit_hours": "1",
        "argv": "python\n-c\npass",
        "code_path": "/shared/code",
    }
    started = time.perf_counter()
    response = client.post("/jobs/submit/", form)
    assert time.perf_counter() - started < QUICK_S
    assert response.status_code == 400
    html = response.content.decode()
    assert specs.COUNTS_LIMIT in html and 'class="field-error"' in html
    over = client.post("/jobs/submit/", {**form, "gpus": "128", "gpus_per_node": "65"})
    assert over.status_code == 400 and "less than or equal to 64" in over.content.decode()
    assert not Job.objects.exists()


def test_the_outlook_says_the_limits_for_huge_counts(client, researcher):
    client.force_login(researcher)
    warmed(client, "/jobs/submit/outlook/")
    started = time.perf_counter()
    response = client.get("/jobs/submit/outlook/", {"gpus": str(10**20), "gpus_per_node": "8"})
    assert time.perf_counter() - started < QUICK_S
    assert specs.COUNTS_LIMIT in response.content.decode()


# --- what a job's env may set -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("NCCL_DEBUG", "nccl.overrides"),
        ("nccl_ib_hca", "nccl.overrides"),
        ("TORCH_NCCL_BLOCKING_WAIT", "nccl.overrides"),
        ("FI_EFA_USE_DEVICE_RDMA", "nccl.overrides"),
        ("LD_PRELOAD", "loader"),
        ("LD_LIBRARY_PATH", "loader"),
        ("LD_AUDIT", "loader"),
        ("PYTHONPATH", "Python"),
        ("PYTHONSTARTUP", "Python"),
        ("CONTROLPLANE_JOB_ID", "control plane"),
        ("CONTROLPLANE_STATUS_FILE", "control plane"),
        ("MASTER_ADDR", "control plane"),
        ("MASTER_PORT", "control plane"),
        ("RANK", "torchrun"),
        ("WORLD_SIZE", "torchrun"),
        ("LOCAL_RANK", "torchrun"),
        ("TORCHELASTIC_RUN_ID", "torchrun"),
    ],
)
def test_env_refuses_the_variables_others_set_naming_each(
    submit, fleet_pool, quota, team, name, reason
):
    spec = command_spec(team, env={"WANDB_MODE": "offline", name: "x"})
    status, answer = submit(json.dumps(spec).encode())
    assert status == 400
    assert list(answer["error"]["details"]) == [f"env.{name}"]
    assert reason in answer["error"]["details"][f"env.{name}"][0]
    assert not Job.objects.exists()


def test_secrets_cannot_be_injected_under_a_reserved_name(submit, fleet_pool, quota, team):
    accounts.team_secret_set(team=team, name="LD_PRELOAD", value="/tmp/evil.so", by=None)
    spec = command_spec(team, secrets=["LD_PRELOAD"])
    status, answer = submit(json.dumps(spec).encode())
    assert status == 400 and "secrets.LD_PRELOAD" in answer["error"]["details"]
    assert not Job.objects.exists()


def test_env_keeps_the_variables_a_job_may_set(fleet_pool, quota, team, researcher, api_for):
    env = {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "4", "PYTORCH_CUDA_ALLOC_CONF": "x"}
    response = api_for(researcher, scopes=("submit",)).post(
        JOBS, command_spec(team, env=env), format="json"
    )
    assert response.status_code == 201, response.content
    assert Job.objects.get().spec["env"] == env


@pytest.mark.parametrize("name", ["FOO\n", "FOO\r\n", "\nFOO", "FOO BAR", "1FOO", "F" * 129])
def test_env_names_are_whole_names(submit, fleet_pool, quota, team, name):
    spec = command_spec(team, env={name: "x"})
    status, answer = submit(json.dumps(spec).encode())
    assert status == 400 and "env" in answer["error"]["details"]
    assert not Job.objects.exists()


# --- names that are not text, JSON nested too deep -----------------------------------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"env": {"\ud800": "x"}}, "env"),
        ({"env": {"A\x00": "x"}}, "env"),
        ({"nccl": {"overrides": {"NCCL_\udfff": "1"}}}, "nccl"),
        ({"nccl": {"reasons": {"\ud800NCCL_ALGO": "old switch"}}}, "nccl"),
        ({"\ud800": 1}, "\\ud800"),
        ({"priority": "\ud800"}, "priority"),
    ],
)
def test_a_lone_surrogate_in_a_name_is_a_400_that_renders(
    submit, fleet_pool, quota, team, change, field
):
    # ensure_ascii writes the surrogate as the escape "\ud800", which a client can send.
    body = json.dumps({**command_spec(team), **change}, ensure_ascii=True).encode()
    status, answer = submit(body)
    assert status == 400 and answer["error"]["code"] == "invalid"
    assert field in answer["error"]["details"]
    assert not Job.objects.exists()


@pytest.mark.parametrize("body", [b"[" * 5000, b'{"name": ' + b"[" * 100_000])
def test_json_nested_past_pythons_limit_is_a_parse_error(submit, fleet_pool, quota, team, body):
    status, answer = submit(body)
    assert status == 400 and answer["error"]["code"] == "parse_error"


def test_a_jobs_output_nested_past_pythons_limit_is_stored_as_a_line(
    fleet_pool, quota, team, researcher
):
    """A job prints what it likes; a line the trainer-event parser cannot read is just a line."""
    from rest_framework.test import APIClient

    from apps.fleet import agents
    from apps.jobs import services
    from apps.jobs.models import LogLine, Run, StepMetric

    job, _ = services.job_submit(team=team, spec=command_spec(team), submitted_by=researcher)
    node = fleet_pool.nodes.first()
    run = Run.objects.create(job=job, node=node, attempt=1, node_rank=0, plan={"argv": ["x"]})
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {agents.node_agent_token_issue(node=node)}")
    deep = '{"event": "step", "step": 1, "loss": ' + "[" * 5000
    response = agent.post(
        f"/api/v1/agent/runs/{run.pk}/logs",
        {"lines": [{"seq": 1, "text": deep}]},
        format="json",
    )
    assert response.status_code == 200, response.content
    assert LogLine.objects.get(run=run).text == deep
    assert not StepMetric.objects.exists()
