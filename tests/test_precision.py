"""Mixed precision: casts before the all-gather, reduce dtype, master shards, per-unit overrides."""

import pytest
import torch
import torch.nn as nn

import shardfn as sf
from shardfn.testing import split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model

BF16 = sf.Precision(param=torch.bfloat16, reduce=torch.float32, output=torch.float32)
FP16 = sf.Precision(param=torch.float16, reduce=torch.float16, output=torch.float32)
LR, STEPS = 0.1, 3


def reference(precision, model_fn=gpt_model, make_batches=lambda: gpt_batches(STEPS), logits_of=lambda out: out):
    """Single process, same casts: params cast to `param` (autograd casts gradients back),
    output cast to `output`, the loss in fp32, plain SGD on the fp32 masters; buffers (a
    rotary embedding's) as they are, as shardfn leaves them. ``logits_of``: the logits of the
    model's output (a transformers model's ``.logits``)."""
    torch.manual_seed(0)
    model = model_fn()
    params, apply = sf.functionalize(model)
    trainable = {n for n, _ in model.named_parameters()}
    buffers = {n: p for n, p in params.items() if n not in trainable}
    masters = {n: p.detach().clone().requires_grad_() for n, p in params.items() if n in trainable}
    start = {n: p.detach().clone() for n, p in masters.items()}
    losses, moved = [], 0.0
    for b in make_batches():
        compute = {**{n: p.to(precision.param) for n, p in masters.items()}, **buffers}
        logits = logits_of(apply(compute, b["x"])).to(precision.output)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["y"].flatten())
        grads = torch.autograd.grad(loss, list(masters.values()))
        with torch.no_grad():
            for p, g in zip(masters.values(), grads):
                p.sub_(LR * g)
        moved += LR * max(float(g.abs().max()) for g in grads)
        losses.append(loss.item())
    return losses, {n: masters[n].detach() - start[n] for n in masters}, moved


def sharded_run(strategy, precision, units=None):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    start = {n: p.detach().clone() for n, p in params.items()}
    sharded = sf.shard(params, mesh, strategy, units=units, precision=precision, bucket_bytes=0)  # unit by unit
    opt = sf.optim.sgd(LR)
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    losses, calls = [], []
    for b in gpt_batches(STEPS):
        with sf.record_collectives() as log:
            sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        losses.append(m["loss"])
        calls = [(c.kind.value, c.purpose.value, c.unit, c.nbytes, str(c.dtype)) for c in log.calls]
    full = sf.gather(sharded)
    return {
        "losses": losses,
        "delta": {n: full[n] - start[n] for n in full},
        "shard_dtypes": {str(t.dtype) for t in sharded.values()},
        "calls": calls,
        "expected": sharded.layout.collectives_per_step(),
        "numel": {u.name: (u.numel, u.grad_numel) for u in sharded.layout.units},
    }


# bf16 keeps 8 significant bits (eps 2^-8 relative rounding), fp16 11 bits (2^-11).
# The sharded run and the reference do the same casts; they differ in where low-precision
# sums are rounded: each rank's backward sums its own slice of the batch in `param`
# precision (and FP16 reduces in fp16: one more rounding per rank added), the reference
# sums the global batch at once, with other kernel blocking. In one step a gradient
# element is thus off by a few roundings (eps) of the largest gradient; a master that
# differs in its last bit can also round to the neighbouring `param` value, which moves
# the next forward by eps of a parameter, the same order again. SGD's update is linear in
# the gradient, and the steps' differences add up: the bound is 8 eps (a few roundings,
# with room for the cast) times the sum over steps of the largest |update| (`moved`).
# The loss gets 8 eps relative: its logits carry the same kind of rounding. This is an
# estimate of the rounding, not a worst case: a sum that cancels can lose more bits, so
# the margin is what guards it (measured with MKL's AVX-512 and its generic kernels: the
# parameters 4.7-11x inside the bound, the losses over 600x).
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("precision", [BF16, FP16], ids=["bf16", "fp16"])
def test_low_precision_matches_a_reference_with_the_same_casts(clusters, precision, strategy, world):
    ref_losses, ref_delta, moved = reference(precision)
    bound = 8 * EPS[precision.param]
    for r in clusters[world].run(sharded_run, strategy, precision):
        assert r["shard_dtypes"] == {"torch.float32"}  # master shards stay fp32
        assert r["losses"] == pytest.approx(ref_losses, rel=bound)
        worst = max((r["delta"][n] - d).abs().max().item() for n, d in ref_delta.items())
        assert worst <= bound * moved, (worst, bound * moved)


