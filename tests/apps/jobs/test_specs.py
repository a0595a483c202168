"""The Submit form's layouts and the submit rules agree: every layout the form offers is
accepted, and every layout of the form's kind that the rules accept is offered."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from apps.fleet.selectors import PoolCapacity
from apps.jobs import specs
from workers.trainer.presets import PRESETS, ModelShape


def _errors_for(shape: ModelShape, *, nodes: int, per_node: int, layout: dict) -> dict:
    """What the submit rules say of a trainer job of this shape and layout, on a pool of
    exactly that size."""
    pool = PoolCapacity(
        pool_id=1,
        slug="p",
        kind="owned",
        gpu_type="H100",
        enabled=True,
        node_sizes=((per_node, nodes),),
        burst_node_gpus=0,
        max_nodes=nodes,
    )
    spec = {
        "resources": {
            "gpu_type": "H100",
            "nodes": nodes,
            "gpus_per_node": per_node,
            "layout": layout,
        },
        "placement": {"where": "owned"},
    }
    errors = specs.SpecErrors()
    resources = specs.resources_from_spec(spec, pools=[pool], errors=errors)
    if resources is not None:
        sizes = {
            "layers": shape.layers,
            "dim": shape.dim,
            "heads": shape.heads,
            "kv_heads": shape.kv_heads,
            "ffn_dim": shape.ffn_dim,
            "vocab_size": shape.vocab_size,
        }
        specs.check_trainer({"model": sizes}, resources, errors)
        specs.check_capacity(
            resources, where="owned", pools=[pool], quota_limit=None, errors=errors
        )
    return errors.details


def _layout(layout: specs.Layout) -> dict:
    return {
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "tp": layout.tp,
        "pp": layout.pp,
    }


shapes = st.one_of(
    st.sampled_from(sorted(PRESETS.values(), key=lambda s: s.layers)),
    st.builds(
        lambda layers, kv, group, head_dim: ModelShape(
            layers=layers,
            dim=kv * group * head_dim,
            heads=kv * group,
            kv_heads=kv,
            ffn_dim=64,
            vocab_size=256,
        ),
        st.integers(1, 24),
        st.sampled_from([1, 2, 3, 4, 8]),
        st.sampled_from([1, 2, 4]),
        st.sampled_from([2, 4, 8]),
    ),
)


@given(shapes, st.integers(1, 6), st.sampled_from([1, 2, 3, 4, 6, 8]))
def test_the_layouts_offered_are_exactly_those_the_rules_accept(shape, nodes, per_node):
    offered = specs.valid_layouts(shape, nodes=nodes, gpus_per_node=per_node)
    assert offered, "data parallel alone always fits"
    for layout in offered:
        assert _errors_for(shape, nodes=nodes, per_node=per_node, layout=_layout(layout)) == {}
    # The form's kind of layout: replicate over every node or none, shard within.
    total = nodes * per_node
    accepted = set()
    for replicate, tp, pp in itertools.product(
        {1, nodes}, range(1, per_node + 1), range(1, total + 1)
    ):
        if total % (replicate * tp * pp):
            continue
        layout = specs.Layout(replicate, total // (replicate * tp * pp), tp, pp)
        if not _errors_for(shape, nodes=nodes, per_node=per_node, layout=_layout(layout)):
            accepted.add(layout)
    assert set(offered) == accepted
