"""Ranks that differ: every rank raises the same clear error before anything changes, or the
step is right. See shardfn._comm.guard [Note: the schedule guard]."""

import functools
import inspect
import math
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardfn as sf
import shardfn.testing
from shardfn.optim import adamw, sgd
from shardfn.testing import check_equivalence
from shardfn.testing.models import MoE

# Equivalence with one device on the global batch (issue 38): the reference sums each
# gradient over all rows in one kernel, a rank over its slice (another blocking), then the
# ranks' sums in rank order, so the two gradients differ by roundings of the same terms in
# another order. SGD's update is linear in the gradient: k steps move a parameter by
# lr * sum_t sum_{j<=t} momentum^(t-j) |dg_j| at most (0.28 max |dg| after 3 steps, 0.89 after
# 6). Here |g| <= 0.37 and the slices' gradients differ from the whole batch's by at most
# 4.5e-8 (two ulps; the same on the AVX-512 and AVX2 kernel paths): 4e-8, 25x inside the tests'
# atol 1e-6. AdamW divides by sqrt(v): an expert's gradient that cancels to near zero is
# scale-free there, so its rounding became a step of 4.3e-6 on an AMD EPYC's kernels (2.2x
# the tolerance) under every strategy, NO_SHARD included: a claim about the CPU, not the shards.
SGD_MOMENTUM = functools.partial(sgd, 0.05, momentum=0.9)
EXPERTS = [f"blocks.{b}.experts.{e}" for b in range(2) for e in range(4)]


def moe_model():
    torch.manual_seed(0)
    return MoE()


def moe_batches(steps=3, rows=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 8, generator=g), "y": torch.randn(rows, 4, generator=g)} for _ in range(steps)]


def mse(apply, params, batch):
    return F.mse_loss(apply(params, batch["x"]), batch["y"])


class Stack(nn.Module):
    """Equal-sized layers; ``skip`` drops some of them (LayerDrop, or a branch not taken)."""

    def __init__(self, d=8, n=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x, skip=()):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = torch.tanh(layer(x))
        return x


def _snapshot(sharded, opt_state):
    state = {k: v.clone() for k, v in sharded.items()}
    flat, _ = torch.utils._pytree.tree_flatten(opt_state)
    return state, [t.clone() if isinstance(t, torch.Tensor) else t for t in flat]


def _unchanged(before, sharded, opt_state):
    state, flat = before
    now = torch.utils._pytree.tree_flatten(opt_state)[0]
    return all(torch.equal(state[k], sharded[k]) for k in state) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(flat, now))


# A rank that waited for a peer until the guard gave up would raise CommError after the mesh's
# step timeout (shardfn's default, 60 s). An error relayed by the guard arrives long before:
# the tests bound that behaviour ("not by the timeout"), never a speed, so they hold on a
# machine many times slower than CI's.
STEP_TIMEOUT = inspect.signature(sf.Mesh.from_group).parameters["step_timeout"].default


def _outcome(fn):
    """Runs ``fn``; returns what a test compares across ranks: the error's type and text, and the time."""
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "message": "", "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}


def _setup(model, strategy="FULL_SHARD", **plan):
    """Units collective by collective (``bucket_bytes=0``) unless the test says otherwise: a
    unit only some ranks run is the subject here ([Note: buckets] for one in a bucket)."""
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, strategy, **{"bucket_bytes": 0, **plan})
    return mesh, apply, sharded


# -- workers (module level: the cluster imports them by reference) ----------------------


def moe_experts_as_units():
    mesh, apply, sharded = _setup(moe_model(), units=EXPERTS)
    opt = adamw(1e-2)
    step = sf.jit_step(mse, mesh, optimizer=opt)
    state = opt.init(sharded)
    batch = moe_batches(1, rows=8, seed=10 + mesh.rank)[0]  # each rank's tokens choose their own experts
    before = _snapshot(sharded, state)
    out = _outcome(lambda: step(sharded, state, batch))
    return {**out, "unchanged": _unchanged(before, sharded, state)}


