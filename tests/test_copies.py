"""Copies per training step: exactly what [Note: copies] (shardfn/_group/gather.py, _group/reduce.py) says remains.

A ``TorchDispatchMode`` sees every aten op a step issues. Ops that move tensor data
without computing anything new (``copy_``, ``_to_copy``, ``cat``, ``clone``, the
``*_copy`` ops, ...) are copies; each is attributed to

* the unit machinery: ``Unit._issue`` (pack the shards into the all-gather input),
  ``Unit._gather`` (unpack the gathered buffer; NO_SHARD's cast) -> direction
  "gather"; ``UnitGrads._accumulate`` (pack gradients), ``UnitGrads._issue`` (the
  collectives) and ``UnitGrads.to_master`` (cast back) -> "reduce";
* gloo: the copy gloo's own reduce-scatter made into the output shard, when it ran (shardfn
  now reduce-scatters on gloo with sends and receives summed into the output, no copy);
* the model: the rest of the forward (``loss_fn``) and backward (``shardfn::backward``),
  which must equal the copies of a plain ``functional_call`` forward and backward of the
  same model; anything else the step does (metrics, optimizer) is reported, not asserted.

Expected counts and bytes (written) are derived from the layout, never typed in.
"""

import collections
import functools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from shardfn._state.layout import build_layout
from shardfn._state.packing import local_shard, pack_leaf, pack_unit, unpack_leaf, unpack_unit
from shardfn._state.plan import Plan
from shardfn._state.tree import tree_info
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=31, seq_len=8, d_model=16, n_layers=3, n_heads=2)  # as test_counts.py
aten = torch.ops.aten

# Ops that only move data: what a copy is. Views (view, slice, t, ...) and fills are not.
_COPIES = {
    aten.copy_, aten._to_copy, aten.clone, aten.cat, aten.stack, aten._chunk_cat,
    aten.split_with_sizes_copy, aten.narrow_copy, aten.index, aten.index_select,
    aten.expand_copy, aten.slice_copy, aten.select_copy, aten.view_copy, aten.permute_copy,
}


def _is_copy(func) -> bool:
    name = func.overloadpacket.__name__
    return func.overloadpacket in _COPIES or name.endswith(("_copy", "copy_"))


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CopyLog(TorchDispatchMode):
    """Every copy op issued inside the block: ``(where, unit, op, bytes written)``.

    ``where`` is "gather" / "reduce" (inside the unit methods named in the module
    docstring), "gloo", "forward" (inside ``self.phase = "forward"``), "backward"
    (inside the ``shardfn::backward`` profiler range) or "step".
    """

    def __init__(self):
        super().__init__()
        self.copies = []
        self.tags = []  # (direction, unit name), innermost last
        self.phase = None
        self._ranges = []  # names of the open profiler ranges, innermost last
        self._reduce_outputs = {}  # data_ptr -> reduce-scatter output whose copy is gloo's
        self._thread = threading.get_ident()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.profiler._record_function_enter_new.default:
            self._ranges.append(args[0])
        elif func is torch.ops.profiler._record_function_exit._RecordFunction:
            self._ranges.pop()
        elif func is torch.ops.c10d._reduce_scatter_base_.default:
            self._reduce_outputs[args[0].data_ptr()] = args[0]
        elif _is_copy(func):
            in_place = func.overloadpacket in (aten.copy_, aten._foreach_copy_)  # they write their first argument
            written = kwargs.get("out", args[0] if in_place else out)
            where, unit = self._where(func, args)
            self.copies.append((where, unit, func.overloadpacket.__name__, _nbytes(written)))
        return out

    def _where(self, func, args):
        if func.overloadpacket is aten.copy_ and self._reduce_outputs.pop(args[0].data_ptr(), None) is not None:
            return "gloo", ""
        if threading.get_ident() != self._thread:
            return "other thread", ""
        if self.tags:
            return self.tags[-1]
        if "shardfn::backward" in self._ranges:
            return "backward", ""
        return self.phase or "step", ""

    def by_unit(self, where):
        """``{unit: (copies, bytes)}`` for one direction."""
        out = collections.defaultdict(lambda: (0, 0))
        for w, unit, _, nbytes in self.copies:
            if w == where:
                c, b = out[unit]
                out[unit] = (c + 1, b + nbytes)
        return dict(out)

    def histogram(self, *wheres):
        return collections.Counter((op, nbytes) for w, _, op, nbytes in self.copies if w in wheres)