@pytest.mark.parametrize("precision", [None, BF16, FP16], ids=["fp32", "bf16", "fp16"])
def test_every_collective_moves_the_configured_dtype(clusters, precision):
    r = clusters[2].run(sharded_run, "FULL_SHARD", precision)[0]
    param = str(precision.param if precision else torch.float32)
    reduce = str(precision.reduce if precision else torch.float32)
    size = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}
    for kind, purpose, unit, nbytes, dtype in r["calls"]:
        if kind == "all_reduce":  # the step's metrics: two fp32 scalars
            assert purpose == "metrics" and dtype == "torch.float32"
            continue
        numel, grad_numel = r["numel"].get(unit, (None, None))
        if kind == "all_gather":
            assert dtype == param and nbytes == 2 * numel * size[param]
        elif kind == "reduce_scatter":
            assert dtype == reduce and nbytes == 2 * grad_numel * size[reduce]
    gathered = sum(n for k, _, _, n, _ in r["calls"] if k == "all_gather")
    assert gathered == r["expected"]["all_gather"][1]
    assert sum(n for k, _, _, n, _ in r["calls"] if k == "reduce_scatter") == r["expected"]["reduce_scatter"][1]


def test_all_gather_bytes_halve_in_bf16(clusters):
    fp32 = clusters[2].run(sharded_run, "FULL_SHARD", None)[0]["expected"]
    bf16 = clusters[2].run(sharded_run, "FULL_SHARD", BF16)[0]["expected"]
    assert bf16["all_gather"][1] * 2 == fp32["all_gather"][1]
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]  # reduced in fp32


def test_per_unit_override_keeps_fp32_for_norm_layers(clusters):
    policy = sf.Precision(param=torch.bfloat16, reduce=torch.float32, output=torch.float32,
                          overrides=((nn.LayerNorm, sf.Precision()),))
    units = sf.by_prefix("blocks.0", "blocks.1", "ln_f")
    r = clusters[2].run(sharded_run, "SHARD_GRAD_OP", policy, units)[0]
    gathers = {(purpose, unit): dtype for kind, purpose, unit, _, dtype in r["calls"] if kind == "all_gather"}
    assert gathers == {("gather", "<root>"): "torch.bfloat16", ("gather", "blocks.0"): "torch.bfloat16",
                       ("gather", "blocks.1"): "torch.bfloat16", ("gather", "ln_f"): "torch.float32"}
    assert all(l == l for l in r["losses"])  # finite


def test_precision_validation():
    with pytest.raises(TypeError, match="floating-point torch.dtype"):
        sf.Precision(param=torch.int8)
    with pytest.raises(TypeError, match="module path or module class"):
        sf.Precision(overrides=((3, sf.Precision()),))
    assert "param=bfloat16" in repr(sf.Plan("FULL_SHARD", precision=BF16))


