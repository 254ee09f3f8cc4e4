"""shardfn.optim against torch.optim, the single-device reference."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
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
    assert adam_state.count.is_meta and adam_state.count.dtype == torch.int64  # the params' device
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


# -- clip_by_global_norm -------------------------------------------------------------------


def test_clip_by_global_norm_matches_clip_grad_norm():
    # Steps 0 and 2 have norms far above max_norm, step 1 far below: both branches run.
    params, grads = make_problem([(4, 3), (3,), ()], seed=8, steps=3)
    for g, factor in zip(grads, [10.0, 0.01, 5.0]):
        for k in g:
            g[k] = g[k] * factor
    ours, state = run_shardfn(optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1)), params, grads)
    assert state[0] == optim.EmptyState()

    ref = {k: torch.nn.Parameter(p.detach().clone()) for k, p in params.items()}
    opt = torch.optim.SGD(ref.values(), lr=0.1)
    norms = []
    for g in grads:
        for k, p in ref.items():
            p.grad = g[k].clone()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.values(), 1.0)))
        opt.step()
    assert norms[0] > 1.0 and norms[1] < 1.0 and norms[2] > 1.0
    assert_params_close(ours, ref)


def test_clip_by_global_norm_scales_every_leaf_by_one_factor():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor(4.0)}  # global norm 5
    clip = optim.clip_by_global_norm(2.5)
    updates, _ = clip.update(grads, clip.init({}), None)
    factor = 2.5 / (5.0 + 1e-6)
    torch.testing.assert_close(updates["a"], torch.tensor([3.0 * factor, 0.0]))
    torch.testing.assert_close(updates["b"], torch.tensor(4.0 * factor))
    small, _ = clip.update({"a": torch.tensor([0.3, 0.4])}, optim.EmptyState(), None)
    torch.testing.assert_close(small["a"], torch.tensor([0.3, 0.4]), rtol=0, atol=0)


def test_clip_by_global_norm_uses_the_norm_of_the_step():
    # Inside a step the norm comes from shardfn.optim._gradients.global_norm, which returns the
    # norm the step computed (over all shards) instead of this rank's local one.
    from shardfn.optim._gradients import Gradients

    grads = Gradients({"w": torch.tensor([3.0, 4.0])}, global_norm=torch.tensor(10.0))
    clip = optim.clip_by_global_norm(1.0)
    updates, _ = clip.update(grads, clip.init({}), None)
    torch.testing.assert_close(updates["w"], grads["w"] / (10.0 + 1e-6))


def test_clip_by_global_norm_keeps_the_grad_dtype():
    clip = optim.clip_by_global_norm(1.0)
    grads = {"w": torch.full((4,), 8.0, dtype=torch.bfloat16)}
    updates, _ = clip.update(grads, clip.init({}), None)
    assert updates["w"].dtype == torch.bfloat16
    torch.testing.assert_close(updates["w"].float(), torch.full((4,), 0.5), rtol=1e-2, atol=0)


# -- hyperparams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [lambda lr: optim.sgd(lr, momentum=0.9), lambda lr: optim.adamw(lr),
     lambda lr: optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(lr))],
    ids=["sgd", "adamw", "chain"],
)
def test_hyperparams_report_the_next_learning_rate(make):
    opt = make(lambda count: 0.1 / (1 + count))
    params, grads = make_problem([(2, 3)], seed=9, steps=3)
    state = opt.init(params)
    for count, g in enumerate(grads):
        assert optim.hyperparams(opt, state) == {"learning_rate": pytest.approx(0.1 / (1 + count), rel=1e-15)}
        _, state = opt.update(g, state, params)
    assert optim.hyperparams(opt, state) == {"learning_rate": pytest.approx(0.1 / 4, rel=1e-15)}


def test_hyperparams_learning_rate_is_the_one_update_uses():
    # Plain SGD: update = -lr * g, so the reported lr can be read back from the update.
    opt = optim.sgd(lambda count: [0.5, 0.25, 0.125][count])
    params = {"w": torch.zeros(2, requires_grad=True)}
    state = opt.init(params)
    for _ in range(3):
        reported = opt.hyperparams(state)["learning_rate"]
        updates, state = opt.update({"w": torch.ones(2)}, state, params)
        assert float(-updates["w"][0]) == reported


def test_chain_merges_hyperparams_later_members_win():
    momentum = optim.GradientTransformation(
        lambda params: optim.EmptyState(),
        lambda grads, state, params=None: (dict(grads), state),
        lambda state: {"momentum": 0.9, "learning_rate": 1.0},
    )
    opt = optim.chain(momentum, optim.scale(1.0), optim.sgd(0.3), optim.masked(optim.scale(2.0), lambda n: True))
    assert optim.hyperparams(opt, opt.init({})) == {"momentum": 0.9, "learning_rate": 0.3}
    opt = optim.chain(optim.sgd(0.3), momentum)
    assert optim.hyperparams(opt, opt.init({})) == {"momentum": 0.9, "learning_rate": 1.0}
    with pytest.raises(ValueError, match="tuple of 2 states"):
        optim.hyperparams(opt, optim.EmptyState())


def test_hyperparams_of_stateless_and_user_written_optimizers_are_empty():
    for opt in (optim.scale(2.0), optim.add_decayed_weights(0.1), optim.clip_by_global_norm(1.0)):
        assert opt.hyperparams(optim.EmptyState()) == {}

    class MySgd:  # a user's own optimizer: init and update only
        init = staticmethod(lambda params: ())
        update = staticmethod(lambda grads, state, params=None: ({k: -g for k, g in grads.items()}, state))

    assert optim.hyperparams(MySgd(), ()) == {}
    two_fields = optim.GradientTransformation(MySgd.init, MySgd.update)
    assert two_fields.hyperparams is None and optim.hyperparams(two_fields, ()) == {}
    chained = optim.chain(two_fields, optim.sgd(0.1))
    assert optim.hyperparams(chained, chained.init({})) == {"learning_rate": 0.1}


def test_hyperparams_reject_a_foreign_state():
    with pytest.raises(TypeError, match="state is tuple, not SgdState"):
        optim.hyperparams(optim.sgd(0.1), ())


def test_from_torch_hyperparams_follow_a_torch_scheduler():
    opt = optim.from_torch(torch.optim.SGD, lr=0.2)
    params = {"w": torch.ones(2, requires_grad=True)}
    state = opt.init(params)
    sched = torch.optim.lr_scheduler.StepLR(state.optimizer, step_size=1, gamma=0.5)
    assert optim.hyperparams(opt, state) == {"learning_rate": 0.2}
    _, state = opt.update({"w": torch.ones(2)}, state, params)
    sched.step()
    assert optim.hyperparams(opt, state) == {"learning_rate": 0.1}


# -- masked and adamw(mask=...) ------------------------------------------------------------

NAMES = ["layers.0.weight", "layers.0.bias", "norm.weight", "head.weight"]
SHAPES = [(4, 3), (4,), (4,), (2, 4)]


def decays(name):
    return name.startswith(("layers", "head")) and name.endswith("weight")


MASKS = {"callable": decays, "mapping": {n: decays(n) for n in NAMES}}


def named_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=gen).requires_grad_() for n, s in zip(NAMES, SHAPES)}
    grads = [{n: torch.randn(s, generator=gen) for n, s in zip(NAMES, SHAPES)} for _ in range(STEPS)]
    return params, grads


def param_groups(ps, weight_decay):
    """torch param groups: ``weight_decay`` for weights, 0.0 for biases and norm weights."""
    by_name = dict(zip(NAMES, ps))
    return [
        {"params": [p for n, p in by_name.items() if decays(n)], "weight_decay": weight_decay},
        {"params": [p for n, p in by_name.items() if not decays(n)], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("mask", MASKS)
def test_adamw_mask_matches_torch_param_groups(mask):
    params, grads = named_problem(seed=10)
    opt = optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-2, weight_decay=0.1, mask=MASKS[mask])
    ours, _ = run_shardfn(opt, params, grads)
    ref = run_torch(lambda ps: torch.optim.AdamW(param_groups(ps, 0.1), lr=1e-2, betas=(0.8, 0.95), eps=1e-2),
                    params, grads)
    assert_params_close(ours, ref)
    # The mask matters at this tolerance: decaying everything gives different params.
    everything, _ = run_shardfn(optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-2, weight_decay=0.1), params, grads)
    assert not torch.allclose(everything["layers.0.bias"], ours["layers.0.bias"], **TOL)


@pytest.mark.parametrize("mask", MASKS)
def test_masked_decay_then_sgd_matches_torch_param_groups(mask):
    params, grads = named_problem(seed=11)
    opt = optim.chain(optim.masked(optim.add_decayed_weights(0.1), MASKS[mask]), optim.sgd(0.1, momentum=0.9))
    ours, _ = run_shardfn(opt, params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(param_groups(ps, 0.1), lr=0.1, momentum=0.9), params, grads)
    assert_params_close(ours, ref)


def test_masked_passes_other_grads_through_unchanged():
    params, grads = named_problem(seed=12)
    opt = optim.masked(optim.scale(-2.0), decays)
    updates, _ = opt.update(grads[0], opt.init(params), params)
    assert list(updates) == NAMES
    for n in NAMES:
        expected = -2.0 * grads[0][n] if decays(n) else grads[0][n]
        torch.testing.assert_close(updates[n], expected, rtol=0, atol=0)


def test_masked_state_covers_selected_trainable_params_only():
    seen = []
    spy = optim.GradientTransformation(lambda p: seen.append(p) or optim.EmptyState(), None)
    params, grads = named_problem(seed=13)
    params["head.weight"].requires_grad_(False)
    optim.masked(spy, decays).init(params)
    assert type(seen[0]) is dict and list(seen[0]) == ["layers.0.weight"]

    opt = optim.masked(optim.adamw(1e-2), MASKS["mapping"])
    state = opt.init(params)
    assert isinstance(state, optim.AdamWState) and set(state.mu) == {"layers.0.weight"}
    del grads[0]["head.weight"]  # frozen: no gradient
    updates, state = opt.update(grads[0], state, params)
    assert set(updates) == set(grads[0]) and int(state.count) == 1


def test_masked_hyperparams_delegate_to_inner():
    opt = optim.masked(optim.sgd(lambda count: 0.5**count), decays)
    params, grads = named_problem(seed=14)
    state = opt.init(params)
    _, state = opt.update(grads[0], state, params)
    assert optim.hyperparams(opt, state) == {"learning_rate": 0.5}


@pytest.mark.parametrize(
    "make",
    [lambda m: optim.masked(optim.scale(1.0), m), lambda m: optim.adamw(1e-3, weight_decay=0.1, mask=m)],
    ids=["masked", "adamw"],
)
def test_mapping_mask_missing_a_name_names_it(make):
    params, _ = named_problem(seed=15)
    opt = make({"layers.0.weight": True, "layers.0.bias": False})
    with pytest.raises(ValueError, match=r"no entry for 'norm\.weight', 'head\.weight'.*callable"):
        opt.init(params)


@pytest.mark.parametrize(
    "make",
    [lambda: optim.masked(optim.scale(1.0), "bias"), lambda: optim.adamw(1e-3, mask=["bias"]),
     lambda: optim.masked(torch.optim.SGD, decays), lambda: optim.clip_by_global_norm(-1.0)],
    ids=["masked-str", "adamw-list", "masked-inner", "clip-negative"],
)
def test_bad_new_arguments_are_rejected(make):
    with pytest.raises((TypeError, ValueError), match="mask must be|not a GradientTransformation|max_norm must be"):
        make()


def test_all_is_sorted_and_exported():
    assert optim.__all__ == sorted(optim.__all__)
    assert {"clip_by_global_norm", "masked", "hyperparams"} <= set(optim.__all__)
    assert all(hasattr(optim, name) for name in optim.__all__)


# -- in-place updates (donation) -----------------------------------------------------------
#
# update_(grads, state, params) -> state writes the new params and state into the tensors
# passed in and may use the grads as scratch (optim._base [Note: donation]). The built-in
# ones do torch.optim's foreach steps op for op, so they equal torch bitwise; they equal the
# pure path (update + apply_updates_) to rounding, with the moments bitwise equal.

EXACT = {"rtol": 0, "atol": 0}


def run_in_place(opt, params, grads_per_step):
    """Like run_shardfn, through update_; each step donates a copy of its grads."""
    params = {k: p.detach().clone().requires_grad_(p.requires_grad) for k, p in params.items()}
    state = opt.init(params)
    for grads in grads_per_step:
        state = opt.update_({k: g.clone() for k, g in grads.items()}, state, params)
    return params, state


def assert_trees_equal(a, b, **tol):
    """Equal pytrees (optimizer states): same structure, tensors equal bitwise (or to ``tol``)."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b):
        torch.testing.assert_close(x, y, **(tol or EXACT))