def skipped_block(skip_ranks, at_step, steps=None, **plan):
    """Ranks ``skip_ranks`` skip layer 1 in step ``at_step``; returns each step's outcome, the
    header exchanges of each step, the full parameters at the end and the step's re-runs."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack(), **plan)
    opt = adamw(1e-2)

    def loss_fn(apply, params, batch):
        skip = (1,) if mesh.rank in skip_ranks and batch["n"] == at_step else ()
        return apply(params, batch["x"], skip=skip).pow(2).mean()

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    state = opt.init(sharded)
    outs = []
    for n in range(steps or at_step + 1):
        batch = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * n + mesh.rank)), "n": n}
        before = _snapshot(sharded, state)
        headers, sent = mesh.guard.headers, mesh.guard.header_bytes
        with sf.record_collectives() as log:
            out = _outcome(lambda: step(sharded, state, batch))
        outs.append({**out, "unchanged": _unchanged(before, sharded, state), "headers": mesh.guard.headers - headers,
                     "header_bytes": mesh.guard.header_bytes - sent, "collectives": len(log.calls)})
    return outs, sf.gather(sharded), step.grad.schedule.reruns


def stack_reference(at_step, steps, world=2, skip_ranks=None):
    """The same training on one device on the global batch, every rank's slice skipping layer 1
    in step ``at_step``: the same arithmetic, bit for bit. Each rank's slice is one of
    ``world`` micro-batches (the same shapes, the loss times ``1 / world`` before backward
    either way), accumulated in rank order as the reduce-scatter sums them."""
    torch.manual_seed(0)
    model = Stack()
    params, apply = sf.functionalize(model)
    mesh = sf.Mesh.from_group()
    sharded = sf.shard(params, mesh, "NO_SHARD")
    opt = adamw(1e-2)
    state = opt.init(sharded)

    def loss_fn(apply, params, batch):
        rank = int(batch["rank"][0])  # the rank whose slice this micro-batch is
        skip = (1,) if batch["n"] == at_step and (skip_ranks is None or rank in skip_ranks) else ()
        return apply(params, batch["x"], skip=skip).pow(2).mean()

    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=world)
    for n in range(steps):
        x = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * n + r)) for r in range(world)])
        rank = torch.arange(world).repeat_interleave(4)
        sharded, state, _ = step(sharded, state, {"x": sf.Batched(x), "n": n, "rank": rank})  # x: [8, 8] at world 2
    return sf.gather(sharded)


def raising_then_going_on(kind):
    """Rank 1's step fails (``kind``); every rank catches its error and steps on."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    opt = adamw(1e-2)
    micro = 2 if kind == "micro_batches" else 1

    def loss_fn(apply, params, batch):
        out = apply(params, batch["x"]).pow(2)
        if mesh.rank == 1 and batch["bad"]:
            if kind == "raise":
                raise ValueError("boom on rank 1")
            if kind == "not_scalar":
                return out.mean(0)
        return out.mean()

    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=micro)
    state = opt.init(sharded)
    rows = 5 if (kind == "micro_batches" and mesh.rank == 1) else 4
    bad = {"x": torch.randn(rows, 8), "bad": True}
    before = _snapshot(sharded, state)
    out = _outcome(lambda: step(sharded, state, bad))
    unchanged = _unchanged(before, sharded, state)
    good = {"x": torch.ones(4, 8) * (mesh.rank + 1), "bad": False}
    _, _, metrics = step(sharded, state, good)
    return {**out, "unchanged": unchanged, "next_loss": metrics["loss"]}


def raising_mid_forward_then_going_on(at):
    """Rank 1 raises in layers.1's forward in step ``at`` (pipelined from step 3 on), after
    layers.0 ran; every rank catches its error and takes two more steps."""
    torch.manual_seed(0)
    model = Stack()
    bad = [False]

    def raise_on_rank_1(module, args):
        if bad[0] and dist.get_rank() == 1:
            raise ValueError("boom in layers.1 on rank 1")

    model.layers[1].register_forward_pre_hook(raise_on_rank_1)
    mesh, apply, sharded = _setup(model)
    opt = adamw(1e-2)
    step = sf.jit_step(lambda apply, params, batch: apply(params, batch["x"]).pow(2).mean(), mesh, optimizer=opt)
    state = opt.init(sharded)
    for n in range(at):
        sharded, state, _ = step(sharded, state, {"x": torch.randn(4, 8)})
    pipelined = step.grad.schedule.pipelined
    bad[0] = True
    out = _outcome(lambda: step(sharded, state, {"x": torch.randn(4, 8)}))
    bad[0] = False
    after = []
    for n in range(2):
        after.append(_outcome(lambda: step(sharded, state, {"x": torch.ones(4, 8) * (n + 1)})))
    return {**out, "pipelined": pipelined, "after": after}


