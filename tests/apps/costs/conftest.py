"""Nodes with known lives and prices, and a metering run with allocations handed in."""

import datetime as dt
from decimal import Decimal

import pytest

from apps.costs import selectors, services
from apps.costs.models import CloudPrice, OwnedPrice, PoolDiscount, SpotPrice
from apps.costs.services import Held
from apps.fleet import services as fleet
from apps.fleet.models import Node, NodeEvent, NodeState
from tests import factories
from tests.apps.jobs import conftest as jobs_fixtures

# The jobs tests' small owned fleet (four ready 8-GPU nodes) and quota, for jobs that cost.
fleet_pool = jobs_fixtures.fleet_pool
quota = jobs_fixtures.quota

T0 = dt.datetime(2026, 11, 2, 0, 0, tzinfo=dt.UTC)


def at(hours: float) -> dt.datetime:
    return T0 + dt.timedelta(hours=hours)


@pytest.fixture(autouse=True)
def _budget_state_forgotten():
    """The budget boundary keeps its answer a few seconds in-process: not across tests."""
    selectors.forget_budget_state()
    yield
    selectors.forget_budget_state()


def owned_pool(slug: str = "owned-h100"):
    return factories.make_owned_pool(slug=slug)


def cloud_pool(slug: str = "aws-p5", region: str = "us-east-1", **extra):
    return fleet.pool_create(
        by=None,
        name=slug,
        slug=slug,
        kind="cloud",
        gpu_type="H100",
        region=region,
        max_nodes=8,
        instance_types=[factories.instance_type("p5.48xlarge")],
        **extra,
    )


def owned_node(pool, *, since: dt.datetime = T0, gpus: int = 8, power_w=None, **extra) -> Node:
    node = factories.make_node(pool=pool, gpu_count=gpus, nameplate_power_w=power_w, **extra)
    Node.objects.filter(pk=node.pk).update(created_at=since)
    return Node.objects.get(pk=node.pk)


def cloud_node(pool, *, launched: dt.datetime | None = T0, capacity: str = "on_demand") -> Node:
    node = factories.make_node(
        pool=pool,
        provider="aws",
        capacity_type=capacity,
        instance_type=factories.instance_type("p5.48xlarge"),
    )
    Node.objects.filter(pk=node.pk).update(created_at=launched or T0, launched_at=launched)
    return Node.objects.get(pk=node.pk)


def terminate(node: Node, when: dt.datetime) -> None:
    """The node's TERMINATED event, at `when` (what ends a node's cost)."""
    NodeEvent.objects.create(
        node=node,
        at=when,
        from_state=NodeState.TERMINATING,
        to_state=NodeState.TERMINATED,
        reason="test",
        actor_label="test",
    )
    NodeEvent.objects.filter(node=node, to_state=NodeState.TERMINATED).update(at=when)


def owned_price(pool, *, since: dt.datetime = T0, **terms) -> OwnedPrice:
    values = {
        "purchase_price": Decimal("300000"),
        "depreciation_months": 48,
        "electricity_per_kwh": Decimal("0.12"),
        "pue": Decimal("1.30"),
        "overhead_per_month": Decimal("1460"),
        "default_power_w": 10000,
        "source": "test",
    }
    values.update(terms)
    return services.price_create(
        model=OwnedPrice, by=None, pool=pool, effective_from=since, **values
    )


def cloud_price(per_hour, *, since: dt.datetime = T0, region: str = "us-east-1") -> CloudPrice:
    return services.price_create(
        model=CloudPrice,
        by=None,
        instance_type=factories.instance_type("p5.48xlarge"),
        region=region,
        effective_from=since,
        per_hour=Decimal(per_hour),
        source="test",
    )


def discount(pool, percent, *, since: dt.datetime = T0) -> PoolDiscount:
    return services.price_create(
        model=PoolDiscount, by=None, pool=pool, effective_from=since, percent=Decimal(percent)
    )


def spot_price(per_hour, *, when: dt.datetime, zone: str = "us-east-1a", region="us-east-1"):
    return SpotPrice.objects.create(
        instance_type=factories.instance_type("p5.48xlarge"),
        region=region,
        availability_zone=zone,
        effective_at=when,
        per_hour=Decimal(per_hour),
    )


class Allocations:
    """What the metering task reads from jobs, kept in a list: (node, job, team, GPUs, from, to)."""

    def __init__(self, rows=()):
        self.rows = [Held(*row) for row in rows]

    def add(self, node, job_id, team_id, gpus, start, end=None):
        self.rows.append(Held(node.pk, job_id, team_id, gpus, start, end))

    def __call__(self, *, node_ids, since, until):
        return [
            r
            for r in self.rows
            if r.node_id in node_ids
            and r.started_at < until
            and (r.ended_at is None or r.ended_at > since)
        ]


def meter(allocations=None, *, until: dt.datetime, **extra):
    return services.usage_meter(allocations_for=allocations or Allocations(), until=until, **extra)


@pytest.fixture
def metered(team, other_team):
    """Two teams' jobs on an owned node and a cloud node over Nov 2–3, 2026, the rest idle."""
    owned, cloud = owned_pool("fra-h100"), cloud_pool("aws-p5")
    owned_price(owned, since=at(-48))
    cloud_price("55.04", since=at(-48))
    a, b = owned_node(owned), cloud_node(cloud)
    allocations = Allocations(
        [
            (a.pk, 1, team.pk, 8, at(0), at(24)),
            (b.pk, 2, other_team.pk, 4, at(12), at(36)),
        ]
    )
    meter(allocations, until=at(48))
    return {"owned": owned, "cloud": cloud}
