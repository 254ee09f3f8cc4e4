"""Tensor parallelism under every strategy (issue 50): the test GPT with its MLPs split over
the tensor axis, each strategy's sharding over the other axes, equal to one process."""

import pytest
import torch
from torch import nn

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import reference_training, split_batch
from test_tensor_parallel import ATOL, PLAN, RTOL, _check, batches, loss_fn, model


def _train(strategy, tensor, replicate=None):
    mesh = sf.Mesh.from_group(replicate=replicate, tensor=tensor)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model())
    sharded = sf.shard(params, mesh, strategy, tensor_parallel=PLAN)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses, norms, logs = [], [], []
    for batch in batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        logs.append([(c.unit, c.kind.value, c.nbytes) for c in log.select("tensor")])
    local = {n: tuple(t.shape) for n, t in sharded.items()}
    return losses, norms, logs, sf.gather(sharded), local, (mesh.axis_names, mesh.shape, mesh.data_size)


@pytest.mark.parametrize("strategy", ["NO_SHARD", "SHARD_OPTIMIZER"])
def test_no_shard_and_shard_optimizer_at_shard_two_by_tensor_two_equal_one_process(clusters, strategy):
    results = clusters[4].run(_train, strategy, 2)
    assert results[0][5] == (("shard", "tensor"), (2, 2), 2)
    _check(results, 2)


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])
def test_hybrids_at_replicate_two_by_tensor_two_equal_one_process(clusters, strategy):
    results = clusters[4].run(_train, strategy, 2, 2)
    assert results[0][5] == (("replicate", "shard", "tensor"), (2, 1, 2), 2)
    _check(results, 2)



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