def float_loss_on(ranks, at):
    """In step ``at``, the ranks ``ranks`` return a Python float from ``loss_fn`` (``.item()``,
    not a tensor), so each of them raises the same TypeError; every rank catches its error
    (with its notes) and steps on."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    opt = adamw(1e-2)

    def loss_fn(apply, params, batch):
        loss = apply(params, batch["x"]).pow(2).mean()
        return loss.item() if mesh.rank in ranks and batch["bad"] else loss

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    state = opt.init(sharded)
    for _ in range(at):
        sharded, state, _ = step(sharded, state, {"x": torch.randn(4, 8), "bad": False})
    out = {"error": None}
    try:
        step(sharded, state, {"x": torch.randn(4, 8), "bad": True})
    except Exception as e:  # noqa: BLE001 - the test inspects it
        out = {"error": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
    _, _, metrics = step(sharded, state, {"x": torch.ones(4, 8) * (mesh.rank + 1), "bad": False})
    return {**out, "next_loss": metrics["loss"]}


def uneven_rows(mean):
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    opt = adamw(1e-2)

    def loss_fn(apply, params, batch):
        sq = apply(params, batch["x"]).pow(2).sum(-1)
        return sf.Mean(sq.sum(), sq.numel()) if mean else sq.mean()

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    state = opt.init(sharded)
    batch = {"x": torch.randn(4 + 2 * mesh.rank, 8, generator=torch.Generator().manual_seed(mesh.rank))}
    before = _snapshot(sharded, state)
    out = _outcome(lambda: step(sharded, state, batch))
    return {**out, "unchanged": _unchanged(before, sharded, state)}


def uneven_tokens():
    """As many rows on every rank, but token ids of different lengths: a plain mean loss."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    opt = adamw(1e-2)
    step = sf.jit_step(lambda apply, p, b: apply(p, b["x"]).pow(2).mean(), mesh, optimizer=opt)
    state = opt.init(sharded)
    batch = {"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(mesh.rank)),
             "ids": torch.zeros(4, 3 + mesh.rank, dtype=torch.long)}  # 12 tokens on rank 0, 16 on rank 1
    before = _snapshot(sharded, state)
    out = _outcome(lambda: step(sharded, state, batch))
    return {**out, "unchanged": _unchanged(before, sharded, state)}


def eval_on_one_rank():
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    opt = adamw(1e-2)
    step = sf.jit_step(lambda apply, p, b: apply(p, b).pow(2).mean(), mesh, optimizer=opt)
    state = opt.init(sharded)
    x = torch.randn(4, 8)
    before = _snapshot(sharded, state)
    if mesh.rank == 0:
        out = _outcome(lambda: apply(sharded, x))
    else:
        out = _outcome(lambda: step(sharded, state, x))
    return {**out, "unchanged": _unchanged(before, sharded, state)}


# -- tests ----------------------------------------------------------------------------


def test_moe_default_units_are_the_blocks_and_train_exactly(clusters):
    params, _ = sf.functionalize(moe_model())
    assert sf.Plan().units.resolve(params.module, list(params)) == ["blocks.0", "blocks.1"]
    # Ranks choose different experts (their tokens differ); inside one unit, the unused
    # experts' gradients are zero in the unit's one reduce-scatter.
    report = check_equivalence(moe_model, mse, moe_batches(), optimizer=SGD_MOMENTUM,
                               strategies=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"], world_sizes=[2, 3],
                               clusters=clusters)
    assert report.failures() == []


def test_experts_as_units_used_differently_raise_on_every_rank(clusters):
    outs = clusters[2].run(moe_experts_as_units)
    for r, out in enumerate(outs):
        assert out["error"] == "DivergenceError", out
        assert "experts" in out["message"] and "rank 0: all_gather (gather of blocks.0.experts" in out["message"]
        assert out["unchanged"] and out["seconds"] < STEP_TIMEOUT
    # Every rank raises the same text (but for its own "[rank N]" prefix).
    assert outs[0]["message"].split("] ", 1)[1] == outs[1]["message"].split("] ", 1)[1]


@pytest.mark.parametrize("at_step", [0, 1, 6])  # steps 0-2 are checked collective by collective; 6 pipelined
def test_a_block_skipped_on_one_rank_raises_on_every_rank(clusters, at_step):
    outs = clusters[2].run(skipped_block, (1,), at_step)
    for per_rank, _, _ in outs:
        assert all(o["error"] is None for o in per_rank[:at_step])
        last = per_rank[at_step]
        assert last["error"] == "DivergenceError" and last["unchanged"], last
        assert "layers.1" in last["message"] and "layers.2" in last["message"]
    assert outs[0][0][at_step]["message"].split("] ", 1)[1] == outs[1][0][at_step]["message"].split("] ", 1)[1]
    if at_step == 6:
        assert "diverged at collective #" in outs[0][0][at_step]["message"]