def state_tensors(state):
    return [t for t in pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("mask", MASKS)
def test_adamw_in_place_is_torch_foreach_adamw_and_the_pure_path(mask):
    # Weight decay on some params only (torch param groups), a schedule, a large eps.
    factor = lambda count: 0.5**count + 0.1 * count  # noqa: E731

    def make():
        return optim.adamw(lambda c: 1e-2 * factor(c), b1=0.8, b2=0.95, eps=1e-3, weight_decay=0.1, mask=MASKS[mask])

    params, grads = named_problem(seed=20)
    ours, state = run_in_place(make(), params, grads)
    for foreach in (True, False):
        ref = run_torch(
            lambda ps, foreach=foreach: torch.optim.AdamW(
                param_groups(ps, 0.1), lr=1e-2, betas=(0.8, 0.95), eps=1e-3, foreach=foreach
            ),
            params, grads, lr_lambda=factor,
        )
        for k in ref:
            torch.testing.assert_close(ours[k].detach(), ref[k].detach(), **EXACT, msg=lambda m, k=k: f"{k}: {m}")
    pure, pure_state = run_shardfn(make(), params, grads)
    assert_params_close(ours, pure)
    assert_trees_equal(state, pure_state)  # moments and count: the same ops in both paths
    assert int(state.count) == STEPS


def test_adamw_in_place_updates_the_tensors_passed_in():
    opt = optim.adamw(1e-2, weight_decay=0.1)
    params, grads = make_problem([(3, 4), (4,)], seed=21, steps=1)
    state = opt.init(params)
    tensors = {k: p for k, p in params.items()}
    moments = state_tensors(state)
    before = {k: p.detach().clone() for k, p in params.items()}
    new_state = opt.update_(grads[0], state, params)
    assert new_state is state and int(state.count) == 1
    assert all(a is b for a, b in zip(state_tensors(new_state), moments))
    assert all(params[k] is tensors[k] and params[k].requires_grad for k in params)
    assert all(not torch.equal(params[k], before[k]) for k in params)
    assert all(m.abs().sum() > 0 for m in (*state.mu.values(), *state.nu.values()))


@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@FAST
@given(shapes=shapes_st, seed=seed_st)
def test_sgd_in_place_is_torch_foreach_sgd_and_the_pure_path(cfg, shapes, seed):
    params, grads = make_problem(shapes, seed)
    ours, state = run_in_place(optim.sgd(0.1, **cfg), params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(ps, lr=0.1, dampening=0, foreach=True, **cfg), params, grads)
    for k in ref:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), **EXACT)
    pure, pure_state = run_shardfn(optim.sgd(0.1, **cfg), params, grads)
    assert_params_close(ours, pure)
    # Weight decay feeds the params (equal to rounding) into the buffers.
    assert_trees_equal(state, pure_state, **(TOL if cfg["weight_decay"] else EXACT))


