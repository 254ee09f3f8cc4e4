"""Exact collectives, bytes, residency and persistent state per rank, counted at the source."""

import math

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=31, seq_len=8, d_model=16, n_layers=3, n_heads=2)
FOUR = 4  # bytes per fp32 element


def _setup(strategy, optimizer=None, prefetch=False, placement="flat", **fields):
    """One step's setup; ``prefetch=False`` so that the exact gather/free order below holds."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    full_numel = {n: p.numel() for n, p in params.items()}
    rows = {n: (p.shape[0] if p.dim() else 1) for n, p in params.items()}
    sharded = sf.shard(params, mesh, strategy, placement=placement, **fields)
    opt = optimizer or sf.optim.sgd(0.1)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=opt, prefetch=prefetch)
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, 31, (12, 8), generator=g) for k in ("x", "y")}
    return mesh, sharded, state, step, split_batch(batch, mesh.rank, mesh.size), full_numel, rows


def padded_bytes(names, full_numel, rows, world, placement="flat"):
    """Bytes of the unit of `names` on all ranks: `flat`, laid end to end and padded at the end to
    a multiple of `world` elements; `rows`, each leaf's dim 0 padded to a multiple of `world`."""
    if placement == "flat":
        return math.ceil(sum(full_numel[n] for n in names) / world) * world * FOUR
    return sum(math.ceil(rows[n] / world) * world * (full_numel[n] // rows[n]) * FOUR for n in names)


def storage_bytes(tensors):
    """Bytes of the distinct storages the tensors live in (a flat unit's shards share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def count_one_step(strategy, placement="flat", **fields):
    mesh, sharded, state, step, batch, full_numel, rows = _setup(strategy, placement=placement, **fields)
    step(sharded, state, batch)  # a first step, then count a steady-state one
    with sf.record_collectives() as log, sf.track_residency() as res:
        step(sharded, state, batch)
    N = mesh.size
    blocks = [[n for n in full_numel if n.startswith(f"blocks.{i}.")] for i in range(CFG.n_layers)]
    root = [n for n in full_numel if not n.startswith("blocks.")]
    ranks = tuple(range(N))
    groups = {c.group for c in log.calls}
    per_kind = {}
    for c in log.calls:
        per_kind.setdefault(c.kind.value, []).append(((c.purpose.value, c.unit), c.nbytes, str(c.dtype)))
    return {
        "counts": dict(log.counts()),
        "bytes": dict(log.bytes()),
        "calls": per_kind,
        "groups_ok": groups <= {ranks},
        "expected_block_bytes": [padded_bytes(b, full_numel, rows, N if strategy != "NO_SHARD" else 1, placement)
                                 for b in blocks],
        "expected_root_bytes": padded_bytes(root, full_numel, rows, N if strategy != "NO_SHARD" else 1, placement),
        "layout_expectation": sharded.layout.collectives_per_step(),
        "buckets": [sharded.layout.bucket_name(b) for b in sharded.layout.buckets],
        "gather_buckets": [sharded.layout.bucket_name(b) for b in sharded.layout.gather_buckets],
        "max_live": res.max_live,
        "events": res.events,
    }


@pytest.mark.parametrize("placement", ["flat", "rows"])
@pytest.mark.parametrize("world", [2, 3])
def test_full_shard_two_gathers_one_reduce_scatter_per_unit(clusters, world, placement):
    r = clusters[world].run(count_one_step, "FULL_SHARD", placement, bucket_bytes=0)[0]
    blocks, root = r["expected_block_bytes"], r["expected_root_bytes"]
    # 3 blocks gathered twice (forward, backward), the root once; one reduce-scatter per unit;
    # plus one all-reduce of two floats: the loss metric and the gradients' sum of squares.
    assert r["counts"] == {"all_gather": 2 * 3 + 1, "reduce_scatter": 4, "all_reduce": 1}
    assert r["bytes"] == {"all_gather": 2 * sum(blocks) + root, "reduce_scatter": sum(blocks) + root, "all_reduce": 8}
    assert r["layout_expectation"] == {"all_gather": (7, 2 * sum(blocks) + root), "reduce_scatter": (4, sum(blocks) + root)}
    assert r["groups_ok"]
    assert all(dtype == "torch.float32" for _, _, dtype in r["calls"]["all_gather"])
    # Forward in order, backward in reverse; each block freed before the next is gathered.
    gathers = [t for t, _, _ in r["calls"]["all_gather"]]
    assert gathers == [("gather", "<root>"), ("gather", "blocks.0"), ("gather", "blocks.1"), ("gather", "blocks.2"),
                       ("regather", "blocks.2"), ("regather", "blocks.1"), ("regather", "blocks.0")]
    assert r["max_live"] == 1
    assert r["events"] == [
        ("gather", "blocks.0"), ("free", "blocks.0"), ("gather", "blocks.1"), ("free", "blocks.1"),
        ("gather", "blocks.2"), ("free", "blocks.2"),
        ("regather", "blocks.2"), ("free", "blocks.2"), ("regather", "blocks.1"), ("free", "blocks.1"),
        ("regather", "blocks.0"), ("free", "blocks.0"),
    ]


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_shard_grad_op_one_gather_one_reduce_scatter_per_unit(clusters, placement):
    r = clusters[2].run(count_one_step, "SHARD_GRAD_OP", placement, bucket_bytes=0)[0]
    blocks, root = r["expected_block_bytes"], r["expected_root_bytes"]
    assert r["counts"] == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 1}
    assert r["bytes"] == {"all_gather": sum(blocks) + root, "reduce_scatter": sum(blocks) + root, "all_reduce": 8}
    assert r["layout_expectation"] == {"all_gather": (4, sum(blocks) + root), "reduce_scatter": (4, sum(blocks) + root)}
    # Kept from forward into backward: all three blocks are gathered at the end of forward.
    assert r["max_live"] == 3
    assert [e for e, _ in r["events"]] == ["gather"] * 3 + ["free"] * 3


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_sharded_strategies_gather_and_reduce_per_bucket(clusters, placement):
    """FULL_SHARD and SHARD_GRAD_OP share collectives between neighbouring units ([Note:
    buckets]): the blocks of this small model gather in one all-gather (forward, and
    backward's regather), and every unit reduces in one reduce-scatter; the bytes are those
    of the units alone. A cap of two blocks cuts the gathers from the first block on and
    the reductions from the last one back."""
    full = clusters[2].run(count_one_step, "FULL_SHARD", placement)[0]
    blocks, root = full["expected_block_bytes"], full["expected_root_bytes"]
    assert full["gather_buckets"] == ["<root>", "blocks.0..blocks.2"] and full["buckets"] == ["<root>..blocks.2"]
    assert full["counts"] == {"all_gather": 1 + 2, "reduce_scatter": 1, "all_reduce": 1}
    assert full["bytes"] == {"all_gather": 2 * sum(blocks) + root, "reduce_scatter": sum(blocks) + root, "all_reduce": 8}
    assert full["layout_expectation"] == {"all_gather": (3, 2 * sum(blocks) + root),
                                          "reduce_scatter": (1, sum(blocks) + root)}
    assert [t for t, _, _ in full["calls"]["all_gather"]] == [
        ("gather", "<root>"), ("gather", "blocks.0..blocks.2"), ("regather", "blocks.0..blocks.2")]
    assert [t for t, _, _ in full["calls"]["reduce_scatter"]] == [("reduce", "<root>..blocks.2")]
    grad_op = clusters[2].run(count_one_step, "SHARD_GRAD_OP", placement)[0]
    assert grad_op["counts"] == {"all_gather": 1 + 1, "reduce_scatter": 1, "all_reduce": 1}
    assert grad_op["layout_expectation"] == {"all_gather": (2, sum(blocks) + root),
                                             "reduce_scatter": (1, sum(blocks) + root)}
    assert blocks[0] == blocks[1] == blocks[2] and root < blocks[0]
    two = clusters[2].run(count_one_step, "FULL_SHARD", placement, bucket_bytes=2 * blocks[0])[0]
    assert two["gather_buckets"] == ["<root>", "blocks.0..blocks.1", "blocks.2"]
    assert two["buckets"] == ["<root>..blocks.0", "blocks.1..blocks.2"]
    assert two["counts"] == {"all_gather": 1 + 2 * 2, "reduce_scatter": 2, "all_reduce": 1}
    assert two["bytes"] == full["bytes"]
    assert two["layout_expectation"] == {"all_gather": (5, 2 * sum(blocks) + root),
                                         "reduce_scatter": (2, sum(blocks) + root)}


def test_no_shard_one_all_reduce_per_bucket(clusters):
    """NO_SHARD reduces in buckets ([Note: buckets]): every unit of this small model in one
    all-reduce by default (25 MiB), one per unit without buckets, and a cap between the two
    cuts the units from the last one back."""
    r = clusters[2].run(count_one_step, "NO_SHARD")[0]
    blocks, root = r["expected_block_bytes"], r["expected_root_bytes"]
    total = sum(blocks) + root
    assert r["buckets"] == ["<root>..blocks.2"]
    assert r["counts"] == {"all_reduce": 1 + 1}  # the bucket's, and the metrics'
    assert r["bytes"] == {"all_reduce": total + 8}
    assert [unit for (_, unit), _, _ in r["calls"]["all_reduce"]] == ["<root>..blocks.2", ""]
    assert r["layout_expectation"] == {"all_reduce": (1, total)}
    assert r["max_live"] == 3
    alone = clusters[2].run(count_one_step, "NO_SHARD", bucket_bytes=0)[0]
    assert alone["buckets"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert alone["counts"] == {"all_reduce": 4 + 1} and alone["bytes"] == r["bytes"]
    assert alone["layout_expectation"] == {"all_reduce": (4, total)}
    assert root < blocks[0]  # so a cap of two blocks holds the last two, then the first and the root
    two = clusters[2].run(count_one_step, "NO_SHARD", bucket_bytes=2 * blocks[0])[0]
    assert two["buckets"] == ["<root>..blocks.0", "blocks.1..blocks.2"]
    assert two["counts"] == {"all_reduce": 2 + 1} and two["bytes"] == r["bytes"]
    assert two["layout_expectation"] == {"all_reduce": (2, total)}


def persistent_bytes(strategy, placement="flat"):
    mesh, sharded, state, step, batch, full_numel, rows = _setup(strategy, sf.optim.adamw(1e-3), placement=placement)
    sharded, state, _ = step(sharded, state, batch)
    shard_bytes = storage_bytes(sharded.values())
    state_bytes = storage_bytes([t for d in (state.mu, state.nu) for t in d.values()])
    N = mesh.size if strategy != "NO_SHARD" else 1
    units = [[n for n in full_numel if n.startswith(f"blocks.{i}.")] for i in range(CFG.n_layers)]
    units.append([n for n in full_numel if not n.startswith("blocks.")])
    expected = sum(padded_bytes(u, full_numel, rows, N, placement) for u in units) // N
    return shard_bytes, state_bytes, expected, sharded.layout.shard_bytes(), sum(full_numel.values()) * FOUR


@pytest.mark.parametrize("placement", ["flat", "rows"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_persistent_state_is_the_padded_one_nth_share(clusters, world, placement):
    results = clusters[world].run(persistent_bytes, "FULL_SHARD", placement)
    for shard_bytes, state_bytes, expected, layout_bytes, full_bytes in results:
        assert shard_bytes == expected == layout_bytes
        assert state_bytes == 2 * expected  # AdamW: mu and nu, fp32, shard-sized
    # NO_SHARD replicates: every rank holds everything.
    shard_bytes, state_bytes, expected, _, full_bytes = clusters[world].run(persistent_bytes, "NO_SHARD", placement)[0]
    assert shard_bytes == full_bytes and state_bytes == 2 * full_bytes


def reduce_scatter_average(values):
    """Each rank contributes `rank + 1` times `values`: the average is known exactly."""
    from shardfn._comm import collectives as C
    from shardfn._comm.events import Purpose

    N, r = dist.get_world_size(), dist.get_rank()
    inp = torch.tensor(values, dtype=torch.float32).repeat(N) * (r + 1)
    out = torch.empty(len(values))
    C.reduce_scatter(out, inp, sf.Mesh.from_group().channel("shard"), Purpose.TEST)
    t = torch.full((3,), float(r + 1))
    C.all_reduce(t, sf.Mesh.from_group().channel("shard"), Purpose.TEST)
    return out, t


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_average_really_averages(clusters, world):
    """A past gloo bug made ReduceOp.AVG sum (pytorch issue 162338); this would see it."""
    mean_factor = sum(range(1, world + 1)) / world
    for out, t in clusters[world].run(reduce_scatter_average, [1.0, -2.0, 4.0]):
        torch.testing.assert_close(out, torch.tensor([1.0, -2.0, 4.0]) * mean_factor)
        torch.testing.assert_close(t, torch.full((3,), mean_factor))


def rank_input(rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """Distinct per chunk and rank, at magnitudes where the order of a sum shows in the last bit."""
    return (torch.randn(world * 4, generator=torch.Generator().manual_seed(rank)) * 10.0**rank).to(dtype)


def reduce_scatter_chunks():
    """Every rank's input distinct per chunk and rank: each rank must end with the sum (and
    mean) of exactly its own chunk over all ranks, blocking or not, in fp32 and bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardfn._comm import collectives as C
    from shardfn._comm.events import Purpose

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.names.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    N, r = dist.get_world_size(), dist.get_rank()
    world = sf.Mesh.from_group().channel("shard")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        inp = rank_input(r, N, dtype)
        for op, name in ((C.SUM, "sum"), (C.AVG, "avg")):
            for asynchronous in (False, True):
                got = torch.empty(4, dtype=dtype)
                with sf.record_collectives() as log, Ops() as ops:
                    work = C.reduce_scatter(got, inp, world, Purpose.TEST, op=op, async_op=asynchronous)
                    if work is not None:
                        work.wait()
                out[(str(dtype), name, asynchronous)] = (got.float(), dict(log.bytes()), sorted(set(ops.names)))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_reduce_scatter_on_gloo_sums_each_ranks_own_chunk(clusters, world):
    # shardfn sends each chunk to its owner and sums locally (_collectives [Note: reduce-scatter
    # on gloo]); the chunks come from every other rank, in the right places, and every chunk is
    # summed in rank order ([Note: the order of the sum]): bit for bit a left-to-right sum in the
    # dtype, whichever rank owns the chunk.
    for r, results in enumerate(clusters[world].run(reduce_scatter_chunks)):
        for (dtype, op, _), (got, recorded, ops) in results.items():
            dt = getattr(torch, dtype.split(".")[1])
            total = rank_input(0, world, dt)[r * 4:r * 4 + 4]
            for s in range(1, world):
                total = total + rank_input(s, world, dt)[r * 4:r * 4 + 4]
            want = (total / world if op == "avg" else total).float()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert recorded == {"reduce_scatter": world * 4 * (4 if dtype == "torch.float32" else 2)}
            # Sends and receives (and the guard's header all-reduce), no gloo reduce-scatter.
            assert set(ops) == {"c10d::allreduce_", "c10d::recv_", "c10d::send"}, ops


def freed_for_real():
    """Weak references to the storage of every gathered tensor: FULL_SHARD's frees must
    release memory, not only the unit's own references (the graph, saved-tensor handles or
    anything they hold must not keep a storage alive)."""
    import weakref

    from shardfn._group.gather import Unit

    refs = {}  # (event, unit) -> weakrefs of the storages of the full tensors it produced
    original = Unit._gather
    dead_at = []

    def spy(self, event):
        full = original(self, event)
        if not self.is_root:
            # Every other unit's earlier gathers must be gone by now.
            alive = [key for key, rs in refs.items() if key[1] != self.unit.name and any(r() is not None for r in rs)]
            dead_at.append(((event, self.unit.name), alive))
            refs[(event, self.unit.name)] = [weakref.ref(t.untyped_storage()) for t in full]
        return full

    Unit._gather = spy
    try:
        mesh, sharded, state, step, batch, *_ = _setup("FULL_SHARD")
        step(sharded, state, batch)
    finally:
        Unit._gather = original
    return dead_at


def test_full_shard_frees_gathered_memory_not_just_the_count(clusters):
    dead_at = clusters[2].run(freed_for_real)[0]
    assert [k for k, _ in dead_at] == [
        ("gather", "blocks.0"), ("gather", "blocks.1"), ("gather", "blocks.2"),
        ("regather", "blocks.2"), ("regather", "blocks.1"), ("regather", "blocks.0"),
    ]
    assert all(alive == [] for _, alive in dead_at), dead_at


def profiled_step():
    mesh, sharded, state, step, batch, *_ = _setup("FULL_SHARD", bucket_bytes=0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(sharded, state, batch)
    return sorted({e.name for e in prof.events() if e.name.startswith("shardfn::")})


def test_profiler_ranges_name_units_collectives_and_optimizer(clusters):
    names = set(clusters[2].run(profiled_step)[0])
    for unit in ("blocks.0", "blocks.2"):
        assert {f"shardfn::forward[{unit}]", f"shardfn::all_gather[gather:{unit}]",
                f"shardfn::all_gather[regather:{unit}]", f"shardfn::backward_reduce[{unit}]",
                f"shardfn::reduce_scatter[reduce:{unit}]"} <= names
    assert {"shardfn::backward", "shardfn::optimizer", "shardfn::all_reduce[metrics]"} <= names


def nested_recorders():
    mesh, sharded, state, step, batch, *_ = _setup("FULL_SHARD")
    with sf.record_collectives() as outer:
        step(sharded, state, batch)
        with sf.record_collectives() as inner, sf.track_residency() as r1, sf.track_residency() as r2:
            step(sharded, state, batch)
        step(sharded, state, batch)
    return len(outer.calls), len(inner.calls), r1.events == r2.events and len(r1.events) > 0


def test_nested_recorders_each_see_their_own_block(clusters):
    outer, inner, same = clusters[2].run(nested_recorders)[0]
    assert outer == 3 * inner and same


def prefetched_step(strategy):
    mesh, sharded, state, step, batch, *_ = _setup(strategy, prefetch=True, bucket_bytes=0)  # prefetch by unit
    step(sharded, state, batch)  # records the unit order
    with sf.record_collectives() as log, sf.track_residency() as res:
        step(sharded, state, batch)
    return dict(log.counts()), res.max_live, res.events


def test_prefetch_keeps_counts_and_at_most_two_units(clusters):
    counts, max_live, events = clusters[2].run(prefetched_step, "FULL_SHARD")[0]
    assert counts == {"all_gather": 7, "reduce_scatter": 4, "all_reduce": 1}  # as without prefetch
    assert max_live == 2  # the running unit and the prefetched one
    # Each unit's gather is started while the one before it still runs, in both directions.
    assert events == [
        ("gather", "blocks.0"), ("prefetch", "blocks.1"), ("free", "blocks.0"),
        ("gather", "blocks.1"), ("prefetch", "blocks.2"), ("free", "blocks.1"),
        ("gather", "blocks.2"), ("free", "blocks.2"),
        ("regather", "blocks.2"), ("prefetch", "blocks.1"), ("free", "blocks.2"),
        ("regather", "blocks.1"), ("prefetch", "blocks.0"), ("free", "blocks.1"),
        ("regather", "blocks.0"), ("free", "blocks.0"),
    ]
