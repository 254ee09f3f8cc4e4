"""A module's state on shards, as both Lightning strategies keep it: taken out of the module
(which stays the object Lightning holds, its parameters meta tensors), sharded, stepped by
the user's torch optimizer, saved and loaded whole, given back whole at the end."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .._io.checkpoint import load, save
from .._mesh import Mesh
from .._run.functionalize import take
from .._shard import shard
from .._state.sharded import gather
from ..optim._gradients import global_norm
from ..optim._psum import on_shards
from ..optim._torch import ELEMENTWISE
from ..optim._whole import require_whole

__all__ = ["Shards"]


def _ignored_names(module: torch.nn.Module, ignored: Iterable[Any], who: str) -> list[str]:
    """FSDP's ``ignored_modules`` and ``ignored_states`` (modules or parameters of ``module``) as
    the module paths and parameter names ``shard(ignored=)`` takes."""
    paths = {id(m): p for p, m in module.named_modules() if p}
    names = {id(t): n for n, t in module.named_parameters()}
    out = []
    for item in ignored:
        found = paths.get(id(item)) if isinstance(item, torch.nn.Module) else names.get(id(item))
        if found is None:
            raise ValueError(f"{who}(ignored_modules=..., ignored_states=...): {type(item).__name__} "
                             f"{tuple(item.shape) if isinstance(item, torch.Tensor) else ''} is not a submodule or "
                             f"parameter of {type(module).__name__}; pass the module's own (model.encoder, "
                             "model.head.weight).")
        out.append(found)
    return out


def _deferred_seed(params: Mapping[str, torch.Tensor], who: str) -> int | None:
    """A module built on the meta device (``init_module(empty_init=True)``) is initialised unit
    by unit on the shards (``shard(seed=)``: each module's ``reset_parameters()``, as
    Lightning's FSDPStrategy materialises one), from the seed ``seed_everything`` set; else None."""
    meta = [n for n, t in params.items() if t.is_meta]
    if not meta:
        return None
    if len(meta) < len(params):
        raise ValueError(f"{who}: {len(meta)} of the module's {len(params)} tensors are on the meta device "
                         f"({', '.join(meta[:3])}{' ...' if len(meta) > 3 else ''}) and the others are not; build the "
                         "whole module under init_module(empty_init=True) (every module then initialised by its "
                         "reset_parameters() on the shards), or none of it.")
    return torch.initial_seed()


class Shards:
    """``module``'s state, taken and sharded on a mesh over the default process group."""

    def __init__(self, module: torch.nn.Module, plan: Any, replicate: int | None, who: str, init_fn: Any = None,
                 ignored: Iterable[Any] = ()):
        self.who = who
        ignored = _ignored_names(module, ignored, who)
        # the module's parameters before and after take, by id, to their names: an optimizer may
        # be built on either (Fabric's joint setup: before; setup_module, then the optimizer: after)
        names = {id(p): n for n, p in module.named_parameters()}
        params, self.apply = take(module)
        names.update({id(p): n for n, p in module.named_parameters()})
        seed = None
        try:
            self.mesh = Mesh.from_group(replicate=replicate)
            seed = _deferred_seed(params, who)
            self.sharded = shard(params, self.mesh, plan, seed=seed, init_fn=init_fn if seed is not None else None,
                                 ignored=ignored or None)
        except BaseException as e:  # the module whole again, so that the error is what the caller sees
            _put_back(module, params)
            if isinstance(e, ValueError) and seed is not None:
                raise ValueError(f"{who}: the module was built on the meta device (init_module(empty_init=True)); "
                                 "each unit is initialised on the shards by reset_parameters() and param_init_fn, "
                                 "from torch.initial_seed(), the same on every rank after lightning.seed_everything(s)"
                                 f".\n{e}") from None
            raise
        del params
        self.names = names
        self.leaf_of = {id(t): n for n, t in self.sharded.items()}  # (an optimizer steps them in place)
        self.module = module

    def to_shards(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s parameters: the shards of the module's parameters it was built on.
        A torch optimizer steps each tensor it holds; one not known to be elementwise is
        refused where a parameter is cut (as ``shardfn.optim.from_torch``)."""
        held = [p for g in optimizer.param_groups for p in g["params"]]
        foreign = [p for p in held if id(p) not in self.names]
        if foreign:
            raise ValueError(f"{self.who}: the optimizer holds {len(foreign)} parameter(s) that are not the module's; "
                             "build it from the module's parameters (module.parameters()).")
        if type(optimizer) not in ELEMENTWISE:
            require_whole(self.sharded, [self.names[id(p)] for p in held],
                          f"{self.who} with torch.optim.{type(optimizer).__name__}",
                          "it is not known to be elementwise, as SGD, Adam and AdamW are: it may read the whole "
                          "parameter, and on this rank's shard would compute something else")
        for group in optimizer.param_groups:
            group["params"] = [self.sharded[self.names[id(p)]] for p in group["params"]]

    def add_grads(self, grads: Mapping[str, torch.Tensor], scale: float = 1.0) -> None:
        """``grads`` (shards, from jit_grad) times ``scale`` added to each shard's ``.grad``."""
        for name, g in grads.items():
            p = self.sharded[name]
            g = g.to(p.dtype) * scale if scale != 1.0 else g.to(p.dtype)
            p.grad = g if p.grad is None else p.grad + g

    def clip_norm(self, max_norm: float) -> torch.Tensor:
        """Every shard's ``.grad`` scaled by one factor, from the norm of the whole gradient
        (summed over the shards, each element once), as ``clip_grad_norm_`` on one device; the norm."""
        grads = {n: t.grad for n, t in self.sharded.items() if t.grad is not None}
        with on_shards(self.sharded):
            total = global_norm(grads)
        factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads.values():
            g.mul_(factor.to(g.dtype))
        return total

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model's ``state_dict`` (every rank gathers; rank 0 keeps it)."""
        return gather(self.sharded, rank0_only=True)

    def load_state_dict(self, full: Mapping[str, torch.Tensor]) -> None:
        """The shards of ``full`` (a whole ``state_dict``) copied into this rank's."""
        layout, rank = self.sharded.layout, self.sharded.layout.shard_rank(self.mesh)
        with torch.no_grad():
            for n, t in self.sharded.items():
                if n in layout.leaves:
                    t.copy_(layout.local_shard(n, full[n], rank, t.device))
                elif n in full:
                    t.copy_(full[n])
        self.sharded._values_replaced()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with each shard-shaped tensor gathered whole (every rank
        gathers; rank 0 keeps it, the others get ``{}``)."""
        state = optimizer.state_dict()
        names = self._indices(optimizer)
        kinds = sorted({k for s in state["state"].values() for k, v in s.items()
                        if isinstance(v, torch.Tensor) and v.dim() > 0})
        full: dict[str, dict[str, torch.Tensor]] = {}
        for kind in kinds:  # (a parameter not stepped yet has none: zeros gathered in its place)
            values = {names[i]: s[kind] for i, s in state["state"].items() if kind in s}
            values = {n: values.get(n, torch.zeros_like(self.sharded[n])) for n in names.values()}
            full[kind] = gather(self.sharded.replace(values), rank0_only=True)
        if self.mesh.rank != 0:
            return {}
        return {"state": {i: {k: (full[k][names[i]] if k in full else v) for k, v in s.items()}
                          for i, s in state["state"].items()}, "param_groups": state["param_groups"]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
        """A whole optimizer state (:meth:`optimizer_state`'s) loaded as this rank's shards."""
        layout, rank = self.sharded.layout, self.sharded.layout.shard_rank(self.mesh)
        names = self._indices(optimizer)
        state = {i: {k: (layout.local_shard(names[i], v, rank, self.sharded[names[i]].device)
                         if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in s.items()}
                 for i, s in saved["state"].items()}
        optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})

    def save(self, path: Any, optimizers: Mapping[Any, torch.optim.Optimizer]) -> dict[Any, dict[str, bool]]:
        """A sharded checkpoint at ``path`` (every rank writes its part, :func:`shardfn.checkpoint.save`):
        the shards, and each optimizer's state as one tree per kind (``momentum_buffer``,
        ``exp_avg``, ``step``: leaf name -> this rank's tensor). Returns each optimizer's kinds
        (True: one value a parameter, as Adam's ``step``), which :meth:`load` needs."""
        trees = {}
        for key, optimizer in optimizers.items():
            tree: dict[str, dict[str, torch.Tensor]] = {}
            for p, state in optimizer.state.items():
                for kind, v in state.items():
                    if isinstance(v, torch.Tensor):
                        tree.setdefault(kind, {})[self.leaf_of[id(p)]] = v
            trees[key] = tree
        save(path, self.sharded, trees)
        return {key: {kind: all(t.dim() == 0 for t in tree.values()) for kind, tree in ts.items()}
                for key, ts in trees.items()}

    def load(self, path: Any, optimizers: Mapping[Any, torch.optim.Optimizer],
             kinds: Mapping[Any, Mapping[str, bool]]) -> None:
        """:meth:`save`'s checkpoint read into this layout: the shards, and each optimizer's state."""
        layout = self.sharded.layout
        trainable = [n for n, leaf in (*layout.leaves.items(), *layout.ignored.items()) if leaf.requires_grad]
        templates = {key: {kind: {n: torch.zeros((), dtype=torch.float32) if scalar else
                                  torch.zeros_like(self.sharded[n]) for n in trainable}
                           for kind, scalar in kinds[key].items()} for key in optimizers}
        _, trees, _ = load(path, self.sharded, templates)
        for key, optimizer in optimizers.items():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    n = self.leaf_of[id(p)]
                    optimizer.state[p] = {kind: tree[n] for kind, tree in trees[key].items() if n in tree}

    def _indices(self, optimizer: torch.optim.Optimizer) -> dict[int, str]:
        """The optimizer's parameter index (its state_dict's keys) -> the leaf it steps."""
        flat: Iterable[torch.Tensor] = (p for group in optimizer.param_groups for p in group["params"])
        return {i: self.leaf_of[id(p)] for i, p in enumerate(flat)}

    def give_back(self) -> None:
        """The state back in the module, whole (every rank gathers it); the non-persistent
        buffers too, which a state_dict leaves out."""
        _put_back(self.module, {**self.sharded.buffers(), **gather(self.sharded)})


def _put_back(module: torch.nn.Module, values: Mapping[str, torch.Tensor]) -> None:
    """``module``'s meta parameters and buffers (shardfn._run.functionalize.take) replaced by
    ``values``' tensors of their names; a tie is one tensor again."""
    made: dict[int, torch.Tensor] = {}
    names = {id(t): n for n, t in [*module.named_parameters(remove_duplicate=False),
                                   *module.named_buffers(remove_duplicate=False)] if n in values}
    for m in module.modules():
        for k, p in list(m._parameters.items()):
            if p is not None and id(p) in names:
                m._parameters[k] = made.setdefault(id(p), torch.nn.Parameter(values[names[id(p)]].detach(),
                                                                             requires_grad=p.requires_grad))
        for k, b in list(m._buffers.items()):
            if b is not None and id(b) in names:
                m._buffers[k] = made.setdefault(id(b), values[names[id(b)]])
    module.__dict__.pop("_shardfn_apply", None)


def _on_meta(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds a meta tensor (built under ``init_module(empty_init=True)``)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))