def test_chain_of_clip_and_adamw_in_place_equals_the_pure_path():
    # Norms far above max_norm on steps 0 and 2 and below on step 1: both branches of the clip.
    params, grads = make_problem([(4, 3), (3,), ()], seed=22, steps=3)
    for g, factor in zip(grads, [10.0, 0.01, 5.0]):
        for k in g:
            g[k] = g[k] * factor
    make = lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))  # noqa: E731
    assert make().update_ is not None
    ours, state = run_in_place(make(), params, grads)
    pure, pure_state = run_shardfn(make(), params, grads)
    assert_params_close(ours, pure)
    assert_trees_equal(state, pure_state)  # the clipped gradients reached adamw bitwise equal
    unclipped, _ = run_in_place(optim.adamw(1e-2, weight_decay=0.1), params, grads)
    assert not torch.allclose(unclipped["layers.0.weight"], ours["layers.0.weight"], **TOL)


def test_chain_in_place_uses_the_grads_object_the_step_measured():
    # In a step, clip reads the norm the step computed, which its gradient tree carries.
    from shardfn.optim._gradients import Gradients

    params = {"w": torch.zeros(2, requires_grad=True)}
    grads = Gradients({"w": torch.tensor([3.0, 4.0])}, global_norm=torch.tensor(10.0))
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-1.0))
    opt.update_(grads, opt.init(params), params)
    torch.testing.assert_close(params["w"].detach(), -torch.tensor([3.0, 4.0]) / (10.0 + 1e-6))


