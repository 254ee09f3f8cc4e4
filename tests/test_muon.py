"""Optimizers that need a whole matrix: Muon exact on shards, and none silently wrong.

The reference is ``torch.optim.Muon`` (and ``torch.optim.AdamW`` for the other parameters) in
one process on the global batch, with its Newton-Schulz computed in fp32 (torch's is bf16,
whose roundings a different order of the gradient's sums can move), and shardfn with
``ns_dtype=torch.float32``: then the comparison holds to rel 1e-5.
"""

import functools
import inspect
import re
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn.optim._torch import ELEMENTWISE
from shardfn.testing import check_equivalence, split_batch
from shardfn.testing.models import MLP

SIZES = (12, 10, 7, 5)
STEPS = 3


def matrices(name, shape):
    return len(shape) == 2


def model():
    return MLP(list(SIZES))


def loss_fn(apply, params, batch):
    return F.mse_loss(apply(params, batch["x"]), batch["y"])


def batches(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(12, SIZES[0], generator=g), "y": torch.randn(12, SIZES[-1], generator=g)}
            for _ in range(steps)]


def optimizer(ns_dtype=torch.float32):
    return sf.optim.partition(
        # AdamW's eps: lr / eps <= 1, so a bias's gradient rounding moves it by a few times
        # that rounding on any CPU (tests/bounds.py)
        {"muon": sf.optim.muon(0.02, ns_dtype=ns_dtype), "adamw": sf.optim.adamw(1e-2, eps=1e-2, weight_decay=0.01)},
        lambda name, shape: "muon" if matrices(name, shape) else "adamw")


def _ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz, in fp32 (written out here, independently of shardfn's)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if grad.size(0) > grad.size(1) else x


def torch_training(make_optimizers, steps=STEPS):
    """The model trained in one process on the global batches by the torch optimizers
    ``make_optimizers(net)`` returns: losses and final parameters."""
    torch.manual_seed(0)
    net = model()
    optimizers = make_optimizers(net)
    losses = []
    for b in batches(steps):
        loss = F.mse_loss(net(b["x"]), b["y"])
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def reference(steps=STEPS):
    """torch.optim.Muon on the matrices and AdamW on the rest, one process, the global batch."""
    def optimizers(net):
        mats = [p for p in net.parameters() if p.ndim == 2]
        rest = [p for p in net.parameters() if p.ndim != 2]
        return torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-2, eps=1e-2, weight_decay=0.01)

    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", _ns_fp32):
        return torch_training(optimizers, steps)


# -- one process --------------------------------------------------------------------------


