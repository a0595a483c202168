"""precision fp8 on the CPU: the blocks' linear layers multiply in float8, through torchao's
Float8Linear and torch's own float8 matrix product.

CI has no GPU with FP8 tensor cores (an H100 or H200), so what fp8 is for, speed, is
measured on the device by bench.trainer's fp8 variant, and its loss on real text against
bf16 by bench.fp8. Here it runs for real, only slowly (about 4 s a step on this preset):
its losses leave the fp32 reference's by more than reordering additions ever moves them
(LOSS_TOLERANCE), so the products really are float8, yet stay within FP8_TOLERANCE of
them; it trains under FSDP2 across two ranks; and a checkpoint it writes resumes under
fp32, since float8 changes how the weights are multiplied, not what is stored.
"""

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from tests.workers.trainer.test_training import (  # noqa: E402
    LOSS_TOLERANCE,
    STEPS,
    dataset,  # noqa: F401  (a fixture)
    reference,  # noqa: F401  (a fixture)
    run_config,
    scratch,  # noqa: F401  (a fixture)
    train,
)

pytestmark = pytest.mark.slow
FP8_TOLERANCE = 0.02  # relative; measured: 0.05% at the first step, 0.7% at the fifth
COMPARED = range(1, STEPS)  # the last step follows a gradient spike and parts further


@pytest.fixture(scope="module")
def float8_run(scratch, dataset):  # noqa: F811
    workdir = scratch / "fp8"
    config = run_config(
        dataset, precision="fp8", checkpoint={"dir": str(workdir / "checkpoints"), "every_steps": 3}
    )
    return train(config, workdir), workdir / "checkpoints"


def test_fp8_multiplies_in_float8_and_keeps_to_the_fp32_curve(float8_run, reference):  # noqa: F811
    run, _ = float8_run

    (start,) = run.of("start")
    assert start["precision"] == "fp8"
    assert start["kernels"]["float8_recipe"] == "tensorwise"
    assert start["dtype"] == "float32"  # CPUs compute around the float8 products in fp32
    gaps = {step: abs(run.losses[step] - reference.losses[step]) for step in COMPARED}
    assert max(gaps.values()) > 2 * LOSS_TOLERANCE, gaps  # not the fp32 products
    for step in COMPARED:
        assert run.losses[step] == pytest.approx(reference.losses[step], rel=FP8_TOLERANCE)
    assert run.losses[STEPS - 1] < run.losses[1]  # it learns
    assert run.status["reason"] == "finished"


def test_a_checkpoint_written_under_fp8_resumes_under_fp32(float8_run, scratch, dataset):  # noqa: F811
    run, checkpoints = float8_run
    workdir = scratch / "fp8-then-fp32"
    copy = workdir / "checkpoints"
    shutil.copytree(checkpoints, copy)
    shutil.rmtree(copy / f"step-{STEPS:08d}")  # resume from step 3, the newest left

    resumed = train(run_config(dataset, checkpoint={"dir": str(copy)}), workdir)

    (resume,) = resumed.of("resume")
    assert resume["step"] == 3
    assert set(resumed.losses) == set(range(4, STEPS + 1))
    # Step 4 from the same weights and batch, its products in fp32 instead of float8.
    assert resumed.losses[4] == pytest.approx(run.losses[4], rel=FP8_TOLERANCE)
    assert resumed.losses[4] != run.losses[4]


def test_fp8_trains_under_fsdp_across_two_ranks(float8_run, reference, scratch, dataset):  # noqa: F811
    """Each rank scales its own half of the batch, so the losses part from one process's
    by a little (measured: 6e-4 to 3e-3), not by what a layout's mistake moves them (1e-2 or
    more)."""
    run, _ = float8_run

    sharded = train(
        run_config(dataset, precision="fp8", layout={"dp_shard": 2}, steps=3),
        scratch / "fp8-fsdp",
        nproc=2,
    )

    (start,) = sharded.of("start")
    assert start["data_parallel"] == "fsdp" and start["precision"] == "fp8"
    for step in range(1, 4):
        assert sharded.losses[step] == pytest.approx(run.losses[step], abs=5 * LOSS_TOLERANCE)
        assert sharded.losses[step] == pytest.approx(reference.losses[step], rel=FP8_TOLERANCE)
