"""Argument checks and small helpers the optimizers share; long messages live here."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import Any, Union

import torch

from .._comm.recording import Unrecordable
from .._comm.scope import here
from ._count import host_count

Params = Mapping[str, torch.Tensor]
ScalarOrSchedule = Union[float, Callable[[int], float]]

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


def _check_mapping(tree: Any, what: str, opt: str = "init(params)") -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{opt}: {what} must be a Mapping name -> torch.Tensor (for example "
            f"ShardedParams or a dict), got {type(tree).__name__}."
        )
    bad = [k for k, v in tree.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(
            f"{opt}: {what} must map names to torch.Tensor, but "
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
    _check_mapping(grads, "grads", opt)
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
    _check_mapping(grads, "grads", opt)
    if params is None:
        raise ValueError(_MISSING_PARAMS.format(opt=opt))
    _check_mapping(params, "params", opt)
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


def _count(count: torch.Tensor) -> Any:
    """The updates done so far, for an update's scalars: an int, read through the mirror
    ([Note: step counts]); while a graph step records (see [Note: recording a step]), the
    count itself as a float64 tensor on its device, so that the scalars are computed by the
    program from the state, not baked into it. An optimizer's update is a public call (its
    arguments carry no step), so the mode is read from its scope here."""
    return count.double() if here().comm.recorded else host_count(count)


def _resolve_learning_rate(learning_rate: ScalarOrSchedule, count: Any, tensor_ok: bool = True) -> Any:
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
    if isinstance(count, torch.Tensor) and not tensor_ok:
        raise Unrecordable("a learning-rate schedule of an optimizer that takes its learning rate as a number (muon)",
                           "a constant learning rate")
    value = learning_rate(count)
    if isinstance(value, torch.Tensor) and isinstance(count, torch.Tensor):
        return value  # computed by the recorded program from the count
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"learning_rate(count): the schedule returned {value!r} ({type(value).__name__}) for "
            f"count={count}; a schedule must return a float."
        )
    return float(value)


def _scratch(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g`` as a tensor of ``dtype`` that may be overwritten: ``g`` itself when it already is
    one (a donated gradient), else a new contiguous copy (another dtype, or a layout such as an
    expanded view that cannot be written element by element)."""
    if g.dtype == dtype and g.is_contiguous():
        return g
    return g.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


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
