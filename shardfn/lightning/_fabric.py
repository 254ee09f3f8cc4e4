"""``lightning.fabric.Fabric(strategy=FabricStrategy(...))``: the user's own loop on shards.

[Note: Fabric's forward and backward]
Under Fabric the user's code calls the model, computes the loss from its output, and calls
``fabric.backward(loss)``: the loss is not a function shardfn can run. So a forward runs
the model on the shards without autograd (a sharded call, units gathered as it runs) and
hands back outputs that are leaves needing a gradient; ``fabric.backward`` computes the
loss's gradient with respect to them (the user's code after the model, as autograd
records it), and then one :func:`shardfn.jit_grad` runs every such forward again, on the
same inputs with the same random state and buffers, with ``sum(output * its gradient)`` as
the loss. Its gradient is the loss's, by the chain rule, computed by the same backward a
single device runs, and jit_grad reduces it to shards on every rank with its guarantees.
The price is a second forward per step; the first holds no activations. Accumulation needs
no ``no_backward_sync``: each backward reduces its own gradient, and they add up in ``.grad``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning.fabric.strategies import DDPStrategy

from .._run.grad import _rng_state, _set_rng_state, jit_grad
from ._keywords import CANNOT, STATE_DICT_TYPES, plan_of, refuse, replicas_of, timeout_of
from ._shards import Shards, _on_meta

__all__ = ["FabricStrategy"]

_WHO = "FabricStrategy"
_REST, _KINDS, _MODULES = "fabric.pt", "shardfn_optimizer_kinds", "shardfn_modules"


class _Forward:
    """One forward awaiting its backward: its inputs, random state, and the outputs handed out."""

    def __init__(self, args: tuple, kwargs: dict, rng: Any, leaves: list[torch.Tensor]):
        self.args, self.kwargs, self.rng, self.leaves = args, kwargs, rng, leaves


class _NoSync:
    def no_backward_sync(self, module: Any, enabled: bool) -> Any:
        return nullcontext()  # (each backward reduces its own gradient: [Note: Fabric's forward and backward])


class _ShardedModule(torch.nn.Module):
    """What ``fabric.setup`` wraps: the user's module (its parameters meta tensors), whose
    forward runs on the shards ([Note: Fabric's forward and backward])."""

    def __init__(self, module: torch.nn.Module, strategy: "FabricStrategy"):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._strategy._forward(args, kwargs)


class FabricStrategy(DDPStrategy):
    """shardfn's sharding for ``Fabric(strategy=...)``, with the keywords of Lightning's
    ``FSDPStrategy`` (as :class:`shardfn.lightning.TrainerStrategy`; docs/lightning.md)."""

    def __init__(self, sharding_strategy: Any = "FULL_SHARD", *, auto_wrap_policy: Any = None,
                 activation_checkpointing_policy: Any = None, cpu_offload: Any = None, state_dict_type: str = "full",
                 timeout: Any = timedelta(minutes=30), device_mesh: Any = None, plan: Any = None, units: Any = None,
                 param_init_fn: Any = None, ignored_modules: Any = None, ignored_states: Any = None,
                 accelerator: Any = None, parallel_devices: Any = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision: Any = None, process_group_backend: str | None = None,
                 start_method: str = "popen", **kwargs: Any) -> None:
        refuse(_WHO, kwargs, CANNOT)
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"{_WHO}(state_dict_type={state_dict_type!r}): expected 'full' or 'sharded'.")
        self.state_dict_type = state_dict_type
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout_of(_WHO, timeout),
                         start_method=start_method)
        self.plan = plan_of(_WHO, sharding_strategy, auto_wrap_policy, activation_checkpointing_policy, cpu_offload,
                            plan, units)
        self._device_mesh = device_mesh
        self._init_fn = param_init_fn
        self._ignored = [*(ignored_modules or ()), *(ignored_states or ())]
        self._backward_sync_control = _NoSync()
        self.shards: Shards | None = None
        self._pending: list[_Forward] = []
        self._buffers: dict[str, torch.Tensor] | None = None  # the buffers before the pending forwards
        self._grad_fn: Any = None

    @property
    def sharded(self) -> Any:
        """The module's state on this rank (a :class:`shardfn.ShardedParams`), once set up."""
        return None if self.shards is None else self.shards.sharded

    # -- setup ---------------------------------------------------------------------------

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[Any],
                                    scheduler: Any = None) -> tuple[Any, list[Any], Any]:
        wrapped = self.setup_module(module)
        return wrapped, [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.shards is not None:
            raise ValueError(f"{_WHO}: one module per strategy; this one already holds "
                             f"{type(self.shards.module).__name__}'s shards.")
        self.shards = Shards(module, self.plan, replicas_of(_WHO, self.plan, self._device_mesh, self.num_nodes), _WHO,
                             self._init_fn, self._ignored)
        self._grad_fn = jit_grad(self._loss, self.shards.mesh)
        return _ShardedModule(module, self)

    def setup_optimizer(self, optimizer: Any) -> Any:
        if self.shards is None:
            raise ValueError(f"{_WHO}: set up the module first (fabric.setup(model, optimizer), or "
                             "fabric.setup_module(model) before fabric.setup_optimizers).")
        self.shards.to_shards(optimizer)
        return optimizer

    def module_to_device(self, module: torch.nn.Module) -> None:
        if self.shards is None and not _on_meta(module):  # (a meta module is initialised on the shards)
            module.to(self.root_device)

    def module_init_context(self, empty_init: bool | None = None) -> Any:
        """``fabric.init_module(empty_init=True)``: the module is built on the meta device and
        each unit initialised on the shards by its ``reset_parameters()`` (as Lightning's
        FSDPStrategy does), from the seed ``seed_everything`` set."""
        stack = super().module_init_context(empty_init=False)
        if empty_init:
            stack.enter_context(torch.device("meta"))
        return stack

    # -- forward and backward ([Note: Fabric's forward and backward]) --------------------

    def _forward(self, args: tuple, kwargs: dict) -> Any:
        sharded, run = self.sharded, self.shards.apply
        if not torch.is_grad_enabled():
            return run(sharded, *args, **kwargs)
        if not self._pending:
            self._buffers = {n: b.detach().clone() for n, b in sharded.buffers().items()}
        rng = _rng_state(self.shards.mesh.device)
        with torch.no_grad():
            out = run(sharded, *args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        handed = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in leaves]
        self._pending.append(_Forward(args, kwargs, rng, handed))
        return pytree.tree_unflatten(handed, spec)

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        pending, self._pending = self._pending, []
        super().backward(tensor, module, *args, **kwargs)  # the gradients of the outputs handed out (and the rest)
        if self.shards is None or not pending:
            return  # (a loss of other modules only)
        runs = [(f, [t.grad if isinstance(t, torch.Tensor) else None for t in f.leaves]) for f in pending]
        runs = [(f, g) for f, g in runs if any(x is not None for x in g)]
        if not runs:  # no output reached the loss: a zero gradient, by the same collectives on every rank
            runs = [(pending[0], [torch.zeros_like(t) if isinstance(t, torch.Tensor) and t.requires_grad else None
                                  for t in pending[0].leaves])]
        now = _rng_state(self.shards.mesh.device)
        if self._buffers:
            with torch.no_grad():
                for n, b in self.sharded.buffers().items():
                    b.copy_(self._buffers[n])
        try:
            _, grads, _ = self._grad_fn(self.sharded, runs)
        finally:
            _set_rng_state(now)
        self.shards.add_grads(grads)

    def _loss(self, apply: Any, params: Any, runs: Any) -> torch.Tensor:
        total = torch.zeros((), device=self.shards.mesh.device)
        for forward, grads in runs:
            _set_rng_state(forward.rng)
            with self.precision.forward_context():
                out = apply(params, *forward.args, **forward.kwargs)
            for o, g in zip(pytree.tree_leaves(out), grads):
                if g is not None:
                    total = total + (o * g.to(o.dtype)).sum(dtype=torch.float32)
        return total

    def clip_gradients_norm(self, module: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError(f"{_WHO}: clip_gradients(norm_type={norm_type}): shardfn clips by the L2 norm only.")
        self.precision.unscale_gradients(optimizer)
        total = self.shards.clip_norm(max_norm)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"{_WHO}: the total norm of the gradients is {float(total)}: not finite.")
        return total

    # -- state ---------------------------------------------------------------------------

    def get_module_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """The full model's ``state_dict`` (every rank gathers; rank 0 keeps it)."""
        return self.shards.state_dict() if self.shards is not None else module.state_dict()

    def load_module_state_dict(self, module: torch.nn.Module, state_dict: Mapping[str, Any],
                               strict: bool = True) -> None:
        if self.shards is None:
            module.load_state_dict(state_dict, strict=strict)
        else:
            self.shards.load_state_dict(state_dict)

    def get_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.shards.optimizer_state(optimizer) if self.shards is not None else optimizer.state_dict()

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        """``"full"``: one file (rank 0 writes it). ``"sharded"``: a directory, the module's
        shards and the optimizers' state written by every rank (:func:`shardfn.checkpoint.save`,
        loadable at any world size), the rest of ``state`` in ``fabric.pt``
        ([Note: Lightning checkpoints of shards] in shardfn/lightning/_trainer.py)."""
        if self.state_dict_type != "sharded" or self.shards is None:
            return super().save_checkpoint(path, state, storage_options, filter)
        if filter:
            raise ValueError(f"{_WHO}: fabric.save(filter=...) with state_dict_type='sharded': the shards are "
                             "written whole; save a full checkpoint to filter it.")
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
        rest = {k: v for k, v in state.items() if k not in optimizers and k not in modules}
        rest[_MODULES] = modules
        rest[_KINDS] = self.shards.save(path, optimizers)
        if self.is_global_zero:
            torch.save(rest, os.path.join(path, _REST))
        self.barrier("shardfn: the checkpoint is written")

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> Any:
        """Fabric's, with each optimizer's whole state loaded as this rank's shards; or a
        sharded checkpoint's directory (:meth:`save_checkpoint`)."""
        if self.shards is not None and isinstance(state, Mapping) and os.path.isdir(path):
            rest = torch.load(os.path.join(path, _REST), weights_only=False)
            kinds = rest.pop(_KINDS)
            rest.pop(_MODULES)
            optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
            self.shards.load(path, optimizers, kinds)
            for k in [k for k in state if k in rest]:
                state[k] = rest.pop(k)
            return rest
        if self.shards is None or not isinstance(state, Mapping):
            return super().load_checkpoint(path, state, strict, weights_only)
        optimizers = {k: v for k, v in state.items() if isinstance(v, torch.optim.Optimizer)}
        rest = {k: v for k, v in state.items() if k not in optimizers}
        checkpoint = super().load_checkpoint(path, rest, strict, weights_only)
        for name, opt in optimizers.items():
            self.shards.load_optimizer_state(opt, checkpoint.pop(name))
        for name in optimizers:  # (the keys Fabric would have restored in place)
            state[name] = optimizers[name]
        return checkpoint
