"""The adoption rule: figures drawn from known distributions, judged as a tuning run would."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.tuning import adoption
from workers.trainer.config import Layout
from workers.trainer.presets import PRESETS

SIZES = (2**12, 2**20, 2**26)
BIG = 2**26


def measure(rng, *, rounds, noise, speedup=None, drift=None):
    """{size: busbw per round}: 100 GB/s × the candidate's factor × per-round drift × noise."""
    speedup = speedup or {}
    drift = drift or [1.0] * rounds
    return {
        s: [
            100 * speedup.get(s, 1.0) * drift[r] * rng.lognormvariate(0, noise)
            for r in range(rounds)
        ]
        for s in SIZES
    }


def pair(seed, *, rounds=5, noise=0.03, speedup=None):
    rng = random.Random(seed)  # noqa: S311
    drift = [rng.lognormvariate(0, 0.05) for _ in range(rounds)]  # hits both alike
    base = measure(rng, rounds=rounds, noise=noise, drift=drift)
    cand = measure(rng, rounds=rounds, noise=noise, speedup=speedup, drift=drift)
    return base, cand


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32), rounds=st.integers(5, 9), noise=st.floats(0.005, 0.1))
def test_a_candidate_from_the_baselines_distribution_is_adopted_at_about_the_stated_rate(
    seed, rounds, noise
):
    draws, confidence = 200, 0.95
    false = sum(
        adoption.judge(*pair(seed * 1000 + i, rounds=rounds, noise=noise), sizes=[BIG]).adopt
        for i in range(draws)
    )
    # One-sided, the rule's chance is at most (1 − confidence) / 2 per size; allow the stated
    # two-sided rate plus three binomial standard deviations.
    rate = 1 - confidence
    assert false <= draws * rate + 3 * math.sqrt(draws * rate * (1 - rate)), false


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32), rounds=st.integers(5, 9))
def test_a_candidate_clearly_faster_than_the_noise_is_adopted(seed, rounds):
    base, cand = pair(seed, rounds=rounds, noise=0.03, speedup={s: 1.15 for s in SIZES})
    verdict = adoption.judge(base, cand, sizes=[BIG], name="NCCL_ALGO=Tree")
    assert verdict.adopt, verdict.summary
    assert 5 < verdict.at(BIG).change < 30
    assert verdict.at(BIG).low > 0
    assert verdict.summary.startswith("faster by ")
    assert verdict.summary.endswith("at 64 MiB: adopted")


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_faster_where_it_matters_but_slower_elsewhere_is_not_adopted(seed):
    base, cand = pair(seed, rounds=7, noise=0.02, speedup={BIG: 1.15, 2**12: 0.8})
    verdict = adoption.judge(base, cand, sizes=[BIG])
    assert verdict.at(BIG).faster and verdict.at(2**12).slower
    assert not verdict.adopt
    assert any(r.startswith("slower by ") and r.endswith("at 4 KiB") for r in verdict.reasons)
    assert verdict.summary.endswith(": not adopted")


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32), speed=st.floats(0.8, 1.2))
def test_the_same_figures_give_the_same_verdict(seed, speed):
    base, cand = pair(seed, speedup={s: speed for s in SIZES})
    assert adoption.judge(base, cand, sizes=[BIG]) == adoption.judge(base, cand, sizes=[BIG])


def test_the_figures_in_words():
    change = adoption.SizeChange(BIG, 6.0, 3.0, 9.0, matters=True)
    slow = adoption.SizeChange(4096, -4.0, -7.0, -1.0, matters=False)
    assert change.describe() == "faster by 6% [3%, 9%] at 64 MiB"
    assert slow.describe() == "slower by 4% [1%, 7%] at 4 KiB"


def test_choosing_takes_the_largest_lower_bound_or_says_nothing_was_adopted():
    base, same = pair(1)
    _, good = pair(2, speedup={s: 1.10 for s in SIZES})
    _, better = pair(3, speedup={s: 1.30 for s in SIZES})
    choice = adoption.judge_all(base, {"same": same, "good": good, "better": better})
    assert choice.best is not None and choice.best.candidate == "better"
    assert choice.reason.startswith("better adopted: faster by")

    nothing = adoption.judge_all(base, {"same": same})
    assert nothing.best is None
    assert "nothing adopted, the baseline stays" in nothing.reason
    assert "nothing adopted" in adoption.choose([]).reason


def test_too_few_or_unpaired_rounds_are_refused():
    base, cand = pair(4, rounds=5)
    short = {s: v[:4] for s, v in cand.items()}
    with pytest.raises(adoption.MeasurementError, match="at least 5"):
        adoption.judge(base, short)
    longer = {s: [*v, 100.0] for s, v in cand.items()}
    with pytest.raises(adoption.MeasurementError, match="in pairs"):
        adoption.judge({s: [*v, 100.0, 100.0] for s, v in base.items()}, longer)
    with pytest.raises(adoption.MeasurementError, match="not measured: 1 GiB"):
        adoption.judge(base, cand, sizes=[2**30])


def test_gradient_bucket_sizes_are_the_trainers_fsdp_messages():
    shape = PRESETS["1b"]
    block = shape.block_parameters()  # 44,052,480 parameters
    # bf16 all-gather 88 MB → 64 MiB; fp32 reduce-scatter 176 MB → 128 MiB; the root
    # (embedding + head, 131 M) → 256 MiB and 512 MiB.
    assert adoption.power_of_two(block * 2) == 2**26
    assert adoption.power_of_two(block * 4) == 2**27
    sizes = adoption.gradient_bucket_sizes(shape, Layout(dp_shard=8))
    assert sizes == (2**26, 2**27, 2**28, 2**29)
    # Replication alone is DDP: its 1 MiB first bucket and 25 MiB buckets (→ 32 MiB).
    assert adoption.gradient_bucket_sizes(shape, Layout(dp_replicate=8)) == (2**20, 2**25)
    assert adoption.gradient_bucket_sizes(shape, Layout(tp=2)) == ()
    # Beyond the benchmark's 1 GiB the sizes stay at 1 GiB.
    assert adoption.gradient_bucket_sizes(PRESETS["70b"], Layout(dp_shard=8)) == (2**30,)
