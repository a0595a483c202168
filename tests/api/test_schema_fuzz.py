"""Schemathesis against the live server, as every role: no 5xx and no answer outside the schema.

Bounded and deterministic: a fixed seed and a fixed number of examples per operation.
Each role reads a team's job and checkpoint (so list and detail answers have rows for the
response-schema check to hold against) and is refused what the role may not do.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client

from apps.accounts import services
from apps.accounts.models import OrgRoleName, TeamRole
from apps.jobs import services as jobs
from tests import factories
from tests.apps.fleet.test_services import ready_node
from tests.apps.jobs.conftest import trainer_spec

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
    ]
)
MAX_EXAMPLES = os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "8")


def _user(role: str, team):
    """Someone in `role` (team roles in `team`), and the user its token is made for."""
    if role == "superuser":
        user = factories.make_user(username="fuzzer", is_superuser=True, is_staff=True)
        factories.make_member(team=team, role=TeamRole.ADMIN, user=user)
        return user
    if role in OrgRoleName.values:
        return factories.make_org_user(role=role)
    if role == "service_account":
        return services.service_account_create(team=team, name="ci", by=None).user
    return factories.make_member(team=team, role=role)


def _seed(team) -> None:
    """A pending job (no pool yet) and a checkpoint whose copy is on shared storage (no
    node): the rows whose nulls the schema must allow."""
    site = factories.make_site(slug="fuzz-site")
    pool = factories.make_owned_pool(site=site, slug="fuzz-h100")
    ready_node(pool=pool, rack=factories.make_rack(site=site), gpu_count=8)
    services.team_quota_set(team=team, gpu_type="H100", max_gpus=64, by=None)
    submitter = factories.make_member(team=team, role=TeamRole.RESEARCHER)
    spec = trainer_spec(
        team, preset="tiny", nodes=1, gpus_per_node=8, layout={"dp_shard": 8}, seq_len=256
    )
    job, _ = jobs.job_submit(team=team, spec=spec, submitted_by=submitter)
    factories.make_checkpoint(job=job, location="/ckpt/step-10")


# The superuser calls every operation, every write path included: the coverage phase's
# valid boundary cases (positive only, see schemathesis.toml) and a random run of valid and
# invalid requests; every other role a shorter random run, enough to meet its refusals and
# its reads.
@pytest.mark.parametrize(
    ("role", "examples", "phases"),
    [
        ("superuser", MAX_EXAMPLES, "examples,coverage,fuzzing"),
        ("ops", "2", "fuzzing"),
        ("finance", "2", "fuzzing"),
        (TeamRole.ADMIN.value, "2", "fuzzing"),
        (TeamRole.RESEARCHER.value, "4", "fuzzing"),
        (TeamRole.VIEWER.value, "2", "fuzzing"),
        ("service_account", "2", "fuzzing"),
    ],
)
def test_the_api_survives_schemathesis(role, examples, phases, live_server, tmp_path):
    team = factories.make_team(slug="fuzzed")
    user = _user(role, team)
    _, secret = services.api_token_create(user=user, name="fuzz", scopes=["admin"], by=None)
    _seed(team)

    # Read here, with no clock on it: under load the schema takes longer to build than
    # schemathesis waits for it.
    schema = tmp_path / "schema.yaml"
    schema.write_bytes(Client().get("/api/schema/").content)
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [
            str(st),
            "--config-file",
            str(Path(__file__).with_name("schemathesis.toml")),
            "run",
            str(schema),
            "--url",
            live_server.url,
            "--header",
            f"Authorization: Bearer {secret}",
            "--checks",
            CHECKS,
            "--max-examples",
            examples,
            "--seed",
            "20261201",
            "--workers",
            "1",  # schemathesis's coverage phase is not thread-safe on Python 3.11
            "--phases",
            phases,
            "--request-timeout",
            "20",
            "--no-shrink",
            "--suppress-health-check",
            "all",
            "--output-truncate",
            "true",
            "--warnings",
            "off",  # missing test data and the like: advice, not failures
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "NO_COLOR": "1"},
    )
    report = result.stdout
    start = report.find("FAILURES")
    assert result.returncode == 0, (report[start:][:12000] if start >= 0 else report[-12000:]) + (
        result.stderr[-2000:]
    )
