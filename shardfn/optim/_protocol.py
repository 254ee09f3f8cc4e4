"""Gradient transformations: the optimizer protocol and its small building blocks.

An optimizer is a pair of pure functions over Mappings ``name -> torch.Tensor`` of
this rank's local shards (in practice ``shardfn.ShardedParams``; only the Mapping
protocol is used here):

* ``init(params) -> state``
* ``update(grads, state, params) -> (updates, new_state)``
* optionally ``hyperparams(state) -> dict``, what the next update will use (for
  logging; read it with :func:`hyperparams`)
* optionally ``update_(grads, state, params) -> new_state``, the in-place (donating)
  twin of ``update`` followed by :func:`apply_updates_`; see [Note: donation]

``grads`` may hold a subset of the keys of ``params``: a frozen parameter has no
gradient and gets no update. State is NamedTuples of dicts of tensors.

[Note: donation]
``update`` is pure: it allocates new moments and a full set of ``updates``, and the
caller adds them to the params. ``update_`` is what a step with ``jit_step(donate=True)``
runs instead (as JAX's buffer donation, behind the same functional contract): it
writes the new params into ``params``' tensors, and the new state into ``state``'s
tensors (returning that same state, or one built from its tensors), and it may use
``grads``' tensors as scratch, so no parameter-sized tensor is allocated per step.
The caller gives up all three: after the call ``grads`` hold garbage, and ``state``
(and any earlier state sharing its tensors) must not be used except as the returned
state. The result equals ``update`` then ``apply_updates_`` to rounding (the moments
exactly); built-in ``update_`` use torch.optim's own expression order.

``update_`` is optional: ``jit_step`` falls back to ``update`` + ``apply_updates_``
without it, and always uses the pure path with ``donate=False``. :func:`chain` has it
when its last member has it and every member before it is a gradient-only
transformation with an in-place gradient kernel, ``update_grads_`` (built with ``stateless(fn, fn_)``: ``scale``,
``add_decayed_weights``, ``clip_by_global_norm``, and ``masked`` or ``chain`` of those),
which then transforms the donated grads in place; :func:`masked` has it when its inner
transformation has it. See [Note: in-place gradient kernels].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

import torch
import torch.utils._pytree as pytree

from ._checks import _check_updates

__all__ = [
    "EmptyState", "GradientTransformation", "OptState", "Params", "ScalarOrSchedule", "Schedule", "Updates",
    "apply_updates", "apply_updates_", "hyperparams", "param_leaves",
]

Params = Mapping[str, torch.Tensor]
Updates = dict[str, torch.Tensor]
OptState = Any
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """An optimizer (or a piece of one) as a pair of pure functions.

    Attributes:
        init: ``init(params) -> state``. Creates state only for trainable params
            (``p.requires_grad``); works on meta tensors.
        update: ``update(grads, state, params=None) -> (updates, new_state)``.
            Computes updates for the keys of ``grads`` only and does not mutate its
            arguments (``from_torch`` advances its state object in place). ``params``
            is required by transforms that read them (weight decay). Runs under ``torch.no_grad()``: updates carry no autograd
            history, so optimizers are not differentiable.
        hyperparams: ``hyperparams(state) -> dict[str, float]``, the hyperparameters
            the next ``update`` with this state will use (``{"learning_rate": ...}``
            with any schedule resolved), for logging. Optional: ``None`` reports
            nothing; read it with :func:`hyperparams`, which also accepts objects
            without this field.
        update_: ``update_(grads, state, params) -> new_state``, optional: the same
            step done in place, with ``params``, ``state`` and ``grads`` donated:
            the params are updated in place, ``state``'s tensors become the new
            state's, and ``grads``' tensors may be used as scratch (see
            [Note: donation]). ``params`` is required. ``None`` when the
            transformation has no in-place path; ``jit_step(donate=True)`` then runs
            ``update`` and :func:`apply_updates_`.
        update_grads_: ``update_grads_(grads, state, params) -> (updates, new_state)``,
            optional, for gradient-only transformations: ``update``'s result computed
            by overwriting the tensors of ``grads`` (donated), returned in a new dict.
            It lets the transformation lead a :func:`chain` whose ``update_`` runs in
            place (see [Note: in-place gradient kernels]).

    Example:
        >>> opt = sgd(0.1)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> params = apply_updates(params, updates)
        >>> opt.hyperparams(state)
        {'learning_rate': 0.1}
        >>> state = opt.update_(grads, state, params)  # in place; grads and state donated
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    hyperparams: Callable[[OptState], dict[str, float]] | None = None
    update_: Callable[..., OptState] | None = None
    update_grads_: Callable[..., tuple[Updates, OptState]] | None = None


