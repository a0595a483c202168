"""Precision fp8 (bf16 with the blocks' linear layers in float8): taken on H100 and H200 with
tp 1 and passed to run.json unchanged; refused at submission, from the API and the Submit
page alike, on a GPU type without FP8 tensor cores (or one that may be such) and with tensor
parallelism; estimated by the advisor without the layouts it may not take."""

import json
import re

import pytest

from apps.accounts import services as accounts
from apps.jobs.dispatch import job_dispatch
from apps.jobs.models import Job, Run
from apps.jobs.scheduler.run import scheduling_pass
from tests import factories
from tests.apps.fleet.test_services import ready_node
from tests.apps.jobs.conftest import form_data, trainer_spec
from tests.apps.jobs.test_submit_form import field_errors_of
from workers.trainer.config import parse

pytestmark = pytest.mark.django_db

TENSOR_CORES = "precision fp8 needs FP8 tensor cores: set gpu_type to H100 or H200"


def fp8_spec(team, *, gpu_type="H100", layout=None) -> dict:
    spec = trainer_spec(
        team,
        preset="tiny",
        nodes=1,
        gpus_per_node=8,
        layout=layout,
        seq_len=256,
        precision="fp8",
    )
    spec["resources"]["gpu_type"] = gpu_type
    return spec


def submit(api_for, user, spec):
    return api_for(user, scopes=("submit",)).post("/api/v1/jobs/", spec, format="json")


@pytest.fixture
def h200_pool(team):
    site = factories.make_site(slug="h200-site")
    rack = factories.make_rack(site=site, name="K1")
    pool = factories.make_owned_pool(site=site, slug="h200-owned", gpu_type="H200")
    ready_node(pool=pool, rack=rack, rack_unit=1, gpu_count=8)
    accounts.team_quota_set(team=team, gpu_type="H200", max_gpus=8, by=None)
    return pool


def test_fp8_on_h100_is_queued_and_reaches_run_json_unchanged(
    fleet_pool, quota, team, researcher, api_for
):
    answer = submit(api_for, researcher, fp8_spec(team))
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    assert job.spec["trainer"]["precision"] == "fp8"
    assert job.estimate is not None  # the advisor estimated it (as bf16: an upper bound)
    assert any("fp8" in line for line in job.estimate["basis"])

    scheduling_pass()
    job_dispatch(job_id=job.pk)
    (run,) = Run.objects.filter(job=job)
    (item,) = [f for f in run.plan["files"] if f["path"] == "run.json"]
    config = json.loads(item["content"])
    assert config["precision"] == "fp8"
    assert parse(config).precision == "fp8"  # as the trainer reads it on the node


def test_fp8_on_h200_is_queued(fleet_pool, quota, h200_pool, team, researcher, api_for):
    answer = submit(api_for, researcher, fp8_spec(team, gpu_type="H200"))
    assert answer.status_code == 201, answer.content
    assert answer.json()["gpu_type"] == "H200"


@pytest.mark.parametrize(
    ("gpu_type", "why"),
    [("A100", "(an A100 has none)"), ("ANY", "(Any may land on a GPU without them)")],
)
def test_fp8_on_a_gpu_type_that_may_lack_fp8_tensor_cores_is_a_400(
    gpu_type, why, fleet_pool, quota, team, researcher, api_for
):
    answer = submit(api_for, researcher, fp8_spec(team, gpu_type=gpu_type))
    assert answer.status_code == 400, answer.content
    details = answer.json()["error"]["details"]
    assert details["resources.gpu_type"] == [f"{TENSOR_CORES} {why}."]
    assert not Job.objects.exists()


def test_fp8_with_tensor_parallelism_is_a_400_naming_tp(
    fleet_pool, quota, team, researcher, api_for
):
    answer = submit(api_for, researcher, fp8_spec(team, layout={"dp_shard": 4, "tp": 2}))
    assert answer.status_code == 400, answer.content
    details = answer.json()["error"]["details"]
    assert list(details) == ["resources.layout.tp"]
    assert "without tensor parallelism" in details["resources.layout.tp"][0]
    assert not Job.objects.exists()
    # The same layout in bf16 is taken: the refusal is fp8's.
    spec = fp8_spec(team, layout={"dp_shard": 4, "tp": 2})
    spec["trainer"]["precision"] = "bf16"
    assert submit(api_for, researcher, spec).status_code == 201


