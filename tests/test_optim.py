"""shardfn.optim against torch.optim, the single-device reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfn import optim

STEPS = 5
TOL = {"rtol": 1e-6, "atol": 1e-7}
FAST = settings(max_examples=12, deadline=None, derandomize=True)

# A few leaves of small shapes, scalars included; keys look like module paths.
shapes_st = st.lists(
    st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=4
)
seed_st = st.integers(0, 2**16)


def make_problem(shapes, seed, steps=STEPS):
    """Random params (all trainable) and one random grads dict per step."""
    gen = torch.Generator().manual_seed(seed)
    names = [f"layers.{i}.weight" for i in range(len(shapes))]
    params = {
        n: torch.randn(s, generator=gen).requires_grad_() for n, s in zip(names, shapes)
    }
    grads = [{n: torch.randn(s, generator=gen) for n, s in zip(names, shapes)} for _ in range(steps)]
    return params, grads


def run_shardfn(opt, params, grads_per_step, inplace=True):
    params = {k: p.detach().clone().requires_grad_(p.requires_grad) for k, p in params.items()}
    state = opt.init(params)
    for grads in grads_per_step:
        updates, state = opt.update(grads, state, params)
        if inplace:
            optim.apply_updates_(params, updates)
        else:
            params = optim.apply_updates(params, updates)
    return params, state


def run_torch(make_opt, params, grads_per_step, lr_lambda=None):
    ref = {
        k: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        for k, p in params.items()
    }
    opt = make_opt([p for p in ref.values() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda else None
    for grads in grads_per_step:
        for k, p in ref.items():
            p.grad = grads[k].clone() if k in grads else None
        opt.step()
        if sched is not None:
            sched.step()
    return ref


def assert_params_close(ours, ref):
    assert ours.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), **TOL, msg=lambda m, k=k: f"{k}: {m}")


SGD_CONFIGS = [
    dict(momentum=0.0, nesterov=False, weight_decay=0.0),
    dict(momentum=0.9, nesterov=False, weight_decay=0.0),
    dict(momentum=0.9, nesterov=True, weight_decay=0.0),
    dict(momentum=0.0, nesterov=False, weight_decay=0.1),
    dict(momentum=0.8, nesterov=True, weight_decay=0.05),
]


@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@FAST
@given(shapes=shapes_st, seed=seed_st)
def test_sgd_matches_torch(cfg, shapes, seed):
    params, grads = make_problem(shapes, seed)
    ours, _ = run_shardfn(optim.sgd(0.1, **cfg), params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, lr=0.1, dampening=0, **cfg), params, grads)
    assert_params_close(ours, ref)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01, 0.3])
@FAST
@given(shapes=shapes_st, seed=seed_st)
def test_adamw_matches_torch(weight_decay, shapes, seed):
    params, grads = make_problem(shapes, seed)
    # A large eps so that its placement in the denominator shows at this tolerance.
    opt = optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-2, weight_decay=weight_decay)
    ours, state = run_shardfn(opt, params, grads)
    ref = run_torch(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-2, weight_decay=weight_decay),
        params,
        grads,
    )
    assert_params_close(ours, ref)
    assert state.count.shape == () and int(state.count) == STEPS


def test_adamw_defaults_match_torch():
    params, grads = make_problem([(3, 4), (4,)], seed=0)
    ours, _ = run_shardfn(optim.adamw(1e-3), params, grads)
    assert_params_close(ours, run_torch(lambda ps: torch.optim.AdamW(ps, lr=1e-3), params, grads))


def test_out_of_place_and_in_place_paths_agree():
    params, grads = make_problem([(3, 4), (4,), ()], seed=1)
    opt = optim.adamw(1e-2)
    in_place, _ = run_shardfn(opt, params, grads, inplace=True)
    out_of_place, _ = run_shardfn(opt, params, grads, inplace=False)
    for k in params:
        torch.testing.assert_close(in_place[k], out_of_place[k], rtol=0, atol=0)


def test_sgd_momentum_matches_torch_when_a_leaf_skips_steps():
    # Leaf "b" gets its first gradient at step 2: torch starts its buffer then.
    params, grads = make_problem([(3,), (2, 2)], seed=2)
    names = list(params)
    for step in (0, 1):
        del grads[step][names[1]]
    ours, _ = run_shardfn(optim.sgd(0.1, momentum=0.9), params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), params, grads)
    assert_params_close(ours, ref)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda lr: optim.sgd(lr, momentum=0.9, weight_decay=0.1),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1)),
        (lambda lr: optim.adamw(lr, weight_decay=0.1),
         lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)),
    ],
    ids=["sgd", "adamw"],
)
def test_schedule_matches_lambda_lr(ours, theirs):
    factor = lambda count: 0.5**count + 0.1 * count  # noqa: E731
    seen = []

    def schedule(count):
        seen.append(count)
        return 0.1 * factor(count)

    params, grads = make_problem([(3, 4), (5,)], seed=3)
    got, _ = run_shardfn(ours(schedule), params, grads)
    assert seen == list(range(STEPS))
    assert_params_close(got, run_torch(theirs, params, grads, lr_lambda=factor))


def test_schedule_sets_the_step_size():
    # With SGD and no momentum the update is exactly -lr(count) * g.
    opt = optim.sgd(lambda count: [1.0, 0.5, 0.25][count])
    params = {"w": torch.zeros(3, requires_grad=True)}
    grads = {"w": torch.ones(3)}
    state = opt.init(params)
    for expected in [1.0, 0.5, 0.25]:
        updates, state = opt.update(grads, state, params)
        torch.testing.assert_close(updates["w"], torch.full((3,), -expected))


def test_schedule_must_return_a_number():
    opt = optim.sgd(lambda count: "fast")
    params = {"w": torch.zeros(2, requires_grad=True)}
    with pytest.raises(TypeError, match="schedule must return a float"):
        opt.update({"w": torch.ones(2)}, opt.init(params), params)


def test_chain_applies_transforms_in_order():
    params = {"w": torch.tensor([1.0, 2.0], requires_grad=True)}
    grads = {"w": torch.tensor([10.0, 20.0])}
    decay_then_scale = optim.chain(optim.add_decayed_weights(0.5), optim.scale(-0.1))
    scale_then_decay = optim.chain(optim.scale(-0.1), optim.add_decayed_weights(0.5))
    u1, s1 = decay_then_scale.update(grads, decay_then_scale.init(params), params)
    u2, _ = scale_then_decay.update(grads, scale_then_decay.init(params), params)
    torch.testing.assert_close(u1["w"], -0.1 * (grads["w"] + 0.5 * params["w"].detach()))
    torch.testing.assert_close(u2["w"], -0.1 * grads["w"] + 0.5 * params["w"].detach())
    assert s1 == (optim.EmptyState(), optim.EmptyState())


def test_chain_of_decay_and_sgd_equals_sgd_with_decay():
    params, grads = make_problem([(4, 3), (3,)], seed=4)
    chained = optim.chain(optim.add_decayed_weights(0.1), optim.sgd(0.1, momentum=0.9))
    got, state = run_shardfn(chained, params, grads)
    assert isinstance(state, tuple) and isinstance(state[1], optim.SgdState)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.1), params, grads)
    assert_params_close(got, ref)


def test_chain_rejects_a_foreign_state():
    opt = optim.chain(optim.scale(1.0), optim.scale(2.0))
    with pytest.raises(ValueError, match="tuple of 2 states"):
        opt.update({}, optim.EmptyState(), {})


OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.1),
    "adamw": lambda: optim.adamw(1e-2),
    "from_torch": lambda: optim.from_torch(torch.optim.Adam, lr=1e-2),
}


def per_leaf_state(state):
    if isinstance(state, optim.SgdState):
        return state.momentum_buffer
    if isinstance(state, optim.AdamWState):
        return state.mu
    return dict.fromkeys(state.names)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_frozen_params_get_no_state_and_are_untouched(name):
    opt = OPTIMIZERS[name]()
    params, grads = make_problem([(3, 2), (4,), (2,)], seed=5)
    frozen = "layers.1.weight"
    params[frozen].requires_grad_(False)
    for g in grads:
        del g[frozen]
    state = opt.init(params)
    assert set(per_leaf_state(state)) == set(params) - {frozen}

    original = params[frozen].clone()
    out_of_place, _ = run_shardfn(opt, params, grads, inplace=False)
    in_place, _ = run_shardfn(opt, params, grads, inplace=True)
    torch.testing.assert_close(out_of_place[frozen], original, rtol=0, atol=0)
    torch.testing.assert_close(in_place[frozen], original, rtol=0, atol=0)
    assert not torch.equal(in_place["layers.0.weight"], params["layers.0.weight"])


def test_apply_updates_keeps_untouched_params_and_requires_grad():
    params = {"a": torch.ones(2, requires_grad=True), "b": torch.zeros(3)}
    new = optim.apply_updates(params, {"a": torch.full((2,), 0.5)})
    assert new["b"] is params["b"]
    assert new["a"].requires_grad and new["a"].is_leaf
    torch.testing.assert_close(new["a"], torch.full((2,), 1.5))
    torch.testing.assert_close(params["a"], torch.ones(2), msg="input was modified")


def test_apply_updates_in_place_writes_leaf_params():
    params = {"a": torch.ones(2, requires_grad=True), "b": torch.zeros(3)}
    a = params["a"]
    assert optim.apply_updates_(params, {"a": torch.full((2,), 0.5)}) is None
    assert params["a"] is a
    torch.testing.assert_close(a.detach(), torch.full((2,), 1.5))


@pytest.mark.parametrize("fn", [optim.apply_updates, optim.apply_updates_])
def test_apply_updates_rejects_unknown_and_misshapen_keys(fn):
    params = {"a": torch.ones(2)}
    with pytest.raises(ValueError, match=r"updates\['nope'\]"):
        fn(params, {"nope": torch.ones(2)})
    with pytest.raises(ValueError, match=r"updates\['a'\] has shape \(3,\)"):
        fn(params, {"a": torch.ones(3)})


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_grad_without_state_names_the_key(name):
    opt = OPTIMIZERS[name]()
    params = {"enc.w": torch.ones(2, requires_grad=True), "head.w": torch.ones(3)}  # head frozen
    state = opt.init(params)
    grads = {"enc.w": torch.ones(2), "head.w": torch.ones(3)}
    with pytest.raises(ValueError, match=r"'head\.w'.*initialised for different params.*opt\.init"):
        opt.update(grads, state, params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_misshapen_grad_names_the_key(name):
    opt = OPTIMIZERS[name]()
    params = {"enc.w": torch.ones(2, 3, requires_grad=True)}
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"grads\['enc\.w'\] has shape \(3, 2\)"):
        opt.update({"enc.w": torch.ones(3, 2)}, state, params)


def test_sgd_without_momentum_checks_grads_against_params():
    opt = optim.sgd(0.1)
    params = {"w": torch.ones(2, requires_grad=True)}
    state = opt.init(params)
    assert state.momentum_buffer == {}
    with pytest.raises(ValueError, match=r"grads\['v'\].*params\['v'\] is missing"):
        opt.update({"v": torch.ones(2)}, state, params)


def test_weight_decay_needs_params():
    opt = optim.adamw(1e-3, weight_decay=0.1)
    params = {"w": torch.ones(2, requires_grad=True)}
    with pytest.raises(ValueError, match="params=None"):
        opt.update({"w": torch.ones(2)}, opt.init(params), None)


def test_non_tensor_leaf_is_a_type_error():
    opt = optim.sgd(0.1, momentum=0.9)
    params = {"w": torch.ones(2, requires_grad=True)}
    with pytest.raises(TypeError, match=r"grads\['w'\] is list"):
        opt.update({"w": [1.0, 2.0]}, opt.init(params), params)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov=True needs momentum > 0"),
        (lambda: optim.sgd(-0.1), "learning_rate must be >= 0"),
        (lambda: optim.sgd("0.1"), "float or a schedule"),
        (lambda: optim.adamw(1e-3, b2=1.0), r"b2 must be in \[0.0, 1.0\)"),
        (lambda: optim.add_decayed_weights(-1.0), "weight_decay must be >= 0"),
        (lambda: optim.chain(optim.scale(1.0), torch.optim.SGD), "not a GradientTransformation"),
        (lambda: optim.from_torch(optim.sgd), "torch.optim.Optimizer subclass"),
    ],
)
def test_bad_hyperparameters_are_rejected(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_update_does_not_mutate_its_inputs():
    opt = optim.adamw(1e-2, weight_decay=0.1)
    params, grads = make_problem([(3, 3)], seed=6)
    state = opt.init(params)
    _, state = opt.update(grads[0], state, params)
    before = [t.clone() for t in (state.count, *state.mu.values(), *state.nu.values())]
    params_before = {k: p.detach().clone() for k, p in params.items()}
    _, new_state = opt.update(grads[1], state, params)
    after = [state.count, *state.mu.values(), *state.nu.values()]
    for b, a in zip(before, after):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_params_close(params, params_before)
    assert int(new_state.count) == 2


def test_updates_carry_no_autograd_history():
    opt = optim.sgd(0.1, momentum=0.9, weight_decay=0.1)
    params = {"w": torch.ones(2, requires_grad=True)}
    updates, state = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    assert updates["w"].grad_fn is None and state.momentum_buffer["w"].grad_fn is None


@FAST
@given(shapes=shapes_st)
def test_init_on_meta_tensors(shapes):
    params = {f"p{i}": torch.empty(s, device="meta", requires_grad=True) for i, s in enumerate(shapes)}
    params["frozen"] = torch.empty(2, device="meta")
    adam_state = optim.adamw(1e-3).init(params)
    sgd_state = optim.sgd(0.1, momentum=0.9).init(params)
    for leaves in (adam_state.mu, adam_state.nu, sgd_state.momentum_buffer):
        assert set(leaves) == set(params) - {"frozen"}
        for k, t in leaves.items():
            assert t.is_meta and t.shape == params[k].shape and t.dtype == params[k].dtype
    assert adam_state.count.device.type == "cpu" and adam_state.count.dtype == torch.int64
    torch_state = optim.from_torch(torch.optim.Adam, lr=1e-3).init(params)
    assert torch_state.names == tuple(k for k in params if k != "frozen")


def test_state_dtype_follows_params():
    params = {"w": torch.ones(4, dtype=torch.bfloat16, requires_grad=True)}
    opt = optim.adamw(1e-2)
    updates, state = opt.update({"w": torch.ones(4)}, opt.init(params), params)  # fp32 grad
    assert state.mu["w"].dtype == state.nu["w"].dtype == updates["w"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.01)),
        (torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9, momentum=0.5, centered=True)),
    ],
    ids=["Adam", "RMSprop"],
)
@pytest.mark.parametrize("inplace", [True, False], ids=["apply_updates_", "apply_updates"])
@settings(max_examples=6, deadline=None, derandomize=True)
@given(shapes=shapes_st, seed=seed_st)
def test_from_torch_matches_torch(cls, kwargs, inplace, shapes, seed):
    params, grads = make_problem(shapes, seed)
    ours, state = run_shardfn(optim.from_torch(cls, **kwargs), params, grads, inplace=inplace)
    ref = run_torch(lambda ps: cls(ps, **kwargs), params, grads)
    for k in ref:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), rtol=1e-6, atol=1e-6)
    assert isinstance(state.optimizer, cls) and "TorchOptimizerState(optimizer=" in repr(state)


def test_from_torch_does_not_modify_grads():
    # torch's foreach Nesterov SGD adds the momentum into .grad in place.
    opt = optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    params = {"w": torch.ones(3, requires_grad=True)}
    grads = {"w": torch.ones(3)}
    opt.update(grads, opt.init(params), params)
    torch.testing.assert_close(grads["w"], torch.ones(3), rtol=0, atol=0)


def test_from_torch_reads_params_changed_by_the_caller():
    # Plain Adam's weight decay reads the param, so a stale private copy would show.
    kwargs = dict(lr=1e-2, weight_decay=0.5)
    params, grads = make_problem([(3, 2), (4,)], seed=7)
    opt = optim.from_torch(torch.optim.Adam, **kwargs)
    ours = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
    state = opt.init(ours)
    with torch.no_grad():
        for p in ours.values():
            p.mul_(3.0)  # after init: the optimizer's copies are now stale
    moved = {k: p.detach().clone().requires_grad_() for k, p in ours.items()}
    for g in grads:
        updates, state = opt.update(g, state, ours)
        ours = optim.apply_updates(ours, updates)
    ref = run_torch(lambda ps: torch.optim.Adam(ps, **kwargs), moved, grads)
    for k in ref:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), rtol=1e-6, atol=1e-6)


def test_foreign_state_is_a_type_error():
    params = {"w": torch.ones(2, requires_grad=True)}
    with pytest.raises(TypeError, match="state is tuple, not AdamWState"):
        optim.adamw(1e-3).update({"w": torch.ones(2)}, (), params)
