"""Old spellings that keep working for one release, each with a ``DeprecationWarning``
naming the new one (docs/migrating.md, "Changes"). Everything here goes in the next release.

[Note: one loss convention]
Every entry point that takes a loss calls it the same way: ``loss_fn(apply, params, batch)``,
``apply`` being the model function of the tree it runs (from :func:`shardfn.functionalize`).
So one loss, a plain top-level function, serves ``jit_step``, ``jit_grad``, ``explain``,
``autoplan`` and the testing kit, whose models (fake ones, cut ones, one per process) are not
the user's own and cannot be reached through a closure. The former ``loss_fn(params, batch)``
of ``jit_step`` and ``jit_grad`` is told apart by its signature: two required positional
parameters and no ``*args``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["as_loss", "deprecated", "old_loss", "old_options", "renamed"]


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warns that ``old`` is now ``new`` and goes in the next release."""
    warnings.warn(f"{old} is deprecated: use {new}. The old spelling goes in the next release "
                  "(docs/migrating.md, 'Changes').", DeprecationWarning, stacklevel=stacklevel)


def renamed(**names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: keyword ``old=`` still reaches parameter ``new`` (``renamed(old="new")``),
    with a warning; passing both is an error."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            for old, new in names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}(): {old}= is the old name of {new}=; pass {new}= only.")
                    deprecated(f"{fn.__name__}({old}=...)", f"{fn.__name__}({new}=...)")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return inner

    return wrap


def old_loss(loss_fn: Callable[..., Any]) -> bool:
    """Whether ``loss_fn`` is written ``(params, batch)`` (see [Note: one loss convention])."""
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or an extension without a signature: take it as the convention
        return False
    kinds = [p.kind for p in sig.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in sig.parameters.values() if p.kind in positional and p.default is inspect.Parameter.empty]
    return len(required) == 2


def as_loss(loss_fn: Callable[..., Any], where: str, stacklevel: int = 4) -> tuple[Callable[..., Any], bool]:
    """``(loss, needs_apply)``: ``loss_fn`` as ``(apply, params, batch) -> loss``, and whether it
    reads ``apply``. A ``(params, batch)`` loss is wrapped, with a warning that names the line
    ``stacklevel`` frames up (the caller of the entry point)."""
    if not old_loss(loss_fn):
        return loss_fn, True
    deprecated(f"{where}: a loss_fn(params, batch)",
               "loss_fn(apply, params, batch), the convention of every entry point that takes a loss "
               "(the step passes the apply of the tree it runs)", stacklevel=stacklevel)

    def loss(apply: Any, params: Any, batch: Any) -> Any:
        return loss_fn(params, batch)

    return loss, False


_OLD_OPTIONS = ("has_aux", "mean_aux", "skip_nonfinite")


def old_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator of ``jit_step`` and ``jit_grad``: their former options, read as ``aux=`` and
    ``on_nonfinite=``, with a warning. Their signatures hold the new ones only."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        old = {k: kwargs.pop(k) for k in _OLD_OPTIONS if k in kwargs}
        where = fn.__name__
        new: dict[str, Any] = {}
        if "has_aux" in old or "mean_aux" in old:
            has, mean = bool(old.get("has_aux", False)), bool(old.get("mean_aux", False))
            if mean and not has:
                raise ValueError(f"{where}(mean_aux=True) averages loss_fn's aux: pass aux=\"mean\".")
            new["aux"] = "mean" if mean else "rank" if has else None
            deprecated(f"{where}(has_aux=..., mean_aux=...)", f'{where}(aux="rank") or {where}(aux="mean")')
        if "skip_nonfinite" in old:
            if where != "jit_step":
                raise TypeError(f"{where}(): got an unexpected keyword argument 'skip_nonfinite'")
            new["on_nonfinite"] = "skip" if old["skip_nonfinite"] else "raise"
            deprecated(f"{where}(skip_nonfinite=...)", f'{where}(on_nonfinite="skip")')
        both = [k for k in new if kwargs.get(k) is not None]
        if both:
            raise TypeError(f"{where}(): {both[0]}= and its old spelling were both given; pass {both[0]}= only.")
        return fn(*args, **kwargs, **new)

    return inner