def _tagged(log, method, direction):
    def wrapper(self, *args, **kwargs):
        # a unit (Unit, UnitGrads), a bucket, or a unit group's collective for a unit or a bucket
        owner = args[0] if type(self).__name__ == "UnitGroup" else self
        log.tags.append((direction, owner.unit.name if hasattr(owner, "unit") else owner.name))
        try:
            return method(self, *args, **kwargs)
        finally:
            log.tags.pop()

    return wrapper


def expected_copies(layout):
    """[Note: copies], per unit: ``{direction: {unit: (copies, bytes)}}`` of one step on one rank."""
    W = layout.world
    gather, reduce = {}, {}
    in_gather_bucket = {i for b in layout.gather_buckets if len(b) > 1 for i in b}
    for b in layout.gather_buckets:
        if len(b) > 1:  # [Note: buckets]: each gather packs the members' shards into the input (one
            # foreach copy of their buffers, flat; a pack per member, rows), and splits the output
            # into their [W, n] buffers in one copy
            members = [layout.units[i] for i in b]
            g, p, n = layout.unit_collectives(members[0])["all_gather"][0], members[0].param_dtype.itemsize, \
                sum(u.numel for u in members)
            packs = 1 if members[0].flat else len(members)
            gather[layout.bucket_name(b)] = (g * (packs + 1), g * (n + W * n) * p)
    for b in layout.buckets:
        if len(b) > 1 and W > 1:  # [Note: buckets]: one cat lays the members' [W, gn] buffers side by side
            reduce[layout.bucket_name(b)] = (1, W * sum(layout.units[i].grad_numel for i in b)
                                             * layout.units[b[0]].reduce_dtype.itemsize)
    for u in layout.units:
        p, r, m = u.param_dtype.itemsize, u.reduce_dtype.itemsize, u.dtype.itemsize
        if W > 1 and u.index in in_gather_bucket:
            # [Note: buckets]: the bucket packs and splits (below); rows, each gather unpacks (W*n).
            if not u.flat:
                g = layout.unit_collectives(u)["all_gather"][0]
                gather[u.name] = (g, g * W * u.numel * p)
        elif W > 1 and u.flat:
            # [Note: placements]: the shard buffer is sent as it is and the leaves are views
            # of the output; only a cast to the param dtype copies (n elements, each gather).
            if u.param_dtype != u.dtype:
                g = layout.unit_collectives(u)["all_gather"][0]
                gather[u.name] = (g, g * u.numel * p)
        elif W > 1:
            # Each gather: pack the shards into this rank's row of the output (n elements,
            # cast included), unpack the whole [W, n] output into the leaves.
            g = layout.unit_collectives(u)["all_gather"][0]
            gather[u.name] = (2 * g, g * (u.numel + W * u.numel) * p)
        elif u.param_dtype != u.dtype:
            # NO_SHARD or a world of one: the shard is the parameter; only a cast copies,
            # leaf by leaf (a flat unit: its buffer at once), at each gather (FULL_SHARD
            # casts again for the backward).
            g = 2 if W == 1 and layout.strategy.reshard_after_forward and u.path != "" else 1
            gather[u.name] = (g * (1 if u.flat else len(u.leaves)), g * u.numel * p)
        if u.grad_numel and W == 1 and layout.replicas == 1:
            # A world of one reduces nothing: autograd's gradients are kept as they are,
            # only cast, leaf by leaf, to the reduce dtype and back to the master dtype
            # where they differ.
            to_reduce, to_master = u.param_dtype != u.reduce_dtype, u.reduce_dtype != u.dtype
            trainable = sum(layout.leaves[n].grad_offset >= 0 for n in u.leaves)
            if (to_reduce or to_master) and u.flat:  # one cat into a buffer, then its cast
                reduce[u.name] = (1 + to_master, u.grad_numel * (r + to_master * m))
            elif to_reduce or to_master:
                reduce[u.name] = ((to_reduce + to_master) * trainable, u.grad_numel * (to_reduce * r + to_master * m))
        elif u.grad_numel:
            # Pack every gradient into the [W, grad_numel] reduce buffer (cast included),
            # then return the reduced shard to the master dtype if it was reduced in another.
            cast = u.reduce_dtype != u.dtype
            reduce[u.name] = (1 + cast, W * u.grad_numel * r + cast * u.grad_numel * m)
    return {"gather": gather, "reduce": reduce}


PATCHED = [("_group.group", "UnitGroup", "_all_gather", "gather"), ("_group.gather", "Unit", "_gather", "gather"),
           ("_group.buckets", "GatherBucket", "packed", "gather"), ("_group.group", "UnitGroup", "_land", "gather"),
           ("_group.group", "UnitGroup", "_issue_bucket", "reduce"),
           ("_group.reduce", "UnitGrads", "accumulate", "reduce"), ("_group.group", "UnitGroup", "_issue", "reduce"),
           ("_group.reduce", "UnitGrads", "to_master", "reduce")]