def reference_fp16_scaled(init_scale, growth_interval, steps):
    """Single process, fp16 casts, torch.amp.GradScaler and torch SGD on fp32 masters."""
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    masters = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    opt = torch.optim.SGD(masters.values(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    trace, moved = [], 0.0
    for b in gpt_batches(steps):
        compute = {n: p.to(torch.float16) for n, p in masters.items()}
        logits = apply(compute, b["x"]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["y"].flatten())
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        before = [p.detach().clone() for p in masters.values()]
        scaler.step(opt)
        scaler.update()
        moved += max(float((p.detach() - b0).abs().max()) for p, b0 in zip(masters.values(), before))
        trace.append((loss.item(), scale, scaler.get_scale() < scale))
    return trace, {n: p.detach() for n, p in masters.items()}, moved


def sharded_fp16_scaled(strategy, init_scale, growth_interval, steps):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, strategy, precision=FP16)
    opt = sf.optim.sgd(LR)
    scale = sf.DynamicLossScale(init_scale=init_scale, growth_interval=growth_interval)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, loss_scale=scale)
    state = step.init(sharded)  # the optimizer's state and the loss scale
    trace = []
    for b in gpt_batches(steps):
        sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        trace.append((m["loss"], m["loss_scale"], m["skipped"]))
    return trace, sf.gather(sharded)


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_dynamic_loss_scale_skips_overflow_on_every_rank(clusters, world):
    init, interval, steps = 2.0**24, 2, 6
    ref_trace, ref_params, moved = reference_fp16_scaled(init, interval, steps)
    skipped = [s for _, _, s in ref_trace]
    assert skipped[0] and not all(skipped)  # the scenario overflows at first, then recovers
    for trace, params in clusters[world].run(sharded_fp16_scaled, "FULL_SHARD", init, interval, steps):
        assert [(s, k) for _, s, k in trace] == [(s, k) for _, s, k in ref_trace]  # same scales, same skips
        assert [l for l, _, _ in trace] == pytest.approx([l for l, _, _ in ref_trace], rel=8 * EPS[torch.float16])
        for n, p in ref_params.items():
            # the bound of test_low_precision_matches_a_reference_with_the_same_casts
            torch.testing.assert_close(params[n], p, rtol=0, atol=8 * EPS[torch.float16] * moved)


# -- normalisation with running statistics under a param dtype ---------------------------------

BN_FIX = sf.Precision(param=torch.bfloat16, reduce=torch.float32,
                      overrides=((nn.modules.batchnorm._BatchNorm, sf.Precision(param=torch.float32)),))


def _bn_batches(steps=3):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)) for _ in range(steps)]


def _bn_sharded(precision, units):
    from shardfn.testing.models import ConvNet

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(ConvNet())
    try:
        sharded = sf.shard(params, mesh, "FULL_SHARD", units=units, precision=precision)
    except ValueError as e:
        return "refused", str(e)
    opt = sf.optim.sgd(0.1)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: nn.functional.cross_entropy(apply(p, b[0]).float(), b[1]), mesh, optimizer=opt)
    losses = []
    for b in _bn_batches():
        sharded, state, m = step(sharded, state, b)
        losses.append(m["loss"])
    return losses, sf.gather(sharded)


def _bn_reference():
    """One process, the same casts: bf16 copies of the conv and head weights (gradients
    back to the fp32 masters), BatchNorm's weights and statistics in fp32, bf16 inputs."""
    from shardfn.testing.models import ConvNet

    torch.manual_seed(0)
    net = ConvNet()
    masters = dict(net.named_parameters())
    buffers = dict(net.named_buffers())
    losses = []
    for x, y in _bn_batches():
        state = {**{k: v if ".bn." in k else v.to(torch.bfloat16) for k, v in masters.items()}, **buffers}
        loss = nn.functional.cross_entropy(torch.func.functional_call(net, state, (x.to(torch.bfloat16),)).float(), y)
        loss.backward()
        with torch.no_grad():
            for p in masters.values():
                p -= 0.1 * p.grad
                p.grad = None
        losses.append(loss.item())
    return losses, {**{k: v.detach() for k, v in masters.items()}, **buffers}


def test_batchnorm_under_a_param_dtype_is_refused_and_trains_with_the_fix(clusters):
    outcome, message = clusters[2].run(_bn_sharded, sf.Precision(param=torch.bfloat16, reduce=torch.float32), None)[0]
    assert outcome == "refused" and "blocks.0.bn (BatchNorm2d: parameters in bfloat16, running statistics in float32)" \
        in message and "overrides=" in message and "mesh Mesh(shard=2" in message, message
    losses, full = clusters[1].run(_bn_sharded, BN_FIX, [nn.BatchNorm2d])[0]
    ref_losses, ref = _bn_reference()
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
