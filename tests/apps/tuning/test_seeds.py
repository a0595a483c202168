"""Every NCCL block in the articles under ../shared/seeds/, variable by variable.

The blocks are quoted below so the table stands on its own; when the seed files are
present (they sit beside the repository), the linter must also find exactly these
variables in them, prose and code around the blocks included.
"""

from pathlib import Path

import pytest

from apps.tuning import linter
from apps.tuning.linter import ERROR, OK, WARNING

SEEDS = Path(__file__).resolve().parents[4] / "shared" / "seeds"

# seed file → the variables it sets, each with (value, verdict, a phrase of the reason).
EXPECTED = {
    # "NCCL Tuning for Transformer Training": Python os.environ lines, promising +40%.
    "000_a80f65700ade0ebf.txt": {
        "NCCL_NET": ("IB", OK, "Forces one network"),
        # No NCCL release reads it: GDR is NCCL_NET_GDR_LEVEL.
        "NCCL_IB_DISABLE_CUDA_VGRAPH": ("1", ERROR, "not an NCCL variable"),
        "NCCL_ALGO": ("Tree", WARNING, "listed under Debugging"),
        "NCCL_PROTO": ("Simple", WARNING, "listed under Debugging"),
        "NCCL_BUFFSIZE": ("268435456", WARNING, "listed under Debugging"),
        # PARALLEL is NCCL's default launch mode: a debugging knob that changes nothing.
        "NCCL_LAUNCH_MODE": ("PARALLEL", WARNING, "same as the default (PARALLEL)"),
    },
    # Only PYTORCH_CUDA_ALLOC_CONF, inside a sentence: no NCCL block at all.
    "002_cc8209dd325c9842.txt": {},
    # Ring order, chunk sizes and an IB "ring buffer" block.
    "003_01986aed8813626f.txt": {
        "NCCL_ORDER_VIA_NVLINK": ("1", ERROR, "not an NCCL variable"),
        "NCCL_TOPO_DUMP_FILE": ("/tmp/nccl_topo.txt", OK, "topology it detected"),
        "NCCL_MAX_CHUNK_SIZE": ("268435456", ERROR, "NCCL_P2P_NET_CHUNKSIZE"),
        "NCCL_MIN_CHUNK_SIZE": ("268435456", ERROR, "NCCL_P2P_NET_CHUNKSIZE"),
        # 4.096 µs × 2^60 is not a timeout: the range is 1..31.
        "NCCL_IB_TIMEOUT": ("60", ERROR, "outside 1..31"),
        "NCCL_NET": ("IB", OK, "Forces one network"),
        "NCCL_IB_DISABLE_DIRECT": ("1", ERROR, "not an NCCL variable"),
    },
    # "Environment variables that actually matter"; the NCCL_DEBUG=WARN that follows is
    # glued to the next sentence ("WARNto see which rank..."), prose rather than a setting.
    "004_e5c22d6e3a6bef3f.txt": {
        "NCCL_DEBUG": ("INFO", OK, "verbose"),
        "NCCL_SOCKET_IFNAME": ("ib0", OK, "IP interfaces"),
        "NCCL_IB_DISABLE": ("0", WARNING, "same as the default (0)"),
        "NCCL_MIN_NCHANNELS": ("16", WARNING, "superseded by NCCL_MIN_CTAS"),
        "NCCL_NET_GDR_LEVEL": ("PHB", WARNING, "listed under Debugging"),
        "NCCL_P2P_DISABLE": ("0", WARNING, "same as the default (0)"),
        "NCCL_IB_CUDA_SUPPORT": ("1", ERROR, "removed in NCCL 2.4.0"),
    },
}

# The blocks as they appear in the seeds (copied from the article text).
BLOCKS = {
    "000_a80f65700ade0ebf.txt": """
# Use NVLink for intra-node, InfiniBand for inter-node
os.environ["NCCL_NET"] = "IB"
os.environ["NCCL_IB_DISABLE_CUDA_VGRAPH"] = "1"
os.environ["NCCL_ALGO"] = "Tree"
os.environ["NCCL_PROTO"] = "Simple"
os.environ["NCCL_BUFFSIZE"] = "268435456"  # 256MB
os.environ["NCCL_LAUNCH_MODE"] = "PARALLEL"
""",
    "002_cc8209dd325c9842.txt": """
Fix: Use PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. Also, we restart training jobs.
""",
    "003_01986aed8813626f.txt": """
os.environ["NCCL_ORDER_VIA_NVLINK"] = "1"
os.environ["NCCL_TOPO_DUMP_FILE"] = "/tmp/nccl_topo.txt"
os.environ["NCCL_MAX_CHUNK_SIZE"] = "268435456"  # 256 MB
os.environ["NCCL_MIN_CHUNK_SIZE"] = "268435456"
export NCCL_IB_TIMEOUT=60
export NCCL_NET=IB
export NCCL_IB_DISABLE_DIRECT=1
""",
    "004_e5c22d6e3a6bef3f.txt": """
# Environment variables that actually matter
export NCCL_DEBUG=INFO
export NCCL_SOCKET_IFNAME=ib0
export NCCL_IB_DISABLE=0
export NCCL_MIN_NCHANNELS=16
export NCCL_NET_GDR_LEVEL=PHB
export NCCL_P2P_DISABLE=0
export NCCL_IB_CUDA_SUPPORT=1
NCCL_DEBUG=WARNto see which rank is slow. - Ethernet bandwidth: if your data pipeline fills
""",
}

CASES = [
    (seed, name, *expected)
    for seed, variables in EXPECTED.items()
    for name, expected in variables.items()
]


@pytest.mark.parametrize(
    ("seed", "name", "value", "level", "phrase"), CASES, ids=lambda x: str(x)[:40]
)
def test_each_seed_variable_gets_its_verdict(seed, name, value, level, phrase):
    verdicts, _ = linter.lint_text(BLOCKS[seed])
    verdict = {v.name: v for v in verdicts}[name]
    assert verdict.value == value
    assert verdict.level == level, verdict.reason
    assert phrase in verdict.reason


@pytest.mark.parametrize("seed", sorted(EXPECTED))
def test_each_block_sets_exactly_the_table_s_variables(seed):
    verdicts, _ = linter.lint_text(BLOCKS[seed])
    assert [v.name for v in verdicts] == list(EXPECTED[seed])


@pytest.mark.parametrize("seed", sorted(EXPECTED))
def test_the_whole_article_yields_the_same_verdicts(seed):
    path = SEEDS / seed
    if not path.exists():
        pytest.skip(f"{path} is not beside this checkout")
    verdicts, parsed = linter.lint_text(path.read_text())
    found = {v.name: (v.value, v.level) for v in verdicts}
    assert found == {name: (value, level) for name, (value, level, _) in EXPECTED[seed].items()}
    assert parsed.skipped  # the prose around the blocks was read and skipped


def test_the_blog_blocks_would_be_refused_for_a_job():
    """What the issue is about: none of these blocks could be pushed to nodes as written."""
    for seed, variables in EXPECTED.items():
        if not variables:
            continue
        verdicts, _ = linter.lint_text(BLOCKS[seed])
        assert any(v.blocking for v in verdicts), seed