def count_step(strategy, precision, placement="rows", bucket_bytes=0):
    import importlib

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, strategy, precision=precision, placement=placement, bucket_bytes=bucket_bytes)
    opt = sf.optim.sgd(0.1)
    state = opt.init(sharded)
    log = CopyLog()

    def loss_fn(apply, p, b):
        log.phase = "forward"
        try:
            return lm_loss(apply(p, b["x"]), b["y"])
        finally:
            log.phase = None

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)  # prefetch and overlap on, as by default
    g = torch.Generator().manual_seed(0)
    batch = split_batch({k: torch.randint(0, 31, (12, 8), generator=g) for k in ("x", "y")}, mesh.rank, mesh.size)
    sharded, state, _ = step(sharded, state, batch)  # a first step; count a steady-state one
    classes = {(m, c): getattr(importlib.import_module(f"shardfn.{m}"), c) for m, c, _, _ in PATCHED}
    originals = [(classes[(m, c)], name, getattr(classes[(m, c)], name), d) for m, c, name, d in PATCHED]
    try:
        for cls, name, method, direction in originals:
            setattr(cls, name, _tagged(log, method, direction))
        with log:
            sharded, state, _ = step(sharded, state, batch)
    finally:
        for cls, name, method, _ in originals:
            setattr(cls, name, method)

    # The same model's own forward and backward, unsharded, in the compute dtype.
    dtype = sharded.layout.units[0].param_dtype
    full = {n: t.detach().to(dtype).requires_grad_(t.requires_grad) for n, t in params.items()}
    ref = CopyLog()
    with ref:
        ref.phase = "forward"
        loss = lm_loss(apply(full, batch["x"]), batch["y"])
        ref.phase = "backward"
        torch.autograd.grad(loss, [t for t in full.values() if t.requires_grad])

    layout = sharded.layout
    return {
        "expected": expected_copies(layout),
        "gather": log.by_unit("gather"),
        "reduce": log.by_unit("reduce"),
        "gloo": log.by_unit("gloo").get("", (0, 0)),
        "reduce_scatter_shards": sorted(u.grad_numel * u.reduce_dtype.itemsize for u in layout.units if u.grad_numel)
        if layout.world > 1 else [],
        "unexplained": [c for c in log.copies if c[0] == "other thread"],
        "model": sorted(log.histogram("forward", "backward").items()),
        "reference": sorted(ref.histogram("forward", "backward").items()),
        "step": sorted(log.histogram("step").items()),
        "ops": sorted(collections.Counter((w, u, op) for w, u, op, _ in log.copies if w in ("gather", "reduce")).items()),
    }


BF16 = sf.Precision(param=torch.bfloat16, reduce=torch.float32)
BF16_REDUCE = sf.Precision(param=torch.bfloat16)  # reduced in bf16: the shard is cast back to fp32
# Units alone (bucket_bytes=0: the copies of [Note: copies]), and in buckets ([Note: buckets]).
CONFIGS = [(s, p, 2, "rows", 0) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD") for p in (None, BF16)] + [
    ("FULL_SHARD", BF16_REDUCE, 2, "rows", 0)
] + [("FULL_SHARD", p, 1, "rows", 0) for p in (None, BF16, BF16_REDUCE)] + [
    (s, p, w, "flat", 0) for s, w in (("FULL_SHARD", 2), ("SHARD_GRAD_OP", 3), ("NO_SHARD", 2)) for p in (None, BF16)
] + [("FULL_SHARD", BF16_REDUCE, 3, "flat", 0), ("FULL_SHARD", BF16, 1, "flat", 0),
     ("FULL_SHARD", BF16_REDUCE, 1, "flat", 0)] + [
    ("FULL_SHARD", None, 2, "flat", None), ("FULL_SHARD", BF16_REDUCE, 3, "rows", None),
    ("SHARD_GRAD_OP", BF16, 2, "flat", None), ("NO_SHARD", None, 2, "flat", None)]
IDS = [f"{s}-{'fp32' if p is None else 'bf16/' + str(p.reduce or p.param)[6:]}-w{w}-{pl}{'-buckets' if b is None else ''}"
       for s, p, w, pl, b in CONFIGS]


@pytest.fixture(scope="module")
def counted(clusters):
    return {c: clusters[c[2]].run(count_step, c[0], c[1], c[3], c[4])[0] for c in CONFIGS}