def test_chain_of_two_clips_in_place_measures_the_clipped_grads_again():
    # A kernel returns a new Mapping, so the second clip does not reuse the first one's norm.
    params, grads = make_problem([(3, 2)], seed=23, steps=2)
    grads = [{k: g * 10 for k, g in step.items()} for step in grads]
    make = lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.clip_by_global_norm(0.5), optim.sgd(0.1))  # noqa: E731
    ours, _ = run_in_place(make(), params, grads)
    pure, _ = run_shardfn(make(), params, grads)
    assert_params_close(ours, pure)


@pytest.mark.parametrize("mask", MASKS)
def test_masked_decay_then_sgd_in_place_is_torch_param_groups(mask):
    params, grads = named_problem(seed=24)
    opt = optim.chain(optim.masked(optim.add_decayed_weights(0.1), MASKS[mask]), optim.sgd(0.1, momentum=0.9))
    assert opt.update_ is not None
    ours, _ = run_in_place(opt, params, grads)
    ref = run_torch(lambda ps: torch.optim.SGD(param_groups(ps, 0.1), lr=0.1, momentum=0.9, foreach=True), params, grads)
    for k in ref:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), **EXACT)


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.chain(optim.add_decayed_weights(0.1), optim.scale(-0.1)),
        lambda: optim.masked(optim.adamw(1e-2, weight_decay=0.1), decays),
        lambda: optim.masked(optim.scale(-0.5), decays),
        lambda: optim.chain(optim.chain(optim.scale(2.0), optim.clip_by_global_norm(1.0)), optim.sgd(0.1, momentum=0.5)),
    ],
    ids=["decay-scale", "masked-adamw", "masked-scale", "nested-chain"],
)
def test_composed_in_place_equals_the_pure_path(make):
    params, grads = named_problem(seed=25)
    assert make().update_ is not None
    ours, state = run_in_place(make(), params, grads)
    pure, pure_state = run_shardfn(make(), params, grads)
    assert_params_close(ours, pure)
    assert_trees_equal(state, pure_state)


