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
transformation with an in-place kernel (built with ``stateless(fn, fn_)``: ``scale``,
``add_decayed_weights``, ``clip_by_global_norm``, and ``masked`` or ``chain`` of those),
which then transforms the donated grads in place; :func:`masked` has it when its inner
transformation has it. See [Note: in-place gradient kernels].
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Union

import torch

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
            arguments (``from_torch`` advances its state object in place). ``params`` is required by transforms that read them (weight
            decay). Runs under ``torch.no_grad()``: updates carry no autograd
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
_MISSING_STATE = (
    "{opt}: {keys} {have} no optimizer state. The optimizer state was initialised "
    "for different params (frozen params, requires_grad=False, get no state). Call "
    "opt.init on the sharded params you train, after freezing or unfreezing them."
)
_SHAPE_MISMATCH = (
    "{opt}: grads[{key!r}] has shape {got} but the optimizer state for it has "
    "shape {want}. The state was initialised for a different sharding; call "
    "opt.init on the sharded params you train."
)
_MISSING_PARAMS = (
    "{opt}: needs the current params (weight decay reads them) but got "
    "params=None; call update(grads, state, params)."
)
_PARAM_MISMATCH = (
    "{opt}: grads[{key!r}] has shape {got} but params[{key!r}] {has}; pass the "
    "params the gradients were computed for."
)


def _trainable(params: Params) -> dict[str, torch.Tensor]:
    """The params that get optimizer state: those with ``requires_grad`` set."""
    _check_mapping(params, "params")
    return {k: p for k, p in params.items() if p.requires_grad}


def _check_mapping(tree: Any, what: str) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{what} must be a Mapping name -> torch.Tensor (for example "
            f"ShardedParams or a dict), got {type(tree).__name__}."
        )
    bad = [k for k, v in tree.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"{what} must map names to torch.Tensor, but "
            + ", ".join(f"{what}[{k!r}] is {type(tree[k]).__name__}" for k in bad)
            + "; pass tensors (for example the local shards)."
        )


def _check_state(state: Any, cls: type, opt: str) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{opt}: state is {type(state).__name__}, not {cls.__name__}; pass the "
            f"state returned by this optimizer's init (inside a chain, the chain's state)."
        )


def _check_grads(grads: Params, state: Mapping[str, torch.Tensor], opt: str) -> None:
    """Raises once, naming every grads leaf that has no state or the wrong shape."""
    _check_mapping(grads, "grads")
    missing = [k for k in grads if k not in state]
    if missing:
        keys = ", ".join(f"grads[{k!r}]" for k in missing)
        have = "has" if len(missing) == 1 else "have"
        raise ValueError(_MISSING_STATE.format(opt=opt, keys=keys, have=have))
    wrong = [k for k in grads if grads[k].shape != state[k].shape]
    if wrong:
        raise ValueError(
            "\n".join(
                _SHAPE_MISMATCH.format(
                    opt=opt,
                    key=k,
                    got=tuple(grads[k].shape),
                    want=tuple(state[k].shape),
                )
                for k in wrong
            )
        )


def _check_params(grads: Params, params: Params | None, opt: str) -> Params:
    """Checks that ``params`` holds a same-shaped tensor for every grads key."""
    _check_mapping(grads, "grads")
    if params is None:
        raise ValueError(_MISSING_PARAMS.format(opt=opt))
    _check_mapping(params, "params")
    errors = []
    for k, g in grads.items():
        if k not in params:
            errors.append(_PARAM_MISMATCH.format(opt=opt, key=k, got=tuple(g.shape), has="is missing"))
        elif params[k].shape != g.shape:
            has = f"has shape {tuple(params[k].shape)}"
            errors.append(_PARAM_MISMATCH.format(opt=opt, key=k, got=tuple(g.shape), has=has))
    if errors:
        raise ValueError("\n".join(errors))
    return params


def _check_learning_rate(learning_rate: ScalarOrSchedule, opt: str) -> None:
    if callable(learning_rate):
        return
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
        raise TypeError(
            f"{opt}: learning_rate must be a float or a schedule (a callable "
            f"count -> float), got {type(learning_rate).__name__}."
        )
    if not learning_rate >= 0.0:
        raise ValueError(f"{opt}: learning_rate must be >= 0, got {learning_rate}.")


def _check_hyper(name: str, value: float, opt: str, *, lo: float, hi: float | None = None) -> None:
    """Checks ``lo <= value`` (and ``value < hi``), the ranges torch.optim enforces."""
    if not (value >= lo and (hi is None or value < hi)):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{opt}: {name} must be {bound}, got {value}.")


