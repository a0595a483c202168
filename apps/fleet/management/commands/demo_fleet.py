"""Load the demo fleet for `make run`: one site, two racks of local nodes, an AWS pool,
three teams and a user for each role. Safe to run again: it adds only what is missing."""

import json
import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction

from apps.accounts import services as accounts
from apps.accounts.context import Origin, acting_from
from apps.accounts.models import Membership, OrgRole, ServiceAccount, Team, TeamRole
from apps.fleet import services as fleet
from apps.fleet.models import Gpu, InstanceType, Node, NodePool, Rack, Site

User = get_user_model()

TEAMS = [
    ("Foundation models", "foundation", 32),
    ("Speech", "speech", 16),
    ("Vision", "vision", 16),
]
# username, what they are, how
PEOPLE = [
    ("admin", "superuser", None),
    ("ops", "ops (runs the fleet)", ("org", "ops")),
    ("finance", "finance (reads all spend)", ("org", "finance")),
    ("alice", "admin of foundation", ("team", "foundation", TeamRole.ADMIN)),
    ("bob", "researcher in foundation", ("team", "foundation", TeamRole.RESEARCHER)),
    ("carol", "viewer in foundation", ("team", "foundation", TeamRole.VIEWER)),
    ("dan", "researcher in speech", ("team", "speech", TeamRole.RESEARCHER)),
    ("erin", "admin of vision", ("team", "vision", TeamRole.ADMIN)),
]
RACKS = [("A1", "hall 1, row A, slot 1"), ("A2", "hall 1, row A, slot 2")]
# What the pools' nodes talk over and which NCCL they run, until nodes report their own.
DEMO_NCCL_VERSION = "2.26.2"
NODES_PER_RACK = 3
SLOTS_PER_NODE = 8  # the local provider's "GPUs" are CPU slots on this machine


def logins_path() -> Path:
    return Path(settings.DEMO_LOGINS_PATH)


def aws_configured() -> bool:
    return bool(os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"))


class Command(BaseCommand):
    help = "Load the demo fleet, teams and users (idempotent)."

    def handle(self, *args, **options):
        with acting_from(Origin(channel="cli", label="demo_fleet")), transaction.atomic():
            passwords = self._people()
            self._teams()
            self._memberships()
            self._fleet()
        # Local nodes are processes of this machine: agents gone since the last run start again.
        self._revive_local_nodes()
        path = logins_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        known = json.loads(path.read_text()) if path.exists() else {}
        known.update(passwords)
        path.write_text(json.dumps(known, indent=2))
        path.chmod(0o600)
        self.stdout.write(
            f"demo fleet: {Node.objects.count()} nodes, {Team.objects.count()} teams, "
            f"{User.objects.count()} users (logins in {path})"
        )

    def _people(self) -> dict:
        passwords = {}
        for username, _, _ in PEOPLE:
            if User.objects.filter(username=username).exists():
                continue
            password = secrets.token_urlsafe(9)
            User.objects.create_user(
                username=username,
                password=password,
                is_staff=username == "admin",
                is_superuser=username == "admin",
            )
            passwords[username] = password
        return passwords

    def _teams(self):
        for name, slug, h100 in TEAMS:
            team = Team.objects.filter(slug=slug).first() or accounts.team_create(
                name=name, slug=slug, description=f"Demo team {name}.", by=None
            )
            accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=h100, by=None)
        foundation = Team.objects.get(slug="foundation")
        if not ServiceAccount.objects.filter(team=foundation, name="ci").exists():
            accounts.service_account_create(
                team=foundation, name="ci", description="The CI pipeline.", by=None
            )

    def _memberships(self):
        for username, _, how in PEOPLE:
            user = User.objects.get(username=username)
            if how is None:
                continue
            if how[0] == "org" and not OrgRole.objects.filter(user=user, role=how[1]).exists():
                accounts.org_role_grant(user=user, role=how[1], by=None)
            if how[0] == "team":
                team = Team.objects.get(slug=how[1])
                if not Membership.objects.filter(user=user, team=team).exists():
                    accounts.membership_create(team=team, user=user, role=how[2], by=None)

    def _fleet(self):
        site = Site.objects.filter(slug="fra1").first() or fleet.site_create(
            name="Frankfurt DC1", slug="fra1", location="Frankfurt am Main", by=None
        )
        pool = NodePool.objects.filter(slug="fra1-h100").first() or fleet.pool_create(
            name="fra1 H100 (owned)",
            slug="fra1-h100",
            kind="owned",
            gpu_type="H100",
            site=site,
            min_nodes=0,
            max_nodes=16,
            fabric="infiniband",
            nccl_version=DEMO_NCCL_VERSION,
            by=None,
        )
        self._record_fabric(pool, "infiniband")
        for rack_name, position in RACKS:
            rack = Rack.objects.filter(site=site, name=rack_name).first() or fleet.rack_create(
                site=site, name=rack_name, position=position, power_budget_kw="45.00", by=None
            )
            for n in range(1, NODES_PER_RACK + 1):
                name = f"fra1-{rack_name.lower()}-n{n}"
                if Node.objects.filter(name=name).exists():
                    continue
                node = fleet.node_create(
                    name=name,
                    pool=pool,
                    rack=rack,
                    rack_unit=1 + (n - 1) * 6,
                    provider="local",
                    capacity_type="owned",
                    gpu_type="H100",
                    gpu_count=SLOTS_PER_NODE,
                    nameplate_power_w=10200,
                    by=None,
                )
                Gpu.objects.bulk_create(
                    Gpu(node=node, index=i, model="local CPU slot", memory_mib=0)
                    for i in range(SLOTS_PER_NODE)
                )
        cloud = NodePool.objects.filter(slug="aws-use1-p5").first()
        if cloud is not None:
            self._record_fabric(cloud, "efa")
        else:
            fleet.pool_create(
                name="AWS us-east-1 p5",
                slug="aws-use1-p5",
                kind="cloud",
                gpu_type="H100",
                region="us-east-1",
                min_nodes=0,
                max_nodes=4,
                burst_delay_s=600,
                idle_timeout_s=900,
                enabled=aws_configured(),
                instance_types=[InstanceType.objects.get(name="p5.48xlarge")],
                fabric="efa",
                nccl_version=DEMO_NCCL_VERSION,
                by=None,
            )

    def _revive_local_nodes(self) -> None:
        from controlplane.celery import app

        try:
            app.send_task("fleet.local_nodes_revive")
        except Exception as exc:  # the demo still starts; nodes come back when asked again
            self.stderr.write(f"could not ask for local nodes to be revived: {exc}")

    def _record_fabric(self, pool, fabric: str) -> None:
        """Pools made before pools recorded their fabric get it now."""
        if not pool.fabric:
            fleet.pool_update(pool=pool, fabric=fabric, nccl_version=DEMO_NCCL_VERSION, by=None)