def _identity():
    """A user's own gradient-only transformation: no in-place kernel."""
    return optim.GradientTransformation(lambda p: optim.EmptyState(), lambda g, s, p=None: (dict(g), s))


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.chain(_identity(), optim.adamw(1e-3)),  # a leading member without a kernel
        lambda: optim.chain(optim.sgd(0.1, momentum=0.9), optim.scale(1.0)),  # a stateful leading member
        lambda: optim.chain(optim.adamw(1e-3), _identity()),  # a last member without update_
        lambda: optim.masked(_identity(), decays),
        lambda: optim.stateless(lambda g, p: dict(g)),
    ],
    ids=["user-first", "sgd-first", "user-last", "masked-user", "stateless-without-fn_"],
)
def test_no_in_place_path_where_members_lack_one(make):
    opt = make()
    assert opt.update_ is None
    params, grads = named_problem(seed=26)
    run_shardfn(opt, params, grads)  # the pure path still works


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.01)),
        (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, foreach=True)),
    ],
    ids=["Adam", "SGD-nesterov"],
)
def test_from_torch_in_place_is_the_torch_step(cls, kwargs):
    params, grads = make_problem([(3, 4), (4,), ()], seed=27)
    ours, state = run_in_place(optim.from_torch(cls, **kwargs), params, grads)
    ref = run_torch(lambda ps: cls(ps, **kwargs), params, grads)
    for k in ref:
        torch.testing.assert_close(ours[k].detach(), ref[k].detach(), **EXACT)
    assert all(q.grad is None for q in state.optimizer.param_groups[0]["params"])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_frozen_params_are_untouched_in_place(name):
    params, grads = make_problem([(3, 2), (4,), (2,)], seed=28)
    frozen = "layers.1.weight"
    params[frozen].requires_grad_(False)
    for g in grads:
        del g[frozen]
    ours, _ = run_in_place(OPTIMIZERS[name](), params, grads)
    torch.testing.assert_close(ours[frozen], params[frozen], **EXACT)
    assert not torch.equal(ours["layers.0.weight"], params["layers.0.weight"])


