"""AdamW, numerically equal to ``torch.optim.AdamW``."""

from __future__ import annotations

import operator
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from ._count import advance, incremented as _next, new_count
from ._checks import _count, _check_grads, _check_hyper, _check_learning_rate, _check_params, _check_state, _resolve_learning_rate, _scratch, _trainable
from .._compile import compilable
from ._protocol import GradientTransformation, Params, ScalarOrSchedule, Updates
from ._fused import fused_groups, zeros_like_views
from ._masked import Mask, _check_mask, _selected


class AdamWState(NamedTuple):
    """State of :func:`adamw`.

    Attributes:
        count: 0-d int64 tensor on the params' device, the number of updates done so
            far ([Note: step counts]). One count
            for all leaves (as optax): a leaf missing from ``grads`` for a step keeps
            its moments, but its next bias correction still uses the global count,
            where ``torch.optim.AdamW`` would count steps per parameter.
        mu: name -> first moment, in the param's dtype and on its device.
        nu: name -> second moment, likewise.
    """

    count: torch.Tensor
    mu: dict[str, torch.Tensor]
    nu: dict[str, torch.Tensor]


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Mask | None = None,
) -> GradientTransformation:
    """Adam with decoupled weight decay.

    Equals ``torch.optim.AdamW(params, lr, betas=(b1, b2), eps=eps,
    weight_decay=weight_decay)``: with ``t = count + 1`` the update is
    ``-lr * wd * p - lr / (1 - b1**t) * mu / (sqrt(nu) / sqrt(1 - b2**t) + eps)``.
    Arithmetic runs in the state's dtype, which is the param's dtype.

    Args:
        learning_rate: a float, or a schedule ``count -> float`` where ``count`` is
            the number of updates done so far; it scales the decay too, as in torch.
        b1: decay rate of the first moment.
        b2: decay rate of the second moment.
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled decay rate; non-zero needs ``params`` in ``update``.
        mask: which params decay, as ``optax.adamw``'s mask: a callable
            ``name -> bool`` or a Mapping ``name -> bool`` (with an entry for every
            trainable param). ``None`` decays all. Equals torch param groups with
            ``weight_decay=0.0`` for the unselected params.

    Returns:
        A :class:`GradientTransformation` with state :class:`AdamWState`; its
        hyperparams are ``{"learning_rate": lr}`` for the next update. Its
        ``update_`` does the step in place as torch's foreach AdamW does, op for op
        (``p *= 1 - lr * wd``, then ``p += -lr / (1 - b1**t) * mu / denom``): params,
        moments and count are updated in place and the donated grads' storage holds
        the denominators, so it allocates no parameter-sized tensor (grads of another
        dtype than the state are first converted, which allocates).

    Example:
        >>> no_decay = ("bias", "norm.weight")
        >>> opt = adamw(3e-4, weight_decay=0.1, mask=lambda name: not name.endswith(no_decay))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> apply_updates_(params, updates)
        >>> state = opt.update_(grads, state, params)  # or in place: grads and state donated
    """
    _check_learning_rate(learning_rate, "adamw")
    _check_hyper("b1", b1, "adamw", lo=0.0, hi=1.0)
    _check_hyper("b2", b2, "adamw", lo=0.0, hi=1.0)
    _check_hyper("eps", eps, "adamw", lo=0.0)
    _check_hyper("weight_decay", weight_decay, "adamw", lo=0.0)
    if mask is not None:
        _check_mask(mask, "adamw")

    def decays(names: Params) -> set[str]:
        return set(names) if mask is None else _selected(mask, names, "adamw")

    def init(params: Params) -> AdamWState:
        trainable = _trainable(params)
        decays(trainable)  # a Mapping mask that lacks a name fails here, not mid-training
        # laid out like the shards, so that update_ can run on a flat unit's buffers ([Note: fused updates])
        return AdamWState(new_count(params), zeros_like_views(trainable), zeros_like_views(trainable))

    def update(
        grads: Params, state: AdamWState, params: Params | None = None
    ) -> tuple[Updates, AdamWState]:
        _check_state(state, AdamWState, "adamw")
        _check_grads(grads, state.mu, "adamw")
        if weight_decay or params is not None:
            params = _check_params(grads, params, "adamw")
        count = _count(state.count)
        lr = _resolve_learning_rate(learning_rate, count)
        # The same float expressions, in the same order, as torch.optim's single
        # tensor AdamW, so results agree to rounding.
        t = count + 1
        step_size = lr / (1 - b1**t)
        bias_correction2_sqrt = (1 - b2**t) ** 0.5
        decayed = decays(grads) if weight_decay else set()

        keys = list(grads)
        if not keys:
            return {}, AdamWState(_next(state.count, count), dict(state.mu), dict(state.nu))
        with torch.no_grad():
            # One foreach kernel per operation over all leaves (fewer, larger launches than
            # a Python loop per leaf); new tensors, so the state passed in is untouched.
            gs = [grads[k].to(state.mu[k].dtype) for k in keys]
            mus, nus, ups = _adamw_step(_NEW, None, [state.mu[k] for k in keys], [state.nu[k] for k in keys], gs,
                                        1 - b1, b2, bias_correction2_sqrt, eps, -step_size)
            for i, k in enumerate(keys):
                if k in decayed:  # decay + (-step_size) * mu / denom, as torch's addcdiv
                    ups[i] = ups[i].add_(params[k].to(mus[i].dtype) * -(lr * weight_decay))
        mu = {**state.mu, **dict(zip(keys, mus))}
        nu = {**state.nu, **dict(zip(keys, nus))}
        return dict(zip(keys, ups)), AdamWState(_next(state.count, count), mu, nu)

    def update_(grads: Params, state: AdamWState, params: Params | None = None) -> AdamWState:
        # [Note: in-place adamw] torch.optim.AdamW's foreach step, op for op: decay the
        # params, update the moments in place, then add -step_size * mu / denom into the
        # params. The denominators are written into the (donated) gradients, which are
        # dead once the moments are updated, so nothing parameter-sized is allocated.
        _check_state(state, AdamWState, "adamw")
        _check_grads(grads, state.mu, "adamw")
        params = _check_params(grads, params, "adamw")
        count = _count(state.count)
        lr = _resolve_learning_rate(learning_rate, count)
        t = count + 1
        step_size = lr / (1 - b1**t)
        bias_correction2_sqrt = (1 - b2**t) ** 0.5
        decayed = decays(grads) if weight_decay else set()
        keys = list(grads)
        with torch.no_grad():
            if not keys:
                state.count.add_(1)
                advance(state.count, count)
                return state
            # a flat unit's leaves as one tensor each where that is exact ([Note: fused updates])
            groups, rest = fused_groups(keys, params, grads, [state.mu, state.nu], state.mu[keys[0]].dtype)
            ps = [b[0] for _, b in groups] + [params[k] for k in rest]
            gs = [b[1] for _, b in groups] + [_scratch(grads[k], state.mu[k].dtype) for k in rest]
            mus = [b[2] for _, b in groups] + [state.mu[k] for k in rest]
            nus = [b[3] for _, b in groups] + [state.nu[k] for k in rest]
            to_decay = [b[0] for names, b in groups if decayed.issuperset(names)]
            to_decay += [params[k] for names, _ in groups if not decayed.issuperset(names) for k in names if k in decayed]
            to_decay += [params[k] for k in rest if k in decayed]
            _adamw_kernel(ps, to_decay, mus, nus, gs, 1 - lr * weight_decay, 1 - b1, b2, bias_correction2_sqrt, eps,
                          -step_size)
            state.count.add_(1)  # last: a kernel that raised leaves the count of the moments it did not finish
            advance(state.count, count)
        return state

    def adamw_hyperparams(state: AdamWState) -> dict[str, float]:
        _check_state(state, AdamWState, "adamw")
        return {"learning_rate": _resolve_learning_rate(learning_rate, _count(state.count))}

    return GradientTransformation(init, update, adamw_hyperparams, update_)


