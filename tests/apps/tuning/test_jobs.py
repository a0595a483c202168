"""Jobs and NCCL: submission lints the overrides (400s naming the field), and the Job API and
page show the environment the job gets on each pool."""

import pytest

from apps.jobs import services as jobs
from apps.jobs.models import Job
from tests.apps.jobs.conftest import command_spec

pytestmark = pytest.mark.django_db


def spec(team, nccl, **extra):
    return command_spec(team, nccl=nccl, **extra)


def submit(client, body):
    return client.post("/api/v1/jobs/", body, format="json")


def test_an_invented_variable_is_a_400_naming_it_and_the_real_one(
    ib_pool, h100_quota, team, researcher, api_for
):
    body = spec(team, {"overrides": {"NCCL_IB_DISABLE_CUDA_VGRAPH": "1"}})
    response = submit(api_for(researcher, scopes=("submit",)), body)
    assert response.status_code == 400
    error = response.json()["error"]
    field = "nccl.overrides.NCCL_IB_DISABLE_CUDA_VGRAPH"
    assert field in error["message"]
    (message,) = error["details"][field]
    assert message.startswith("Not an NCCL variable")
    assert message.endswith("Did you mean NCCL_NET_GDR_LEVEL or NCCL_IB_DISABLE?")
    assert not Job.objects.exists()


def test_an_unknown_profile_is_a_400(ib_pool, h100_quota, team, researcher, api_for):
    response = submit(api_for(researcher), spec(team, {"profile": "ib-h100-fast"}))
    assert response.status_code == 400
    assert (
        "No NCCL profile is named ib-h100-fast"
        in response.json()["error"]["details"]["nccl.profile"][0]
    )


def test_a_debugging_knob_needs_a_reason(ib_pool, h100_quota, team, researcher, api_for):
    client = api_for(researcher)
    refused = submit(client, spec(team, {"overrides": {"NCCL_ALGO": "Ring"}}))
    assert refused.status_code == 400
    assert refused.json()["error"]["details"]["nccl.overrides.NCCL_ALGO"][0].endswith(
        "Give nccl.reasons.NCCL_ALGO to keep it."
    )
    nccl = {"overrides": {"NCCL_ALGO": "Ring"}, "reasons": {"NCCL_ALGO": "Tree hangs on 2.26 here"}}
    accepted = submit(client, spec(team, nccl))
    assert accepted.status_code == 201, accepted.content
    assert accepted.json()["spec"]["nccl"] == nccl


def test_an_override_that_breaks_on_the_burst_pool_is_refused(
    ib_pool, efa_pool, h100_quota, team, researcher, api_for
):
    client = api_for(researcher)
    anywhere = spec(
        team, {"overrides": {"NCCL_NET": "IB"}}, placement={"where": "owned_then_cloud"}
    )
    response = submit(client, anywhere)
    assert response.status_code == 400
    assert response.json()["error"]["details"]["nccl.overrides.NCCL_NET"] == [
        "On pool aws-p5 (efa): IB is not the network of efa nodes: NCCL would fail."
    ]
    owned_only = spec(team, {"overrides": {"NCCL_NET": "IB"}}, placement={"where": "owned"})
    assert submit(client, owned_only).status_code == 201


def test_the_job_api_shows_the_environment_on_each_pool_it_may_run_in(
    ib_pool, efa_pool, h100_quota, team, researcher, api_for
):
    body = spec(
        team,
        {"overrides": {"NCCL_DEBUG": "INFO"}},
        placement={"where": "owned_then_cloud"},
        resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8},
    )
    client = api_for(researcher)
    job_id = submit(client, body).json()["id"]

    detail = client.get(f"/api/v1/jobs/{job_id}/").json()

    by_pool = {env["pool"]: env for env in detail["nccl_environments"]}
    assert set(by_pool) == {"ib-h100", "aws-p5"}
    ib = by_pool["ib-h100"]
    assert (ib["profile"], ib["fabric"], ib["nccl_version"], ib["ok"]) == (
        "ib-nvswitch-8gpu",
        "infiniband",
        "2.26.2",
        True,
    )
    variables = {v["name"]: v for v in ib["variables"]}
    assert (variables["NCCL_DEBUG"]["value"], variables["NCCL_DEBUG"]["source"]) == ("INFO", "job")
    assert variables["NCCL_IB_TIMEOUT"]["source"] == "profile"
    assert by_pool["aws-p5"]["profile"] == "efa-p5"


def test_a_single_node_job_gets_the_single_node_profile(
    ib_pool, h100_quota, team, researcher, api_for
):
    client = api_for(researcher)
    job_id = submit(client, command_spec(team)).json()["id"]
    (env,) = client.get(f"/api/v1/jobs/{job_id}/").json()["nccl_environments"]
    assert env["profile"] == "single-node"


def test_the_job_page_shows_the_nccl_environment(client, ib_pool, h100_quota, team, researcher):
    nccl = {"overrides": {"NCCL_ALGO": "Ring"}, "reasons": {"NCCL_ALGO": "bisecting hang #812"}}
    job, _ = jobs.job_submit(
        team=team,
        spec=spec(team, nccl, resources={"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8}),
        submitted_by=researcher,
    )
    client.force_login(researcher)

    html = client.get(f"/jobs/{job.pk}/").content.decode()

    assert "NCCL environment" in html
    assert 'data-pool="ib-h100"' in html
    assert 'href="/nccl/profiles/ib-nvswitch-8gpu/"' in html
    assert "<code>NCCL_ALGO=Ring</code>" in html and "job override" in html
    assert "Kept: bisecting hang #812" in html


def test_a_node_range_down_to_one_node_is_linted_for_one_node_too(
    ib_pool, h100_quota, team, researcher, api_for
):
    """On one node a job gets the single-node profile: an override that breaks on top of
    it is refused for a job whose range goes down to one node, and only for that job."""
    from apps.tuning.models import NcclProfile

    single = NcclProfile.objects.get(name="single-node")
    NcclProfile.objects.filter(pk=single.pk).update(env={**single.env, "NCCL_SOCKET_NTHREADS": "8"})
    nccl = {"overrides": {"NCCL_NSOCKS_PERTHREAD": "16"}}
    resources = {"gpu_type": "H100", "nodes": 2, "gpus_per_node": 8}
    client = api_for(researcher)
    ranged = submit(client, spec(team, nccl, resources={**resources, "min_nodes": 1}))
    assert ranged.status_code == 400, ranged.content
    (message,) = ranged.json()["error"]["details"]["nccl.overrides.NCCL_NSOCKS_PERTHREAD"]
    assert "NCCL_SOCKET_NTHREADS × NCCL_NSOCKS_PERTHREAD = 128 > 64" in message
    assert submit(client, spec(team, nccl, resources=resources)).status_code == 201
