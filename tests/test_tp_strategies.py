"""Tensor parallelism under every strategy (issue 50): the test GPT with its MLPs split over
the tensor axis, each strategy's sharding over the other axes, equal to one process."""

import pytest
import torch
from torch import nn

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import reference_training, split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model
from test_precision import BF16, EPS, LR, STEPS, reference
from test_tensor_parallel import ATOL, PLAN, RTOL, _check, _train, batches, loss_fn, model


@pytest.mark.parametrize("strategy", ["NO_SHARD", "SHARD_OPTIMIZER"])
def test_no_shard_and_shard_optimizer_at_shard_two_by_tensor_two_equal_one_process(clusters, strategy):
    results = clusters[4].run(_train, strategy, 2)
    assert results[0][5] == (("shard", "tensor"), (2, 2), 2)
    _check(results, 2)
    kind = "all_reduce" if strategy == "NO_SHARD" else "reduce_scatter"
    for rank, r in enumerate(results):  # one gradient reduction a step, over the data ranks, never the tensor axis
        assert r[6] == [[(kind, (rank % 2, rank % 2 + 2))]] * 3, (rank, r[6])
    results = clusters[2].run(_train, strategy, 2)  # tensor 2 alone: one data rank, nothing to reduce
    _check(results, 1)
    assert all(r[6] == [[]] * 3 for r in results), [r[6] for r in results]


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])
def test_hybrids_at_replicate_two_by_tensor_two_equal_one_process(clusters, strategy):
    results = clusters[4].run(_train, strategy, 2, 2)
    assert results[0][5] == (("replicate", "shard", "tensor"), (2, 1, 2), 2)
    _check(results, 2)
    for rank, r in enumerate(results):  # over the replicas {0, 2} and {1, 3}, never the tensor axis
        assert r[6] == [[("all_reduce", (rank % 2, rank % 2 + 2))]] * 3, (rank, r[6])



class PostNormBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))

    def forward(self, x):
        return torch.tanh(x + self.mlp(x))


class PostNorm(nn.Module):
    """Blocks whose rowwise output is saved inside the block (by the tanh after the residual):
    a recompute must make the rowwise layer's all-reduce again to save the forward's value."""

    def __init__(self, d=8, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(PostNormBlock(d) for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


POST_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def _mse(apply, params, batch):
    return apply(params, batch["x"]).pow(2).mean()


def _post_batches():
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(4, 8, generator=g)} for _ in range(3)]