def test_steady_steps_check_their_schedule_with_two_headers(clusters):
    outs = clusters[2].run(skipped_block, (), -1, 8)
    for per_rank, _, reruns in outs:
        assert all(o["error"] is None for o in per_rank) and reruns == 0
        headers = [o["headers"] for o in per_rank]
        # checked steps (0-2: until two have the same schedule): the opening header and one per collective
        assert headers[:3] == [1 + o["collectives"] for o in per_rank[:3]], headers
        assert per_rank[0]["collectives"] > 5
        assert headers[3:] == [2] * 5, headers  # pipelined from step 3 on: the opening and the metrics header


def test_the_guard_sends_a_fixed_size_whatever_the_world(clusters):
    """[Note: a fixed-size agreement]: ranks that agree exchange one 112-byte all-reduce per
    header (the header and its negation), at 2, 3 and 4 ranks alike: a steady step's two
    cost 224 bytes whatever the world (an all-gather of every rank's header grew with it)."""
    per_world = {}
    for world in (2, 3, 4):
        for outs, _, _ in clusters[world].run(skipped_block, (), -1, 6):
            per_rank = [(o["headers"], o["header_bytes"]) for o in outs]
            assert all(sent == 112 * headers for headers, sent in per_rank), per_rank  # no all-gather
            assert per_rank[3:] == [(2, 224)] * 3, per_rank  # pipelined from step 3 on
            per_world.setdefault(world, per_rank)
    assert per_world[2] == per_world[3] == per_world[4]


def test_a_block_skipped_on_every_rank_alike_runs_the_step_again_and_trains_exactly(clusters):
    outs = clusters[2].run(skipped_block, (0, 1), 5, 8)
    expected = clusters[1].run(stack_reference, 5, 8)[0]
    for per_rank, full, reruns in outs:
        assert all(o["error"] is None for o in per_rank), per_rank
        assert reruns == 1
        for name in expected:
            torch.testing.assert_close(full[name], expected[name], rtol=0, atol=0)


@pytest.mark.parametrize("at_step", [1, 6])  # checked collective by collective; pipelined
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("bucket_bytes", [0, None], ids=["alone", "bucketed"])
def test_a_block_skipped_on_one_rank_raises_alone_or_in_a_bucket(clusters, bucket_bytes, strategy, at_step):
    """One rule ([Note: buckets]): a unit that some ranks skip raises the same error on every
    rank, whether it reduces alone or in a bucket with its neighbours (the default 4 MiB
    buckets hold all three layers: the same collectives on every rank, told apart by their
    headers), before anything changes; declared optional, it trains (the test after)."""
    outs = clusters[2].run(skipped_block, (1,), at_step, strategy=strategy, bucket_bytes=bucket_bytes)
    for per_rank, _, _ in outs:
        assert all(o["error"] is None for o in per_rank[:at_step])
        last = per_rank[at_step]
        assert last["error"] == "DivergenceError" and last["unchanged"], last
        assert "layers.1" in last["message"] and "optional" in last["message"], last["message"]
    assert outs[0][0][at_step]["message"].split("] ", 1)[1] == outs[1][0][at_step]["message"].split("] ", 1)[1]
    if bucket_bytes is None and at_step == 1:  # the header names what the skipping rank left out
        assert "without layers.1 (not run on this rank)" in outs[0][0][at_step]["message"]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_block_declared_optional_and_skipped_on_one_rank_trains_as_the_global_batch_does(clusters, strategy):
    """Declared optional, the skipped layer is gathered and reduced on every rank, the
    skipping rank contributing a zero gradient: exactly the one-device step on the global
    batch whose skipping rank's rows skip the layer (DDP's arithmetic), bit for bit."""
    outs = clusters[2].run(skipped_block, (0,), 2, 4, strategy=strategy, optional=["layers.1"])
    expected = clusters[1].run(stack_reference, 2, 4, 2, (0,))[0]
    for per_rank, full, reruns in outs:
        assert all(o["error"] is None for o in per_rank), per_rank
        for name in expected:
            torch.testing.assert_close(full[name], expected[name], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["raise", "not_scalar", "micro_batches"])
def test_an_error_on_one_rank_reaches_every_rank_and_training_goes_on(clusters, kind):
    outs = clusters[2].run(raising_then_going_on, kind)
    original = {"raise": "boom on rank 1", "not_scalar": "scalar", "micro_batches": "micro"}[kind]
    assert outs[1]["error"] in ("ValueError", "TypeError"), outs[1]
    assert outs[0]["error"] == "PeerError" and "rank 1 raised" in outs[0]["message"], outs[0]
    assert original in outs[0]["message"] and original in outs[1]["message"]
    assert f"{outs[1]['error']}: " in outs[0]["message"]  # the original exception's type
    for out in outs:
        assert out["unchanged"] and out["seconds"] < STEP_TIMEOUT
    # Both went on in lockstep: the next step ran on both ranks and agrees.
    assert outs[0]["next_loss"] == outs[1]["next_loss"]


