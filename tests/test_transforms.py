"""What a tree knows survives every transformation of it, or the transformation raises.

A pending verdict of a step with ``on_nonfinite="raise_next"`` ([Note: a step that does not
wait]) and SHARD_OPTIMIZER's replica ([Note: replicated parameters]) travel through pytree
utilities, ``reshard`` and ``ShardedParams.replace``: see [Note: what a tree carries].
"""

import os

import torch
import torch.utils._pytree as pytree
from test_ranks_differ import Stack, _outcome, _setup

import shardfn as sf
from shardfn.optim import adamw


def _round_trip(tree):
    leaves, spec = pytree.tree_flatten(tree)
    return pytree.tree_unflatten(leaves, spec)


# Each takes (sharded, opt_state) and returns the transformed pair.
TRANSFORMS = {
    "pytree round trip": lambda s, st: (_round_trip(s), st),
    "tree_map identity": lambda s, st: (pytree.tree_map(lambda t: t, s), st),
    "tree_map copy": lambda s, st: (pytree.tree_map(torch.clone, s), st),  # an EMA copy, a cast, a move
    "reshard": lambda s, st: sf.reshard(s, st, "SHARD_GRAD_OP"),
    "replace": lambda s, st: (s.replace({n: s[n].clone() for n in s.layout.leaves}), st),
}