def test_fp8_with_sizes_a_float8_product_cannot_take_is_a_400_naming_each(
    fleet_pool, quota, team, researcher, api_for
):
    spec = fp8_spec(team)
    del spec["trainer"]["preset"]
    sizes = {"layers": 2, "dim": 72, "heads": 4, "kv_heads": 2, "ffn_dim": 192}
    spec["trainer"]["model"] = {**sizes, "vocab_size": 256, "max_seq_len": 512}
    spec["trainer"]["seq_len"] = 200

    answer = submit(api_for, researcher, spec)

    assert answer.status_code == 400, answer.content
    details = answer.json()["error"]["details"]
    assert details["trainer.model"] == [
        "precision fp8 needs multiples of 16: dim 72 is not.",
        "precision fp8 needs multiples of 16: heads × head_dim 72 is not.",
        "precision fp8 needs multiples of 16: kv_heads × head_dim 36 is not.",
    ]
    assert details["trainer.seq_len"] == [
        "precision fp8 needs multiples of 16: seq_len 200 is not."
    ]
    assert not Job.objects.exists()
    spec["trainer"]["precision"] = "bf16"  # bf16 takes any sizes
    assert submit(api_for, researcher, spec).status_code == 201


def test_the_estimate_refuses_what_submit_does_and_suggests_no_tp_for_fp8(
    fleet_pool, quota, team, researcher, api_for
):
    client = api_for(researcher)
    refused = client.post("/api/v1/jobs/estimate/", fp8_spec(team, gpu_type="A100"), format="json")
    assert refused.status_code == 400, refused.content
    assert "resources.gpu_type" in refused.json()["error"]["details"]

    (h100,) = client.post("/api/v1/jobs/estimate/", fp8_spec(team), format="json").json()
    assert h100["chosen"]["layout"] == "1x8x1x1" and h100["chosen"]["fit"] == "fits"
    tps = {layout["layout"].split("x")[2] for layout in h100["layouts"]}
    assert tps == {"1"}  # bf16 would offer tp 2 too (tiny has 4 heads)
    spec = fp8_spec(team)
    spec["trainer"]["precision"] = "bf16"
    (bf16,) = client.post("/api/v1/jobs/estimate/", spec, format="json").json()
    assert "2" in {layout["layout"].split("x")[2] for layout in bf16["layouts"]}


def test_the_submit_page_offers_fp8_and_puts_its_refusals_on_their_fields(
    client, fleet_pool, quota, team, researcher
):
    client.force_login(researcher)
    html = client.get("/jobs/submit/").content.decode()
    assert '<option value="fp8">fp8 (H100/H200)</option>' in html

    response = client.post("/jobs/submit/", form_data(team, precision="fp8", gpu_type="ANY"))
    errors = field_errors_of(response.content.decode())
    assert errors == {"gpu_type": [f"{TENSOR_CORES} (Any may land on a GPU without them)."]}

    response = client.post("/jobs/submit/", form_data(team, precision="fp8", layout="1x4x2x1"))
    errors = field_errors_of(response.content.decode())
    assert list(errors) == ["layout"] and "without tensor parallelism" in errors["layout"][0]
    assert not Job.objects.exists()

    response = client.post("/jobs/submit/", form_data(team, precision="fp8"))
    assert response.status_code == 302, field_errors_of(response.content.decode())
    assert Job.objects.get().spec["trainer"]["precision"] == "fp8"


def test_the_submit_pages_layouts_follow_the_precision(client, researcher):
    client.force_login(researcher)
    query = {"preset": "tiny", "gpus": "8", "gpus_per_node": "8"}

    def tps(precision: str) -> set[str]:
        html = client.get("/jobs/submit/layouts/", {**query, "precision": precision})
        values = re.findall(r'<option value="([^"]*)"', html.content.decode())
        return {value.split("x")[2] for value in values if value}

    assert tps("bf16") == {"1", "2"}  # tp must divide tiny's 2 KV heads
    assert tps("fp8") == {"1"}
    page = client.get("/jobs/submit/").content.decode()
    assert page.count("[name=precision]") >= 5  # every control that asks for the layouts


def test_the_api_schema_documents_fp8(client):
    schema = client.get("/api/schema/", {"format": "json"}).json()
    schemas = schema["components"]["schemas"]
    precision = schemas["TrainerRequest"]["properties"]["precision"]
    assert precision["allOf"] == [{"$ref": "#/components/schemas/PrecisionEnum"}]
    assert schemas["PrecisionEnum"]["enum"] == ["bf16", "fp32", "fp8"]
    assert (
        "needs FP8 tensor cores (gpu_type H100 or H200) and layout.tp 1"
        in (precision["description"])
    )