def hyperparams(opt: Any, state: OptState) -> dict[str, float]:
    """The hyperparameters that ``opt.update(grads, state, ...)`` will use next.

    Call it before ``update`` (``jit_step`` does, to report
    ``metrics["learning_rate"]``). Optimizers without a ``hyperparams`` function,
    such as a user's own ``init``/``update`` pair, report ``{}``.

    Args:
        opt: a :class:`GradientTransformation`, or any object with ``init`` and
            ``update``.
        state: ``opt``'s current state.

    Returns:
        A new dict name -> float, e.g. ``{"learning_rate": 3e-4}``.

    Example:
        >>> opt = chain(clip_by_global_norm(1.0), adamw(lambda count: 1e-3 / (1 + count)))
        >>> state = opt.init(params)
        >>> hyperparams(opt, state)
        {'learning_rate': 0.001}
    """
    fn = getattr(opt, "hyperparams", None)
    return {} if fn is None else dict(fn(state))


def _no_hyperparams(state: OptState) -> dict[str, float]:
    return {}


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


# Long user-facing messages live here so every optimizer words them the same way.


def apply_updates(params: Params, updates: Params) -> dict[str, torch.Tensor]:
    """Returns ``params + updates`` out of place.

    Params without an update are returned unchanged (the same tensor objects). The
    new tensors keep each param's dtype and ``requires_grad`` and have no autograd
    history: chaining steps through the graph would keep every step's activations
    alive.

    Args:
        params: name -> tensor.
        updates: name -> tensor, for a subset of the keys of ``params``.

    Returns:
        A new dict with every key of ``params``.

    Example:
        >>> updates, state = opt.update(grads, state, params)
        >>> params = apply_updates(params, updates)
    """
    _check_updates(params, updates, "apply_updates")
    out = dict(params.items())
    with torch.no_grad():
        for k, u in updates.items():
            p = params[k]
            out[k] = (p + u).to(p.dtype).requires_grad_(p.requires_grad)
    return out


def apply_updates_(params: Params, updates: Params) -> None:
    """Adds ``updates`` to ``params`` in place (the donation path of a step).

    Runs under ``torch.no_grad()`` so leaf params that require grad can be written.

    Args:
        params: name -> tensor; modified in place.
        updates: name -> tensor, for a subset of the keys of ``params``.

    Example:
        >>> updates, state = opt.update(grads, state, params)
        >>> apply_updates_(params, updates)
    """
    _check_updates(params, updates, "apply_updates_")
    with torch.no_grad():
        for k, u in updates.items():
            params[k].add_(u)


def param_leaves(opt_state: Any) -> list[tuple[str, str | None, Any]]:
    """Every leaf of an optimizer state: ``(path, parameter name or None, leaf)``.

    A leaf belongs to the parameter named by the last mapping key on its path (``mu``,
    ``nu`` and ``momentum_buffer`` are dicts name -> tensor in shardfn.optim's states);
    ``path`` is ``pytree.keystr`` of it (``".mu['blocks.0.w']"``). ``None`` state has no
    leaves. The one rule that the step's checks, checkpoints and explain share.
    """
    if opt_state is None:
        return []
    out = []
    for path, leaf in pytree.tree_flatten_with_path(opt_state)[0]:
        keys = [k.key for k in path if isinstance(k, pytree.MappingKey)]
        out.append((pytree.keystr(path), keys[-1] if keys else None, leaf))
    return out
