"""Tensor parallelism with optimizers that need whole matrices, recorded steps and psum
(issue 50): Muon on split leaves equal to one process, the tensor axis's gathers counted."""

import pytest
import torch

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import reference_training, split_batch
from test_tensor_parallel import PLAN, batches, loss_fn, model

SPLIT = sorted(f"blocks.{b}.mlp.{i}.weight" for b in range(2) for i in (0, 2))
D, HIDDEN = 16, 64  # the test GPT's d_model and MLP width: a split weight is 64 x 16 whole, 32 x 16 per tensor rank
# tests/test_muon.py's tolerances: Newton-Schulz in fp32, a gradient's terms summed in another order
RTOL, ATOL = 1e-5, 1e-6


def matrices(name, shape):
    return len(shape) >= 2


def muon():
    return sf.optim.partition({"muon": sf.optim.muon(0.02, ns_dtype=torch.float32), "sgd": sf.optim.sgd(0.1)},
                              lambda name, shape: "muon" if matrices(name, shape) else "sgd")


def _train_muon(strategy):
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model())
    sharded = sf.shard(params, mesh, sf.Plan(strategy, placement=sf.whole(matrices)), tensor_parallel=PLAN)
    opt = muon()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses, gathers = [], []
    for batch in batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
        gathers.append(sorted((c.unit, c.nbytes) for c in log.select("tensor") if c.kind.value == "all_gather"))
    return losses, gathers, sf.gather(sharded), mesh.axis_rank("tensor")


def test_muon_on_split_leaves_equals_one_process(clusters):
    ref_losses, ref_state = reference_training(model, loss_fn, batches(), muon)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        results = clusters[4].run(_train_muon, strategy)
        for losses, _, full, _ in results:
            assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
            for name, ref in ref_state.items():
                diff = (full[name] - ref).abs() - RTOL * ref.abs()
                assert float(diff.max()) <= ATOL, (strategy, name, float(diff.max()))
        # each split weight's update pieces gathered once per step over the tensor axis, by the
        # tensor group (ranks 0, 1 or 2, 3) whose shard rank holds the weight whole: 64 x 16 fp32
        for t in range(2):
            for k in range(len(ref_losses)):
                got = sorted(g for s in range(2) for g in results[s * 2 + t][1][k])
                assert got == [(name, HIDDEN * D * 4) for name in SPLIT], (strategy, t, k, got)


# -- graph=True with a tensor axis ------------------------------------------------------------


