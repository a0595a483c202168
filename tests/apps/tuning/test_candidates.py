"""Candidate settings for a tuning run: from the catalogue, each passed by the linter."""

import pytest

from apps.tuning import candidates, linter
from apps.tuning import catalogue as c

BASELINE = {"NCCL_DEBUG": "WARN"}
VERSIONS = ("", "2.18.3", "2.26.2")


@pytest.mark.parametrize("fabric", c.FABRICS)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_generated_candidate_lints_clean_for_its_fabric(fabric, version):
    context = linter.Context(fabric=fabric, nccl_version=version)
    kept, _ = candidates.generate(baseline=BASELINE, context=context)
    assert 0 < len(kept) <= candidates.DEFAULT_LIMIT
    for candidate in kept:
        env = candidate.environment
        assert env == {**BASELINE, **dict(candidate.changes)}
        verdicts = linter.lint(env, context=context)
        assert not [v for v in verdicts if v.level == linter.ERROR], candidate.label
        # What warns is only the Debugging note a measurement answers.
        assert (
            candidates.problems(dict(candidate.changes), baseline=BASELINE, context=context) == []
        )
        assert all(name in c.VARIABLES for name, _ in candidate.changes)
        assert len(candidate.changes) <= 2


def test_efa_pools_get_no_setting_the_plugin_makes_itself():
    kept, dropped = candidates.generate(
        baseline={}, context=linter.Context(fabric=c.EFA, nccl_version="2.26.2")
    )
    names = {name for k in kept for name, _ in k.changes}
    assert "FI_EFA_USE_DEVICE_RDMA" in names
    assert not names & {"NCCL_PROTO", "NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MIN_CTAS"}
    assert any("switches off" in d.reason for d in dropped)


def test_infiniband_pools_vary_the_ib_transport_and_the_cap_holds():
    context = linter.Context(fabric=c.INFINIBAND)
    kept, _ = candidates.generate(baseline={}, context=context, limit=20)
    labels = {k.label for k in kept}
    assert {"NCCL_IB_QPS_PER_CONNECTION=4", "NCCL_NET_GDR_LEVEL=PHB", "NCCL_PROTO=^LL"} <= labels
    assert len(candidates.generate(baseline={}, context=context, limit=3)[0]) == 3


def test_a_setting_the_baseline_has_is_no_candidate():
    kept, _ = candidates.generate(
        baseline={"NCCL_ALGO": "Tree"}, context=linter.Context(fabric=c.INFINIBAND)
    )
    assert "NCCL_ALGO=Tree" not in {k.label for k in kept}
    assert "NCCL_ALGO=Ring" in {k.label for k in kept}


def test_ops_candidates_come_first_and_bad_ones_are_refused_with_the_linters_reason():
    context = linter.Context(fabric=c.INFINIBAND)
    out = candidates.with_ops_candidates(
        [{"NCCL_IB_QPS_PER_CONNECTION": "8"}], baseline=BASELINE, context=context, limit=4
    )
    assert len(out) == 4
    assert out[0].origin == candidates.OPS and out[0].label == "NCCL_IB_QPS_PER_CONNECTION=8"
    assert all(o.origin == candidates.GENERATED for o in out[1:])

    bad = {"NCCL_IB_DISABLE_CUDA_VGRAPH": "1"}
    expected = linter.lint(bad, context=context)[0].reason
    with pytest.raises(candidates.CandidateRefused) as refused:
        candidates.with_ops_candidates([bad], baseline=BASELINE, context=context)
    assert refused.value.name == "NCCL_IB_DISABLE_CUDA_VGRAPH"
    assert refused.value.reason == expected

    with pytest.raises(candidates.CandidateRefused, match="forces it on"):
        candidates.with_ops_candidates([{"NCCL_PROTO": "LL128"}], baseline={}, context=context)
    with pytest.raises(candidates.CandidateRefused, match="no effect on infiniband"):
        candidates.with_ops_candidates(
            [{"FI_EFA_USE_DEVICE_RDMA": "1"}], baseline={}, context=context
        )
