"""Exports to Hugging Face: who may ask, of which checkpoints, one at a time; the node's agent
(its real CheckpointKeeper, running the trainer's real exporter) answering; the API, and the
Job page's panel with its button."""

from pathlib import Path

import pytest
from django.test import Client

from apps.checkpoints import services
from apps.checkpoints.models import Checkpoint, CheckpointCopy, CheckpointExport
from apps.jobs.models import Run
from apps.jobs.runconfig import checkpoint_dir
from controlplane.errors import ApplicationError
from tests import factories
from tests.apps.checkpoints.conftest import (
    AgentBridge,
    agent_of,
    commit_event,
    report,
    write_checkpoint,
)
from tests.conftest import token_client

pytestmark = pytest.mark.django_db


@pytest.fixture
def committed(running_job) -> Checkpoint:
    """Step 10 of the running job, reported by its agent and verified by it."""
    run = Run.objects.get(job=running_job)
    keeper = agent_of(run.node)
    path, digest = write_checkpoint(Path(checkpoint_dir(running_job)), 10, job=running_job)
    report(keeper, run, commit_event(path, digest, 10))
    keeper.poll_once()
    checkpoint = Checkpoint.objects.get(job=running_job, step=10)
    assert checkpoint.state == "verified"
    return checkpoint


def test_who_may_ask(committed, researcher, team_admin, viewer, ops_user, finance_user, other_team):
    outsider = factories.make_member(team=other_team)
    for refused in (viewer, finance_user, outsider):
        with pytest.raises(ApplicationError) as caught:
            services.checkpoint_export_request(checkpoint=committed, by=refused)
        assert caught.value.status == 403
    assert not CheckpointExport.objects.exists()
    for allowed in (researcher, team_admin, ops_user):
        export = services.checkpoint_export_request(checkpoint=committed, by=allowed)
        assert export.state == "requested"
        export.delete()


def test_one_open_export_per_checkpoint_and_what_it_asks_of_the_agent(committed, researcher):
    export = services.checkpoint_export_request(
        checkpoint=committed, by=researcher, dtype="float32"
    )
    location = committed.copies.get().location
    assert export.source == location and export.path == location + "-hf"
    assert export.node_id == committed.node_id
    with pytest.raises(ApplicationError) as caught:
        services.checkpoint_export_request(checkpoint=committed, by=researcher)
    assert (caught.value.status, caught.value.code) == (409, "export_open")
    with pytest.raises(ApplicationError) as caught:
        services.checkpoint_export_request(checkpoint=committed, by=researcher, dtype="int8")
    assert caught.value.status == 400
    work = AgentBridge(committed.node).call("GET", "/api/v1/agent/checkpoints/work")
    (item,) = work["export"]
    assert item == {
        "export": export.pk,
        "job": committed.job_id,
        "path": location,
        "out": location + "-hf",
        "manifest_sha256": committed.manifest_sha256,
        "dtype": "float32",
        "timeout_s": item["timeout_s"],
    }


def test_only_committed_or_verified_checkpoints_and_not_s3_only(committed, researcher):
    Checkpoint.objects.filter(pk=committed.pk).update(state="corrupt")
    with pytest.raises(ApplicationError) as caught:
        services.checkpoint_export_request(checkpoint=committed, by=researcher)
    assert caught.value.status == 409
    Checkpoint.objects.filter(pk=committed.pk).update(state="verified")
    committed.copies.update(state="deleted")
    CheckpointCopy.objects.create(
        checkpoint=committed, kind="s3", location="s3://b/p/step-10", state="verified"
    )
    with pytest.raises(ApplicationError) as caught:
        services.checkpoint_export_request(checkpoint=committed, by=researcher)
    assert (caught.value.status, caught.value.code) == (409, "s3_only")
    assert "S3" in caught.value.message
    assert not CheckpointExport.objects.exists()


def test_a_copy_outside_the_jobs_directory_is_refused(committed, researcher):
    committed.copies.update(location="/elsewhere/step-00000010")
    with pytest.raises(ApplicationError) as caught:
        services.checkpoint_export_request(checkpoint=committed, by=researcher)
    assert caught.value.code == "not_owned"
    assert not CheckpointExport.objects.exists()


def test_the_agent_runs_the_exporter_and_a_failure_comes_back_with_its_reason(
    committed, researcher
):
    """The test's checkpoint has no model in it: the real exporter fails, and says why."""
    export = services.checkpoint_export_request(checkpoint=committed, by=researcher)
    keeper = agent_of(committed.node)
    assert keeper.poll_once() == 1
    export.refresh_from_db()
    assert export.state == "failed" and export.finished_at
    assert "model" in export.error  # the manifest names no model shape
    # Failed: the button is offered again, and a second request is taken.
    again = services.checkpoint_export_request(checkpoint=committed, by=researcher)
    assert again.state == "requested"


