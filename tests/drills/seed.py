"""What the drills start from, made through the product's own services in the drill stack's
database: a team with a quota, an ops user who is also the team's admin (with an API token),
a pool of local nodes and a pool of SSH nodes (created, not yet provisioned), and a second
team whose checkpoints a drill puts on a small disk.

Run as `python -m tests.drills.seed '<sshd as JSON>'` with the stack's environment; the
last line of its output is what it made, as JSON.
"""

import json
import sys

import django


def main(ssh: dict) -> dict:
    django.setup()
    from apps.accounts import services as accounts
    from apps.accounts.models import Membership, OrgRole, OrgRoleName, TeamRole
    from tests import factories

    ops = factories.make_user(username="drill-ops")
    OrgRole.objects.create(user=ops, role=OrgRoleName.OPS)
    teams = {}
    for slug in ("drills", "tight"):
        team = factories.make_team(slug=slug)
        accounts.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
        Membership.objects.create(team=team, user=ops, role=TeamRole.ADMIN)
        teams[slug] = team.pk
    _, secret = accounts.api_token_create(user=ops, name="drills", scopes=["admin"], by=ops)
    local = factories.make_owned_pool(slug="drill-local")
    remote = factories.make_owned_pool(slug="drill-ssh")
    local_nodes = [
        factories.make_node(pool=local, name=f"local-{n}", provider="local", gpu_count=2)
        for n in range(1, 4)
    ]
    ssh_nodes = [
        factories.make_node(
            pool=remote,
            name=f"ssh-{n}",
            provider="ssh",
            address="127.0.0.1",
            ssh_port=ssh["port"],
            ssh_user=ssh["user"],
            host_key=ssh["host_key"],
            gpu_count=4,
        )
        for n in range(1, 3)
    ]
    return {
        "token": secret,
        "teams": teams,
        "pools": {"local": local.slug, "ssh": remote.slug},
        "local_nodes": [n.pk for n in local_nodes],
        "ssh_nodes": [n.pk for n in ssh_nodes],
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