def _train_post(mode):
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(PostNorm())
    plan = sf.Plan("FULL_SHARD", units=["blocks.0", "blocks.1"], remat=sf.Remat(mode=mode))
    sharded = sf.shard(params, mesh, plan, tensor_parallel=POST_PLAN)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(_mse, mesh, optimizer=opt)
    losses, logs = [], []
    for batch in _post_batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, batch)
        losses.append(float(metrics["loss"]))
        logs.append(sorted(c.unit for c in log.select("tensor")))
    return losses, logs, sf.gather(sharded)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_remat_recomputes_a_saved_rowwise_output_with_its_all_reduce(clusters, mode):
    ref_losses, ref_state = reference_training(PostNorm, _mse, _post_batches(), SGD_MOMENTUM)
    for losses, logs, full in clusters[2].run(_train_post, mode):
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for name, ref in ref_state.items():
            assert float(((full[name] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, name
        # per block and step: the rowwise output's all-reduce in forward and again in the
        # recompute, the colwise input gradient's in backward (not block 0's: the batch has none)
        assert logs == [sorted(["blocks.0.mlp.2"] * 2 + ["blocks.1.mlp.0"] + ["blocks.1.mlp.2"] * 2)] * 3, logs


def _plan(strategy, **kw):
    return sf.Plan(strategy, **kw)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_remat_at_shard_two_by_tensor_two_equals_one_process(clusters, mode):
    results = clusters[4].run(_train, _plan("FULL_SHARD", remat=sf.Remat(mode=mode)), 2)
    _check(results, 2)  # (each block's rowwise output is saved by nothing inside it: no recompute makes it)


def test_offload_at_shard_two_by_tensor_two_equals_one_process(clusters):
    results = clusters[4].run(_train, _plan("FULL_SHARD", offload=sf.Offload(params=True, optimizer=True)), 2)
    _check(results, 2)


def _bf16_run(precision, model_fn=gpt_model, plan=PLAN, make_batches=lambda: gpt_batches(STEPS), loss=gpt_loss):
    """test_precision's sharded run (plain SGD, 3 steps) with a tensor axis of 2 (at world 4:
    shard 2 x tensor 2), the MLPs split (or ``plan``)."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model_fn())
    start = {n: p.detach().clone() for n, p in params.items()}
    sharded = sf.shard(params, mesh, "FULL_SHARD", precision=precision, tensor_parallel=plan)
    opt = sf.optim.sgd(LR)
    state = opt.init(sharded)
    step = sf.jit_step(loss, mesh, optimizer=opt)
    losses, dtypes = [], set()
    for b in make_batches():
        with sf.record_collectives() as log:
            sharded, state, m = step(sharded, state, split_batch(b, mesh.data_rank, mesh.data_size))
        losses.append(float(m["loss"]))
        once = ("sequence", "replicated_with_grad_allreduce")
        dtypes |= {str(c.dtype) for c in log.select("tensor") if c.unit not in once}
        # (a sequence region's and the per-head norms' partial gradients are summed as the
        # gradients are kept: reduce's dtype)
        dtypes |= {f"{c.unit} {c.dtype}" for c in log.select("tensor") if c.unit in once}
    full = sf.gather(sharded)
    return losses, {n: full[n] - start[n] for n in full}, {str(t.dtype) for t in sharded.values()}, dtypes


def test_bf16_at_shard_two_by_tensor_two_matches_a_reference_with_the_same_casts(clusters):
    # test_precision's bound (8 eps of bf16 times the largest updates' sum), derived there
    # for a rank's slice summed in bf16; a split layer adds one rounding of the same kind:
    # its partial sums, each rounded to bf16, are added by the tensor all-reduce in bf16.
    ref_losses, ref_delta, moved = reference(BF16)
    bound = 8 * EPS[torch.bfloat16]
    for losses, delta, shard_dtypes, tensor_dtypes in clusters[4].run(_bf16_run, BF16):
        assert shard_dtypes == {"torch.float32"} and tensor_dtypes == {"torch.bfloat16"}
        assert losses == pytest.approx(ref_losses, rel=bound)
        worst = max((delta[n] - d).abs().max().item() for n, d in ref_delta.items())
        assert worst <= bound * moved, (worst, bound * moved)


def _train_with(optimizer, micro_batches=1):
    """The test GPT, MLPs split, FULL_SHARD at shard 2 x tensor 2: each step's loss and norm, the gathered params."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(model())[0], mesh, "FULL_SHARD", tensor_parallel=PLAN)
    opt = optimizer()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=micro_batches)
    out = []
    for batch in batches():
        sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return out, sf.gather(sharded)


def _reference_with(optimizer):
    """One process on the global batches: each step's loss and gradient norm, the final params."""
    torch.manual_seed(0)
    params, apply = sf.functionalize(model())
    state = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    opt = optimizer()
    opt_state = opt.init(state)
    out = []
    for batch in batches():
        loss = loss_fn(apply, state, batch)
        grads = dict(zip(state, torch.autograd.grad(loss, list(state.values()))))
        out.append((float(loss.detach()), float(torch.sqrt(sum(g.square().sum() for g in grads.values())))))
        updates, opt_state = opt.update(grads, opt_state, state)
        state = {n: t.detach().requires_grad_() for n, t in sf.optim.apply_updates(state, updates).items()}
    return out, {n: t.detach() for n, t in state.items()}


def _clipped():
    return sf.optim.chain(sf.optim.clip_by_global_norm(0.5), SGD_MOMENTUM())


@pytest.mark.parametrize("optimizer, micro_batches", [(_clipped, 1), (SGD_MOMENTUM, 2)], ids=["clipped", "micro"])
def test_clipping_and_micro_batches_at_shard_two_by_tensor_two_equal_one_process(clusters, optimizer, micro_batches):
    ref_steps, ref_state = _reference_with(optimizer)
    if optimizer is _clipped:
        assert all(norm > 0.5 for _, norm in ref_steps)  # every step clips
    for steps, full in clusters[4].run(_train_with, optimizer, micro_batches):
        for (loss, norm), (ref_loss, ref_norm) in zip(steps, ref_steps):  # the norm over both axes, each step
            assert abs(loss - ref_loss) <= ATOL + RTOL * abs(ref_loss), (steps, ref_steps)
            assert abs(norm - ref_norm) <= ATOL + RTOL * ref_norm, (steps, ref_steps)
        for name, ref in ref_state.items():
            assert float(((full[name] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, name
