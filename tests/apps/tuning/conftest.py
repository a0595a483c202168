"""Pools that say what their nodes talk over: owned InfiniBand racks and an AWS p5 pool on EFA."""

import pytest

from apps.accounts import services as accounts
from apps.fleet import services as fleet
from tests import factories
from tests.apps.fleet.test_services import ready_node

NCCL = "2.26.2"


@pytest.fixture
def ib_pool(db):
    site = factories.make_site(slug="nccl-site")
    rack = factories.make_rack(site=site, name="N1")
    pool = factories.make_owned_pool(
        site=site, slug="ib-h100", fabric="infiniband", nccl_version=NCCL
    )
    for unit in range(4):
        ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4, gpu_count=8)
    return pool


@pytest.fixture
def efa_pool(db):
    return fleet.pool_create(
        name="AWS p5",
        slug="aws-p5",
        kind="cloud",
        gpu_type="H100",
        region="us-east-1",
        max_nodes=4,
        enabled=True,
        fabric="efa",
        nccl_version=NCCL,
        instance_types=[factories.instance_type("p5.48xlarge")],
        by=None,
    )


@pytest.fixture
def h100_quota(team):
    return accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
