"""Profiles (ops write, linted, audited), the default each pool gets, and the environment a
job gets on a pool's nodes: the profile, then the job's overrides, linted for those nodes."""

import pytest

from apps.accounts.models import AuditEvent
from apps.tuning import linter, selectors, services
from apps.tuning.models import NcclProfile
from apps.tuning.selectors import PoolNccl
from controlplane.errors import ApplicationError

pytestmark = pytest.mark.django_db

BUILT_IN = ["efa-p5", "ib-nvswitch-8gpu", "single-node"]


def pool(fabric="infiniband", version="2.26.2", slug="p"):
    return PoolNccl(
        pool_id=1, slug=slug, name=slug, kind="owned", fabric=fabric, nccl_version=version
    )


def new_profile(by, **fields):
    values = {"name": "custom", "title": "Custom", "fabric": "infiniband", "env": {}}
    values.update(fields)
    return services.nccl_profile_create(by=by, **values)


# --- the built-in profiles ------------------------------------------------------------------


def test_the_built_in_profiles_are_seeded_and_pass_their_own_linter():
    profiles = {p.name: p for p in NcclProfile.objects.all()}
    assert sorted(profiles) == BUILT_IN
    for profile in profiles.values():
        assert profile.built_in and profile.is_default
        assert not [v for v in profile.lint() if v.level != linter.OK], profile.name
        assert profile.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
        assert profile.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_the_ib_profile_sets_what_the_issue_names_and_the_efa_one_leaves_the_plugin_alone():
    ib = NcclProfile.objects.get(name="ib-nvswitch-8gpu")
    assert {
        "NCCL_IB_HCA",
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_TIMEOUT",
        "NCCL_CROSS_NIC",
        "NCCL_TOPO_FILE",
    } <= set(ib.env)
    assert ib.env["NCCL_IB_HCA"].startswith("=")
    efa = NcclProfile.objects.get(name="efa-p5")
    assert efa.env["NCCL_NET"] == "AWS Libfabric"
    # aws-ofi-nccl 1.7+ sets these itself on p5, or they were advice for plugin ≤ 1.5
    assert not {"NCCL_PROTO", "NCCL_BUFFSIZE", "NCCL_P2P_NET_CHUNKSIZE", "FI_EFA_FORK_SAFE"} & set(
        efa.env
    )


# --- writing profiles -------------------------------------------------------------------------


def test_ops_create_a_profile_with_an_audit_record(ops_user):
    profile = new_profile(ops_user, env={"NCCL_IB_TIMEOUT": "23"})
    assert profile.updated_by == ops_user and not profile.built_in
    audit = AuditEvent.objects.get(action="nccl_profile.create")
    assert audit.actor == ops_user and audit.after["env"] == {"NCCL_IB_TIMEOUT": "23"}


@pytest.mark.parametrize("role", ["researcher", "admin", "viewer", "finance"])
def test_only_ops_edit_profiles(user_for_role, role):
    with pytest.raises(ApplicationError) as refused:
        new_profile(user_for_role(role))
    assert refused.value.status == 403
    profile = NcclProfile.objects.get(name="single-node")
    with pytest.raises(ApplicationError):
        services.nccl_profile_update(profile=profile, by=user_for_role(role), title="Mine")
    assert not AuditEvent.objects.filter(action__startswith="nccl_profile").exists()


def test_a_profile_that_fails_the_linter_is_refused_naming_each_variable(ops_user):
    with pytest.raises(ApplicationError) as refused:
        new_profile(
            ops_user,
            env={"NCCL_ORDER_VIA_NVLINK": "1", "NCCL_IB_TIMEOUT": "60", "NCCL_ALGO": "Ring"},
        )
    details = refused.value.details
    assert set(details) == {"env.NCCL_ORDER_VIA_NVLINK", "env.NCCL_IB_TIMEOUT", "env.NCCL_ALGO"}
    assert "Did you mean NCCL_TOPO_FILE?" in details["env.NCCL_ORDER_VIA_NVLINK"][0]
    assert "outside 1..31" in details["env.NCCL_IB_TIMEOUT"][0]
    assert "Give reasons.NCCL_ALGO to keep it." in details["env.NCCL_ALGO"][0]
    assert not NcclProfile.objects.filter(name="custom").exists()


