"""One world for the access tests: two teams, a person in every role, a token of every scope
for each, and an object of every kind the API serves (one per team where it has a team).

Built once per module inside a transaction that is rolled back at the end; each test runs
in a savepoint of it (pytest-django's `db`), so a write a test lets through is undone.
"""

import datetime as dt
from dataclasses import dataclass, field
from decimal import Decimal

import pytest
from django.conf import settings
from django.db import transaction
from django.middleware.csrf import get_token
from django.test import Client, RequestFactory
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.models import AuditEvent, Membership, OrgRoleName, TeamRole
from apps.accounts.secrets import encrypt
from apps.checkpoints import services as checkpoints
from apps.checkpoints.models import CheckpointCopy
from apps.costs import services as costs
from apps.costs.models import (
    BudgetAlert,
    CloudPrice,
    OwnedPrice,
    PoolDiscount,
    SpotPrice,
    UsageEntry,
)
from apps.fleet import services as fleet
from apps.fleet.agents import node_agent_token_issue
from apps.fleet.models import NodeEvent, OrphanInstance
from apps.jobs import datasets
from apps.jobs import services as jobs
from apps.jobs.models import Webhook
from apps.jobs.tuning_runs import tuning_run_start
from apps.tuning import services as tuning
from tests import factories
from tests.apps.fleet.test_services import ready_node
from tests.apps.jobs.conftest import trainer_spec

# Who asks. A service account acts through tokens only; anonymous has no credentials.
ANON = "anonymous"
VIEWER = "viewer"
RESEARCHER = "researcher"
TEAM_ADMIN = "team_admin"
SERVICE = "service_account"
OPS = "ops"
FINANCE = "finance"
SUPER = "superuser"
TEAM_ROLES = frozenset({VIEWER, RESEARCHER, TEAM_ADMIN, SERVICE})
ORG_ROLES = frozenset({OPS, FINANCE, SUPER})
SIGNED_IN = TEAM_ROLES | ORG_ROLES
ROLES = (ANON, VIEWER, RESEARCHER, TEAM_ADMIN, SERVICE, OPS, FINANCE, SUPER)
SCOPES = ("read", "submit", "admin")
# The kinds of object the world holds one of per team (the rest, one in all).
TEAMED = frozenset(
    {
        "team",
        "team-quota",
        "membership",
        "service-account",
        "token",
        "audit-event",
        "team-secret",
        "job",
        "checkpoint-job",
        "checkpoint",
        "checkpoint-copy",
        "webhook",
        "dataset",
        "budget",
        "budget-alert",
        "usage",
        "checkpoint-s3-destination",
    }
)


@dataclass
class World:
    alpha: object  # the team the team roles belong to
    beta: object  # another team
    users: dict = field(default_factory=dict)  # role -> user
    tokens: dict = field(default_factory=dict)  # (role, scope) -> secret
    objects: dict = field(default_factory=dict)  # (basename, "own" | "other") -> pk
    node_token: str = ""
    sessions: dict = field(default_factory=dict)  # role -> session key (no service account)
    csrf_cookie: str = ""
    csrf_token: str = ""
    ids: dict = field(default_factory=dict)  # what request bodies refer to


