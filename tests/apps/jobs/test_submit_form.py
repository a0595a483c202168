"""The Submit page offers everything the API's submit spec does, through the same serializer
and service, and puts each refusal on the field that made it."""

import datetime as dt
import re
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework import serializers

from apps.accounts import services as accounts
from apps.jobs.api.serializers import JobSubmitSerializer
from apps.jobs.forms import SPEC_FIELDS, SubmitForm
from apps.jobs.models import Job
from tests import factories
from tests.apps.costs.conftest import owned_price
from tests.apps.jobs.conftest import form_data

pytestmark = pytest.mark.django_db


def spec_leaves(serializer, prefix="") -> set[str]:
    """Every field path of a (nested) serializer: `trainer.pipeline.schedule`..."""
    paths = set()
    for name, field in serializer.fields.items():
        path = f"{prefix}{name}"
        if isinstance(field, serializers.Serializer):
            paths |= spec_leaves(field, f"{path}.")
        else:
            paths.add(path)
    return paths


def test_every_field_of_the_apis_spec_has_a_field_on_the_form():
    leaves = spec_leaves(JobSubmitSerializer())
    assert "trainer.pipeline.stages_per_rank" in leaves and "command.git.ref" in leaves
    assert sorted(leaves - set(SPEC_FIELDS)) == []
    assert sorted(set(SPEC_FIELDS.values()) - set(SubmitForm.base_fields)) == []


def post(client, user, data):
    client.force_login(user)
    return client.post("/jobs/submit/", data)


def submitted(response) -> Job:
    assert response.status_code == 302, field_errors_of(response.content.decode())
    return Job.objects.get(pk=response["Location"].strip("/").rpartition("/")[2])


def field_errors_of(html: str) -> dict[str, list[str]]:
    """Every field's errors on the page, by the field's name; the top's under None."""
    errors = {}
    for block in re.findall(
        r'<div class="field[ "].*?(?=<div class="field[ "]|</fieldset>)', html, re.S
    ):
        name = re.search(r'name="([^"]+)"', block)
        found = re.findall(r'<span class="field-error">([^<]*)</span>', block)
        if name and found:
            errors.setdefault(name.group(1), []).extend(found)
    top = re.search(r'<div class="form-errors".*?</div>', html, re.S)
    if top:
        errors[None] = re.findall(r"<li>(.*?)</li>", top.group(0), re.S)
    return errors


@pytest.fixture
def wandb_secret(team, team_admin):
    accounts.team_secret_set(team=team, name="WANDB_API_KEY", value="k-123", by=team_admin)
    accounts.team_secret_set(team=team, name="HF_TOKEN", value="hf-456", by=team_admin)


def test_a_trainer_job_from_the_form_carries_every_trainer_setting(
    client, fleet_pool, quota, team, researcher, wandb_secret
):
    response = post(
        client,
        researcher,
        form_data(
            team,
            gpus=16,
            layout="2x4x2x1",
            min_nodes=1,
            max_cost_usd="500.00",
            restart_limit=1,
            checkpoint_every_steps=100,
            checkpoint_every_minutes=30,
            checkpoint_keep=5,
            checkpoint_keep_every=1000,
            precision="fp32",
            activation_checkpointing="full",
            compile="on",
            micro_batch=4,
            lr="0.0003",
            warmup_steps=10,
            min_lr_ratio="0.1",
            grad_clip="1.0",
            seed=7,
            collective_timeout_s=600,
            log_every=5,
            attention_backend="math",
            pipeline_schedule="1f1b",
            pipeline_microbatches=4,
            env="WANDB_PROJECT=pretrain\nEMPTY=\n\nQUOTED=a=b c",
            secrets=["WANDB_API_KEY", "HF_TOKEN"],
            nccl_overrides="NCCL_ALGO=Ring",
            nccl_reasons="NCCL_ALGO=Tree hangs on 2.26 here",
        ),
    )

    job = submitted(response)
    spec = job.spec
    assert (job.max_cost_usd, job.restart_limit, job.min_nodes) == (Decimal("500.00"), 1, 1)
    assert (job.nodes, job.dp_replicate, job.dp_shard, job.tp) == (2, 2, 4, 2)
    assert spec["trainer"] == {
        "preset": "tiny",
        "dataset": "synthetic",
        "steps": 10,
        "global_batch": 64,
        "seq_len": 128,
        "precision": "fp32",
        "activation_checkpointing": "full",
        "compile": True,
        "check_memory": True,
        "checkpoint_every_steps": 100,
        "checkpoint_every_minutes": 30,
        "checkpoint_keep": 5,
        "checkpoint_keep_every": 1000,
        "micro_batch": 4,
        "lr": 0.0003,
        "warmup_steps": 10,
        "min_lr_ratio": 0.1,
        "grad_clip": 1.0,
        "seed": 7,
        "collective_timeout_s": 600,
        "log_every": 5,
        "attention_backend": "math",
        "pipeline": {"schedule": "1f1b", "microbatches": 4},
    }
    assert spec["env"] == {"WANDB_PROJECT": "pretrain", "EMPTY": "", "QUOTED": "a=b c"}
    assert sorted(spec["secrets"]) == ["HF_TOKEN", "WANDB_API_KEY"]
    assert spec["nccl"] == {
        "overrides": {"NCCL_ALGO": "Ring"},
        "reasons": {"NCCL_ALGO": "Tree hangs on 2.26 here"},
    }
    assert spec["max_cost_usd"] == "500.00"


