"""functionalize: an ``nn.Module`` -> (its state tree, a pure ``apply``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

from .call import Prepared, Site, sharded_call
from .._state.sharded import ShardedParams
from .._state.tree import Params, check_names, tree_info

__all__ = ["Apply", "Params", "apply_of", "functionalize", "take"]


class Apply:
    """``apply(state, *args, **kwargs)``: the model as a pure function of its state.

    Given a plain mapping of full tensors (parameters and buffers) it is
    ``torch.func.functional_call``. Given :class:`shardfn.ShardedParams` it gathers each
    unit's parameters just before the unit runs and reshards per the strategy (see
    ``shardfn._run.call``). Buffers come from the tree you pass, never from ``apply``: in train
    mode a forward that updates them (BatchNorm's running statistics) updates the tree's
    buffers in place, as the module would (inside a step: the step's working copies, see
    :func:`shardfn.jit_step`).

    ``apply.train()`` / ``apply.eval()`` set the mode, as ``nn.Module`` does (and return
    ``apply``): ``apply.eval()`` turns dropout off and makes BatchNorm use and keep its
    running statistics.

    Example:
        >>> val_loss = loss_fn(apply.eval(), sharded, batch)   # no dropout; running statistics read
        >>> apply.train()
    """

    def __init__(self, module: nn.Module, names: tuple[str, ...]):
        self.module = module  # parameters and buffers on the meta device: it holds no state
        self.names = names  # every name of the state tree
        self.hooked: set[str] = set()  # module paths carrying shardfn's hooks (by kind)
        self.sites: dict[str, Site] = {}  # module path -> what its hooks read (shardfn._run.call.Site)
        self.prepared: dict[int, Prepared] = {}  # id(layout) -> what is made once for it (shardfn._run.call)

    def __deepcopy__(self, memo: dict[int, Any]) -> "Apply":
        return self  # a function: a copied module tree still names the model function of its trees

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> "Apply":
        """Train mode (``mode=False``: eval mode) for every module of the model; returns ``self``."""
        if not isinstance(mode, bool):
            raise TypeError(f"apply.train(mode): mode must be a bool, got {type(mode).__name__}")
        self.module.train(mode)
        return self

    def eval(self) -> "Apply":
        """Eval mode: ``apply.train(False)``; returns ``self``."""
        return self.train(False)

    def __call__(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        return self._run(None, params, args, kwargs)

    def method(self, name: str) -> Any:
        """``apply.method(name)(params, *args, **kwargs)``: the model's method ``name`` (a
        LightningModule's ``training_step``) run on ``params`` as ``apply`` runs ``forward``:
        the module's parameters are ``params`` inside it, gathered unit by unit for shards."""
        if not callable(getattr(self.module, name, None)):
            raise AttributeError(f"apply.method({name!r}): {type(self.module).__name__} has no method {name!r}")
        return lambda params, *args, **kwargs: self._run(name, params, args, kwargs)

    def _run(self, method: str | None, params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        if isinstance(params, ShardedParams):
            return sharded_call(self, params, args, kwargs, method)
        if not isinstance(params, Mapping):
            raise TypeError(
                f"apply(params, ...): params must be a mapping name -> tensor (from functionalize or "
                f"shard), got {type(params).__name__}."
            )
        check_names(params.keys(), self.names, what="apply(params, ...)")
        # functional_call writes a buffer the module replaced back into the dict it gets.
        state = params if isinstance(params, dict) else dict(params)
        if method is None:
            return functional_call(self.module, state, args, kwargs, tie_weights=True, strict=False)
        with _reparametrize_module(self.module, state, tie_weights=True, strict=False):
            return getattr(self.module, method)(*args, **kwargs)

    def __repr__(self) -> str:
        mode = "train" if self.training else "eval"
        return f"Apply({type(self.module).__name__}, {len(self.names)} tensors, {mode})"


def functionalize(model: nn.Module) -> tuple[Params, Apply]:
    """Splits ``model`` into its state and a pure function of it.

    Returns ``(params, apply)``: ``params`` maps each parameter name of
    ``model.named_parameters()`` and each buffer name of ``model.named_buffers()`` (a
    tensor reachable under several names once, under its first name) to a tensor sharing
    the model's storage, parameters with their ``requires_grad``. ``apply(params, *args,
    **kwargs)`` runs the model. ``apply`` holds a copy of the module tree whose parameters
    and buffers live on the meta device: all of the state is in ``params``. The mode
    (train or eval) is the model's when called; change it with ``apply.train()`` /
    ``apply.eval()``.

    Example:
        >>> params, apply = functionalize(torch.nn.Linear(4, 2))
        >>> apply(params, torch.ones(3, 4)).shape
        torch.Size([3, 2])
    """
    info, named, buffers, params = _state_of(model, "functionalize")
    # Copy the module tree with meta tensors (ties preserved through deepcopy's memo), so
    # apply holds neither a second copy of the weights nor the buffers.
    memo: dict[int, Any] = {}
    for p in named.values():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in buffers.values():
        memo[id(b)] = torch.empty_like(b, device="meta")
    skeleton = copy.deepcopy(model, memo)
    params.module = skeleton
    apply = Apply(skeleton, info.names)
    # The model function of every tree made from these params (see apply_of).
    skeleton.__dict__["_shardfn_apply"] = apply
    return params, apply


def _state_of(model: nn.Module, who: str) -> tuple[Any, dict[str, nn.Parameter], dict[str, torch.Tensor], Params]:
    """``model``'s tree info, parameters and buffers by name, and its state tree: each
    parameter (first name of a tie) detached with its ``requires_grad``, each buffer itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}(model): expected an nn.Module, got {type(model).__name__}")
    info = tree_info(model)
    named = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    params = Params({n: named[n].detach().requires_grad_(named[n].requires_grad) for n in info.params})
    params.update({n: buffers[n] for n in info.buffers})
    return info, named, buffers, params


def take(model: nn.Module) -> tuple[Params, Apply]:
    """:func:`functionalize` without the copy: ``model`` itself becomes ``apply``'s module tree,
    each parameter and buffer replaced by a meta tensor of its shape (a tie stays one tensor),
    and the values are ``params``'. For a framework that keeps calling the module it holds
    (Lightning's Trainer runs ``training_step`` and logs on its own LightningModule): the
    calls find the state shardfn passes, and the module keeps no second copy of it."""
    info, _, _, params = _state_of(model, "take")
    meta: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for k, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[k] = meta.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"),
                                                                       requires_grad=p.requires_grad))
        for k, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[k] = meta.setdefault(id(b), torch.empty_like(b, device="meta"))
    params.module = model
    apply = Apply(model, info.names)
    model.__dict__["_shardfn_apply"] = apply
    return params, apply


def apply_of(tree: Any) -> Apply | None:
    """The ``apply`` of the model a tree was made from (``params`` of :func:`functionalize`,
    and every ``ShardedParams`` made from them), or None for a plain mapping."""
    return getattr(getattr(tree, "module", None), "__dict__", {}).get("_shardfn_apply")
