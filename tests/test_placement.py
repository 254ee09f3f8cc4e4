"""Placement.FLAT: a unit's parameters laid end to end and cut into equal pieces ([Note: placements]).

The same training as Placement.ROWS, bit for bit (the reduce-scatter sums every element in
rank order whatever the layout), with no copy into or out of an all-gather (test_copies.py
counts them), and checkpoints that either placement loads at any world size.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn._state.layout import build_layout
from shardfn._state.packing import pack_unit, unpack_unit
from shardfn._state.pieces import rectangles
from shardfn._state.plan import Plan
from shardfn._state.tree import tree_info
from shardfn.testing import check_equivalence, split_batch
from test_equivalence import OPTIMIZERS, gpt_batches, gpt_loss, gpt_model, mlp_batches, mlp_loss, mlp_model

# -- the layout, single process ------------------------------------------------------------

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@settings(max_examples=80)
@given(shapes=st.lists(shapes, min_size=1, max_size=5), world=st.integers(1, 5))
def test_pieces_cut_the_unit_into_equal_shard_buffers(shapes, world):
    params = {f"p{i}": torch.randn(s).requires_grad_() for i, s in enumerate(shapes)}
    layout = build_layout(Plan("FULL_SHARD", placement="flat"), (world,), world, 1, params, [], tree_info(None, params))
    (unit,) = layout.units
    total = sum(t.numel() for t in params.values())
    assert unit.flat and unit.numel == -(-total // world) and unit.grad_numel == unit.numel
    # Every rank's shard buffer: its pieces end to end, in leaf order, then (last ranks only) padding.
    rows = []
    for r in range(world):
        at = 0
        pieces = [layout.local_shard(n, params[n], r, torch.device("cpu")) for n in unit.leaves]
        for n, p in zip(unit.leaves, pieces):
            off, length = layout.piece(n, r)
            assert p.shape == (length,) == layout.shard_shape(n, r)
            if length:
                assert off == at
                at += length
        rows.append(torch.cat([*pieces, torch.zeros(unit.numel - at)]))
        assert at == unit.numel or all(layout.piece(n, q)[1] == 0 for n in unit.leaves for q in range(r + 1, world))
    # Each leaf's pieces over the ranks are the leaf, in order.
    for n, t in params.items():
        assert sum(layout.piece(n, r)[1] for r in range(world)) == t.numel()
    gathered = torch.stack(rows)
    full = unpack_unit(gathered, [layout.leaves[n] for n in unit.leaves], world)
    for n, f in zip(unit.leaves, full):
        assert torch.equal(f, params[n].detach()) and f.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()
    # Gradients pack into the same global buffer, padding zero.
    buf = torch.full((world, unit.numel), float("nan"))
    pack_unit(buf, [params[n].detach() for n in unit.leaves], world, [layout.leaves[n].start for n in unit.leaves])
    assert torch.equal(buf, gathered.detach())


@settings(max_examples=200)
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple), data=st.data())
def test_rectangles_cover_exactly_a_run_of_elements(shape, data):
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    full = torch.arange(n).reshape(shape or (1,))
    rects = rectangles(tuple(full.shape), lo, hi)
    assert len(rects) <= max(1, 2 * full.dim() - 1)
    got = []
    for offsets, sizes in rects:
        assert all(o + s <= d for o, s, d in zip(offsets, sizes, full.shape))
        got += full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1).tolist()
    assert got == list(range(lo, hi))  # in element order, each a contiguous run


def test_frozen_and_trainable_parameters_of_one_module_are_two_flat_units():
    lin = torch.nn.Linear(3, 4)
    lin.bias.requires_grad_(False)
    params, _ = sf.functionalize(torch.nn.Sequential(lin, torch.nn.Linear(4, 2)))
    layout = build_layout(Plan("FULL_SHARD", placement="flat"), (2,), 2, 1, params, ["0"], tree_info(params.module,
                                                                                                     list(params)))
    by_name = {u.name: u for u in layout.units}
    assert set(by_name) == {"<root>", "0", "0[frozen]"}
    assert by_name["0"].leaves == ("0.weight",) and by_name["0"].grad_numel == 6
    assert by_name["0[frozen]"].leaves == ("0.bias",) and by_name["0[frozen]"].grad_numel == 0
    rows = build_layout(Plan("FULL_SHARD", placement="rows"), (2,), 2, 1, params, ["0"],
                        tree_info(params.module, list(params)))
    assert [u.name for u in rows.units] == ["<root>", "0"]  # rows keep frozen leaves in the unit


# -- training ----------------------------------------------------------------------------


def _train(strategy, placement, steps=3):
    mesh = sf.Mesh.from_group(replicate=2 if "HYBRID" in strategy else None)
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, strategy, placement=placement)
    opt = OPTIMIZERS["adamw"]()
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    losses, comm = [], []
    for b in gpt_batches(steps):
        sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        losses.append(float(m["loss"]))
        comm.append(dict(m["comm_bytes"]))
    predicted = {k: b for k, (_, b) in sharded.layout.collectives_per_step().items()}
    elements = sum(t.numel() for t in sharded.params().values())
    return (losses, sf.gather(sharded), comm[-1], predicted, sharded.layout.shard_bytes(), elements,
            sharded.layout.num_params)


@pytest.mark.parametrize("strategy, world", [
    ("FULL_SHARD", 2), ("FULL_SHARD", 3), ("SHARD_GRAD_OP", 3), ("NO_SHARD", 2), ("SHARD_OPTIMIZER", 3),
    ("HYBRID_SHARD", 4), ("HYBRID_SHARD_ZERO2", 4),
])
def test_flat_trains_bit_for_bit_as_rows(clusters, strategy, world):
    rows = clusters[world].run(_train, strategy, "rows")
    flat = clusters[world].run(_train, strategy, "flat")
    copies = 1 if strategy == "NO_SHARD" else (2 if "HYBRID" in strategy else 1)  # replicas of each element
    for (losses, full, comm, predicted, shard_bytes, *_), (rl, rfull, _, _, rbytes, *_) in zip(flat, rows):
        assert losses == rl
        assert full.keys() == rfull.keys() and all(torch.equal(full[k], rfull[k]) for k in full)
        # Bytes moved are the layout's prediction; a flat unit pads once, at its end, so it
        # moves and keeps no more than rows do.
        assert {k: v for k, v in comm.items() if k != "all_reduce"} == {
            k: v for k, v in predicted.items() if k != "all_reduce"}
        assert shard_bytes <= rbytes
    # The shards hold every element once per replica, and no padding.
    total = flat[0][6]
    held = sum(r[5] for r in flat)
    assert held == total * (world if strategy == "NO_SHARD" else copies), (held, total)


def test_flat_equals_single_process_training(clusters):
    plans = [sf.Plan(s, placement="flat") for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]
    for world in (1, 2, 3, 4):
        check_equivalence(mlp_model, mlp_loss, mlp_batches(), optimizer=OPTIMIZERS["sgd_momentum"], strategies=plans,
                          world_sizes=[world], clusters=clusters)
    check_equivalence(gpt_model, gpt_loss, gpt_batches(), optimizer=OPTIMIZERS["adamw"], strategies=[
        sf.Plan("HYBRID_SHARD", placement="flat"), sf.Plan("HYBRID_SHARD_ZERO2", placement="flat", remat=True)],
        world_sizes=[(2, 2)], clusters=clusters)


# -- checkpoints ---------------------------------------------------------------------------


def _save(path, placement):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD", placement=placement)
    opt = OPTIMIZERS["adamw"]()
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    for b in gpt_batches(2):
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    sf.checkpoint.save(path, sharded, state)
    return sf.gather(sharded), {k: sf.gather(sharded.replace(dict(v))) for k, v in (("mu", state.mu), ("nu", state.nu))}


def _load(path, placement, strategy):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(1)  # other values: the load must replace them all
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, strategy, placement=placement)
    opt = OPTIMIZERS["adamw"]()
    sharded, state, _ = sf.checkpoint.load(path, sharded, opt.init(sharded))
    loaded = sf.gather(sharded), {k: sf.gather(sharded.replace(dict(v))) for k, v in (("mu", state.mu), ("nu", state.nu))}
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    _, _, m = step(sharded, state, split_batch(gpt_batches(3)[2], mesh.rank, mesh.size))
    return loaded, float(m["loss"])


@pytest.mark.parametrize("saved", ["flat", "rows"])
def test_a_checkpoint_of_either_placement_loads_into_the_other_at_any_world_size(clusters, tmp_path, saved):
    path = str(tmp_path / "ckpt")
    params, moments = clusters[2].run(_save, path, saved)[0]
    next_loss = {}
    for world, strategy in ((1, "FULL_SHARD"), (3, "FULL_SHARD"), (3, "SHARD_GRAD_OP"), (4, "NO_SHARD")):
        for placement in ("flat", "rows"):
            (lp, lm), loss = clusters[world].run(_load, path, placement, strategy)[0]
            assert all(torch.equal(lp[k], params[k]) for k in params), (world, placement)
            assert all(torch.equal(lm[k][n], moments[k][n]) for k in moments for n in moments[k]), (world, placement)
            next_loss.setdefault(world, set()).add(loss)
    assert all(len(losses) == 1 for losses in next_loss.values()), next_loss  # either placement trains on alike


# -- the optimizer on the buffers (shardfn.optim [Note: fused updates]) ------------------------


def _optimizer_ops(placement, opt_name, donate):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.inside, self.ops = False, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.inside:
                lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
                self.ops.append((func.overloadpacket.__name__, len(lists[0]) if lists else 1))
            return func(*args, **(kwargs or {}))

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD", placement=placement)
    opt = OPTIMIZERS[opt_name]()
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, donate=donate)
    update_, ops = opt.update_, Ops()

    def counted(*args, **kwargs):
        ops.inside = True
        try:
            return update_(*args, **kwargs)
        finally:
            ops.inside = False

    opt_counted = opt._replace(update_=counted)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt_counted, donate=donate)
    losses = []
    with ops:
        for b in gpt_batches(3):
            sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
            losses.append(float(m["loss"]))
    trainable = [u for u in sharded.layout.units if u.grad_numel]
    views = all(sharded[n]._base is not None for u in trainable for n in u.leaves) if placement == "flat" else None
    return ops.ops, losses, sf.gather(sharded), len(trainable), sum(len(u.leaves) for u in trainable), views


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
def test_the_optimizer_runs_once_per_flat_unit(clusters, opt_name):
    (rows_ops, rows_losses, rows_full, units, leaves, _), = clusters[2].run(_optimizer_ops, "rows", opt_name, True)[:1]
    flat_ops, flat_losses, flat_full, _, _, views = clusters[2].run(_optimizer_ops, "flat", opt_name, True)[0]
    assert flat_losses == rows_losses and all(torch.equal(flat_full[k], rows_full[k]) for k in rows_full)
    assert views  # the in-place update kept every shard a view of its unit's buffer
    # Each foreach op takes one tensor per unit instead of one per leaf (AdamW's sqrt too: a foreach op).
    assert {n for op, n in flat_ops if op.startswith("_foreach")} == {units}
    assert {n for op, n in rows_ops if op.startswith("_foreach")} == {leaves}
    assert sum(op.startswith("_foreach") for op, _ in flat_ops) == 3 * (9 if opt_name == "adamw" else 3)  # per step
    assert not any(op == "sqrt" for op, _ in flat_ops + rows_ops)
    assert units < leaves


def test_an_update_out_of_place_lays_the_new_shards_out_as_views_again(clusters):
    flat_ops, flat_losses, flat_full, _, _, views = clusters[2].run(_optimizer_ops, "flat", "adamw", False)[0]
    _, rows_losses, rows_full, _, _, _ = clusters[2].run(_optimizer_ops, "rows", "adamw", False)[0]
    assert flat_ops == [] and views  # donate=False: update + apply_updates, then one buffer per unit again
    assert flat_losses == rows_losses and all(torch.equal(flat_full[k], rows_full[k]) for k in rows_full)


# -- whole parameters (sf.whole) ----------------------------------------------------------------


def matrices(name, shape):
    return len(shape) == 2


@settings(max_examples=60)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), world=st.integers(1, 5))
def test_whole_leaves_each_live_on_one_rank_spread_largest_first(sizes, world):
    params = {f"p{i}": torch.randn(n, 3).requires_grad_() for i, n in enumerate(sizes)}
    layout = build_layout(Plan("FULL_SHARD", placement=sf.whole()), (world,), world, 1, params, [],
                          tree_info(None, params))
    (unit,) = layout.units
    assert unit.whole and unit.name == "<root>[whole]"
    holders = {n: [r for r in range(world) if layout.piece(n, r)[1]] for n in params}
    for n, t in params.items():  # the whole leaf on one rank, nothing of it elsewhere
        assert len(holders[n]) == (1 if t.numel() else 0)
        if t.numel():
            r = holders[n][0]
            assert layout.shard_shape(n, r) == (t.numel(),)
            assert torch.equal(layout.local_shard(n, params[n], r, torch.device("cpu")), t.detach().reshape(-1))
    # the shard buffer is the largest rank's share, and that share is what greedy LPT gives
    loads = [sum(layout.piece(n, r)[1] for n in params) for r in range(world)]
    lpt = [0] * world
    for n in sorted(params, key=lambda n: -params[n].numel()):
        lpt[lpt.index(min(lpt))] += params[n].numel()
    assert unit.numel == max(loads) == max(lpt)
    # a buffer with gaps still round-trips: every rank's pieces at their offsets, then unpacked views
    rows = []
    for r in range(world):
        buf = torch.zeros(unit.numel)
        for n in params:
            off, k = layout.piece(n, r)
            buf[off:off + k] = layout.local_shard(n, params[n], r, torch.device("cpu"))
        rows.append(buf)
    full = unpack_unit(torch.stack(rows), [layout.leaves[n] for n in unit.leaves], world)
    assert all(torch.equal(f, params[n].detach()) for n, f in zip(unit.leaves, full))
    packed = torch.full((world, unit.numel), float("nan"))
    pack_unit(packed, [params[n].detach() for n in unit.leaves], world, [layout.leaves[n].start for n in unit.leaves])
    assert torch.equal(packed, torch.stack(rows))


def _train_whole(strategy, placement, steps=3):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    plan = sf.Plan(strategy, placement=sf.whole(matrices) if placement == "whole" else placement,
                   bucket_bytes=None if strategy == "NO_SHARD" else 0)  # sharded: unit by unit ([Note: buckets])
    sharded = sf.shard(params, mesh, plan)
    opt = OPTIMIZERS["adamw"]()
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    losses = []
    with sf.record_collectives() as log:
        for b in gpt_batches(steps):
            sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
            losses.append(float(m["loss"]))
    rank = sharded.layout.shard_rank(mesh)
    whole = {n: tuple(sharded[n].shape) for n, leaf in sharded.layout.leaves.items()
             if sharded.layout.units[leaf.unit].whole}
    names = [u.name for u in sharded.layout.units]
    return losses, sf.gather(sharded), whole, names, rank, dict(log.counts())


@pytest.mark.parametrize("strategy, world", [("FULL_SHARD", 2), ("FULL_SHARD", 3), ("SHARD_GRAD_OP", 3),
                                             ("NO_SHARD", 2)])
def test_whole_matrices_train_bit_for_bit_as_rows(clusters, strategy, world):
    rows = clusters[world].run(_train_whole, strategy, "rows")
    whole = clusters[world].run(_train_whole, strategy, "whole")
    for (losses, full, *_), (rl, rfull, *_) in zip(whole, rows):
        assert losses == rl and all(torch.equal(full[k], rfull[k]) for k in full)
    _, _, shapes, names, _, counts = whole[0]
    assert "blocks.0[whole]" in names and "blocks.0" in names  # each block: its matrices whole, the rest flat
    # every matrix lies whole on exactly one rank
    held = {}
    for _, full, shapes, _, rank, _ in whole:
        for n, shape in shapes.items():
            if shape[0]:
                held.setdefault(n, []).append(rank)
                assert shape == (full[n].numel(),) or strategy == "NO_SHARD"
    if strategy != "NO_SHARD":
        assert set(held) == set(whole[0][2]) and all(len(r) == 1 for r in held.values())
    # each block is two units (its matrices whole, the rest flat): one more collective per block and
    # direction; none under NO_SHARD, whose units share one bucket's all-reduce ([Note: buckets])
    more = {k: (counts[k] - rows[0][5][k]) // 3 for k in counts}  # (3 steps counted)
    per_block = 2 if strategy == "FULL_SHARD" else 1
    assert more == ({"all_reduce": 0} if strategy == "NO_SHARD" else
                    {"all_gather": per_block * 2 + 1, "reduce_scatter": 3, "all_reduce": 0}), more


def test_a_whole_checkpoint_loads_into_flat_and_rows(clusters, tmp_path):
    path = str(tmp_path / "ckpt")
    params, moments = clusters[2].run(_save, path, sf.whole(matrices))[0]
    for world in (1, 3):
        for placement in ("flat", "rows", "whole"):
            (lp, lm), _ = clusters[world].run(_load, path, placement if placement != "whole" else sf.whole(matrices),
                                              "FULL_SHARD")[0]
            assert all(torch.equal(lp[k], params[k]) for k in params), (world, placement)
            assert all(torch.equal(lm[k][n], moments[k][n]) for k in moments for n in moments[k]), (world, placement)


def test_explain_shows_each_units_placement_and_padding():
    from shardfn.testing.models import GPT
    from test_equivalence import GPT_CFG

    with torch.device("meta"):
        model = GPT(GPT_CFG)
    flat = sf.explain(model, 3, "FULL_SHARD", verbose=False)
    rows = sf.explain(model, 3, sf.Plan("FULL_SHARD", placement="rows"), verbose=False)
    whole = sf.explain(model, 3, sf.Plan("FULL_SHARD", placement=sf.whole(matrices)), verbose=False)
    for report, placement in ((flat, "flat"), (rows, "rows")):
        assert {u.placement for u in report.units} == {placement}
    assert {u.placement for u in whole.units} == {"flat", "whole"}
    # padding: what the placement costs beyond the parameters, all ranks together
    for report in (flat, rows, whole):
        for u in report.units:
            assert u.padding == u.param_bytes // 4 * 3 - u.params
    assert all(u.padding < 3 for u in flat.units)  # flat pads to a multiple of the ranks, at most world - 1
    assert sum(u.padding for u in rows.units) > sum(u.padding for u in flat.units)
    assert "placement" in str(flat) and "whole" in str(whole)


# -- saved tensors: each packed as a view of its own leaf ---------------------------------


class Views(torch.nn.Module):
    """Three parameters of one unit, each saved for backward as a view at an offset inside it."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(6, 4))
        self.w2 = torch.nn.Parameter(torch.randn(7))
        self.w3 = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        h = x @ torch.sin(self.w1[2:]).t()  # rows 2.. of w1 (saved by sin): [4, 4]
        h = h[:, :3] * self.w2[2:5]  # elements 2..4 of w2
        return torch.tanh(h) @ self.w3[1:]  # rows 1.. of w3: [3, 4]


