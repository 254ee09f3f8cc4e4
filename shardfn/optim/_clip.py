"""Gradient clipping by the global norm over all leaves (and all shards)."""

from __future__ import annotations

import torch

from ._gradients import global_norm
from ._checks import _check_hyper, _scratch
from ._combinators import stateless
from ._protocol import GradientTransformation, Params, Updates


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scales all grads by ``min(1, max_norm / (norm + 1e-6))``.

    ``norm`` is the L2 norm of all incoming grads together, taken over whole
    parameters: inside a sharded step, :func:`shardfn.optim.global_norm` sums the
    shards' squares across ranks (and reuses the norm the step already computed
    for ``metrics["grad_norm"]``). On one device this equals
    ``torch.nn.utils.clip_grad_norm_(params, max_norm)``. The scale stays a
    tensor, so clipping does not sync the host with an accelerator.

    Args:
        max_norm: the largest global norm let through.

    Returns:
        A :class:`GradientTransformation` with state :class:`EmptyState`.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), adamw(3e-4))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> state = opt.update_(grads, state, params)  # clips the donated grads in place
    """
    _check_hyper("max_norm", max_norm, "clip_by_global_norm", lo=0.0)

    def factor(grads: Params) -> torch.Tensor:
        # The same expression as clip_grad_norm_, clamped rather than branched on.
        return (max_norm / (global_norm(grads) + 1e-6)).clamp(max=1.0)

    def clip(grads: Params, params: Params | None) -> Updates:
        f = factor(grads)
        return {k: g * f.to(g.device) for k, g in grads.items()}

    def clip_(grads: Params, params: Params | None) -> Updates:
        f = factor(grads)  # before any gradient is overwritten
        return {k: _scratch(g, g.dtype).mul_(f.to(g.device)) for k, g in grads.items()}

    return stateless(clip, clip_)
