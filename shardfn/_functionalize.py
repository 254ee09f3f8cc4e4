"""functionalize: an ``nn.Module`` -> (params pytree, pure ``apply``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call

__all__ = ["Apply", "Params", "functionalize"]


class Params(dict):
    """A plain ``dict`` name -> tensor that also remembers the module tree it came from.

    The module tree (``params.module``, parameters on the meta device) lets unit
    policies such as ``by_module_type(Block)`` resolve. A plain dict works everywhere
    a ``Params`` does, except with policies that need the module tree.
    """

    module: nn.Module | None = None


class Apply:
    """``apply(params, *args, **kwargs)``: the model as a pure function of its parameters.

    Given a plain mapping of full tensors it is ``torch.func.functional_call``. Given
    :class:`shardfn.ShardedParams` it gathers each unit's parameters just before the
    unit runs and reshards per the strategy (see ``shardfn._call``).

    Buffers (causal masks, BatchNorm statistics, ...) are not part of ``params``: they
    live here, in ``apply.buffers``, are replicated on every rank, and are passed to
    every call, so in-place updates by the model (running statistics) persist across
    calls, exactly as in the module. They are the model's own buffer tensors.
    """

    def __init__(self, module: nn.Module, buffers: dict[str, torch.Tensor], param_names: tuple[str, ...]):
        self.module = module
        self.buffers = buffers
        self.param_names = param_names
        self.hooked: set[str] = set()  # unit module paths carrying shardfn's hooks
        self.prepared: dict[int, Any] = {}  # id(layout) -> (layout, slots), see shardfn._call

    def __call__(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        from ._call import sharded_call
        from ._sharded import ShardedParams

        if isinstance(params, ShardedParams):
            return sharded_call(self, params, args, kwargs)
        if not isinstance(params, Mapping):
            raise TypeError(
                f"apply(params, ...): params must be a mapping name -> tensor (from functionalize or "
                f"shard), got {type(params).__name__}."
            )
        check_names(params.keys(), self.param_names, what="apply(params, ...)")
        return functional_call(self.module, {**params, **self.buffers}, args, kwargs, tie_weights=True, strict=False)

    def __repr__(self) -> str:
        return f"Apply({type(self.module).__name__}, {len(self.param_names)} params, {len(self.buffers)} buffers)"


def check_names(got, expected, *, what: str) -> None:
    """Raises one ValueError listing every missing and unexpected parameter path."""
    got, expected = set(got), set(expected)
    if got == expected:
        return
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    lines = [f"{what}: the parameter names do not match the model."]
    if missing:
        lines.append(f"  missing ({len(missing)}): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        lines.append(
            f"  unexpected ({len(unexpected)}): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )
    lines.append("  Pass the params returned by functionalize(model) (or shard() of them) for this same model.")
    raise ValueError("\n".join(lines))


def functionalize(model: nn.Module) -> tuple[Params, Apply]:
    """Splits ``model`` into its parameters and a pure function of them.

    Returns ``(params, apply)``: ``params`` maps each name of ``model.named_parameters()``
    (tied parameters once, under their first name) to a tensor sharing the parameter's
    storage, with its ``requires_grad``; ``apply(params, *args, **kwargs)`` runs the model.
    ``apply`` holds a copy of the module tree whose parameters live on the meta device
    (it never holds a second copy of the weights), plus the model's buffers.

    Example:
        >>> params, apply = functionalize(torch.nn.Linear(4, 2))
        >>> apply(params, torch.ones(3, 4)).shape
        torch.Size([3, 2])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"functionalize expects an nn.Module, got {type(model).__name__}")
    named = dict(model.named_parameters())
    params = Params({n: p.detach().requires_grad_(p.requires_grad) for n, p in named.items()})
    # Copy the module tree with meta parameters (ties preserved through deepcopy's memo)
    # and the *same* buffer tensors, so apply neither duplicates weights nor buffers.
    memo: dict[int, Any] = {}
    for p in named.values():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    buffers = dict(model.named_buffers())
    for b in buffers.values():
        memo[id(b)] = b
    skeleton = copy.deepcopy(model, memo)
    params.module = skeleton
    return params, Apply(skeleton, buffers, tuple(named))