def test_muon_equals_torch_muon_in_one_process_bit_for_bit():
    # the same ops as torch's (bf16 Newton-Schulz, decay, then the adjusted step): equal bits
    torch.manual_seed(0)
    ws = {"a": torch.randn(6, 4), "b": torch.randn(3, 8)}
    mine = {k: v.clone() for k, v in ws.items()}
    theirs = [torch.nn.Parameter(v.clone()) for v in ws.values()]
    ref = torch.optim.Muon(theirs, lr=0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    opt = sf.optim.muon(0.05, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    state = opt.init({k: v.requires_grad_() for k, v in mine.items()})
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = {k: torch.randn(v.shape, generator=g) for k, v in ws.items()}
        for p, gr in zip(theirs, grads.values()):
            p.grad = gr.clone()
        ref.step()
        state = opt.update_({k: v.clone() for k, v in grads.items()}, state, mine)
    for p, (k, v) in zip(theirs, mine.items()):
        assert torch.equal(v.detach(), p.detach()), k
    # the pure update agrees to rounding
    updates, _ = opt.update(grads, opt.init(mine), mine)
    assert set(updates) == set(mine)


def test_muon_refuses_what_is_not_a_matrix():
    opt = sf.optim.muon(0.02)
    with pytest.raises(ValueError, match=r"muon: 1 parameter\(s\) are not matrices \(bias \[5\]\).*partition"):
        opt.init({"w": torch.zeros(5, 3, requires_grad=True), "bias": torch.zeros(5, requires_grad=True)})
    stacked = opt.init({"experts": torch.zeros(4, 5, 3, requires_grad=True)})  # a batch of matrices: fine
    assert stacked.momentum_buffer["experts"].shape == (4, 5, 3)


def test_stacked_experts_are_a_batch_of_matrices():
    torch.manual_seed(0)
    experts = torch.randn(3, 6, 4)
    grads = torch.randn(3, 6, 4)
    opt = sf.optim.muon(0.05, ns_dtype=torch.float32)
    stacked = {"e": experts.clone().requires_grad_()}
    opt.update_({"e": grads.clone()}, opt.init(stacked), stacked)
    for i in range(3):
        one = {"e": experts[i].clone().requires_grad_()}
        opt.update_({"e": grads[i].clone()}, opt.init(one), one)
        torch.testing.assert_close(stacked["e"][i].detach(), one["e"].detach(), rtol=1e-6, atol=1e-7)


def test_every_elementwise_torch_optimizer_is_elementwise_in_the_installed_torch():
    # Each listed optimizer's step functions (single-tensor, foreach, fused) read no norm, sum,
    # mean or matrix product: every element of a new value comes from the same element.
    forbidden = re.compile(r"\.norm\(|torch\.norm|vector_norm|_foreach_norm|\.sum\(|\.mean\(|\bmm\(|matmul|addmm|"
                           r"bmm\(| @ |\.var\(")
    for cls in ELEMENTWISE:
        module = inspect.getmodule(cls.step)
        fns = [f for f in vars(module).values()
               if inspect.isfunction(f) and f.__name__.startswith(("_single_tensor", "_multi_tensor", "_fused"))]
        assert fns, cls
        for f in fns:
            lines = [ln for ln in inspect.getsource(f).splitlines() if forbidden.search(ln) and not ln.strip().startswith("#")]
            assert lines == [], (cls.__name__, f.__name__, lines)
    assert torch.optim.Muon not in ELEMENTWISE and torch.optim.Adafactor not in ELEMENTWISE


# -- on shards ------------------------------------------------------------------------------


def test_muon_on_shards_equals_torch_muon_in_one_process(clusters):
    opt = functools.partial(optimizer, torch.float32)
    plans = [sf.Plan(s, placement=sf.whole(matrices)) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")]
    ref_losses, ref = reference()
    for world in (1, 2, 3, 4):
        report = check_equivalence(model, loss_fn, batches(), optimizer=opt, strategies=plans, world_sizes=[world],
                                   clusters=clusters, raise_on_failure=False)
        _against_torch(report, ref_losses)
    report = check_equivalence(model, loss_fn, batches(), optimizer=opt, world_sizes=[(2, 2)], clusters=clusters,
                               strategies=[sf.Plan("HYBRID_SHARD", placement=sf.whole(matrices))],
                               raise_on_failure=False, step_options={"micro_batches": 3})
    _against_torch(report, ref_losses)


def _against_torch(report, ref_losses):
    # check_equivalence's own reference runs the same shardfn optimizer in one process: it must
    # pass; and that reference must equal torch's Muon + AdamW (compared once, here)
    assert report.failures() == [], report.failures()
    for cfg, pairs in report.losses.items():
        for (got, _), want in zip(pairs, ref_losses):
            assert got == pytest.approx(want, rel=1e-5), cfg


def test_shardfn_muon_in_one_process_equals_torch_muon():
    from shardfn.testing import reference_training

    losses, state = reference_training(model, loss_fn, batches(), functools.partial(optimizer, torch.float32))
    ref_losses, ref = reference()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in ref.items():
        torch.testing.assert_close(state[n], p, rtol=1e-5, atol=1e-6)


def _refused(placement, opt_name):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(model())
    sharded = sf.shard(params, mesh, "FULL_SHARD", placement=placement)
    opt = {"muon": lambda: optimizer(), "torch_muon": lambda: sf.optim.from_torch(torch.optim.Muon, lr=0.02),
           "torch_adam": lambda: sf.optim.from_torch(torch.optim.Adam, lr=0.02)}[opt_name]()
    try:
        opt.init(sharded)
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("opt_name", ["muon", "torch_muon"])
def test_a_cut_matrix_is_refused_on_every_rank(clusters, opt_name):
    messages = clusters[2].run(_refused, "flat", opt_name)
    assert re.sub(r"rank=\d", "", messages[0]) == re.sub(r"rank=\d", "", messages[1]) != "accepted"  # (the mesh's repr)
    assert "layers.0.linear.weight: shape [10, 12]" in messages[0] and "shardfn.whole" in messages[0]
    if opt_name == "torch_muon":
        assert "from_torch(Muon)" in messages[0] and "shardfn.optim.muon" in messages[0]
    # whole matrices are accepted (the biases, 1-D, go to AdamW), and an elementwise torch optimizer anywhere
    assert clusters[2].run(_refused, sf.whole(matrices), "muon") == ["accepted"] * 2
    assert clusters[2].run(_refused, "flat", "torch_adam") == ["accepted"] * 2


def _ns_calls(world_steps):
    """Train with Muon on whole matrices; which matrices this rank orthogonalised, and its flops."""
    import shardfn.optim._muon as M

    calls = []
    original = M.newton_schulz

    def counted(g, *args, **kwargs):
        calls.append(tuple(g.shape))
        return original(g, *args, **kwargs)

    M.newton_schulz = counted
    try:
        mesh = sf.Mesh.from_group()
        torch.manual_seed(0)
        params, apply = sf.functionalize(model())
        sharded = sf.shard(params, mesh, "FULL_SHARD", placement=sf.whole(matrices))
        opt = optimizer()
        state = opt.init(sharded)
        step = sf.jit_step(loss_fn, mesh, optimizer=opt)
        with sf.record_collectives() as log:
            for b in batches(world_steps):
                sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    finally:
        M.newton_schulz = original
    # Newton-Schulz flops of an m x n matrix (m <= n): per step 2 m^2 n (gram) + 2 m^3 (its square) + 2 m^2 n
    flops = sum(4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3 for s in calls)
    return calls, flops, dict(log.counts())


@pytest.mark.parametrize("world", [2, 3])
def test_each_matrix_is_orthogonalised_once_in_the_world_with_no_communication(clusters, world):
    results = clusters[world].run(_ns_calls, 2)
    every = sorted(s for calls, _, _ in results for s in calls)
    torch.manual_seed(0)
    shapes = sorted(tuple(p.shape) for p in model().parameters() if p.ndim == 2)
    assert every == sorted(shapes * 2)  # each matrix once per step, on one rank (2 steps)
    # the optimizer adds no collective: the same counts as AdamW on the same whole placement
    counts = {tuple(sorted(c.items())) for _, _, c in results}
    assert len(counts) == 1
    flops = [f for _, f, _ in results]
    print(f"\nworld {world}: Newton-Schulz flops per rank {flops}, largest / mean {max(flops) / (sum(flops) / world):.2f}")
    assert max(flops) / (sum(flops) / world) < world  # spread (3 matrices over the ranks), not all on one


def _optimizer_named(name):
    return adafactor_opt() if name == "adafactor" else optimizer()


def _save_muon(path, opt_name="muon", placement=None):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(model())
    sharded = sf.shard(params, mesh, "FULL_SHARD", placement=placement or sf.whole(matrices))
    opt = _optimizer_named(opt_name)
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    for b in batches(2):
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    sf.checkpoint.save(path, sharded, state)


def _resume_muon(path, strategy, placement, opt_name="muon"):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(1)
    params, apply = sf.functionalize(model())
    sharded = sf.shard(params, mesh, strategy, placement=placement)
    opt = _optimizer_named(opt_name)
    sharded, state, _ = sf.checkpoint.load(path, sharded, opt.init(sharded))
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses = []
    for b in batches(4)[2:]:
        sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        losses.append(float(m["loss"]))
    return losses, sf.gather(sharded)


def test_muon_momentum_reshards_through_a_checkpoint(clusters, tmp_path):
    path = str(tmp_path / "ckpt")
    clusters[2].run(_save_muon, path)
    straight = clusters[1].run(_resume_muon, path, "NO_SHARD", "flat")[0]
    for world, strategy in ((3, "FULL_SHARD"), (4, "SHARD_GRAD_OP"), (2, "NO_SHARD")):
        losses, full = clusters[world].run(_resume_muon, path, strategy, sf.whole(matrices))[0]
        assert losses == pytest.approx(straight[0], rel=1e-5)
        for n, t in straight[1].items():
            torch.testing.assert_close(full[n], t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_name", ["muon", "adafactor"])
def test_offload_and_compile_equal_the_torch_optimizer(clusters, opt_name):
    if opt_name == "muon":
        opt, (ref_losses, _), placement = functools.partial(optimizer, torch.float32), reference(), sf.whole(matrices)
    else:
        opt, (ref_losses, _), placement = adafactor_opt, adafactor_reference(), "flat"
    offloaded = sf.Plan("FULL_SHARD", placement=placement, offload=sf.Offload(params=True, optimizer=True))
    for plan, options in ((offloaded, {}), (sf.Plan("FULL_SHARD", placement=placement), {"compile": True})):
        report = check_equivalence(model, loss_fn, batches(), optimizer=opt, strategies=[plan], world_sizes=[2],
                                   clusters=clusters, raise_on_failure=False, step_options=options)
        _against_torch(report, ref_losses)


# -- Adafactor: statistics summed over the shards ----------------------------------------------


def adafactor_opt():
    return sf.optim.adafactor(0.05, weight_decay=0.01)


def adafactor_reference(steps=STEPS):
    return torch_training(lambda net: (torch.optim.Adafactor(net.parameters(), lr=0.05, weight_decay=0.01),), steps)


def test_adafactor_equals_torch_adafactor_in_one_process():
    from shardfn.testing import reference_training

    losses, state = reference_training(model, loss_fn, batches(), adafactor_opt)
    ref_losses, ref = adafactor_reference()
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    for n, p in ref.items():
        torch.testing.assert_close(state[n], p, rtol=1e-6, atol=1e-7)


def test_adafactor_on_any_shards_equals_torch_adafactor(clusters):
    ref_losses, _ = adafactor_reference()
    plans = [sf.Plan("FULL_SHARD"), sf.Plan("FULL_SHARD", placement="rows"), sf.Plan("SHARD_GRAD_OP"),
             sf.Plan("FULL_SHARD", placement=sf.whole(matrices)), sf.Plan("NO_SHARD")]
    for world in (1, 2, 3, 4):
        report = check_equivalence(model, loss_fn, batches(), optimizer=adafactor_opt, strategies=plans,
                                   world_sizes=[world], clusters=clusters, raise_on_failure=False)
        _against_torch(report, ref_losses)
    report = check_equivalence(model, loss_fn, batches(), optimizer=adafactor_opt, world_sizes=[(2, 2)],
                               strategies=["HYBRID_SHARD"], clusters=clusters, raise_on_failure=False)
    _against_torch(report, ref_losses)


def _adafactor_collectives():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = adafactor_opt()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    sharded, state, _ = step(sharded, state, split_batch(batches(1)[0], mesh.rank, mesh.size))
    with sf.record_collectives() as log:
        sharded, state, _ = step(sharded, state, split_batch(batches(1)[0], mesh.rank, mesh.size))
    return log.counts(purpose="psum"), log.bytes(purpose="psum")


def test_adafactor_sums_its_statistics_in_two_all_reduces_per_step(clusters):
    counts, nbytes = clusters[2].run(_adafactor_collectives)[0]
    torch.manual_seed(0)
    shapes = [tuple(p.shape) for p in model().parameters()]
    # rows + cols per matrix and one sum of squares per parameter, then one per parameter again
    floats = sum(s[0] + s[1] for s in shapes if len(s) == 2) + 2 * len(shapes)
    assert dict(counts) == {"all_reduce": 2} and dict(nbytes) == {"all_reduce": 4 * floats}


def test_adafactor_moments_reshard_through_a_checkpoint(clusters, tmp_path):
    # the factored moments are whole on every rank, the 1-D ones shards: both load at any world
    path = str(tmp_path / "ckpt")
    clusters[2].run(_save_muon, path, "adafactor", "flat")
    straight = clusters[1].run(_resume_muon, path, "NO_SHARD", "flat", "adafactor")[0]
    for world, strategy, placement in ((3, "FULL_SHARD", "rows"), (4, "SHARD_GRAD_OP", "flat"),
                                       (2, "FULL_SHARD", sf.whole(matrices))):
        losses, full = clusters[world].run(_resume_muon, path, strategy, placement, "adafactor")[0]
        assert losses == pytest.approx(straight[0], rel=1e-5)
        for n, t in straight[1].items():
            torch.testing.assert_close(full[n], t, rtol=1e-5, atol=1e-6)