def test_a_debugging_knob_is_kept_with_a_reason_and_a_stray_reason_is_refused(ops_user):
    profile = new_profile(
        ops_user,
        env={"NCCL_ALGO": "Ring"},
        reasons={"NCCL_ALGO": "NCCL 2.21 picks Tree and hangs on rack A3 (ticket 812)"},
    )
    (verdict,) = profile.lint()
    assert verdict.level == linter.WARNING and verdict.kept_because.startswith("NCCL 2.21")
    with pytest.raises(ApplicationError) as refused:
        services.nccl_profile_update(profile=profile, by=ops_user, reasons={"NCCL_PROTO": "x"})
    assert "reasons.NCCL_PROTO" in refused.value.details


def test_the_fabric_is_part_of_the_lint(ops_user):
    with pytest.raises(ApplicationError) as refused:
        new_profile(
            ops_user, fabric="efa", env={"NCCL_PROTO": "simple"}, reasons={"NCCL_PROTO": "old"}
        )
    assert "Switches off LL and LL128 on EFA" in refused.value.details["env.NCCL_PROTO"][0]


def test_one_default_per_fabric_scope_and_version_range(ops_user):
    with pytest.raises(ApplicationError) as refused:
        new_profile(ops_user, is_default=True, min_nccl_version="2.20")
    assert "ib-nvswitch-8gpu is already the default" in refused.value.details["is_default"][0]
    # a range that does not overlap is another default
    NcclProfile.objects.filter(name="ib-nvswitch-8gpu").update(max_nccl_version="2.21.99")
    assert new_profile(ops_user, is_default=True, min_nccl_version="2.22").is_default


def test_a_profile_keeps_its_name_and_built_in_ones_cannot_be_deleted(ops_user):
    built_in = NcclProfile.objects.get(name="efa-p5")
    with pytest.raises(ApplicationError) as renamed:
        services.nccl_profile_update(profile=built_in, by=ops_user, name="efa")
    assert "name" in renamed.value.details
    with pytest.raises(ApplicationError) as deleted:
        services.nccl_profile_delete(profile=built_in, by=ops_user)
    assert deleted.value.status == 409
    updated = services.nccl_profile_update(profile=built_in, by=ops_user, title="p5 (EFA)")
    assert updated.title == "p5 (EFA)" and updated.updated_by == ops_user
    audit = AuditEvent.objects.get(action="nccl_profile.update")
    assert (audit.before["title"], audit.after["title"]) == ("AWS p5 on EFA", "p5 (EFA)")
    custom = new_profile(ops_user)
    services.nccl_profile_delete(profile=custom, by=ops_user)
    assert AuditEvent.objects.filter(action="nccl_profile.delete").exists()


# --- the profile a pool's nodes give, and the environment a job gets ----------------------------

DEFAULTS = [
    # (fabric, NCCL version, single node, the default profile)
    ("infiniband", "2.26.2", False, "ib-nvswitch-8gpu"),
    ("efa", "2.26.2", False, "efa-p5"),
    ("efa", "2.18.3", False, None),  # older than AWS names for p5 (2.18.5)
    ("infiniband", "2.17", False, None),
    ("infiniband", "", False, "ib-nvswitch-8gpu"),  # an unknown version fits any range
    ("", "2.26.2", False, None),  # an unknown fabric gets NCCL's own defaults
    ("infiniband", "2.26.2", True, "single-node"),
    ("", "2.26.2", True, "single-node"),
]


@pytest.mark.parametrize(("fabric", "version", "single", "expected"), DEFAULTS)
def test_the_default_profile_by_fabric_version_and_scope(fabric, version, single, expected):
    chosen = selectors.default_profile(
        selectors.profiles_all(), fabric=fabric, nccl_version=version, single_node=single
    )
    assert (chosen.name if chosen else None) == expected


