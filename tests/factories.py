"""Test data, made through the same services the product uses (so rules apply)."""

import importlib
import itertools

from django.apps import apps as django_apps
from django.contrib.auth import get_user_model

from apps.accounts import services as accounts
from apps.accounts.models import Membership, OrgRole, Team, TeamRole
from apps.fleet import services as fleet
from apps.fleet.models import InstanceType, NodePool, Rack, Site

User = get_user_model()
_seq = itertools.count(1)

PASSWORD = "correct-horse-battery-staple"


def unique(prefix: str) -> str:
    return f"{prefix}{next(_seq)}"


def make_user(*, username: str | None = None, password: str = PASSWORD, **extra):
    return User.objects.create_user(username=username or unique("user"), password=password, **extra)


def make_team(*, slug: str | None = None, **extra) -> Team:
    slug = slug or unique("team")
    return accounts.team_create(name=extra.pop("name", slug.title()), slug=slug, by=None, **extra)


def make_member(*, team: Team, role: str = TeamRole.RESEARCHER, user=None):
    user = user or make_user()
    Membership.objects.create(team=team, user=user, role=role)
    return user


def make_org_user(*, role: str):
    user = make_user(username=unique(role))
    OrgRole.objects.create(user=user, role=role)
    return user


def make_site(**extra) -> Site:
    slug = extra.pop("slug", unique("site"))
    return fleet.site_create(name=extra.pop("name", slug.upper()), slug=slug, by=None, **extra)


def make_rack(*, site: Site | None = None, **extra) -> Rack:
    return fleet.rack_create(
        site=site or make_site(),
        name=extra.pop("name", unique("R")),
        power_budget_kw=extra.pop("power_budget_kw", "40.00"),
        by=None,
        **extra,
    )


def instance_type(name: str = "p5.48xlarge") -> InstanceType:
    """A catalogue row the fleet migration loads; loaded again when a transactional test
    before this one flushed the database (which empties migration-loaded tables)."""
    found = InstanceType.objects.filter(name=name).first()
    if found is None:
        migration = importlib.import_module("apps.fleet.migrations.0002_instance_type_catalogue")
        migration.load(django_apps, None)
        found = InstanceType.objects.get(name=name)
    return found


def make_owned_pool(*, site: Site | None = None, gpu_type: str = "H100", **extra) -> NodePool:
    slug = extra.pop("slug", unique("pool"))
    return fleet.pool_create(
        name=slug,
        slug=slug,
        kind="owned",
        gpu_type=gpu_type,
        site=site,
        max_nodes=100,
        by=None,
        **extra,
    )


def make_node(*, pool: NodePool | None = None, rack: Rack | None = None, **extra):
    pool = pool or make_owned_pool()
    fields = {
        "name": unique("node"),
        "pool": pool,
        "rack": rack,
        "provider": "local",
        "capacity_type": "owned",
        "gpu_count": 8,
    }
    fields.update(extra)
    return fleet.node_create(by=None, **fields)


def make_checkpoint(*, job, step: int = 10, location: str = "", **extra):
    """A committed checkpoint row of `job` (as the registry records a trainer's report), with
    a shared-storage copy at `location` when one is given."""
    from django.utils import timezone

    from apps.checkpoints.models import Checkpoint, CheckpointCopy

    fields = {"attempt": 1, "manifest_sha256": "0" * 64, "committed_at": timezone.now()}
    checkpoint = Checkpoint.objects.create(
        job_id=job.pk, team_id=job.team_id, step=step, **(fields | extra)
    )
    if location:
        CheckpointCopy.objects.create(checkpoint=checkpoint, kind="shared", location=location)
    return checkpoint