def _nonfinite_step(strategy="FULL_SHARD"):
    """Two steps under on_nonfinite="raise_next", the second with a NaN in rank 1's batch; also
    an EMA copy taken after the first (good) step."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack(), strategy)
    step = sf.jit_step(lambda apply, p, b: apply(p, b).pow(2).mean(), mesh, optimizer=adamw(1e-2),
                       on_nonfinite="raise_next")
    state = step.init(sharded)
    bad = torch.randn(4, 8)
    if mesh.rank == 1:
        bad[2, 3] = float("nan")
    sharded, state, _ = step(sharded, state, torch.ones(4, 8))
    ema = pytree.tree_map(torch.clone, sharded)
    sharded, state, _ = step(sharded, state, bad)
    return sharded, state, ema


def _save_outcome(path, sharded, state):
    out = _outcome(lambda: sf.checkpoint.save(path, sharded, state))
    return {"error": out["error"], "message": out["message"], "written": [p for p in (path, path + ".partial")
                                                                          if os.path.exists(p)]}


def nonfinite_through_transforms(directory):
    sharded, state, ema = _nonfinite_step()
    out = {}
    for name, transform in TRANSFORMS.items():
        tree, moved = transform(sharded, state)
        out[name] = {"type": type(tree).__name__,
                     **_save_outcome(f"{directory}/{name.replace(' ', '-')}", tree, moved)}
    # An EMA update over two trees: the result's structure is the first tree's, and the second
    # one's unread verdict is read there (the result can carry one), so its NaN does not pass.
    def ema_update():
        new = pytree.tree_map(lambda e, p: 0.5 * e + 0.5 * p, ema, sharded)
        sf.checkpoint.save(f"{directory}/ema", new, None)
    out["tree_map of two trees"] = {**_outcome(ema_update), "written": [
        p for p in (f"{directory}/ema", f"{directory}/ema.partial") if os.path.exists(p)]}
    return out


def test_a_nonfinite_verdict_survives_every_transformation_of_the_tree(clusters, tmp_path):
    outs = clusters[2].run(nonfinite_through_transforms, str(tmp_path))
    for rank, out in enumerate(outs):
        for name, got in out.items():
            # every rank raises, before anything is written
            assert got["error"] == "FloatingPointError", (rank, name, got)
            assert "not finite" in got["message"] and got["written"] == [], (rank, name, got)
            if name in TRANSFORMS:
                assert got["type"] == "ShardedParams", (rank, name, got)
                assert got["message"].startswith(f"[rank {rank}] checkpoint.save(path, sharded, ...)"), (rank, name)
    assert not os.listdir(tmp_path)


def finite_trees_map_together():
    """The EMA update of a training loop: two trees, each with a finite verdict of its own."""
    torch.manual_seed(0)
    mesh, apply, fresh = _setup(Stack())
    step = sf.jit_step(lambda apply, p, b: apply(p, b).pow(2).mean(), mesh, optimizer=adamw(1e-2),
                       on_nonfinite="raise_next")
    state = step.init(fresh)
    a, state, _ = step(fresh, state, torch.ones(4, 8))
    b, state, _ = step(a, state, torch.ones(4, 8))
    new = pytree.tree_map(lambda e, p: 0.5 * e + 0.5 * p, a, b)
    other_layout = _outcome(lambda: pytree.tree_map(lambda e, p: e, a, sf.reshard(b, None, "SHARD_GRAD_OP")[0]))
    return {"type": type(new).__name__, "layout": new.layout is a.layout,
            "values": all(torch.equal(new[n], 0.5 * a[n] + 0.5 * b[n]) for n in a),
            "other_layout": other_layout["error"]}


def test_trees_with_finite_verdicts_map_together(clusters):
    for out in clusters[2].run(finite_trees_map_together):
        assert out["type"] == "ShardedParams" and out["layout"] and out["values"], out
        assert out["other_layout"] == "ValueError", out  # a different structure is still a different tree


def _slots(tree):
    """Every field a tree holds besides its values, over its classes (so a field added later counts)."""
    return [s for cls in type(tree).__mro__ for s in getattr(cls, "__slots__", ()) if s != "_data"]


def zero1_round_trip():
    """A SHARD_OPTIMIZER tree after a step under raise_next: every field is set."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack(), "SHARD_OPTIMIZER")
    loss = lambda apply, p, b: apply(p, b).pow(2).mean()  # noqa: E731
    step = sf.jit_step(loss, mesh, optimizer=adamw(1e-2), on_nonfinite="raise_next")
    state = step.init(sharded)
    sharded, state, _ = step(sharded, state, torch.ones(4, 8))
    out = {"unset": [s for s in _slots(sharded) if getattr(sharded, s) is None], "lost": []}
    for name, transform in (("round trip", _round_trip), ("tree_map", lambda s: pytree.tree_map(lambda t: t, s))):
        tree = transform(sharded)
        for slot in _slots(sharded):
            before, after = getattr(sharded, slot), getattr(tree, slot)
            kept = before == after if isinstance(before, dict) else before is after
            if not kept:
                out["lost"].append((name, slot))
    grad = sf.jit_grad(loss, mesh)

    def gathers(tree):
        with sf.record_collectives() as log:
            value, _, _ = grad(tree, torch.ones(4, 8))
        return float(value), [c.unit for c in log.select("gather") if c.kind.value == "all_gather"]

    out["units"] = [u.name for u in sharded.layout.units]
    out["kept"] = gathers(_round_trip(sharded))  # the replica: no gather in forward
    # new values: the replica is no longer theirs, so it is dropped, and the next use gathers
    copy = pytree.tree_map(torch.clone, sharded)
    out["copy_replicas"] = copy.replicas
    out["copied"] = gathers(copy)
    # another layout (other units): the verdict goes along, the replica of the old units does not
    moved, _ = sf.reshard(sharded, None, units=["layers.0"])
    out["resharded"] = {"units": len(moved.layout.units), "replicas": moved.replicas,
                        "verdict": moved._verdict is sharded._verdict}
    return out


def test_every_field_of_a_tree_survives_a_pytree_round_trip(clusters):
    for out in clusters[2].run(zero1_round_trip):
        assert out["unset"] == [] and out["lost"] == [], out
        loss, gathered = out["kept"]
        assert gathered == [], out
        assert out["copy_replicas"] is None and out["copied"] == (loss, out["units"]), out
        assert out["resharded"] == {"units": 2, "replicas": None, "verdict": True}, out