def _people(world: World) -> None:
    alpha, beta = world.alpha, world.beta
    world.users[VIEWER] = factories.make_member(team=alpha, role=TeamRole.VIEWER)
    world.users[RESEARCHER] = factories.make_member(team=alpha, role=TeamRole.RESEARCHER)
    world.users[TEAM_ADMIN] = factories.make_member(team=alpha, role=TeamRole.ADMIN)
    world.users[SERVICE] = accounts.service_account_create(team=alpha, name="ci", by=None).user
    world.users[OPS] = factories.make_org_user(role=OrgRoleName.OPS)
    world.users[FINANCE] = factories.make_org_user(role=OrgRoleName.FINANCE)
    world.users[SUPER] = factories.make_user(is_superuser=True, is_staff=True)
    for role, user in world.users.items():
        for scope in SCOPES:
            _, secret = accounts.api_token_create(user=user, name=scope, scopes=[scope], by=None)
            world.tokens[role, scope] = secret
        if role != SERVICE:  # a service account acts through tokens only
            client = Client()
            client.force_login(user)
            world.sessions[role] = client.cookies[settings.SESSION_COOKIE_NAME].value
    blank = RequestFactory().get("/")
    world.csrf_token = get_token(blank)
    world.csrf_cookie = blank.META["CSRF_COOKIE"]

    # Targets that are nobody's credentials, so a write through them cannot lock a role out.
    factories.make_member(team=beta, role=TeamRole.ADMIN)
    world.ids["beta_researcher"] = factories.make_member(team=beta, role=TeamRole.RESEARCHER)
    world.ids["outsider"] = factories.make_user().get_username()
    for key, team in (("own", alpha), ("other", beta)):
        member = factories.make_member(team=team, role=TeamRole.RESEARCHER)
        world.objects["membership", key] = Membership.objects.get(user=member).pk
        spare = accounts.service_account_create(
            team=team, name="spare", role=TeamRole.VIEWER, by=None
        )
        world.objects["service-account", key] = spare.pk
        token, _ = accounts.api_token_create(user=spare.user, name="t", scopes=["read"], by=None)
        world.objects["token", key] = token.pk
        world.objects["team", key] = team.pk
        world.objects["team-quota", key] = accounts.team_quota_set(
            team=team, gpu_type="H100", max_gpus=64, by=None
        ).pk
        world.objects["team-secret", key] = accounts.team_secret_set(
            team=team, name="HF_TOKEN", value="hf_secret", by=None
        ).pk
        # The newest of the team's audit rows (the secret just set).
        world.objects["audit-event", key] = (
            AuditEvent.objects.filter(team=team).order_by("-id").values_list("id", flat=True)[0]
        )


def _fleet(world: World) -> None:
    site = factories.make_site(slug="sec-site")
    rack = factories.make_rack(site=site, name="S1")
    pool = factories.make_owned_pool(site=site, slug="sec-h100")
    for unit in range(2):
        ready_node(pool=pool, rack=rack, rack_unit=1 + unit * 4, gpu_count=8)
    p5 = factories.instance_type("p5.48xlarge")
    cloud = fleet.pool_create(
        by=None,
        name="sec-aws",
        slug="sec-aws",
        kind="cloud",
        gpu_type="H100",
        region="us-east-1",
        max_nodes=4,
        instance_types=[p5],
    )
    node = ready_node(pool=pool, rack=rack, rack_unit=20, gpu_count=8, name="sec-target")
    instance_type = fleet.instance_type_create(
        by=None,
        name="x9.sec",
        gpu_type="H100",
        gpu_count=8,
        gpu_memory_gib=80,
        vcpus=96,
        memory_gib=1024,
        network_gbps=400,
    )
    now = timezone.now()
    orphan = OrphanInstance.objects.create(
        instance_id="i-0123456789abcdef0",
        region="us-east-1",
        instance_state="running",
        action="reported",
        first_seen_at=now,
        last_seen_at=now,
    )
    world.node_token = node_agent_token_issue(node=node)
    world.ids.update(site=site.pk, pool=pool.pk, cloud_pool=cloud.pk, node=node.pk, p5=p5.pk)
    world.objects.update(
        {
            ("site", "own"): site.pk,
            ("rack", "own"): rack.pk,
            ("pool", "own"): pool.pk,
            ("node", "own"): node.pk,
            ("instance-type", "own"): instance_type.pk,
            ("gpu", "own"): fleet.gpu_create(by=None, node=node, index=0).pk,
            ("node-event", "own"): NodeEvent.objects.filter(node=node).values_list("pk")[0][0],
            ("orphan-instance", "own"): orphan.pk,
            ("reservation", "own"): jobs.reservation_create(
                by=None,
                name="window",
                team=None,
                reason="maintenance",
                nodes=[node],
                starts_at=now + dt.timedelta(days=30),
                ends_at=now + dt.timedelta(days=31),
            ).pk,
            ("nccl-profile", "own"): tuning.nccl_profile_create(
                by=None, name="sec-custom", title="Custom", fabric="infiniband", env={}
            ).pk,
        }
    )
    # A team's destination names where its checkpoints can be read: the team's and another's.
    for key, team in (("own", world.alpha), ("other", world.beta)):
        world.objects["checkpoint-s3-destination", key] = checkpoints.s3_destination_create(
            by=None, team=team, bucket=f"sec-{key}-checkpoints"
        ).pk
    checkpoints.s3_destination_create(by=None, pool=pool, bucket="sec-pool-checkpoints")
    # A queued tuning run on the pool's nodes (adopting or declining it is a 409, cancelling
    # it is allowed: either way, past the permission).
    world.objects["tuning-run", "own"] = tuning_run_start(
        pool=pool.slug, by=world.users[OPS], team=world.alpha.slug, sizes=[2**20], limit=2
    ).pk


