"""A small fleet the job tests submit to: one owned pool of four 8-GPU H100 nodes."""

import pytest

from apps.accounts import services as accounts
from tests import factories
from tests.apps.fleet.test_services import ready_node


@pytest.fixture
def fleet_pool(db):
    site = factories.make_site(slug="jobs-site")
    rack = factories.make_rack(site=site, name="J1")
    pool = factories.make_owned_pool(site=site, slug="h100-owned")
    for unit in range(4):
        ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4, gpu_count=8)
    return pool


@pytest.fixture
def quota(team):
    return accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=32, by=None)


@pytest.fixture
def other_member(other_team):
    """A researcher of another team, with a quota of its own."""
    accounts.team_quota_set(team=other_team, gpu_type="H100", max_gpus=32, by=None)
    return factories.make_member(team=other_team, role="researcher")


def command_spec(team, **overrides) -> dict:
    spec = {
        "name": "smoke",
        "team": team.pk,
        "time_limit_s": 3600,
        "command": {"argv": ["python", "-c", "print('hello')"], "path": "/shared/code"},
        "resources": {"gpu_type": "H100", "gpus": 8},
        "placement": {"where": "owned"},
    }
    spec.update(overrides)
    return spec


def trainer_spec(team, *, preset="8b", nodes=2, gpus_per_node=8, layout=None, **extra) -> dict:
    return {
        "name": "pretrain",
        "team": team.pk,
        "time_limit_s": 7200,
        "trainer": {
            "preset": preset,
            "dataset": "synthetic",
            "steps": 100,
            "global_batch": 64,
            "seq_len": 2048,
            **extra,
        },
        "resources": {
            "gpu_type": "H100",
            "nodes": nodes,
            "gpus_per_node": gpus_per_node,
            "layout": layout or {"dp_shard": nodes * gpus_per_node},
        },
        "placement": {"where": "owned"},
    }


def form_data(team, **overrides) -> dict:
    """A good Submit form's fields: a tiny trainer job on 8 H100s."""
    data = {
        "name": "tiny-run",
        "team": team.pk,
        "kind": "trainer",
        "preset": "tiny",
        "gpu_type": "H100",
        "gpus": 8,
        "gpus_per_node": 8,
        "layout": "",
        "priority": "normal",
        "placement": "owned",
        "time_limit_hours": "2",
        "dataset": "synthetic",
        "steps": 10,
        "global_batch": 64,
        "seq_len": 128,
        "check_memory": "on",  # as the page sends it: ticked unless unticked
    }
    data.update(overrides)
    return data
