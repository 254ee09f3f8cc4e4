"""The arithmetic behind the equivalence tests' tolerances (tests/bounds.py, [Note: tolerances
after training]): the optimizers' bounds hold, and this CPU's gradients stay inside them."""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import shardfn as sf
from bounds import ADAMW, SGD_MOMENTUM, adamw_bound, sgd_bound
from shardfn.optim import apply_updates
from shardfn.testing import split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model, mlp_batches, mlp_loss, mlp_model
from test_ranks_differ import moe_batches, moe_model, mse

ATOL = 1e-6  # check_equivalence's default


def test_the_bounds_are_the_documented_figures():
    assert sgd_bound(0.05, 0.9, 3, 1.0) == pytest.approx(0.05 * (1 + 1.9 + 2.71))
    assert adamw_bound(1e-3, 1e-3, 3, 1.0) == pytest.approx(6.0, rel=1e-3)
    # C = max |m|/sqrt(v) after one step is 1 (the update is the gradient's sign)
    assert adamw_bound(1.0, 1.0, 1, 1.0) == pytest.approx(2.0)


def _train(opt_fn, grads):
    """Parameters after one step per gradient in ``grads`` (a list of [n] tensors, float64)."""
    opt = opt_fn()
    params = {"p": torch.zeros_like(grads[0]).requires_grad_()}
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update({"p": g}, state, params)
        params = {"p": apply_updates(params, updates)["p"].detach().requires_grad_()}
    return params["p"].detach()


@given(scale=st.sampled_from([1e-9, 1e-6, 1e-3, 1.0]), seed=st.integers(0, 2**16))
def test_a_gradient_moved_by_dg_moves_the_parameters_within_the_bound(scale, seed):
    """The worst case included: gradients near zero (scale 1e-9), where AdamW with torch's eps
    moves by lr and ADAMW's eps keeps the step proportional to dg."""
    g = torch.Generator().manual_seed(seed)
    dg = 1e-7
    grads = [torch.randn(256, generator=g, dtype=torch.float64) * scale for _ in range(3)]
    moved = [x + dg * (2 * torch.rand(256, generator=g, dtype=torch.float64) - 1) for x in grads]
    for opt_fn, bound in [(ADAMW, adamw_bound(1e-3, 1e-3, 3, dg)), (SGD_MOMENTUM, sgd_bound(0.05, 0.9, 3, dg))]:
        diff = float((_train(opt_fn, grads) - _train(opt_fn, moved)).abs().max())
        assert diff <= bound * (1 + 1e-6), (opt_fn, scale, diff, bound)
    # and the bound is why: torch's eps lets the same dg move a near-zero gradient's parameter by ~lr
    if scale == 1e-9:
        plain = functools.partial(sf.optim.adamw, 1e-3, weight_decay=0.01)
        assert float((_train(plain, grads) - _train(plain, moved)).abs().max()) > 100 * adamw_bound(1e-3, 1e-3, 3, dg)


@pytest.mark.parametrize("model", ["gpt", "mlp", "moe"])
def test_this_cpus_gradients_of_a_slice_stay_inside_the_bounds(model):
    """The input of the bounds, measured on this CPU's kernels: the one-process gradient of a
    global batch against the mean of its slices' (summed in rank order, as the
    reduce-scatter does), for every world the suite runs. The tests' atol holds while dg
    does; on a CPU where it does not, this test names the model and the figure."""
    model_fn, loss_fn, batches = {"gpt": (gpt_model, gpt_loss, gpt_batches), "mlp": (mlp_model, mlp_loss, mlp_batches),
                                  "moe": (moe_model, mse, moe_batches)}[model]
    torch.manual_seed(0)
    params, apply = sf.functionalize(model_fn())
    p = {n: t.detach().requires_grad_() for n, t in params.items() if t.is_floating_point()}
    dg = 0.0
    for world in (2, 3, 4):
        for batch in batches():
            whole = torch.autograd.grad(loss_fn(apply, p, batch), list(p.values()), allow_unused=True)
            parts = [torch.autograd.grad(loss_fn(apply, p, split_batch(batch, r, world)), list(p.values()),
                                         allow_unused=True) for r in range(world)]
            for i, g in enumerate(whole):
                terms = [q[i] if q[i] is not None else torch.zeros_like(list(p.values())[i]) for q in parts]
                total = terms[0]
                for t in terms[1:]:
                    total = total + t
                ref = g if g is not None else torch.zeros_like(total)
                dg = max(dg, float((total / world - ref).abs().max()))
    budget = min(ATOL / adamw_bound(1e-3, 1e-3, 3, 1.0), ATOL / sgd_bound(0.05, 0.9, 3, 1.0))
    assert dg <= budget / 2, f"{model}: gradients of slices differ from the whole batch's by {dg:.3g} (budget {budget:.3g})"