@pytest.mark.parametrize("at", [0, 4])  # a step checked collective by collective, and a pipelined one
def test_a_rank_that_raised_mid_forward_steps_on_with_the_others(clusters, at):
    """The units a failed step saw run are not the next step's prefetch order: the rank that
    raised after one unit would prefetch otherwise than its peers and leave the schedule."""
    outs = clusters[2].run(raising_mid_forward_then_going_on, at)
    assert outs[1]["error"] == "ValueError" and outs[0]["error"] == "PeerError", outs
    assert all(out["pipelined"] == (at == 4) for out in outs), outs
    for n in range(2):
        assert [out["after"][n]["error"] for out in outs] == [None, None], "\n".join(
            f"step {at + 1 + n}: {out['after'][n]['message']}" for out in outs)


@pytest.mark.parametrize("at", [0, 4])  # a step checked collective by collective, and a pipelined one
@pytest.mark.parametrize("ranks", [(1,), (0, 1)])
def test_the_note_on_an_error_says_what_the_other_ranks_raise(clusters, ranks, at):
    """A rank that raised alone tells the others, which raise PeerError naming it; when every
    rank raised (a loss_fn returning a Python float, on every rank alike), none raises
    PeerError, and the note does not claim they do."""
    outs = clusters[2].run(float_loss_on, ranks, at)
    for r, out in enumerate(outs):
        head = f"[rank {r}] shardfn: raised on rank {r} of Mesh(shard=2, device=cpu, backend=gloo, rank={r}); "
        if r not in ranks:
            assert out["error"] == "PeerError" and out["notes"] == [], out
            assert out["message"].startswith(f"[rank {r}] shardfn: rank 1 raised, so this rank stops too"), out
            assert "TypeError: loss_fn(apply, params, batch): must return a scalar tensor" in out["message"]
            continue
        assert out["error"] == "TypeError" and "got float" in out["message"], out
        if len(ranks) == 1:
            assert out["notes"] == [head + "the other ranks raise PeerError naming it."]
        else:
            assert out["notes"] == [head + "every rank raised this same error itself, so no rank raises PeerError."]
    assert outs[0]["next_loss"] == outs[1]["next_loss"]


def test_batches_of_different_sizes(clusters):
    outs = clusters[2].run(uneven_rows, False)
    for out in outs:
        assert out["error"] == "DivergenceError" and out["unchanged"], out
        assert "batch of 4 rows" in out["message"] and "batch of 6 rows" in out["message"]
        assert "shardfn.Mean" in out["message"]
    outs = clusters[2].run(uneven_rows, True)  # Mean weighs every element: nothing to refuse
    assert all(out["error"] is None for out in outs)


def test_batches_of_equal_rows_but_different_tokens(clusters):
    for out in clusters[2].run(uneven_tokens):
        assert out["error"] == "DivergenceError" and out["unchanged"], out
        assert "batch of 4 rows, 12 tokens" in out["message"] and "batch of 4 rows, 16 tokens" in out["message"]
        # the fix names what differs (tokens, not rows) and both ways out
        assert "same number of rows" not in out["message"], out["message"]
        assert "different numbers of tokens" in out["message"] and "the same number of tokens" in out["message"]
        assert "shardfn.Mean(total, count)" in out["message"]


def test_evaluating_on_one_rank_while_the_other_steps(clusters):
    outs = clusters[2].run(eval_on_one_rank)
    for out in outs:
        assert out["error"] == "DivergenceError" and out["unchanged"], out
        assert "in apply outside a step" in out["message"] and "in a step" in out["message"]


def test_a_policy_that_matches_nothing_names_the_module_types():
    params, _ = sf.functionalize(MoE())
    module, names = params.module, list(params)
    with pytest.raises(ValueError, match=r"by_module_type\(Conv2d\) matches no module of MoE.*'Linear', 'MoEBlock'"):
        sf.Plan(units=sf.by_module_type(nn.Conv2d)).units.resolve(module, names)
    with pytest.raises(ValueError, match=r"by_module_type\(Conv2d\) matches no module of MoE"):
        sf.Remat(sf.by_module_type(nn.Conv2d)).select(module, names, ["blocks.0", "blocks.1"])


def shards_after_destroy():
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    dist.destroy_process_group()
    return _outcome(lambda: apply(sharded, torch.randn(2, 8)))


def test_shards_after_destroy_process_group_is_a_clear_error():
    with sf.testing.Cluster(2, timeout=60) as cluster:
        outs = cluster.run(shards_after_destroy)
    for out in outs:
        assert out["error"] == "RuntimeError" and "destroy_process_group" in out["message"], out


