"""`cpctl` against the live server, as a CI job would run it."""

import json
import os
import subprocess
import sys

import pytest

from apps.accounts import services
from apps.fleet.models import Node, NodeState
from tests.apps.fleet.test_services import ready_node

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def cpctl(live_server, token, *args):
    env = {**os.environ, "CPCTL_URL": live_server.url, "CPCTL_TOKEN": token}
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def token_of(user, scopes=("admin",)):
    return services.api_token_create(user=user, name="cli", scopes=list(scopes), by=user)[1]


def test_whoami_nodes_and_drain(live_server, ops_user):
    ready_node(name="cli-n1")
    token = token_of(ops_user)
    who = cpctl(live_server, token, "whoami")
    assert who.returncode == 0, who.stderr
    assert ops_user.username in who.stdout and "ops" in who.stdout
    listed = cpctl(live_server, token, "-o", "json", "nodes", "--state", "ready")
    assert [n["name"] for n in json.loads(listed.stdout)] == ["cli-n1"]
    drained = cpctl(live_server, token, "drain", "cli-n1", "--reason", "firmware")
    assert drained.returncode == 0, drained.stderr
    assert Node.objects.get(name="cli-n1").state == NodeState.DRAINED


def test_the_api_saying_no_is_exit_1_with_its_message(live_server, researcher):
    ready_node(name="cli-n2")
    result = cpctl(live_server, token_of(researcher), "drain", "cli-n2", "--reason", "mine")
    assert result.returncode == 1
    assert "Only ops may change the fleet." in result.stderr
    bad = cpctl(live_server, "cp_not-a-token", "whoami")
    assert bad.returncode == 1 and "Invalid token" in bad.stderr


def test_no_server_is_exit_2():
    env = {**os.environ, "CPCTL_URL": "http://127.0.0.1:9", "CPCTL_TOKEN": "x"}
    result = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", "whoami"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot reach" in result.stderr
