"""Ops per step: what a step dispatches that would launch a kernel on a GPU, pinned exactly.

[Note: counting launches on a CPU] (shardfn/testing/_ops.py) says what is counted. A step
of shardfn at world 1 runs the model's forward and backward and an AdamW update, as a
plain PyTorch loop with torch's foreach AdamW does; what it adds must not grow with the
number of leaves or units (on a GPU each op is a kernel launch: an op per leaf was ~2x
plain's launches). So the difference from plain is pinned op for op, for two unit
policies (5 units and 27), and mixed precision adds exactly the casts the layout says.
"""

import collections

import pytest
import torch
import torch.nn as nn

import shardfn as sf
from shardfn.testing import count_ops
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2)

# What a step dispatches beyond plain PyTorch's (foreach AdamW), whatever the units:
# the metrics (the loss's mean over micro-batches; the gradients' sum of squares as one
# foreach norm, stacked, squared and summed; one vector for the metrics all-reduce, its
# parts divided by the world and the norm's square root) and AdamW's denominators
# (a foreach copy and an in-place sqrt where torch makes a new list with one sqrt, and no
# step counter tensor to increment).
STEP_EXTRA = {"mean": 1, "stack": 4, "_foreach_norm": 1, "pow": 1, "sum": 1, "zeros": 1, "cat": 1, "div": 2,
              "sqrt": 1, "add_": 1, "_foreach_copy_": 1, "_foreach_sqrt_": 1, "_foreach_add_": -1, "_foreach_sqrt": -1}
# (the embeddings stay in the root unit: their backward reads no weight, so FULL_SHARD
# does not gather them again for it, and the count of gathers below would not hold)
UNITS = {"blocks": None, "linears and norms": (nn.Linear, nn.LayerNorm)}


def _batch():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g) for _ in range(2))


def _plain_ops():
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    x, y = _batch()

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()  # the optimizer's state exists
    with count_ops() as c:
        step()
    return collections.Counter(c.ops)


def _shardfn_ops(strategy, units, precision):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, strategy, units=units, precision=precision)
    opt = sf.optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt)
    batch = _batch()
    for _ in range(2):
        sharded, state, _ = step(sharded, state, batch)
    with count_ops() as c:
        sharded, state, _ = step(sharded, state, batch)
    lay = sharded.layout
    # the casts the layout implies ([Note: copies]): each flat unit's shard buffer at each
    # gather (FULL_SHARD gathers a non-root unit again for backward), its gradients once
    regathered = sum(1 for u in lay.units if lay.strategy.reshard_after_forward and u.path != "")
    casts = {"gather": len(lay.units) + regathered, "reduce": sum(1 for u in lay.units if u.grad_numel)}
    return collections.Counter(c.ops), dict(c.collectives), c.syncs, casts, len(lay.units), len(lay.leaves)


@pytest.mark.parametrize("units", list(UNITS), ids=list(UNITS))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_step_adds_a_fixed_number_of_ops_to_plain_pytorch(clusters, strategy, units):
    plain = _plain_ops()
    ops, collectives, syncs, _, n_units, n_leaves = clusters[1].run(_shardfn_ops, strategy, UNITS[units], None)[0]
    extra = collections.Counter(ops)
    extra.subtract(plain)
    assert {k: v for k, v in extra.items() if v} == STEP_EXTRA, (n_units, n_leaves)
    assert sum(ops.values()) == sum(plain.values()) + sum(STEP_EXTRA.values())
    assert collectives == {}  # a world of one: nothing to exchange
    # from few units to many: one per block and the root; one per Linear and LayerNorm and the root
    assert n_units == (5 if units == "blocks" else 27) and n_leaves == 49


@pytest.mark.parametrize("units", list(UNITS), ids=list(UNITS))
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_mixed_precision_adds_one_cast_per_unit_and_gather(clusters, strategy, units):
    bf16 = sf.Precision(param=torch.bfloat16, reduce=torch.float32)
    fp32_ops = clusters[1].run(_shardfn_ops, strategy, UNITS[units], None)[0][0]
    ops, _, _, casts, _, _ = clusters[1].run(_shardfn_ops, strategy, UNITS[units], bf16)[0]
    extra = collections.Counter(ops)
    extra.subtract(fp32_ops)
    # each gather casts its unit's buffer to bf16, each unit's gradients go to fp32 in one
    # cat; and the bf16 loss is cast to fp32 once, for the metrics
    assert {k: v for k, v in extra.items() if v} == {"_to_copy": casts["gather"] + 1, "cat": casts["reduce"]}


def _device_reads(on_nonfinite, mean):
    """What a step reads from tensors to the host, less the reads of host tensors by design
    (the schedule guard's headers, exchanged over gloo in host memory on any device; with
    "raise_next", the last call's values, which a GPU copies to pinned host memory without
    waiting): on a GPU each read left is a synchronisation. AdamW's step count lives on the
    device and is not read ([Note: step counts])."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = sf.optim.adamw(1e-3, weight_decay=0.1)
    if mean:  # a token-weighted loss: its count is not read either
        def loss(apply, p, b):
            return sf.Mean(lm_loss(apply(p, b[0]), b[1]) * b[1].numel(), b[1].numel())
    else:
        def loss(apply, p, b):
            return lm_loss(apply(p, b[0]), b[1])
    step = sf.jit_step(loss, mesh, optimizer=opt, on_nonfinite=on_nonfinite)
    state = step.init(sharded)
    for _ in range(2):
        sharded, state, _ = step(sharded, state, _batch())
    on_host = [sharded._verdict.values] if sharded._verdict is not None else []
    with count_ops() as c:
        sharded, state, metrics = step(sharded, state, _batch())
    reads = [(how, str(t.dtype), tuple(t.shape)) for how, t in c.device_reads(on_host, mesh.size)]
    return reads, type(metrics["loss"]).__name__, len(c.reads)


@pytest.mark.parametrize("on_nonfinite,mean", [("raise", False), ("raise_next", False), ("raise_next", True)])
def test_a_step_reads_the_device_once_or_not_at_all(clusters, on_nonfinite, mean):
    for reads, loss_type, all_reads in clusters[2].run(_device_reads, on_nonfinite, mean):
        if on_nonfinite == "raise":  # the loss and the norm in one copy, before the update
            assert reads == [("tolist", "torch.float32", (2,))] and loss_type == "float", reads
        else:  # [Note: a step that does not wait]
            assert reads == [] and loss_type == "Tensor", reads
        assert all_reads > len(reads)  # (the step count was read, and seen)