def nonfinite_on_one_rank(skip):
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    opt = adamw(1e-2)
    step = sf.jit_step(lambda apply, p, b: apply(p, b).pow(2).mean(), mesh, optimizer=opt,
                       on_nonfinite="skip" if skip else "raise")
    state = opt.init(sharded)
    x = torch.randn(4, 8)
    if mesh.rank == 1:
        x[2, 3] = float("nan")
    before = _snapshot(sharded, state)
    result = {}
    out = _outcome(lambda: result.update(step(sharded, state, x)[2]))
    after = {"unchanged": _unchanged(before, sharded, state), "skipped": result.get("skipped")}
    good = step(sharded, state, torch.ones(4, 8))[2]
    return {**out, **after, "next_skipped": good.get("skipped"), "changed_next": not _unchanged(before, sharded, state)}


@pytest.mark.parametrize("skip", [True, False])
def test_a_nonfinite_loss_on_one_rank(clusters, skip):
    outs = clusters[2].run(nonfinite_on_one_rank, skip)
    for out in outs:
        assert out["unchanged"] and out["changed_next"], out
        if skip:
            assert out["error"] is None and out["skipped"] is True and out["next_skipped"] is False
        else:
            assert out["error"] == "FloatingPointError", out
            assert "Ranks whose own loss was not finite: [1]" in out["message"] and 'on_nonfinite="skip"' in out["message"]


def nonfinite_found_by_the_next_call(directory):
    """on_nonfinite="raise_next": the bad step updates (it does not wait to read its values);
    the next step and checkpoint.save on its shards raise on every rank and change or write
    nothing, until a checkpoint is loaded into them."""
    torch.manual_seed(0)
    mesh, apply, sharded = _setup(Stack())
    step = sf.jit_step(lambda apply, p, b: apply(p, b).pow(2).mean(), mesh, optimizer=adamw(1e-2),
                       on_nonfinite="raise_next")
    state = step.init(sharded)
    good = torch.ones(4, 8)
    bad = torch.randn(4, 8)
    if mesh.rank == 1:
        bad[2, 3] = float("nan")
    sharded, state, first = step(sharded, state, good)
    sf.checkpoint.save(f"{directory}/good", sharded, state)  # (reads the first step's verdict: finite)
    sharded, state, metrics = step(sharded, state, bad)
    out = {"types": [type(m["loss"]).__name__ for m in (first, metrics)], "loss": float(metrics["loss"]),
           "bad_in_state": any(t.isnan().any().item() for t in sharded.values())}
    before = _snapshot(sharded, state)
    out.update(_outcome(lambda: step(sharded, state, good)))
    now = torch.utils._pytree.tree_flatten(state)[0]
    out["unchanged"] = all(torch.equal(before[0][k].nan_to_num(), sharded[k].nan_to_num()) for k in before[0]) and all(
        torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before[1], now) if isinstance(a, torch.Tensor))
    saving = _outcome(lambda: sf.checkpoint.save(f"{directory}/bad", sharded, state))
    out["save"] = (saving["error"], saving["message"].split(":")[0], os.path.exists(f"{directory}/bad"))
    out["again"] = _outcome(lambda: step(sharded, state, good))["error"]  # the shards still hold the update
    sharded, state, _ = sf.checkpoint.load(f"{directory}/good", sharded, state)
    sharded, state, after = step(sharded, state, good)
    out["after_load"] = float(after["loss"])
    return out


def test_a_nonfinite_step_is_reported_by_what_uses_its_shards_next_with_raise_next(clusters, tmp_path):
    outs = clusters[2].run(nonfinite_found_by_the_next_call, str(tmp_path))
    for rank, out in enumerate(outs):
        assert out["types"] == ["Tensor", "Tensor"] and math.isnan(out["loss"]) and out["bad_in_state"], out
        assert out["error"] == "FloatingPointError" and out["unchanged"], out
        assert out["message"].startswith(f"[rank {rank}] step: the last step on these shards had a global loss (nan)")
        assert out["save"] == ("FloatingPointError", f"[rank {rank}] checkpoint.save(path, sharded, ...)", False)
        assert out["again"] == "FloatingPointError" and math.isfinite(out["after_load"]), out


def refused_nonfinite_options():
    mesh = sf.Mesh.from_group()
    return [_outcome(lambda: sf.jit_step(lambda apply, p, b: apply(p, b).sum(), mesh, optimizer=adamw(1e-2), **kw))
            for kw in ({"on_nonfinite": "sometimes"},
                       {"on_nonfinite": "raise_next", "loss_scale": sf.DynamicLossScale()})]