# [Note: one AdamW formula]
# A step of AdamW, with t = count + 1, as torch.optim.AdamW computes it (after the decay
# p <- p * (1 - lr * wd), which update adds to its result instead, as -lr * wd * p):
#     mu <- lerp(mu, g, 1 - b1)
#     nu <- nu * b2 + g * g * (1 - b2)
#     p  <- p + -lr / (1 - b1**t) * mu / (sqrt(nu) / sqrt(1 - b2**t) + eps)
# _adamw_step writes it once, in ops that each path supplies, so that each path keeps the
# kernels, and so the rounding, it is tested with: _IN_PLACE, torch's foreach kernels in
# place (update_, [Note: in-place adamw]); _NEW, the same kernels on new tensors (update:
# the state passed in is untouched); _TRACED, one leaf as torch.compile and a recorded
# step trace it, a chain of elementwise ops for inductor to fuse (_adamw_traced).


def _adamw_step(ops: SimpleNamespace, ps: Any, mus: Any, nus: Any, gs: Any, one_minus_b1: Any, b2: Any,
                bias_correction2_sqrt: Any, eps: Any, neg_step_size: Any) -> tuple[Any, Any, Any]:
    """``(mus, nus, ps)`` after one step of the moments and params ([Note: one AdamW formula]):
    lists of tensors, or one leaf's tensors with ``_TRACED``. With ``_NEW``, ``ps`` is None
    and the step itself comes back in its place."""
    mus = ops.lerp(mus, gs, one_minus_b1)
    nus = ops.addcmul(ops.mul(nus, b2), gs, gs, 1 - b2)
    denoms = ops.add(ops.div(ops.sqrt(nus, gs), bias_correction2_sqrt), eps)
    return mus, nus, ops.addcdiv(ps, mus, denoms, neg_step_size)


