"""Combinators and gradient-only transformations: chain, stateless, scale, decay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._checks import _check_hyper, _check_mapping, _check_params, _scratch
from ._protocol import (
    EmptyState,
    GradientTransformation,
    OptState,
    Params,
    Updates,
    _no_hyperparams,
    apply_updates_,
    hyperparams,
)

__all__ = ["add_decayed_weights", "chain", "scale", "stateless"]

# [Note: in-place gradient kernels]
# chain's update_ needs the *outputs* of the members before its last (their transformed
# gradients), not their effect on params, so update_ does not serve there. A gradient-only
# transformation built with stateless(fn, fn_) also has an in-place kernel, its field
# update_grads_(grads, state, params) -> (updates, state): the same result as update,
# computed by overwriting grads' tensors. A kernel returns a new dict (never the grads
# Mapping passed in), so a transformed tree never carries the norm the step attached to
# its own gradients (shardfn.optim._gradients.Gradients). chain and masked have a kernel when all
# their members do. A member without one makes chain.update_ None rather than running its
# pure update: a pure update may return tensors that alias its state or the params (an
# identity transform, a momentum buffer), which the next member would then overwrite as
# scratch.


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Composes transformations: each one's updates are the next one's grads.

    Args:
        *transforms: applied in order.

    Returns:
        A transformation whose state is a tuple with one state per transform. Its
        hyperparams merge the members' (each read from its own state); a later
        member wins a clash. It has an in-place ``update_`` when the last member has
        one and every member before it is gradient-only with an in-place kernel
        (``scale``, ``add_decayed_weights``, ``clip_by_global_norm``, ``masked`` of
        those): those transform the donated grads in place, then the last member
        updates the params in place. Otherwise ``update_`` is ``None`` and a
        donating step runs ``update`` and :func:`apply_updates_`.

    Example:
        >>> opt = chain(add_decayed_weights(1e-4), sgd(0.1, momentum=0.9))
        >>> state = opt.init(params)  # (EmptyState(), SgdState(...))
        >>> state = opt.update_(grads, state, params)  # in place
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a "
                "GradientTransformation; pass optimizers such as sgd(...) or adamw(...)."
            )

    def check(state: Any) -> None:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain: expected a tuple of {len(transforms)} states, one per "
                f"transform, got {type(state).__name__}; pass the state returned by "
                "this chain's init."
            )

    def init(params: Params) -> tuple[OptState, ...]:
        return tuple(t.init(params) for t in transforms)

    def run(
        fns: list[Callable[..., tuple[Updates, OptState]]], grads: Params, state: tuple[OptState, ...],
        params: Params | None,
    ) -> tuple[Params, list[OptState]]:
        updates: Params = grads  # the first member sees the grads object itself (and the norm it carries)
        new_state = []
        for fn, s in zip(fns, state):
            updates, s = fn(updates, s, params)
            new_state.append(s)
        return updates, new_state

    def update(
        grads: Params, state: tuple[OptState, ...], params: Params | None = None
    ) -> tuple[Updates, tuple[OptState, ...]]:
        check(state)
        updates, new_state = run([t.update for t in transforms], grads, state, params)
        return dict(updates), tuple(new_state)

    def chain_hyperparams(state: tuple[OptState, ...]) -> dict[str, float]:
        # Later members win a clash, so the optimizer at the end of a chain names the learning rate.
        check(state)
        merged: dict[str, float] = {}
        for t, s in zip(transforms, state):
            merged.update(hyperparams(t, s))
        return merged

    kernels = [t.update_grads_ for t in transforms]
    update_ = None
    if transforms and all(kernels[:-1]) and transforms[-1].update_ is not None:
        lead, last = kernels[:-1], transforms[-1]

        def update_(grads: Params, state: tuple[OptState, ...], params: Params | None = None) -> tuple[OptState, ...]:
            check(state)
            updates, new_state = run(lead, grads, state[:-1], params)
            return (*new_state, last.update_(updates, state[-1], params))

    update_grads_ = None
    if all(kernels):  # also with no members: the identity

        def update_grads_(
            grads: Params, state: tuple[OptState, ...], params: Params | None = None
        ) -> tuple[Updates, tuple[OptState, ...]]:
            check(state)
            updates, new_state = run(kernels, grads, state, params)
            return dict(updates), tuple(new_state)

    return GradientTransformation(init, update, chain_hyperparams, update_, update_grads_)


def stateless(
    fn: Callable[[Params, Params | None], Updates],
    fn_: Callable[[Params, Params | None], Updates] | None = None,
) -> GradientTransformation:
    """A transformation without state from ``fn(grads, params) -> updates``.

    Args:
        fn: computes the updates without modifying its arguments.
        fn_: optional in-place twin, ``fn_(grads, params) -> updates``: the same
            result, computed by overwriting the tensors of ``grads`` (which are
            donated) and returned in a new dict. With it the transformation has an
            ``update_`` (``fn_``, then add to the params) and runs in place as a
            leading member of a :func:`chain` (see [Note: in-place gradient kernels]).

    Example:
        >>> negate = stateless(lambda grads, params: {k: -g for k, g in grads.items()},
        ...                    lambda grads, params: {k: g.neg_() for k, g in grads.items()})
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def applying(f: Callable[..., Updates]) -> Callable[..., tuple[Updates, EmptyState]]:
        def run(grads: Params, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
            _check_mapping(grads, "grads")
            if not grads:
                return {}, state
            with torch.no_grad():
                return f(grads, params), state

        return run

    update = applying(fn)
    if fn_ is None:
        return GradientTransformation(init, update, _no_hyperparams)
    in_place = applying(fn_)

    def update_(grads: Params, state: EmptyState, params: Params | None = None) -> EmptyState:
        if params is None:
            raise ValueError(
                "update_: needs the params to update in place but got params=None; call "
                "update_(grads, state, params)."
            )
        updates, state = in_place(grads, state, params)
        apply_updates_(params, updates)
        return state

    return GradientTransformation(init, update, _no_hyperparams, update_, in_place)


def scale(factor: float) -> GradientTransformation:
    """Multiplies every update by ``factor``.

    Example:
        >>> opt = chain(add_decayed_weights(1e-4), scale(-0.1))  # plain SGD
    """

    def scale_(grads: Params, params: Params | None) -> Updates:
        out = {k: _scratch(g, g.dtype) for k, g in grads.items()}
        torch._foreach_mul_(list(out.values()), factor)
        return out

    return stateless(lambda grads, params: {k: g * factor for k, g in grads.items()}, scale_)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Adds ``weight_decay * params`` to the updates (L2 regularisation).

    As ``torch.optim.SGD(weight_decay=...)``: the decay enters the gradient, so it
    goes through whatever follows it in a ``chain``.

    Example:
        >>> opt = chain(add_decayed_weights(1e-4), scale(-0.1))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)  # needs params
    """
    _check_hyper("weight_decay", weight_decay, "add_decayed_weights", lo=0.0)

    def decay(grads: Params, params: Params | None) -> Updates:
        if weight_decay == 0:
            return dict(grads)
        params = _check_params(grads, params, "add_decayed_weights")
        return {k: g.add(params[k], alpha=weight_decay) for k, g in grads.items()}

    def decay_(grads: Params, params: Params | None) -> Updates:
        if weight_decay == 0:
            return dict(grads)
        params = _check_params(grads, params, "add_decayed_weights")
        return {k: _add_(g, params[k], weight_decay) for k, g in grads.items()}

    return stateless(decay, decay_)


def _add_(g: torch.Tensor, p: torch.Tensor, alpha: float) -> torch.Tensor:
    """``g.add(p, alpha=alpha)``, written into ``g`` (donated) when the result has its dtype."""
    if torch.result_type(g, p) != g.dtype:
        return g.add(p, alpha=alpha)  # type promotion (a bf16 gradient of an fp32 param): as the pure path
    return _scratch(g, g.dtype).add_(p, alpha=alpha)
