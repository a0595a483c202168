"""`make run`'s demo training: a dataset prepared from this repository's own text through the
real `tokenizers` library, registered for foundation, and one small trainer job queued by bob
through the submit service; a second start adds nothing."""

import json
import stat

import pytest
from django.core.management import call_command

from apps.accounts import services as accounts
from apps.accounts.models import TeamRole
from apps.jobs.models import Dataset, Job, JobState
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo_team(fleet_pool):
    team = factories.make_team(slug="foundation")
    alice, bob = factories.make_user(username="alice"), factories.make_user(username="bob")
    factories.make_member(team=team, role=TeamRole.ADMIN, user=alice)
    factories.make_member(team=team, user=bob)
    accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=32, by=None)
    return team


def test_the_demo_registers_its_dataset_and_queues_one_training_job(demo_team, settings, tmp_path):
    settings.VAR_DIR = tmp_path
    call_command("demo_training")

    dataset = Dataset.objects.get(team=demo_team, name="demo-docs")
    where = tmp_path / "datasets" / "demo-docs"
    assert dataset.uri == str(where)
    index = json.loads((where / "index.json").read_text())
    assert index["tokenizer"]["vocab_size"] <= 2048
    assert index["splits"]["train"]["tokens"] > 100_000
    assert index["splits"]["validation"]["tokens"] > 1_000  # what the job's eval reads
    # The jobs' own users read it in place: every file readable, every directory passable.
    for path in [where, *where.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o005 == (0o005 if path.is_dir() else 0o004)
    assert not (tmp_path / "datasets" / "demo-work").exists()

    job = Job.objects.get(team=demo_team)
    assert job.state == JobState.PENDING
    assert job.submitted_by.username == "bob"
    trainer = job.spec["trainer"]
    assert trainer["data"]["mixture"] == [{"dataset": "demo-docs", "weight": 1}]
    assert trainer["eval"]["every"] > 0 and trainer["steps"] % trainer["eval"]["every"] == 0

    call_command("demo_training")
    assert Job.objects.filter(team=demo_team).count() == 1
    assert Dataset.objects.filter(team=demo_team).count() == 1


def test_the_demo_training_needs_the_demo_fleet_first(db, settings, tmp_path):
    from django.core.management.base import CommandError

    settings.VAR_DIR = tmp_path
    with pytest.raises(CommandError, match="demo_fleet"):
        call_command("demo_training")
    assert not Dataset.objects.exists() and not Job.objects.exists()