IN_PLACE = {
    **OPTIMIZERS,
    "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)),
    "masked": lambda: optim.masked(optim.sgd(0.1, momentum=0.9), lambda name: True),
}


@pytest.mark.parametrize("name", IN_PLACE)
def test_in_place_rejects_bad_input_before_writing_anything(name):
    opt = IN_PLACE[name]()
    params, grads = make_problem([(3, 2), (4,)], seed=29, steps=2)
    state = opt.init(params)
    state = opt.update_(grads[0], state, params)  # a real state, with non-zero moments
    snapshot = ({k: p.detach().clone() for k, p in params.items()}, [t.clone() for t in state_tensors(state)])
    bad = dict(grads[1], **{"layers.1.weight": torch.ones(5)})  # the wrong shape for the second leaf
    with pytest.raises(ValueError, match=r"layers\.1\.weight"):
        opt.update_(bad, state, params)
    with pytest.raises(ValueError, match="params=None"):
        opt.update_(grads[1], state, None)
    for k, p in snapshot[0].items():
        torch.testing.assert_close(params[k].detach(), p, **EXACT)
    for a, b in zip(state_tensors(state), snapshot[1]):
        torch.testing.assert_close(a, b, **EXACT)


def test_adamw_in_place_converts_grads_of_another_dtype():
    params = {"w": torch.linspace(-1, 1, 8, dtype=torch.bfloat16).requires_grad_()}
    grads = [{"w": torch.linspace(0.5, -0.3, 8)}]  # fp32 grads, bf16 params and state
    ours, state = run_in_place(optim.adamw(1e-2, weight_decay=0.1), params, grads)
    pure, pure_state = run_shardfn(optim.adamw(1e-2, weight_decay=0.1), params, grads)
    assert ours["w"].dtype == state.mu["w"].dtype == torch.bfloat16
    torch.testing.assert_close(ours["w"], pure["w"])  # bf16 tolerance
    assert_trees_equal(state, pure_state)


# -- memory of an in-place update ----------------------------------------------------------

MEM_SHAPES = {"layers.0.weight": (64, 32), "layers.0.bias": (32,), "norm.weight": (32,), "head.weight": (10, 7)}


