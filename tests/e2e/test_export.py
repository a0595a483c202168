"""Export to Hugging Face end to end: the tiny preset trained for a few steps on a local node
whose agent is a real process, its checkpoint exported through the API by that agent (the
trainer's exporter run as the job's user), and the directory loaded by transformers."""

import os
import subprocess
import sys

import pytest

from apps.checkpoints.models import Checkpoint, CheckpointExport
from apps.jobs.models import Job
from tests import factories
from tests.e2e.conftest import wait_for
from tests.e2e.test_checkpoints import _dispatch
from workers.providers import local

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]
transformers = pytest.importorskip("transformers")


@pytest.fixture
def agents_import_what_we_do(monkeypatch):
    """Where safetensors is on this process's PYTHONPATH only (not installed beside the
    agent's Python), the local agents get that path too: the exporter runs under them."""
    bare = subprocess.run(
        [sys.executable, "-c", "import safetensors"], env={"PATH": os.defpath}, check=False
    )
    if bare.returncode != 0 and os.environ.get("PYTHONPATH"):
        monkeypatch.setattr(local, "_PASSED_THROUGH", (*local._PASSED_THROUGH, "PYTHONPATH"))


def test_a_trained_checkpoint_exported_through_the_api_loads_in_transformers(
    agents_import_what_we_do, local_nodes, e2e_team, api_for
):
    pool = factories.make_owned_pool(slug="e2e-export")
    local_nodes(pool, count=1, gpus=1)
    member = factories.make_member(team=e2e_team)
    spec = {
        "name": "tiny-exported",
        "team": e2e_team.pk,
        "time_limit_s": 600,
        "trainer": {
            "preset": "tiny",
            "dataset": "synthetic",
            "steps": 4,
            "global_batch": 2,
            "seq_len": 32,
            "precision": "fp32",
        },
        "resources": {"gpu_type": "H100", "nodes": 1, "gpus_per_node": 1},
        "placement": {"where": "owned"},
    }
    api = api_for(member, scopes=("submit",))
    answer = api.post("/api/v1/jobs/", spec, format="json")
    assert answer.status_code == 201, answer.content
    job = Job.objects.get(pk=answer.json()["id"])
    _dispatch(job)
    job = wait_for(
        "the job to end",
        lambda: (j := Job.objects.get(pk=job.pk)).state in ("succeeded", "failed") and j,
        timeout_s=240,
        every_s=1.0,
    )
    assert job.state == "succeeded", job.state_reason
    checkpoint = wait_for(
        "its final checkpoint to be verified",
        lambda: Checkpoint.objects.filter(job=job, step=4, state="verified").first(),
        timeout_s=60,
    )

    asked = api.post(f"/api/v1/checkpoints/{checkpoint.pk}/export/", {}, format="json")
    assert asked.status_code == 202, asked.content
    export = wait_for(
        "the agent to export it",
        lambda: (
            (e := CheckpointExport.objects.get(pk=asked.json()["id"])).state != "requested" and e
        ),
        timeout_s=180,
        every_s=1.0,
    )
    assert export.state == "done", export.error
    detail = api.get(f"/api/v1/checkpoints/{checkpoint.pk}/").json()
    assert detail["exports"][0]["state"] == "done"
    names = {f["name"] for f in export.files}
    assert {"config.json", "model.safetensors"} <= names
    assert export.path == checkpoint.copies.get().location + "-hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(export.path)
    assert model.config.model_type == "llama"
    assert sum(p.numel() for p in model.parameters()) > 0