def _jobs(world: World) -> None:
    now = timezone.now()
    submitters = {"own": world.users[RESEARCHER], "other": world.ids["beta_researcher"]}
    for key, team in (("own", world.alpha), ("other", world.beta)):
        spec = trainer_spec(
            team, preset="tiny", nodes=1, gpus_per_node=8, layout={"dp_shard": 8}, seq_len=256
        )
        job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=submitters[key])
        checkpoint = factories.make_checkpoint(job=job, state="verified", committed_at=now)
        copies = [
            CheckpointCopy.objects.create(
                checkpoint=checkpoint, kind="shared", location=f"/ckpt/{key}/{n}", state="verified"
            )
            for n in range(2)
        ]
        hook = Webhook.objects.create(
            team=team, url="https://hooks.example.com/done", signing_key=encrypt("key")
        )
        dataset = datasets.dataset_register(
            team=team,
            name="sec-data",
            uri=f"/shared/data/{key}",
            index={
                "tokenizer": {"name": "bytes", "vocab_size": 256},
                "shards": [{"file": "a.bin", "sha256": "0" * 64, "tokens": 1}],
            },
            by=None,
        )
        budget, _ = costs.budget_set(team=team, monthly_limit=Decimal("1000.00"), by=None)
        alert = BudgetAlert.objects.create(
            team=team,
            month=now.date().replace(day=1),
            threshold=50,
            spent=Decimal("500"),
            monthly_limit=Decimal("1000.00"),
            at=now,
        )
        usage = UsageEntry.objects.create(
            node_id=world.ids["node"],
            pool_id=world.ids["pool"],
            team=team,
            job_id=job.pk,
            kind="job",
            capacity_type="owned",
            gpus=8,
            node_gpus=8,
            start=now - dt.timedelta(hours=1),
            end=now,
            day=now.date(),
            rate_per_hour=Decimal("10"),
            amount=Decimal("10"),
            price_ref="test",
            recorded_at=now,
        )
        world.objects.update(
            {
                ("job", key): job.pk,
                ("checkpoint-job", key): job.pk,
                ("checkpoint", key): checkpoint.pk,
                ("checkpoint-copy", key): copies[0].pk,
                ("webhook", key): hook.pk,
                ("dataset", key): dataset.pk,
                ("budget", key): budget.pk,
                ("budget-alert", key): alert.pk,
                ("usage", key): usage.pk,
            }
        )


def _prices(world: World) -> None:
    since = timezone.now() - dt.timedelta(days=10)
    pool, cloud = world.ids["pool"], world.ids["cloud_pool"]
    p5 = world.ids["p5"]
    world.objects["owned-price", "own"] = costs.price_create(
        model=OwnedPrice,
        by=None,
        pool_id=pool,
        effective_from=since,
        purchase_price=Decimal("300000"),
        depreciation_months=48,
        electricity_per_kwh=Decimal("0.12"),
        pue=Decimal("1.30"),
        overhead_per_month=Decimal("1460"),
        default_power_w=10000,
        source="test",
    ).pk
    world.objects["cloud-price", "own"] = costs.price_create(
        model=CloudPrice,
        by=None,
        instance_type_id=p5,
        region="us-east-1",
        effective_from=since,
        per_hour=Decimal("55.04"),
        source="test",
    ).pk
    world.objects["pool-discount", "own"] = costs.price_create(
        model=PoolDiscount, by=None, pool_id=cloud, effective_from=since, percent=Decimal("10")
    ).pk
    world.objects["spot-price", "own"] = SpotPrice.objects.create(
        instance_type_id=p5,
        region="us-east-1",
        availability_zone="us-east-1a",
        effective_at=since,
        per_hour=Decimal("20"),
    ).pk


def build_world() -> World:
    world = World(
        alpha=factories.make_team(slug="sec-alpha"), beta=factories.make_team(slug="sec-beta")
    )
    _people(world)
    _fleet(world)
    _jobs(world)
    _prices(world)
    assert {kind for kind, key in world.objects if key == "other"} == TEAMED
    return world


@pytest.fixture(scope="module")
def world(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), transaction.atomic():
        built = build_world()
        yield built
        transaction.set_rollback(True)