def mem_problem(dtype=torch.float32, grad_dtype=torch.float32):
    gen = torch.Generator().manual_seed(30)
    params = {k: torch.randn(s, generator=gen).to(dtype).requires_grad_() for k, s in MEM_SHAPES.items()}
    grads = {k: torch.randn(s, generator=gen).to(grad_dtype) for k, s in MEM_SHAPES.items()}
    return params, grads


def set_bytes(dtype):
    """Bytes of one tensor per parameter (one "shard-sized set") in ``dtype``."""
    return sum(torch.Size(s).numel() for s in MEM_SHAPES.values()) * dtype.itemsize


def transient_bytes(fn, *trees):
    """Peak live bytes during ``fn()`` beyond those of ``trees`` (counted from the start)."""
    from shardfn._memory import track_live_bytes

    with track_live_bytes(*trees) as mem:
        start = mem.current
        fn()
    return mem.peak - start


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.adamw(lambda c: 1e-2 / (1 + c), weight_decay=0.1, mask=decays),
        lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    ],
    ids=["adamw", "sgd"],
)
def test_in_place_update_allocates_nothing(make):
    # The bound: 0 bytes. Moments, buffers and params are written in place, the
    # denominators (adamw) and the decayed / Nesterov gradients (sgd) go into the donated
    # grads, and the count is incremented in place.
    opt = make()
    params, grads = mem_problem()
    state = opt.init(params)
    state = opt.update_({k: g.clone() for k, g in grads.items()}, state, params)  # step 2 below: a used state
    box = {}
    extra = transient_bytes(lambda: box.update(state=opt.update_(grads, state, params)), params, state, grads)
    assert extra == 0
    assert box["state"] is state


def test_pure_adamw_update_allocates_four_sets():
    # What the in-place path saves: update makes new mu and nu, the denominators and the
    # updates, four parameter-sized sets (plus a decay temporary per leaf). This also shows
    # that the counter sees the optimizer's allocations.
    opt = optim.adamw(1e-2, weight_decay=0.1, mask=decays)
    params, grads = mem_problem()
    state = opt.init(params)

    def pure():
        updates, _ = opt.update(grads, state, params)
        optim.apply_updates_(params, updates)

    assert transient_bytes(pure, params, state, grads) >= 4 * set_bytes(torch.float32)


def test_in_place_chain_with_clip_allocates_only_the_clip_factor():
    # Inside a step the norm is the step's (its gradient tree carries it), so clipping in
    # place allocates only the 0-d fp32 intermediates of max_norm / (norm + 1e-6) clamped:
    # at most 3 x 4 bytes, and nothing parameter-sized.
    from shardfn.optim._gradients import Gradients
    from shardfn.optim._gradients import global_norm

    opt = optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2, weight_decay=0.1))
    params, grads = mem_problem()
    state = opt.init(params)
    grads = Gradients(grads, global_norm=global_norm(grads))
    extra = transient_bytes(lambda: opt.update_(grads, state, params), params, state, grads, grads.global_norm)
    assert extra <= 3 * torch.float32.itemsize


def test_in_place_update_with_grads_of_another_dtype_allocates_one_set():
    # fp32 grads for bf16 params and state: the grads are converted once, into one bf16 set
    # (then the scratch), exactly.
    opt = optim.adamw(1e-2, weight_decay=0.1)
    params, grads = mem_problem(dtype=torch.bfloat16, grad_dtype=torch.float32)
    state = opt.init(params)
    extra = transient_bytes(lambda: opt.update_(grads, state, params), params, state, grads)
    assert extra == set_bytes(torch.bfloat16)


# -- donation in a step --------------------------------------------------------------------

STEP_OPTIMIZERS = {
    "adamw": lambda: optim.adamw(lambda c: 1e-2 / (1 + c), weight_decay=0.1, mask=lambda n: n.endswith("weight")),
    "clip-sgd": lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1, momentum=0.9, nesterov=True)),
    "no-update_": lambda: optim.chain(_identity(), optim.adamw(1e-2)),
}


