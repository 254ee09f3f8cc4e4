"""Stochastic gradient descent, numerically equal to ``torch.optim.SGD``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._count import advance, incremented as _next, new_count
from ._checks import _count, _check_grads, _check_hyper, _check_learning_rate, _check_params, _check_state, _resolve_learning_rate, _scratch, _trainable
from ._combinators import _add_
from ._fused import fused_groups, zeros_like_views
from .._compile import compilable
from ._protocol import GradientTransformation, Params, ScalarOrSchedule, Updates


class SgdState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: 0-d int64 tensor on the params' device, the number of updates done
            so far (read by a learning-rate schedule; [Note: step counts]).
        momentum_buffer: name -> buffer (param dtype and device) for each trainable
            param; empty when ``momentum == 0``.
    """

    count: torch.Tensor
    momentum_buffer: dict[str, torch.Tensor]


# [Note: zero momentum buffer]
# torch.optim.SGD creates the buffer lazily as a copy of the first gradient. A
# functional state needs its buffers up front (and must work on meta tensors), so
# they start at zero: the first update then computes 0 * momentum + g, which is g
# exactly, and a leaf whose first gradient arrives late behaves the same way. This
# holds because dampening is fixed at 0.


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """SGD with optional momentum, Nesterov momentum and L2 weight decay.

    Equals ``torch.optim.SGD(params, lr, momentum, dampening=0,
    weight_decay=weight_decay, nesterov=nesterov)`` step for step: the decay is
    added to the gradient, the momentum buffer starts as the first gradient, and
    Nesterov uses ``g + momentum * buf``.

    Args:
        learning_rate: a float, or a schedule ``count -> float`` where ``count`` is
            the number of updates done so far.
        momentum: momentum factor; 0 keeps no per-param state.
        nesterov: use Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 penalty added to the gradient; needs ``params`` in
            ``update``.

    Returns:
        A :class:`GradientTransformation` with state :class:`SgdState`; its
        hyperparams are ``{"learning_rate": lr}`` for the next update. Its ``update_``
        does the step in place as torch's foreach SGD does (buffers and params
        updated in place; decay and the Nesterov term written into the donated grads).

    Example:
        >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> apply_updates_(params, updates)
    """
    _check_learning_rate(learning_rate, "sgd")
    _check_hyper("momentum", momentum, "sgd", lo=0.0)
    _check_hyper("weight_decay", weight_decay, "sgd", lo=0.0)
    if nesterov and momentum <= 0:
        raise ValueError(
            f"sgd: nesterov=True needs momentum > 0, got momentum={momentum}; set "
            "momentum (for example 0.9) or nesterov=False."
        )

    def init(params: Params) -> SgdState:
        trainable = _trainable(params)
        # laid out like the shards, so that update_ can run on a flat unit's buffers ([Note: fused updates])
        buffers = zeros_like_views(trainable) if momentum else {}
        return SgdState(new_count(params), buffers)

    def update(
        grads: Params, state: SgdState, params: Params | None = None
    ) -> tuple[Updates, SgdState]:
        _check_state(state, SgdState, "sgd")
        if momentum:
            _check_grads(grads, state.momentum_buffer, "sgd")
        if weight_decay or params is not None:
            # Without momentum this is the only check of keys and shapes.
            params = _check_params(grads, params, "sgd")
        done = _count(state.count)
        lr = _resolve_learning_rate(learning_rate, done)

        updates: Updates = {}
        buffers = dict(state.momentum_buffer)
        with torch.no_grad():
            for k, g in grads.items():
                if weight_decay:
                    g = g.add(params[k], alpha=weight_decay)
                if momentum:
                    g = g.to(buffers[k].dtype)  # compute in the state's dtype
                    buf = buffers[k] * momentum + g  # [Note: zero momentum buffer]
                    buffers[k] = buf
                    g = g.add(buf, alpha=momentum) if nesterov else buf
                updates[k] = g * -lr
        return updates, SgdState(_next(state.count, done), buffers)

    def update_(grads: Params, state: SgdState, params: Params | None = None) -> SgdState:
        # torch.optim.SGD's foreach step, op for op, in place; the weight decay and the
        # Nesterov term are added into the (donated) gradients.
        _check_state(state, SgdState, "sgd")
        if momentum:
            _check_grads(grads, state.momentum_buffer, "sgd")
        params = _check_params(grads, params, "sgd")
        done = _count(state.count)
        lr = _resolve_learning_rate(learning_rate, done)
        keys = list(grads)
        with torch.no_grad():
            if not keys:
                state.count.add_(1)
                advance(state.count, done)
                return state
            states = [state.momentum_buffer] if momentum else []
            dtype = state.momentum_buffer[keys[0]].dtype if momentum else params[keys[0]].dtype
            groups, rest = fused_groups(keys, params, grads, states, dtype)  # [Note: fused updates]
            ps = [b[0] for _, b in groups] + [params[k] for k in rest]
            gs = [b[1] for _, b in groups] + [grads[k] for k in rest]
            bufs = ([b[2] for _, b in groups] + [state.momentum_buffer[k] for k in rest]) if momentum else []
            _sgd_kernel(ps, gs, bufs, -lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov)
            state.count.add_(1)  # last: a kernel that raised leaves the count as it was
            advance(state.count, done)
        return state

    def sgd_hyperparams(state: SgdState) -> dict[str, float]:
        _check_state(state, SgdState, "sgd")
        return {"learning_rate": _resolve_learning_rate(learning_rate, _count(state.count))}

    return GradientTransformation(init, update, sgd_hyperparams, update_)



def _sgd_kernel(ps: list[torch.Tensor], gs: list[torch.Tensor], bufs: list[torch.Tensor], neg_lr: float, *,
                weight_decay: float, momentum: float, nesterov: bool) -> None:
    """The in-place SGD step on lists of tensors (``gs`` donated), torch's foreach kernels op for op."""
    if weight_decay:
        gs = [_add_(g, p, weight_decay) for g, p in zip(gs, ps)]
    if momentum:
        gs = [_scratch(g, b.dtype) if nesterov else g.to(b.dtype) for g, b in zip(gs, bufs)]
        torch._foreach_mul_(bufs, momentum)
        torch._foreach_add_(bufs, gs)  # [Note: zero momentum buffer]
        if nesterov:
            torch._foreach_add_(gs, bufs, alpha=momentum)
        else:
            gs = bufs
    torch._foreach_add_(ps, gs, alpha=neg_lr)


def _sgd_traced(ps: list[torch.Tensor], gs: list[torch.Tensor], bufs: list[torch.Tensor], neg_lr: torch.Tensor, *,
                weight_decay: float, momentum: float, nesterov: bool) -> None:
    """:func:`_sgd_kernel` as ``torch.compile`` sees it: the learning rate a 0-d tensor, one
    chain of elementwise ops per leaf."""
    for i, (p, g) in enumerate(zip(ps, gs)):
        if weight_decay:
            g = g + p * weight_decay
        if momentum:
            b = bufs[i]
            b.mul_(momentum).add_(g.to(b.dtype))
            g = g.to(b.dtype) + b * momentum if nesterov else b
        p.add_(g * neg_lr)


_sgd_kernel = compilable(_sgd_kernel, traced=_sgd_traced)