def test_what_a_nonfinite_step_does_is_one_of_three_and_a_loss_scale_skips(clusters):
    unknown, with_scale = clusters[1].run(refused_nonfinite_options)[0]
    assert unknown["error"] == "ValueError" and '"raise", "skip" or "raise_next"' in unknown["message"], unknown
    assert with_scale["error"] == "ValueError" and "on_nonfinite='raise_next'" in with_scale["message"]
    assert "leave on_nonfinite out" in with_scale["message"]


def differently_seeded(src_rank):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(mesh.rank)  # a per-rank seed: each rank builds other weights
    params, apply = sf.functionalize(Stack())
    out = _outcome(lambda: sf.shard(params, mesh, "NO_SHARD", src_rank=src_rank))
    if out["error"] is None:
        sharded = sf.shard(params, mesh, "NO_SHARD", src_rank=src_rank)
        out["weight"] = sharded["layers.0.weight"].clone()
    return out


def test_ranks_that_build_different_values_are_caught_at_shard(clusters):
    outs = clusters[2].run(differently_seeded, None)
    for out in outs:
        assert out["error"] == "ValueError", out
        assert "different values for 6 of the 6 tensors, first 'layers.0.weight'" in out["message"]
        assert "src_rank=0" in out["message"]
    outs = clusters[2].run(differently_seeded, 0)  # or rank 0's values are taken everywhere
    assert outs[0]["error"] is None and (outs[0]["weight"] == outs[1]["weight"]).all()


def hybrid_raise_on_one_rank(bad_rank):
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group(replicate=2)
    params, apply = sf.functionalize(Stack())
    sharded = sf.shard(params, mesh, "HYBRID_SHARD")
    opt = adamw(1e-2)

    def loss_fn(apply, params, batch):
        if mesh.rank == bad_rank and batch["bad"]:
            raise KeyError("no such column")
        return apply(params, batch["x"]).pow(2).mean()

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    state = opt.init(sharded)
    before = _snapshot(sharded, state)
    out = _outcome(lambda: step(sharded, state, {"x": torch.randn(4, 8), "bad": True}))
    unchanged = _unchanged(before, sharded, state)
    _, _, metrics = step(sharded, state, {"x": torch.ones(4, 8), "bad": False})
    return {**out, "unchanged": unchanged, "next_loss": metrics["loss"]}


def test_an_error_on_one_rank_of_a_2d_mesh_reaches_all_four(clusters):
    outs = clusters[4].run(hybrid_raise_on_one_rank, 3)
    assert outs[3]["error"] == "KeyError"
    for out in outs[:3]:
        assert out["error"] == "PeerError" and "rank 3 raised" in out["message"], out
        assert "KeyError: 'no such column'" in out["message"]
    assert all(out["unchanged"] and out["seconds"] < STEP_TIMEOUT for out in outs)
    assert len({out["next_loss"] for out in outs}) == 1


# Where the failing ranks raise: before the step's first collective (in loss_fn, before
# apply), mid-forward (layers.1's forward, after layers.0 ran), after the forward (before the
# backward's regathers). A short step timeout: a rank that is not told fails in seconds.
POINTS = ("before the first collective", "mid-forward", "after the forward")
PAIRS = [(a, b) for a in range(4) for b in range(a + 1, 4)]
SHORT_TIMEOUT = 10.0


def two_ranks_raise_on_a_2d_mesh():
    """On a 2x2 mesh (replicas [0, 1] / [2, 3], shard groups [0, 1] and [2, 3], replicate groups
    [0, 2] and [1, 3]), every pair of ranks raises in one step, checked (a step function's
    first) and pipelined (a step function's fourth and later), at each of POINTS; every rank
    catches its error and steps on."""
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group(replicate=2, step_timeout=SHORT_TIMEOUT)
    model = Stack()
    failing, where = set(), [None]

    def raise_at(point):
        if mesh.rank in failing and where[0] == point:
            raise KeyError(f"no such column on rank {mesh.rank}")

    model.layers[1].register_forward_pre_hook(lambda module, args: raise_at("mid-forward"))
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "HYBRID_SHARD")
    opt = adamw(1e-2)

    def loss_fn(apply, params, batch):
        raise_at("before the first collective")
        loss = apply(params, batch["x"]).pow(2).mean()
        raise_at("after the forward")
        return loss

    steady = sf.jit_step(loss_fn, mesh, optimizer=opt)  # a failed step leaves it pipelined
    state = opt.init(sharded)
    for n in range(3):
        sharded, state, _ = steady(sharded, state, {"x": torch.randn(4, 8)})
    cases = []
    for pair in PAIRS:
        for mode in ("checked", "pipelined"):
            for point in POINTS:
                step = steady if mode == "pipelined" else sf.jit_step(loss_fn, mesh, optimizer=opt)
                pipelined = step.grad.schedule.pipelined
                before = _snapshot(sharded, state)
                failing.update(pair)
                where[0] = point
                t0 = time.monotonic()
                try:
                    step(sharded, state, {"x": torch.randn(4, 8)})
                    error = {"error": None, "message": "", "origin": None}
                except Exception as e:  # noqa: BLE001 - the test inspects it
                    error = {"error": type(e).__name__, "message": str(e), "origin": getattr(e, "rank", None)}
                seconds = time.monotonic() - t0
                failing.clear()
                case = {"pair": pair, "mode": mode, "point": point, "pipelined": pipelined, **error, "seconds": seconds,
                        "unchanged": _unchanged(before, sharded, state)}
                cases.append(case)
                if error["error"] == "CommError":  # the process group is unusable: stop here
                    return cases
                try:  # the ranks still match: the next step runs on every rank
                    sharded, state, metrics = step(sharded, state, {"x": torch.ones(4, 8)})
                    case["next_loss"] = metrics["loss"]
                except Exception as e:  # noqa: BLE001 - the test inspects it
                    case["next_loss"] = f"{type(e).__name__}: {e}"
                    return cases
    return cases