def donation_step(name, donate, overflow):
    """One step (after a first one) on a 2-rank FULL_SHARD MLP; what it called and changed."""
    import torch.nn.functional as F

    import shardfn as sf
    from shardfn.testing.models import MLP

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(MLP([6, 5, 4]))  # 5 and 4 rows: padded shards at world 2
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    inner = STEP_OPTIMIZERS[name]()
    calls = []

    def update(g, s, p=None):
        calls.append("update")
        return inner.update(g, s, p)

    def update_(g, s, p=None):
        calls.append("update_")
        return inner.update_(g, s, p)

    opt = optim.GradientTransformation(inner.init, update, inner.hyperparams, update_ if inner.update_ else None)
    step = sf.jit_step(
        lambda apply, p, b: F.mse_loss(apply(p, b["x"]), b["y"]) * b["k"], mesh, optimizer=opt, donate=donate,
        loss_scale=sf.DynamicLossScale() if overflow else None,
    )
    gen = torch.Generator().manual_seed(mesh.rank)
    batch = {"x": torch.randn(4, 6, generator=gen), "y": torch.randn(4, 4, generator=gen), "k": torch.tensor(1.0)}
    sharded, state, _ = step(sharded, step.init(sharded), batch)  # a state with non-zero moments
    calls.clear()
    scale_in = float(state.scale) if overflow else None
    own_state = (lambda s: s.opt_state) if overflow else (lambda s: s)  # the optimizer's own state
    params_in, state_in = dict(sharded.items()), state_tensors(own_state(state))
    params_copy, state_copy = {k: v.detach().clone() for k, v in params_in.items()}, [t.clone() for t in state_in]
    if overflow:
        batch["k"] = torch.tensor(float("inf"))  # non-finite gradients on every rank
    new, new_state, metrics = step(sharded, state, batch)
    return {
        "calls": calls,
        "skipped": metrics.get("skipped", False),
        "inputs_unchanged": all(torch.equal(params_in[k], v) for k, v in params_copy.items())
        and all(torch.equal(a, b) for a, b in zip(state_in, state_copy)),
        "same_params": all(new[k] is params_in[k] for k in new),
        "same_state": all(a is b for a, b in zip(state_tensors(own_state(new_state)), state_in)),
        "params": {k: v.detach().clone() for k, v in new.items()},
        "state": [t.clone() for t in state_tensors(own_state(new_state))],
        "scale": (scale_in, float(new_state.scale)) if overflow else None,
    }


@pytest.mark.parametrize("name", STEP_OPTIMIZERS)
def test_step_donates_params_and_state_only_when_asked(clusters, name):
    in_place = STEP_OPTIMIZERS[name]().update_ is not None
    donated = clusters[2].run(donation_step, name, True, False)
    kept = clusters[2].run(donation_step, name, False, False)
    for d, k in zip(donated, kept):
        # donate=False: the pure path, and nothing passed in was modified.
        assert k["calls"] == ["update"] and k["inputs_unchanged"] and not k["same_params"]
        # donate=True: the in-place path where the optimizer has one, else update + apply_updates_.
        assert d["calls"] == (["update_"] if in_place else ["update"])
        assert d["same_params"] and d["same_state"] == in_place and not d["inputs_unchanged"]
        for n, p in k["params"].items():
            torch.testing.assert_close(d["params"][n], p, **TOL)
        for a, b in zip(d["state"], k["state"]):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
def test_skipped_step_leaves_params_and_state_untouched(clusters, donate):
    for r in clusters[2].run(donation_step, "adamw", donate, True):
        assert r["skipped"] and r["calls"] == [] and r["inputs_unchanged"]
        assert r["same_params"] and r["same_state"]  # the step returns what it was given
        assert r["scale"][1] == r["scale"][0] / 2  # ... but a halved loss scale, in the state it returns