def _run(graph, differ_at=None):
    """Three steps of the split GPT (FULL_SHARD, SGD with momentum) at shard 2 x tensor 2; at
    call ``differ_at`` rank 1 of each tensor group gets its rows in another order. Per call:
    the loss and the tensor axis's collectives, or the error and whether the state is as before."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(model())[0], mesh, "FULL_SHARD", tensor_parallel=PLAN)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, graph=graph)
    out = []
    for k, batch in enumerate(batches()):
        local = split_batch(batch, mesh.data_rank, mesh.data_size)
        if k == differ_at and mesh.axis_rank("tensor") == 1:
            local = {**local, "x": local["x"].flip(0)}
        before = {n: t.clone() for n, t in sharded.items()}
        try:
            with sf.record_collectives() as log:
                sharded, state, metrics = step(sharded, state, local)
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out.append((f"{type(e).__name__}: {e}", all(torch.equal(before[n], sharded[n]) for n in before)))
            break
        out.append((float(metrics["loss"]), sorted((c.unit, c.kind.value, c.nbytes) for c in log.select("tensor"))))
    return out, sf.gather(sharded) if differ_at is None else None


def test_graph_step_with_a_tensor_axis_equals_the_eager_step(clusters):
    eager = clusters[4].run(_run, False)
    graph = clusters[4].run(_run, True)
    # per block and call (warm-up, recording, replay): the rowwise output's all-reduce and the
    # colwise input gradient's, in the program as in the eager step; 2 of 4 rows x 8 x 16 fp32
    expect = sorted((f"blocks.{b}.mlp.{i}", "all_reduce", 2 * 8 * 16 * 4) for b in range(2) for i in (0, 2))
    for (e_calls, e_full), (g_calls, g_full) in zip(eager, graph):
        assert len(g_calls) == 3 and [c[1] for c in g_calls] == [expect] * 3, g_calls
        # tests/test_graph.py's bounds: the program sums a reduce-scatter's terms in rank order
        # ([Note: reduce-scatter on gloo]), the eager step in the order its sends arrive
        torch.testing.assert_close(torch.tensor([c[0] for c in g_calls]), torch.tensor([c[0] for c in e_calls]),
                                   rtol=1e-6, atol=0)
        for name, p in e_full.items():
            torch.testing.assert_close(g_full[name], p, rtol=1e-5, atol=1e-6)


def test_graph_step_ranks_of_a_tensor_group_with_other_batches_all_raise(clusters):
    for differ_at in (1, 2):  # the call that records, a call that replays
        for rank, (out, _) in enumerate(clusters[4].run(_run, True, differ_at)):
            group = [rank - rank % 2, rank - rank % 2 + 1]
            error, unchanged = out[differ_at]
            assert len(out) == differ_at + 1 and unchanged, (differ_at, rank, out)
            assert error.startswith(f"DivergenceError: [rank {rank}] shardfn: the ranks of tensor group {group} got "
                                    "different batches"), (differ_at, rank, error)


class _Mesh:
    """What jit_step(graph=...) asks of a mesh when it is built: a tensor axis of 2."""

    def __init__(self, device):
        self.device, self.backend = torch.device(device), "nccl" if device == "cuda" else "gloo"

    def axis_size(self, axis):
        return 2 if axis == "tensor" else 1


def test_graph_step_with_a_tensor_axis_on_a_device_is_refused(monkeypatch):
    from shardfn._jit import _check_graph

    monkeypatch.setenv("SHARDFN_CUDA_GRAPH", "1")  # not what refuses it
    with pytest.raises(ValueError, match=r"a mesh with a 'tensor' axis on cuda: each call checks .* reading the batch "
                                         r"on the host before the program"):
        _check_graph(True, _Mesh("cuda"), True, None, None, False)
    _check_graph(True, _Mesh("cpu"), True, None, None, False)  # built


def _muon_graph():
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model())
    sharded = sf.shard(params, mesh, sf.Plan("FULL_SHARD", placement=sf.whole(matrices)), tensor_parallel=PLAN)
    opt = muon()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, graph=True)
    for batch in batches()[:2]:  # a warm-up, a recording
        before = {n: t.clone() for n, t in sharded.items()}
        try:
            sharded, state, _ = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        except Exception as e:  # noqa: BLE001 (reported to the test)
            return f"{type(e).__name__}: {e}", all(torch.equal(before[n], sharded[n]) for n in before)
    return "accepted", None


def test_graph_step_refuses_muon_on_split_matrices(clusters):
    # The tensor group that holds a split matrix gathers its pieces, the other does not: the
    # ranks' programs differ (a DivergenceError naming fingerprints, not the cause, before)
    results = clusters[4].run(_muon_graph)
    for rank, (error, unchanged) in enumerate(results):
        assert unchanged, (rank, error)
        assert error.startswith(f"ValueError: [rank {rank}] jit_step(graph=True): this step cannot be recorded"), error
        assert "muon gathers the pieces of a matrix split over the 'tensor' axis" in error, error
        assert "graph=False" in error and "sf.optim.partition" in error
        assert "as a constant" not in error  # (no value is frozen: the programs differ)


# -- psum with a tensor axis ------------------------------------------------------------------


def _psums():
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(model())[0], mesh, "FULL_SHARD", tensor_parallel=PLAN)
    split = {leaf for leaf, *_ in sharded.layout.splits}
    out = {}
    with sf.on_shards(sharded):
        try:
            sf.optim.psum(sharded["blocks.0.mlp.0.weight"].double().square().sum())
            out["unsaid"] = "accepted"
        except ValueError as e:
            out["unsaid"] = str(e)
        with sf.record_collectives() as log:
            out["sums"] = {n: float(sf.optim.psum(p.double().square().sum(), split=n in split))
                           for n, p in sharded.items()}
        out["calls"] = [(c.kind.value, tuple(c.group)) for c in log.select("psum")]
    full = sf.gather(sharded)
    return out, {n: float(t.double().square().sum()) for n, t in full.items()}, len(split), len(sharded)


def test_psum_sums_over_the_axes_where_a_values_other_parts_live(clusters):
    for rank, (out, ref, n_split, n) in enumerate(clusters[4].run(_psums)):
        assert "psum(t): on a mesh with a 'tensor' axis" in out["unsaid"] and "split=True" in out["unsaid"]
        # fp64 sums of at most 64 x 16 terms, in pieces: relative rounding far below 1e-12
        for name, want in ref.items():
            assert abs(out["sums"][name] - want) <= 1e-12 * want, (rank, name, out["sums"][name], want)
        # split leaves over the shard axis then the tensor axis; the others over the shard axis only
        shard = tuple(r for r in range(4) if r % 2 == rank % 2)
        tensor = tuple(r for r in range(4) if r // 2 == rank // 2)
        calls = out["calls"]
        assert sorted(calls) == sorted([("all_reduce", shard)] * n + [("all_reduce", tensor)] * n_split), calls


# -- Adafactor with a tensor axis ---------------------------------------------------------------


def adafactor():  # on every leaf, the MLPs' split ones included
    return sf.optim.adafactor(0.05, weight_decay=0.01)


def _train_adafactor(placement):
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    plan = sf.Plan("FULL_SHARD", placement=placement)
    sharded = sf.shard(sf.functionalize(model())[0], mesh, plan, tensor_parallel=PLAN)
    opt = adafactor()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses = []
    for batch in batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
    groups = sorted(tuple(c.group) for c in log.select("psum"))
    return losses, sf.gather(sharded), groups


@pytest.mark.parametrize("placement", [None, "rows"])
def test_adafactor_on_split_leaves_equals_one_process(clusters, placement):
    # Each split leaf's row and column sums of g**2 are made at their places in the whole
    # parameter and summed over the tensor axis too: two all-reduces more per step (the
    # statistics and the updates' norms of the split leaves), each over the shard axis and
    # then the tensor axis.
    ref_losses, ref_state = reference_training(model, loss_fn, batches(), adafactor)
    for rank, (losses, full, groups) in enumerate(clusters[4].run(_train_adafactor, placement)):
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for name, ref in ref_state.items():
            diff = (full[name] - ref).abs() - RTOL * ref.abs()
            assert float(diff.max()) <= ATOL, (name, float(diff.max()))
        shard = tuple(r for r in range(4) if r % 2 == rank % 2)
        tensor = tuple(r for r in range(4) if r // 2 == rank // 2)
        assert groups == sorted([shard] * 4 + [tensor] * 2), groups