def _resolve_learning_rate(learning_rate: ScalarOrSchedule, count: int) -> float:
    """The learning rate for the update after ``count`` updates.

    Args:
        learning_rate: a float, or a schedule ``count -> float``.
        count: number of updates done so far (0 for the first update).

    Returns:
        The learning rate as a Python float.

    Example:
        >>> _resolve_learning_rate(lambda c: 0.1 * 0.5**c, 2)
        0.025
    """
    if not callable(learning_rate):
        return float(learning_rate)
    value = learning_rate(count)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"learning-rate schedule returned {value!r} ({type(value).__name__}) for "
            f"count={count}; a schedule must return a float."
        )
    return float(value)


def _new_count() -> torch.Tensor:
    # The count lives on the CPU whatever the params' device (as torch.optim keeps
    # its "step"): schedules and bias correction need it as a Python number every
    # step, and reading it from an accelerator would sync the stream. torch.tensor
    # (not zeros) makes it a constant under FakeTensorMode, so the simulated step of
    # shardfn.explain can read it too.
    return torch.tensor(0, dtype=torch.int64)


# [Note: in-place gradient kernels]
# chain's update_ needs the *outputs* of the members before its last (their transformed
# gradients), not their effect on params, so update_ does not serve there. A gradient-only
# transformation built with stateless(fn, fn_) also carries an in-place kernel,
# kernel(grads, state, params) -> (updates, state), stored as the attribute `in_place` of
# its update function (read it with _in_place): the same result as update, computed by
# overwriting grads' tensors. A kernel returns a new dict (never the grads Mapping passed
# in), so global_norm's per-object cache (shardfn._psum) never mistakes a transformed tree
# for the one whose norm the step computed. chain and masked pass kernels on when all
# their members have one. A member without a kernel makes chain.update_ None rather than
# running its pure update: a pure update may return tensors that alias its state or the
# params (an identity transform, a momentum buffer), which the next member would then
# overwrite as scratch.


def _in_place(t: Any) -> Callable[..., tuple[Updates, OptState]] | None:
    """``t``'s in-place gradient kernel, or ``None`` (see [Note: in-place gradient kernels])."""
    return getattr(getattr(t, "update", None), "in_place", None)


def _scratch(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g`` as a tensor of ``dtype`` that may be overwritten: ``g`` itself when it already is
    one (a donated gradient), else a new contiguous copy (another dtype, or a layout such as an
    expanded view that cannot be written element by element)."""
    if g.dtype == dtype and g.is_contiguous():
        return g
    return g.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


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
        updates: Params = grads  # the first member sees the grads object itself (global_norm's cache)
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

    kernels = [_in_place(t) for t in transforms]
    update_ = None
    if transforms and all(kernels[:-1]) and transforms[-1].update_ is not None:
        lead, last = kernels[:-1], transforms[-1]

        def update_(grads: Params, state: tuple[OptState, ...], params: Params | None = None) -> tuple[OptState, ...]:
            check(state)
            updates, new_state = run(lead, grads, state[:-1], params)
            return (*new_state, last.update_(updates, state[-1], params))

    if all(kernels):  # also with no members: the identity

        def in_place(
            grads: Params, state: tuple[OptState, ...], params: Params | None = None
        ) -> tuple[Updates, tuple[OptState, ...]]:
            check(state)
            updates, new_state = run(kernels, grads, state, params)
            return dict(updates), tuple(new_state)

        update.in_place = in_place  # type: ignore[attr-defined]

    return GradientTransformation(init, update, chain_hyperparams, update_)


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

    def update(grads: Params, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        _check_mapping(grads, "grads")
        if not grads:
            return {}, state
        with torch.no_grad():
            return fn(grads, params), state

    if fn_ is None:
        return GradientTransformation(init, update, _no_hyperparams)

    def in_place(grads: Params, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        _check_mapping(grads, "grads")
        if not grads:
            return {}, state
        with torch.no_grad():
            return fn_(grads, params), state

    def update_(grads: Params, state: EmptyState, params: Params | None = None) -> EmptyState:
        if params is None:
            raise ValueError(
                "update_: needs the params to update in place but got params=None; call "
                "update_(grads, state, params)."
            )
        updates, state = in_place(grads, state, params)
        apply_updates_(params, updates)
        return state

    update.in_place = in_place  # type: ignore[attr-defined]
    return GradientTransformation(init, update, _no_hyperparams, update_)


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


def _check_updates(params: Params, updates: Params, fn: str) -> None:
    _check_mapping(params, "params")
    _check_mapping(updates, "updates")
    errors = []
    for k, u in updates.items():
        if k not in params:
            errors.append(f"{fn}: updates[{k!r}] has no matching params[{k!r}]")
        elif params[k].shape != u.shape:
            errors.append(
                f"{fn}: updates[{k!r}] has shape {tuple(u.shape)} but params[{k!r}] "
                f"has shape {tuple(params[k].shape)}"
            )
    if errors:
        raise ValueError(
            "\n".join(errors)
            + "\nPass the params the optimizer state was initialised for."
        )


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