def test_a_form_job_with_explicit_sizes_pipeline_stages_and_a_profile(
    client, fleet_pool, quota, team, researcher
):
    sizes = {
        "model_layers": 4,
        "model_dim": 256,
        "model_heads": 4,
        "model_kv_heads": 2,
        "model_ffn_dim": 512,
        "model_vocab_size": 1024,
        "model_max_seq_len": 256,
    }
    response = post(
        client,
        researcher,
        form_data(
            team,
            preset="custom",
            layout="1x4x1x2",
            pipeline_schedule="interleaved_1f1b",
            pipeline_stages_per_rank=2,
            nccl_profile="ib-nvswitch-8gpu",
            **sizes,
        ),
    )

    spec = submitted(response).spec
    assert "preset" not in spec["trainer"]
    assert spec["trainer"]["model"] == {key.removeprefix("model_"): v for key, v in sizes.items()}
    assert spec["trainer"]["pipeline"] == {"schedule": "interleaved_1f1b", "stages_per_rank": 2}
    assert spec["nccl"] == {"profile": "ib-nvswitch-8gpu"}


def test_a_command_job_from_the_form_runs_from_git(client, fleet_pool, quota, team, researcher):
    response = post(
        client,
        researcher,
        form_data(
            team,
            kind="command",
            argv="python\ntrain.py\n--fast",
            git_repo="https://example.com/lab/train.git",
            git_ref="v1.2",
            workdir="src",
            gpu_type="ANY",
        ),
    )

    job = submitted(response)
    assert job.kind == "command" and job.gpu_type == "ANY"
    assert job.spec["command"] == {
        "argv": ["python", "train.py", "--fast"],
        "git": {"repo": "https://example.com/lab/train.git", "ref": "v1.2"},
        "workdir": "src",
    }


def test_a_command_without_its_codes_source_is_told_so_on_the_code_path(
    client, fleet_pool, quota, team, researcher
):
    response = post(client, researcher, form_data(team, kind="command", argv="python\nrun.py"))

    assert response.status_code == 200
    errors = field_errors_of(response.content.decode())
    assert errors == {
        "code_path": ["Give the code&#x27;s source: git (repo and ref) or path, one of them."]
    }
    assert not Job.objects.exists()


def test_the_services_refusals_land_on_their_fields(
    client, fleet_pool, quota, team, researcher, wandb_secret
):
    owned_price(fleet_pool, since=timezone.now() - dt.timedelta(days=1))
    response = post(
        client,
        researcher,
        form_data(
            team,
            max_cost_usd="0.01",
            env="LD_PRELOAD=/tmp/x.so",
            nccl_overrides="NCCL_ALGO=Ring",
            git_repo="not a url",  # a trainer job: command fields are not sent
        ),
    )

    assert response.status_code == 200
    html = response.content.decode()
    errors = field_errors_of(html)
    assert set(errors) == {"max_cost_usd", "env", "nccl_overrides"}, errors
    assert errors["max_cost_usd"][0].startswith("The projected cost is $")
    assert errors["env"] == [
        "The dynamic loader&#x27;s: a job does not change how its programs are loaded."
    ]
    assert errors["nccl_overrides"][0].endswith("Give nccl.reasons.NCCL_ALGO to keep it.")
    assert re.search(r"<details class=\"more\" open>\s*<summary>NCCL", html)  # shown, not folded
    assert not Job.objects.exists()


def test_the_serializers_refusals_land_on_their_fields(client, fleet_pool, quota, team, researcher):
    response = post(
        client,
        researcher,
        form_data(
            team,
            kind="command",
            argv="true",
            git_repo="ftp://example.com/x",
            git_ref="-x",
            env="1BAD=x\nGOOD=y",
            checkpoint_every_minutes=0,
            max_cost_usd="-1",
        ),
    )

    errors = field_errors_of(response.content.decode())
    assert errors == {
        "git_repo": ["Use an https://, ssh:// or git@ repository URL."],
        "git_ref": ["A branch, tag or commit: letters, digits, ./_-."],
        "env": ["Not environment variable names: 1BAD."],
        "max_cost_usd": ["Ensure this value is greater than or equal to 0."],
    }  # checkpoint_every_minutes belongs to the trainer: a command job does not send it