@pytest.mark.parametrize("strategy,precision,world,placement,buckets", CONFIGS, ids=IDS)
def test_copies_per_unit_and_direction_are_the_designed_ones(counted, strategy, precision, world, placement, buckets):
    r = counted[(strategy, precision, world, placement, buckets)]
    print(f"\n{strategy} {precision}: machinery copies by unit:")
    for key, n in r["ops"]:
        print(f"  {n:3d} x {key}")
    print(f"  gloo {r['gloo']}; step (metrics, optimizer): {r['step']}")
    assert r["gather"] == r["expected"]["gather"]
    assert r["reduce"] == r["expected"]["reduce"]
    assert r["unexplained"] == []


@pytest.mark.parametrize("strategy,precision,world,placement,buckets", CONFIGS, ids=IDS)
def test_the_rest_is_the_models_own_copies(counted, strategy, precision, world, placement, buckets):
    r = counted[(strategy, precision, world, placement, buckets)]
    # Outside the unit machinery, forward and backward copy exactly what the plain
    # model does on one device (here: the attention's head merge, a reshape of a
    # transposed tensor).
    assert r["model"] == r["reference"]
    # gloo's reduce-scatter wrote each output shard with one copy of its own; shardfn's
    # (sends and receives, summed straight into the output shard) copies nothing.
    assert r["gloo"] == (0, 0)


# -- the packing helpers, single process -------------------------------------------------

shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60)
@given(shapes=st.lists(shapes, min_size=1, max_size=4), world=st.integers(1, 5), cast=st.booleans())
def test_unit_packing_equals_leaf_packing_in_one_copy(shapes, world, cast):
    params = {f"p{i}": torch.randn(s) for i, s in enumerate(shapes)}
    layout = build_layout(Plan("FULL_SHARD", placement="rows"), (world,), world, 1, params, [], tree_info(None, params))
    (unit,) = layout.units
    leaves = [layout.leaves[n] for n in unit.leaves]
    rows = [torch.cat([local_shard(params[n], layout.leaves[n], r, torch.device("cpu")).reshape(-1) for n in unit.leaves])
            for r in range(world)]
    gathered = torch.stack(rows)
    with CopyLog() as log:
        full = unpack_unit(gathered, leaves, world)
    assert log.histogram("step") == collections.Counter({("split_with_sizes_copy", world * unit.numel * 4): 1})
    for t, leaf in zip(full, leaves):
        assert t.shape == leaf.shape and t.is_contiguous()
        torch.testing.assert_close(t, unpack_leaf(gathered, leaf, world), rtol=0, atol=0)
    # Packing (non-contiguous sources, cast to the buffer's dtype) gives what pack_leaf gives.
    dtype = torch.bfloat16 if cast else torch.float32
    buf = torch.full((world, unit.numel), float("nan"), dtype=dtype)
    sources = [params[n].t().contiguous().t() if params[n].dim() == 2 else params[n] for n in unit.leaves]
    with CopyLog() as log:
        pack_unit(buf, sources, world)
    nonempty = any(params[n].numel() for n in unit.leaves)
    assert log.histogram("step") == (collections.Counter({("_chunk_cat", buf.numel() * buf.element_size()): 1})
                                     if nonempty else collections.Counter())
    expect = torch.full((world, unit.numel), float("nan"), dtype=dtype)
    for n in unit.leaves:
        pack_leaf(expect, params[n], layout.leaves[n], world, layout.leaves[n].offset)
    torch.testing.assert_close(buf, expect, rtol=0, atol=0)


# -- a world of one keeps autograd's gradients ----------------------------------------------


class TwoBiases(torch.nn.Module):
    """``out + a + b``: autograd hands ``a`` and ``b`` the very same gradient tensor."""

    def __init__(self, d=6):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, d))
        self.a = torch.nn.Parameter(torch.randn(d))
        self.b = torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        return (x @ self.w).mean(0) + self.a + self.b


def two_biases_loss(apply, params, batch):
    return (apply(params, batch["x"]) - 1).square().mean()


def test_world_of_one_copies_gradients_that_share_memory(clusters):
    # Kept as they are, a and b would share one gradient tensor, which the in-place
    # optimizer uses as scratch: b's update would read a's. Each must get its own.
    batches = [{"x": torch.randn(4, 6, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    report = sf.testing.check_equivalence(
        TwoBiases, two_biases_loss, batches, optimizer=functools.partial(sf.optim.adamw, 0.1),
        strategies=["FULL_SHARD", "NO_SHARD"], world_sizes=[1], clusters=clusters, raise_on_failure=False,
    )
    assert report.failures() == []