def _named(message):
    """The ranks a PeerError's first line names as the ones that raised."""
    m = re.search(r"rank (\d+) raised(?: \(and ranks \[([\d, ]+)\]\))?", message)
    return {int(m.group(1)), *(int(r) for r in (m.group(2) or "").split(",") if r.strip())} if m else set()


def test_two_ranks_that_raise_on_a_2d_mesh_reach_every_rank(clusters):
    """Whichever two ranks of a 2x2 mesh raise, in whichever order their errors travel along
    the two axes, every rank raises within the step timeout: the two their own error, the
    others PeerError naming them (both, for a rank that shares a group with each of them);
    nothing changed, and the next step runs on every rank."""
    outs = clusters[4].run(two_ranks_raise_on_a_2d_mesh)
    for n in range(min(len(cases) for cases in outs)):
        case = [cases[n] for cases in outs]
        pair, mode, point = case[0]["pair"], case[0]["mode"], case[0]["point"]
        what = f"ranks {pair} raise {point} in a {mode} step: {case}"
        assert all(c["pipelined"] == (mode == "pipelined") for c in case), what
        for r, c in enumerate(case):
            assert c["seconds"] < SHORT_TIMEOUT and c["unchanged"], what
            if r in pair:
                assert c["error"] == "KeyError" and f"no such column on rank {r}" in c["message"], what
                continue
            assert c["error"] == "PeerError" and c["origin"] in pair, what
            named = _named(c["message"])
            assert c["origin"] in named and named <= set(pair), what
            if set(pair) == {r ^ 1, r ^ 2}:  # one failing rank in its shard group, the other in its replicate group
                assert named == set(pair), what
            assert f"KeyError: 'no such column on rank {c['origin']}'" in c["message"], what
        assert all(isinstance(c["next_loss"], float) for c in case), what
        assert len({c["next_loss"] for c in case}) == 1, what
    assert [len(cases) for cases in outs] == [len(PAIRS) * 2 * len(POINTS)] * 4


def moe_optional_training(strategy, steps):
    """MoE trained with the experts as optional units; each rank's tokens choose their own.
    Returns the full state at the end and, per step, the experts this rank ran."""
    mesh = sf.Mesh.from_group()
    model = moe_model()
    ran = []
    for name in EXPERTS:
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, name=name: ran[-1].add(name))
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, strategy, optional=EXPERTS)
    assert [u.path for u in sharded.layout.units if u.optional] == EXPERTS
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(mse, mesh, optimizer=opt)
    for batch in moe_batches(steps, rows=6):
        ran.append(set())
        sharded, state, _ = step(sharded, state, sf.testing.split_batch(batch, mesh.rank, mesh.size))
    return sf.testing.full_state(sharded), [sorted(r) for r in ran]


def test_optional_units_train_exactly_when_ranks_skip_them(clusters):
    from shardfn.testing import reference_training

    _, expected = reference_training(moe_model, mse, moe_batches(6, rows=6), SGD_MOMENTUM)
    for world in (2, 3):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            outs = clusters[world].run(moe_optional_training, strategy, 6)
            # the ranks ran different experts in some steps (else this tests nothing)
            assert any(len({tuple(ran[n]) for _, ran in outs}) > 1 for n in range(6))
            for state, _ in outs:
                for name, value in expected.items():
                    torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                                               msg=f"{name} at {world} ranks, {strategy}")
