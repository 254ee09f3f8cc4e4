"""Layout arithmetic, packing, unit policies and printouts (single process)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn._state.layout import build_layout
from shardfn._state.packing import local_shard, pack_leaf, unpack_leaf
from shardfn._state.plan import Plan
from shardfn._state.tree import tree_info
from shardfn.testing.models import GPT, MLP, Block, GPTConfig, Layer

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60)
@given(shapes=st.lists(shapes, min_size=1, max_size=4), world=st.integers(1, 5))
def test_shard_pack_unpack_round_trip(shapes, world):
    params = {f"p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    layout = build_layout(Plan("FULL_SHARD", placement="rows"), (world,), world, 1, params, [], tree_info(None, params))
    (unit,) = layout.units
    # What each rank would hold, laid end to end, is what an all-gather returns (Placement.FLAT:
    # tests/test_placement.py).
    rows = []
    for r in range(world):
        shards = [local_shard(params[n], layout.leaves[n], r, torch.device("cpu")) for n in unit.leaves]
        for n, s in zip(unit.leaves, shards):
            leaf = layout.leaves[n]
            assert s.shape == leaf.shard_shape
            assert not s[leaf.local_rows(r):].any()  # padding rows are zero
        rows.append(torch.cat([s.reshape(-1) for s in shards]) if shards else torch.zeros(0))
    gathered = torch.stack(rows) if unit.numel else torch.zeros(world, 0)
    for n in unit.leaves:
        torch.testing.assert_close(unpack_leaf(gathered, layout.leaves[n], world), params[n], rtol=0, atol=0)
    # Packing full tensors gives back exactly the stacked shards (padding zeroed).
    buf = torch.full((world, unit.numel), float("nan"))
    for n in unit.leaves:
        pack_leaf(buf, params[n], layout.leaves[n], world, layout.leaves[n].offset)
    torch.testing.assert_close(buf, gathered, rtol=0, atol=0)
    # Shard bytes: ceil(rows / world) rows per rank, 0-d parameters count as one row.
    expect = sum(math.ceil((s[0] if s else 1) / world) * math.prod(s[1:]) for s in shapes) * 4
    assert layout.shard_bytes() == expect


def test_default_units_are_the_outermost_block_list():
    params, _ = sf.functionalize(GPT(GPTConfig(n_layers=3)))
    sharded_paths = sf.Plan().units.resolve(params.module, list(params))
    assert sharded_paths == ["blocks.0", "blocks.1", "blocks.2"]
    # A model without repeated blocks has only the root unit.
    params, _ = sf.functionalize(torch.nn.Linear(3, 4))
    assert sf.Plan().units.resolve(params.module, list(params)) == []


def test_unit_policies_resolve():
    model = GPT(GPTConfig(n_layers=2))
    params, _ = sf.functionalize(model)
    assert sf.by_module_type(Block).resolve(params.module, list(params)) == ["blocks.0", "blocks.1"]
    # Outermost only: Linear layers inside blocks stay in their block's unit.
    outer = sf.by_module_type(Block, torch.nn.Linear).resolve(params.module, list(params))
    assert outer == ["blocks.0", "blocks.1", "head"]
    assert sf.by_prefix("blocks.1").resolve(None, list(params)) == ["blocks.1"]
    # by_param_count never picks a container (a ModuleList has no forward for hooks).
    mlp, _ = sf.functionalize(MLP([1, 3, 9]))
    with pytest.raises(ValueError, match=r"by_param_count\(40\) matches no module of MLP.*42 in the whole model"):
        sf.by_param_count(40).resolve(mlp.module, list(mlp))
    assert sf.by_param_count(30).resolve(mlp.module, list(mlp)) == ["layers.1.linear"]


def test_layout_printout_and_costs():
    params, _ = sf.functionalize(MLP([8, 8, 8]))
    layout = build_layout(Plan("FULL_SHARD", units=sf.by_module_type(Layer), placement="rows"), (3,), 3, 1, params,
                          ["layers.0", "layers.1"], tree_info(None, params))
    text = str(layout)
    assert "FULL_SHARD" in text and "layers.0" in text and "all_gather" in text
    # 8x8 weight + 8 bias per layer, padded to 9 rows: 9*8 + 9 = 81 elements over 3 ranks = 27 per rank.
    assert [u.numel for u in layout.units] == [27, 27]
    # both layers in one bucket ([Note: buckets]): one all-gather in forward, one in backward, one reduce-scatter
    assert layout.gather_buckets == layout.buckets == ((0, 1),)
    assert layout.collectives_per_step() == {"all_gather": (2, 4 * 81 * 4), "reduce_scatter": (1, 2 * 81 * 4)}
    # the printout says that buckets merged the units' collectives, and how many they had
    assert ("per step and rank: 2 all_gather (0.00 MiB; buckets merge the units' 4 into 2), "
            "1 reduce_scatter (0.00 MiB; buckets merge the units' 2 into 1)") in text, text
    # Flat (the default): the 72 elements of a layer end to end, 24 per rank, no padding; each
    # layer alone (bucket_bytes=0): two all-gathers and a reduce-scatter per layer.
    flat = build_layout(Plan("FULL_SHARD", units=sf.by_module_type(Layer), bucket_bytes=0), (3,), 3, 1, params,
                        ["layers.0", "layers.1"], tree_info(None, params))
    assert [u.numel for u in flat.units] == [24, 24] and "placement flat" in str(flat) and "placement rows" in text
    assert flat.collectives_per_step() == {"all_gather": (4, 4 * 72 * 4), "reduce_scatter": (2, 2 * 72 * 4)}
    assert "per step and rank: 4 all_gather (0.00 MiB), 2 reduce_scatter (0.00 MiB)" in str(flat)  # nothing merged
    same = build_layout(Plan("FULL_SHARD", units=sf.by_module_type(Layer), placement="rows"), (3,), 3, 1, params,
                        ["layers.0", "layers.1"], tree_info(None, params))
    assert same.fingerprint() == layout.fingerprint() != flat.fingerprint()
    other = build_layout(Plan("SHARD_GRAD_OP", units=sf.by_module_type(Layer), placement="rows"), (3,), 3, 1, params,
                         ["layers.0", "layers.1"], tree_info(None, params))
    assert other.fingerprint() != layout.fingerprint()


def test_plan_parsing_and_repr():
    assert sf.Plan("full_shard").strategy is sf.Strategy.FULL_SHARD
    assert sf.Plan("FULL_SHARD", units=[Block]).units == sf.by_module_type(Block)
    assert "by_module_type(Block)" in repr(sf.Plan("shard_grad_op", units=Block))
    with pytest.raises(ValueError, match="'FULL' is not one of 'FULL_SHARD'"):
        sf.Plan("FULL")
    assert sf.Plan("hybrid_shard_zero2").strategy is sf.Strategy.HYBRID_SHARD_ZERO2
    assert not sf.Strategy.HYBRID_SHARD_ZERO2.reshard_after_forward and sf.Strategy.HYBRID_SHARD.reshard_after_forward
    with pytest.raises(TypeError, match="units="):
        sf.Plan("NO_SHARD", units=42)