def test_an_answer_is_taken_only_from_the_node_asked_and_for_the_path_asked(
    committed, researcher, fleet_pool
):
    export = services.checkpoint_export_request(checkpoint=committed, by=researcher)
    path = f"/api/v1/agent/checkpoints/exports/{export.pk}"
    files = [{"name": "model.safetensors", "size": 1000}, {"name": "config.json", "size": 10}]
    other = factories.make_node(pool=committed.node.pool, state="ready")
    answer = Client().post(
        path,
        {"ok": True, "path": export.path, "files": files},
        content_type="application/json",
        HTTP_AUTHORIZATION=AgentBridge(other)._auth,
    )
    assert answer.status_code == 404
    bridge = AgentBridge(committed.node)
    bridge.call("POST", path, {"ok": True, "path": "/etc/elsewhere", "files": files})
    export.refresh_from_db()
    assert export.state == "failed" and "another directory" in export.error
    second = services.checkpoint_export_request(checkpoint=committed, by=researcher)
    bridge.call(
        "POST",
        f"/api/v1/agent/checkpoints/exports/{second.pk}",
        {"ok": True, "path": second.path, "files": files},
    )
    second.refresh_from_db()
    assert (second.state, second.size_bytes, second.files) == ("done", 1010, files)


def test_the_api_asks_and_the_detail_shows_its_state(committed, researcher, viewer):
    api = token_client(researcher, scopes=("submit",))
    answer = api.post(
        f"/api/v1/checkpoints/{committed.pk}/export/", {"dtype": "float16"}, format="json"
    )
    assert answer.status_code == 202, answer.content
    assert answer.json()["state"] == "requested" and answer.json()["dtype"] == "float16"
    again = api.post(f"/api/v1/checkpoints/{committed.pk}/export/")
    assert again.status_code == 409 and again.json()["error"]["code"] == "export_open"
    detail = api.get(f"/api/v1/checkpoints/{committed.pk}/").json()
    (shown,) = detail["exports"]
    assert (
        shown["path"].endswith("step-00000010-hf") and shown["requested_by"] == researcher.username
    )
    refused = token_client(viewer, scopes=("submit",)).post(
        f"/api/v1/checkpoints/{committed.pk}/export/"
    )
    assert refused.status_code == 403


def test_the_panel_offers_the_button_and_shows_the_export(committed, researcher, viewer):
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(researcher)
    panel = browser.get(f"/checkpoints/jobs/{committed.job_id}/").content.decode()
    assert "Export to Hugging Face" in panel
    assert f'action="/checkpoints/{committed.pk}/export/"' in panel
    token = panel.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
    assert browser.post(f"/checkpoints/{committed.pk}/export/").status_code == 403  # no token
    answer = browser.post(f"/checkpoints/{committed.pk}/export/", {"csrfmiddlewaretoken": token})
    assert answer.status_code == 302 and answer["Location"] == f"/jobs/{committed.job_id}/"
    export = CheckpointExport.objects.get()
    panel = browser.get(f"/checkpoints/jobs/{committed.job_id}/").content.decode()
    assert 'data-export="requested"' in panel and "Export to Hugging Face" not in panel
    CheckpointExport.objects.filter(pk=export.pk).update(
        state="done", files=[{"name": "a", "size": 1}]
    )
    panel = browser.get(f"/checkpoints/jobs/{committed.job_id}/").content.decode()
    assert 'data-export="done"' in panel and export.path in panel
    assert "Export to Hugging Face" in panel  # asked again, it is written afresh
    watcher = Client()
    watcher.force_login(viewer)
    assert (
        "Export to Hugging Face"
        not in watcher.get(f"/checkpoints/jobs/{committed.job_id}/").content.decode()
    )


def test_the_checkpoints_page_offers_the_newest_verified_step_and_exports_it(
    committed, researcher, viewer
):
    """Without evaluations the page's row offers the newest verified checkpoint; the button
    asks through the same service (test_eval.py: the best one, where there is a best)."""
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(researcher)
    page = browser.get("/checkpoints/").content.decode()
    row = page[page.index(f'data-job="{committed.job_id}"') :].split("</tr>")[0]
    assert f'action="/checkpoints/{committed.pk}/export/"' in row and "Step 10 to HF" in row
    token = page.split('name="csrfmiddlewaretoken" value="')[1].split('"')[0]
    answer = browser.post(f"/checkpoints/{committed.pk}/export/", {"csrfmiddlewaretoken": token})
    assert answer.status_code == 302 and answer["Location"] == f"/jobs/{committed.job_id}/"
    (export,) = CheckpointExport.objects.all()
    assert export.checkpoint_id == committed.pk and export.state == "requested"
    watcher = Client()
    watcher.force_login(viewer)
    page = watcher.get("/checkpoints/").content.decode()
    row = page[page.index(f'data-job="{committed.job_id}"') :].split("</tr>")[0]
    assert "/export/" not in row and "to HF" not in row
