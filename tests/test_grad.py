"""shardfn.jit_grad: a step's gradients as a tree of shards; psum on shards outside a step."""

import functools

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.optim import adamw, chain, clip_by_global_norm, psum, scale, sgd
from shardfn.testing import split_batch
from test_equivalence import gpt_model
from test_loops import padded_batches, token_mean

ADAMW = functools.partial(adamw, 1e-3)


def reference_gradients(batch):
    """Single process, global batch: the loss, each parameter's gradient, the global norm."""
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    out = token_mean(apply, state, batch)
    loss = out.total / out.count
    trainable = [n for n, t in state.items() if t.requires_grad]
    grads = dict(zip(trainable, torch.autograd.grad(loss, [state[n] for n in trainable])))
    norm = torch.stack([g.square().sum() for g in grads.values()]).sum().sqrt()
    return float(loss.detach()), grads, float(norm)


def mesh_for(strategy):
    return sf.Mesh.from_group(replicate=2 if strategy == "HYBRID_SHARD" else None)


def grads_of_one_batch(strategy, micro_batches):
    mesh = mesh_for(strategy)
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, strategy)
    grad_fn = sf.jit_grad(token_mean, mesh, micro_batches=micro_batches)
    batch = split_batch(padded_batches(1)[0], mesh.rank, mesh.size)
    loss, grads, metrics = grad_fn(sharded, batch)
    layout = sharded.layout
    shard_rank = layout.shard_rank(mesh)
    # Padding rows (past this rank's real rows) are zero; shapes are the shards'. (A flat
    # shard has no padding: it is a run of the parameter's elements.)
    padding_zero = all(g[layout.local_rows(n, shard_rank):].abs().sum() == 0 for n, g in grads.items()
                       if not layout.leaves[n].flat)
    shapes = all(g.shape == sharded[n].shape for n, g in grads.items())
    full = sf.gather(sharded.replace(dict(grads)))  # the gradient shards assembled like parameters
    with sf.on_shards(sharded), sf.record_collectives() as log:  # per-parameter norms: over the shards
        norms = {n: float(psum(g.square().sum()).sqrt()) for n, g in grads.items()}
    return (float(loss), metrics["loss"], float(grads.global_norm), metrics["grad_norm"], padding_zero, shapes,
            {n: full[n] for n in grads}, norms, dict(log.counts()))


@pytest.mark.parametrize("strategy, world, micro_batches", [
    ("FULL_SHARD", 2, 1), ("FULL_SHARD", 3, 2), ("SHARD_GRAD_OP", 2, 1), ("NO_SHARD", 2, 1), ("HYBRID_SHARD", 4, 1),
])
def test_grads_are_the_global_batch_gradients_as_shards(clusters, strategy, world, micro_batches):
    ref_loss, ref, ref_norm = reference_gradients(padded_batches(1)[0])
    for loss, metric_loss, norm, metric_norm, padding_zero, shapes, full, norms, counts in clusters[world].run(
            grads_of_one_batch, strategy, micro_batches):
        # The loss is a sum of n positive per-token terms (n <= 12 rows x 8 tokens), added here
        # in another tree (micro-batches, ranks, gloo's all-reduce) than the reference's one sum:
        # two orders differ by at most 2 (n - 1) u relative (u = 2**-24: 1.1e-5 at n = 96), and
        # each term by the rounding of its logits' matmul, whose shape differs (a slice of rows).
        assert loss == pytest.approx(ref_loss, rel=2 * 95 * 2**-24 + 1e-6) and metric_loss == loss
        assert norm == pytest.approx(ref_norm, rel=1e-5) and metric_norm == norm
        assert padding_zero and shapes
        assert full.keys() == ref.keys()
        for n, g in ref.items():
            torch.testing.assert_close(full[n], g, rtol=1e-5, atol=1e-7)
            assert norms[n] == pytest.approx(float(g.norm()), rel=1e-5, abs=1e-9), n
        # One psum (all-reduce) per parameter where ranks hold different shards; none under NO_SHARD.
        assert counts == ({} if strategy == "NO_SHARD" else {"all_reduce": len(ref)})


def step_vs_grad(steps=3):
    """jit_step(donate=False) and jit_grad + opt.update + apply_updates_: the same states."""
    mesh = sf.Mesh.from_group()
    results = []
    for use_grad in (False, True):
        torch.manual_seed(0)
        params, apply = sf.functionalize(gpt_model())
        sharded = sf.shard(params, mesh, "FULL_SHARD")
        opt = chain(clip_by_global_norm(0.05), ADAMW())
        state = opt.init(sharded)
        loss_fn = token_mean
        step, grad_fn = sf.jit_step(loss_fn, mesh, optimizer=opt, donate=False), sf.jit_grad(loss_fn, mesh)
        losses = []
        for b in padded_batches(steps):
            local = split_batch(b, mesh.rank, mesh.size)
            if use_grad:
                loss, grads, _ = grad_fn(sharded, local)
                updates, state = opt.update(grads, state, sharded)  # the clip reads grads.global_norm
                sf.optim.apply_updates_(sharded, updates)
                losses.append(float(loss))
            else:
                sharded, state, m = step(sharded, state, local)
                losses.append(m["loss"])
        results.append((losses, sf.testing.full_state(sharded)))
    return results


def test_jit_step_is_jit_grad_and_the_optimizer(clusters):
    for (step_losses, by_step), (grad_losses, by_grad) in clusters[2].run(step_vs_grad):
        assert step_losses == grad_losses
        assert by_step.keys() == by_grad.keys()
        for n in by_step:
            assert torch.equal(by_step[n], by_grad[n]), n