def test_the_job_s_overrides_go_on_top_of_the_profile_and_are_linted_for_the_nodes():
    nccl = {
        "overrides": {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1"},
        "reasons": {"NCCL_IB_DISABLE": "bisecting a hang"},
    }
    rendered = services.nccl_environment_render(
        nccl=nccl, nodes=2, pool=pool(), profiles=selectors.profiles_all()
    )
    assert rendered.profile == "ib-nvswitch-8gpu"
    sources = {v.name: (v.value, v.source) for v in rendered.variables}
    assert sources["NCCL_DEBUG"] == ("INFO", "job")  # the override wins
    assert sources["NCCL_IB_TIMEOUT"] == ("22", "profile")
    verdicts = {v.name: v for v in rendered.verdicts}
    assert verdicts["NCCL_IB_DISABLE"].level == linter.ERROR  # a reason never keeps an error
    assert "TCP sockets" in verdicts["NCCL_IB_DISABLE"].reason
    assert not rendered.ok
    assert "export NCCL_DEBUG=INFO\n" in rendered.file_text
    assert list(rendered.env)[-1] == "NCCL_IB_DISABLE"


def test_a_named_profile_for_another_fabric_is_a_problem_on_that_pool():
    rendered = services.nccl_environment_render(
        nccl={"profile": "ib-nvswitch-8gpu"},
        nodes=2,
        pool=pool("efa"),
        profiles=selectors.profiles_all(),
    )
    assert rendered.problems == ["Profile ib-nvswitch-8gpu is for InfiniBand nodes; pool p is efa."]
    assert not rendered.ok


def test_a_reason_of_the_profile_does_not_cover_the_job_s_own_value(ops_user):
    new_profile(
        ops_user, name="ring", env={"NCCL_ALGO": "Ring"}, reasons={"NCCL_ALGO": "hang on Tree"}
    )
    profiles = selectors.profiles_all()
    kept = services.nccl_environment_render(
        nccl={"profile": "ring"}, nodes=2, pool=pool(), profiles=profiles
    )
    assert kept.ok
    overridden = services.nccl_environment_render(
        nccl={"profile": "ring", "overrides": {"NCCL_ALGO": "Tree"}},
        nodes=2,
        pool=pool(),
        profiles=profiles,
    )
    assert not overridden.ok and overridden.verdicts[0].kept_because == ""


# --- what job submission checks ------------------------------------------------------------------


def test_a_spec_without_nccl_settings_costs_no_query(django_assert_num_queries):
    with django_assert_num_queries(0):
        assert services.nccl_spec_problems(nccl=None, nodes=2, pool_ids=[1]) == {}
        assert services.nccl_spec_problems(nccl={"overrides": {}}, nodes=2, pool_ids=[1]) == {}


def test_the_spec_check_names_each_field(ib_pool):
    problems = services.nccl_spec_problems(
        nccl={
            "profile": "fast",
            "overrides": {
                "NCCL_IB_DISABLE_CUDA_VGRAPH": "1",
                "NCCL_ALGO": "Tree",
                "CUDA_VISIBLE_DEVICES": "0",
                "NCCL_PROTO": "Simple",
            },
            "reasons": {"NCCL_PROTO": "suspected LL bug, NVIDIA case 42", "NCCL_BUFFSIZE": "big"},
        },
        nodes=2,
        pool_ids=[ib_pool.pk],
    )
    assert problems["nccl.profile"] == [
        "No NCCL profile is named fast (profiles: efa-p5, ib-nvswitch-8gpu, single-node)."
    ]
    assert problems["nccl.overrides.NCCL_IB_DISABLE_CUDA_VGRAPH"][0].endswith(
        "Did you mean NCCL_NET_GDR_LEVEL or NCCL_IB_DISABLE?"
    )
    assert problems["nccl.overrides.NCCL_ALGO"][0].endswith(
        "Give nccl.reasons.NCCL_ALGO to keep it."
    )
    assert problems["nccl.overrides.CUDA_VISIBLE_DEVICES"] == [
        "Not an NCCL, PyTorch-NCCL or EFA variable: put it in env."
    ]
    assert problems["nccl.reasons.NCCL_BUFFSIZE"]
    assert "nccl.overrides.NCCL_PROTO" not in problems  # a reason keeps a debugging knob


def test_an_override_that_breaks_the_job_after_a_burst_is_refused_now(ib_pool, efa_pool):
    nccl = {"overrides": {"NCCL_NET": "IB"}}
    problems = services.nccl_spec_problems(nccl=nccl, nodes=2, pool_ids=[ib_pool.pk, efa_pool.pk])
    assert problems == {
        "nccl.overrides.NCCL_NET": [
            "On pool aws-p5 (efa): IB is not the network of efa nodes: NCCL would fail."
        ]
    }
    assert services.nccl_spec_problems(nccl=nccl, nodes=2, pool_ids=[ib_pool.pk]) == {}


def test_every_pool_a_job_may_run_in_is_rendered_in_two_queries(
    ib_pool, efa_pool, django_assert_num_queries
):
    with django_assert_num_queries(2):
        rendered = services.nccl_environments_render(
            nccl=None, nodes=2, pool_ids=[ib_pool.pk, efa_pool.pk]
        )
    assert {r.pool.slug: r.profile for r in rendered} == {
        "ib-h100": "ib-nvswitch-8gpu",
        "aws-p5": "efa-p5",
    }
    assert all(r.ok for r in rendered)