def test_a_line_without_a_value_is_an_error_on_its_field(
    client, fleet_pool, quota, team, researcher
):
    response = post(client, researcher, form_data(team, env="GOOD=1\nJUSTANAME"))

    assert field_errors_of(response.content.decode()) == {"env": ["Line 2: write NAME=value."]}


def test_the_form_offers_the_teams_secrets_by_name_and_preselects_the_only_team(
    client, fleet_pool, quota, team, researcher, wandb_secret, other_team
):
    accounts.team_secret_set(team=other_team, name="NOT_YOURS", value="x", by=None)
    client.force_login(researcher)
    html = client.get("/jobs/submit/").content.decode()

    assert re.findall(r'name="secrets" value="([^"]+)"', html) == ["HF_TOKEN", "WANDB_API_KEY"]
    assert "k-123" not in html
    team_select = re.search(r'<select name="team".*?</select>', html, re.S).group(0)
    assert re.findall(r'<option value="([^"]*)"', team_select) == [str(team.pk)]
    assert "selected" in team_select


def test_a_member_of_two_teams_chooses_the_team_and_sees_whose_secret_is_whose(
    client, fleet_pool, quota, team, researcher, wandb_secret, other_team
):
    factories.make_member(team=other_team, role="researcher", user=researcher)
    accounts.team_secret_set(team=other_team, name="WANDB_API_KEY", value="x", by=None)
    client.force_login(researcher)
    html = client.get("/jobs/submit/").content.decode()

    team_select = re.search(r'<select name="team".*?</select>', html, re.S).group(0)
    assert re.findall(r'<option value="([^"]*)"', team_select)[0] == ""
    assert f"WANDB_API_KEY ({other_team.slug}, {team.slug})" in html or (
        f"WANDB_API_KEY ({team.slug}, {other_team.slug})" in html
    )


def test_explicit_sizes_bring_the_layouts_that_fit_them(client, researcher):
    client.force_login(researcher)
    sizes = {
        "model_layers": "6",
        "model_dim": "384",
        "model_heads": "6",
        "model_kv_heads": "6",
        "model_ffn_dim": "1024",
        "model_vocab_size": "1000",
    }
    query = {"preset": "custom", "gpus": "8", "gpus_per_node": "8", **sizes}
    html = client.get("/jobs/submit/layouts/", query).content.decode()

    values = re.findall(r'<option value="([^"]*)"', html)
    assert "1x8x1x1" in values and "1x4x2x1" in values and "1x1x2x4" not in values
    assert not [v for v in values[1:] if v.split("x")[2] in ("4", "8")]  # tp divides 6 heads
    assert "1x1x1x8" not in values and "1x4x1x2" in values  # pp divides 6 layers

    unsized = client.get("/jobs/submit/layouts/", {**query, "model_heads": ""}).content.decode()
    assert re.findall(r'<option value="([^"]*)"', unsized) == [""]
    assert "once all of them are given" in unsized


def _grow(researcher, *, teams: int, secrets: int) -> None:
    """More teams the researcher submits for, each with its own secrets and quota, and more
    NCCL profiles: what an N+1 on the Submit page would pay for once each."""
    from apps.tuning import services as tuning

    ops = factories.make_org_user(role="ops")
    for _ in range(teams):
        extra = factories.make_team()
        factories.make_member(team=extra, role="researcher", user=researcher)
        accounts.team_quota_set(team=extra, gpu_type="H100", max_gpus=16, by=None)
        for n in range(secrets):
            accounts.team_secret_set(team=extra, name=f"SECRET_{n}", value="v", by=None)
        tuning.nccl_profile_create(
            by=ops, name=f"ib-{extra.slug}", title=extra.slug, fabric="infiniband", env={}
        )


def test_the_submit_page_makes_as_many_queries_for_one_team_as_for_many(
    client, fleet_pool, quota, team, researcher, wandb_secret, django_assert_max_num_queries
):
    client.force_login(researcher)
    client.get("/jobs/submit/")  # warm: the session's first read
    # The session, the user, their roles, their teams (listed, and read by the team select),
    # the teams' secrets, the budget alerts of the navigation: none per team or per secret.
    with django_assert_max_num_queries(9) as one_team:
        assert client.get("/jobs/submit/").status_code == 200
    _grow(researcher, teams=6, secrets=3)
    with django_assert_max_num_queries(len(one_team.captured_queries)):
        html = client.get("/jobs/submit/").content.decode()
    team_select = re.search(r'<select name="team".*?</select>', html, re.S).group(0)
    assert len(re.findall(r'<option value="\d+"', team_select)) == 7
    assert "SECRET_2" in html