def psum_outside_a_step():
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    grads = {n: torch.ones_like(t) for n, t in sharded.params().items()}  # a plain dict: no norm carried
    opt = chain(scale(1.0), clip_by_global_norm(1.0))  # scale returns a new mapping: clip computes the norm
    state = opt.init(sharded)
    try:
        opt.update(grads, state, sharded)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    with sf.on_shards(sharded):
        total = float(psum(torch.tensor(float(sum(t.numel() for t in grads.values())))))
    return error, total, sum(t.numel() for t in sharded.params().values())


def test_psum_outside_a_step_raises_unless_on_shards(clusters):
    for rank, (error, total, local) in enumerate(clusters[2].run(psum_outside_a_step)):
        assert f"[rank {rank}]" in error and "outside a step, on 2 processes" in error
        assert "shardfn.on_shards(sharded)" in error
        assert total == 2 * local  # summed over the two ranks' shards


def test_psum_on_one_process_needs_no_scope():
    assert float(psum(torch.tensor(3.0))) == 3.0


def sgd_with_buffers():
    """jit_grad keeps buffers as a step does: updated in the tree, averaged over ranks."""
    from shardfn.testing.models import ConvNet
    from test_state import conv_batches, conv_loss

    mesh = sf.Mesh.from_group()
    out = []
    for use_grad in (False, True):
        torch.manual_seed(0)
        params, apply = sf.functionalize(ConvNet())
        sharded = sf.shard(params, mesh, "FULL_SHARD")
        opt = sgd(0.1)
        state = opt.init(sharded)
        loss_fn = conv_loss
        local = split_batch(conv_batches(1)[0], mesh.rank, mesh.size)
        if use_grad:
            _, grads, _ = sf.jit_grad(loss_fn, mesh)(sharded, local)
            sharded = sharded.replace(sf.optim.apply_updates(sharded.params(), opt.update(grads, state, sharded)[0]))
        else:
            sharded, _, _ = sf.jit_step(loss_fn, mesh, optimizer=opt, donate=False)(sharded, state, local)
        out.append(sf.testing.full_state(sharded))
    return out


def test_jit_grad_updates_and_averages_buffers_as_a_step(clusters):
    results = clusters[2].run(sgd_with_buffers)
    for by_step, by_grad in results:
        for n in by_step:
            torch.testing.assert_close(by_grad[n], by_step[n], rtol=0, atol=0)
    assert any("running_mean" in n for n in results[0][0])
    for n in results[0][1]:
        assert torch.equal(results[0][1][n], results[1][1][n]), n  # every rank the same


def norm_after_changes(loss_name):
    """The norm grads report after the user changes them in place, against the norm of what
    they hold; and the collectives each read of the norm issued."""
    from shardfn.optim._psum import sum_of_squares

    mesh = mesh_for("FULL_SHARD")
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    loss_fn = token_mean if loss_name == "mean" else lambda apply, p, b: token_mean(apply, p, b).total / 100
    _, grads, metrics = sf.jit_grad(loss_fn, mesh)(sharded, split_batch(padded_batches(1)[0], mesh.rank, mesh.size))
    out = {}
    with sf.on_shards(sharded), sf.record_collectives() as log:
        out["handed_over"] = float(sf.optim.global_norm(grads))  # as the step computed it: no collective
    out["reads"] = [dict(log.counts())]
    for g in grads.values():
        g.mul_(0.5)  # scaled in place: a power of two, so the norm halves exactly
    with sf.on_shards(sharded), sf.record_collectives() as log:
        out["scaled"] = float(sf.optim.global_norm(grads))
        out["scaled_again"] = float(grads.global_norm)  # recomputed once, then current again
    out["reads"].append(dict(log.counts()))
    with sf.on_shards(sharded):
        out["scaled_truth"] = float(psum(sum_of_squares(dict(grads))).sqrt())
    next(iter(grads.values())).zero_()  # a leaf masked
    with sf.on_shards(sharded):
        out["masked"] = float(grads.global_norm)
        out["masked_truth"] = float(psum(sum_of_squares(dict(grads))).sqrt())
        clipped, _ = clip_by_global_norm(out["masked"] / 2).update(grads, (), sharded)
        out["clipped"] = float(psum(sum_of_squares(clipped)).sqrt())
    out["metric"] = metrics["grad_norm"]
    return out


@pytest.mark.parametrize("loss_name", ["plain", "mean"])
def test_the_norm_follows_gradients_changed_in_place(clusters, loss_name):
    for out in clusters[2].run(norm_after_changes, loss_name):
        # The norm handed over is the step's (no collective), also after a Mean loss rescaled the grads.
        assert out["handed_over"] == out["metric"] and out["reads"][0] == {}
        assert out["scaled"] == out["scaled_again"] == out["scaled_truth"]
        if loss_name == "plain":  # the step's norm of unrescaled grads: the same sums, halved exactly
            assert out["scaled"] == out["handed_over"] / 2
        assert out["reads"][1] == {"all_reduce": 1}
        assert out["masked"] == out["masked_truth"] < out["scaled"]
        # Clipping to half the norm of what the grads hold: the clipped norm is half of it
        # (the factor max_norm / (norm + 1e-6) rounds the product by a few units of 2**-24).
        assert out["clipped"] == pytest.approx(out["masked"] / 2, rel=4 * 2**-24 + 1e-6 / out["masked"])