def _views_loss(apply, params, batch):
    return apply(params, batch["x"]).square().mean()


def _saved_views(placement, regather_apart):
    """Gradients of one FULL_SHARD batch, and for each saved-tensor handle packed in forward
    the leaf it names and whether the saved tensor lies inside that leaf. ``regather_apart``:
    backward's regather gives each leaf a storage of its own (an all-gather laid out anew),
    so a handle made again from another leaf's storage, or at its absolute offset, shows."""
    import shardfn._group.gather as G

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(torch.nn.Sequential(Views(), Views()))
    sharded = sf.shard(params, mesh, "FULL_SHARD", units=sf.by_module_type(Views), placement=placement)
    batch = {"x": torch.randn(2 * mesh.size, 4, generator=torch.Generator().manual_seed(1))}
    handles, unpack, init = [], G.unpack_unit, G._Handle.__init__

    def regather(*args):
        full = unpack(*args)
        return [t.clone() for t in full] if regather_apart and G._in_backward() else full

    def record(self, unit, index, t, kind=0):
        init(self, unit, index, t, kind)
        leaf = unit.full[index]
        start, end = leaf.storage_offset(), leaf.storage_offset() + leaf.numel()
        handles.append((unit.unit.leaves[index], start <= t.storage_offset() < end))

    G.unpack_unit, G._Handle.__init__ = regather, record
    try:
        _, grads, _ = sf.jit_grad(_views_loss, mesh)(sharded, split_batch(batch, mesh.rank, mesh.size))
    finally:
        G.unpack_unit, G._Handle.__init__ = unpack, init
    return sf.gather(sharded.replace(dict(grads))), sorted(set(handles))


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_a_saved_view_is_made_again_from_its_own_leaf(clusters, placement):
    every_leaf = [(f"{m}.{w}", True) for m in "01" for w in ("w1", "w2", "w3")]
    grads = None
    for apart in (False, True):
        for got, handles in clusters[2].run(_saved_views, placement, apart):
            # every leaf of both units saved, and each handle names the leaf its tensor lies in
            assert handles == every_leaf
            # and backward makes it again from that leaf's regathered value, wherever it lies
            grads = grads or got
            for n, g in grads.items():
                assert torch.equal(got[n], g), n
