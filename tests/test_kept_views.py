"""Kept views ([Note: kept views] in shardfn/_state/packing.py): where nothing is gathered (a world
of one, NO_SHARD), a unit's parameters are views of its shard buffer made once per tree, not
at every gather; they must never be stale.

Pinned: how many times a unit's views are made (exactly once per unit and tree, none for a
cast), and that a step on a tree whose views are kept equals, bit for bit, a step on a fresh
copy of the tree (no kept views), through in-place updates, values written into the shards
and a checkpoint loaded into them.
"""

import torch
import torch.utils._pytree as pytree
from test_ranks_differ import Stack

import shardfn as sf
import shardfn._group.gather as gather
import shardfn._state.packing as packing
from shardfn._state.sharded import unit_views
from shardfn.optim import adamw


def _made(fn):
    """``fn()`` and how many times it made a unit's parameters from its buffer (unpack_unit,
    kept or not)."""
    calls = []
    plain = packing.unpack_unit

    def counted(*args, **kwargs):
        calls.append(1)
        return plain(*args, **kwargs)

    packing.unpack_unit = gather.unpack_unit = counted
    try:
        out = fn()
    finally:
        packing.unpack_unit = gather.unpack_unit = plain
    return out, len(calls)


def _fresh(tree):
    """A copy of ``tree`` on new tensors (a flat unit's shards views of one new buffer, as
    shard lays them out): its views are made anew."""
    params = unit_views({n: tree[n].detach().clone() for n in tree.layout.leaves}, tree.layout, 0)
    return tree.replace({n: t.requires_grad_(tree.layout.leaves[n].requires_grad) for n, t in params.items()})


def kept_views_scenarios(strategy, directory):
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(Stack(n=4))
    loss = lambda apply, p, b: apply(p, b).pow(2).mean()  # noqa: E731
    step = sf.jit_step(loss, mesh, optimizer=adamw(1e-2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    kept = sf.shard(params, mesh, strategy, bucket_bytes=0)
    units = len(kept.layout.units)
    state = step.init(kept)
    out = {"units": units, "made": [], "losses": [], "fresh_losses": []}
    fresh_tree, fresh_state = _fresh(kept), pytree.tree_map(torch.clone, state)
    for _ in range(3):
        (kept, state, m), made = _made(lambda: step(kept, state, x))
        out["made"].append(made)
        out["losses"].append(float(m["loss"]))
        fresh_tree, fresh_state, m = step(_fresh(fresh_tree), fresh_state, x)
        out["fresh_losses"].append(float(m["loss"]))
    out["same_params"] = all(torch.equal(kept[n], fresh_tree[n]) for n in kept)
    # values written into the shards in place show through the kept views
    with torch.no_grad():
        for n in kept.layout.leaves:
            kept[n].mul_(0.5)
    out["after_write"] = torch.equal(apply(kept, x), apply(_fresh(kept), x))
    # a checkpoint loaded into the shards, the same
    sf.checkpoint.save(directory, kept, state)
    before = apply(kept, x).detach().clone()
    with torch.no_grad():
        for n in kept.layout.leaves:
            kept[n].zero_()
    sf.checkpoint.load(directory, kept, state)
    out["after_load"] = torch.equal(apply(kept, x), before)
    # a new tree makes its own views, once
    copy = _fresh(kept)
    _, out["made_copy"] = _made(lambda: (apply(copy, x), apply(copy, x)))
    return out


def cast_scenario():
    """Parameters cast to another dtype are a copy of the current values: never kept."""
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(Stack(n=2))
    tree = sf.shard(params, mesh, "FULL_SHARD", bucket_bytes=0, precision=sf.Precision(param=torch.bfloat16))
    x = torch.randn(4, 8)
    first, made = _made(lambda: apply(tree, x))
    with torch.no_grad():
        for n in tree.layout.leaves:
            tree[n].mul_(2.0)
    second, again = _made(lambda: apply(tree, x))
    return {"made": (made, again), "changed": not torch.equal(first, second), "units": len(tree.layout.units)}


def test_kept_views_are_made_once_per_tree_and_never_stale(clusters, tmp_path):
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        out = clusters[1].run(kept_views_scenarios, strategy, str(tmp_path / strategy))[0]
        # the first step makes every unit's views once (forward and regather share them), later steps none
        assert out["made"] == [out["units"], 0, 0], (strategy, out)
        assert out["losses"] == out["fresh_losses"] and out["same_params"], (strategy, out)
        assert out["after_write"] and out["after_load"], (strategy, out)
        assert out["made_copy"] == out["units"], (strategy, out)


def test_views_of_a_cast_are_not_kept(clusters):
    out = clusters[1].run(cast_scenario)[0]
    assert out["made"] == (out["units"], out["units"]) and out["changed"], out