def _writes(kernel: Callable[..., None]) -> Callable[..., list[torch.Tensor]]:
    """A foreach kernel that writes its first list in place, returning that list."""

    def op(a: list[torch.Tensor], *args: Any) -> list[torch.Tensor]:
        kernel(a, *args)
        return a

    return op


def _sqrt_into_grads(nus: list[torch.Tensor], gs: list[torch.Tensor]) -> list[torch.Tensor]:
    # the gradients are not read again: their storage becomes the denominators
    torch._foreach_copy_(gs, nus)  # two foreach ops, not one sqrt per tensor
    torch._foreach_sqrt_(gs)
    return gs


def _new_step(ps: None, mus: list[torch.Tensor], denoms: list[torch.Tensor], neg_step_size: float,
              ) -> list[torch.Tensor]:
    steps = list(torch._foreach_div(mus, denoms))
    torch._foreach_mul_(steps, neg_step_size)
    return steps


_IN_PLACE = SimpleNamespace(
    lerp=_writes(torch._foreach_lerp_), mul=_writes(torch._foreach_mul_), addcmul=_writes(torch._foreach_addcmul_),
    sqrt=_sqrt_into_grads, div=_writes(torch._foreach_div_), add=_writes(torch._foreach_add_),
    addcdiv=_writes(torch._foreach_addcdiv_),
)
_NEW = SimpleNamespace(**{**vars(_IN_PLACE), "lerp": torch._foreach_lerp, "mul": torch._foreach_mul,
                          "sqrt": lambda nus, gs: torch._foreach_sqrt(nus), "addcdiv": _new_step})
_TRACED = SimpleNamespace(
    lerp=torch.Tensor.lerp_, mul=torch.Tensor.mul_, addcmul=lambda nu, g, g2, v: nu.add_(g * g2 * v),
    sqrt=lambda nu, g: nu.sqrt(), div=operator.truediv, add=operator.add,
    addcdiv=lambda p, mu, denom, v: p.add_(mu / denom * v),
)


def _adamw_kernel(ps: list[torch.Tensor], to_decay: list[torch.Tensor], mus: list[torch.Tensor],
                  nus: list[torch.Tensor], gs: list[torch.Tensor], decay: float, one_minus_b1: float, b2: float,
                  bias_correction2_sqrt: float, eps: float, neg_step_size: float) -> None:
    """The in-place AdamW step on lists of tensors, torch's foreach kernels op for op (see
    [Note: in-place adamw]); ``gs`` are donated and become the denominators."""
    if to_decay:
        torch._foreach_mul_(to_decay, decay)
    _adamw_step(_IN_PLACE, ps, mus, nus, gs, one_minus_b1, b2, bias_correction2_sqrt, eps, neg_step_size)


def _adamw_traced(ps: list[torch.Tensor], to_decay: list[torch.Tensor], mus: list[torch.Tensor],
                  nus: list[torch.Tensor], gs: list[torch.Tensor], decay: torch.Tensor, one_minus_b1: torch.Tensor,
                  b2: torch.Tensor, bias_correction2_sqrt: torch.Tensor, eps: torch.Tensor,
                  neg_step_size: torch.Tensor) -> None:
    """:func:`_adamw_kernel` as ``torch.compile`` sees it: the scalars are 0-d tensors (inputs
    of the graph), and each leaf's update is one chain of elementwise ops for inductor to
    fuse (the same formulas; compiled results differ from eager by reassociation only)."""
    for p in to_decay:
        p.mul_(decay)
    for p, mu, nu, g in zip(ps, mus, nus, gs):
        _adamw_step(_TRACED, p, mu, nu, g, one_minus_b1, b2, bias_correction2_sqrt, eps, neg_step_size)


_adamw_kernel = compilable(_adamw_kernel, traced=_adamw_traced)
