"""jit_step: one training step on local shards, as a function."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from . import _collectives as C
from ._layout import Layout
from ._mesh import Mesh
from ._sharded import ShardedParams
from .optim import GradientTransformation, apply_updates, apply_updates_

__all__ = ["Step", "jit_step"]

_OTHER_LAYOUT = (
    "step(sharded, ...): these shards have a different layout than the ones this step was first called with.\n"
    "  first call: {first!r}\n  this call:  {got!r}\n"
    "A step (and its optimizer state) belongs to one layout: build a new step with shardfn.jit_step(...) and a "
    "new opt_state with opt.init(sharded) for these shards, or pass the shards this step returned."
)


class Step:
    """``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``; see :func:`jit_step`."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], mesh: Mesh, optimizer: GradientTransformation, donate: bool):
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.optimizer = optimizer
        self.donate = donate
        self.layout: Layout | None = None  # recorded on the first call

    def __call__(self, sharded: ShardedParams, opt_state: Any, batch: Any) -> tuple[ShardedParams, Any, dict[str, Any]]:
        self._check(sharded, opt_state)
        trainable = [n for n, t in sharded.items() if t.requires_grad]
        loss = self.loss_fn(sharded, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        if trainable and not loss.requires_grad:
            raise ValueError(
                "loss_fn returned a tensor that does not depend on the parameters: call apply(params, ...) on the "
                "params loss_fn receives (the sharded tree), not on a captured copy."
            )
        grads_list = torch.autograd.grad(loss, [sharded[n] for n in trainable], allow_unused=True) if trainable else ()
        grads = {n: g if g is not None else torch.zeros_like(sharded[n]) for n, g in zip(trainable, grads_list)}
        updates, opt_state = self.optimizer.update(grads, opt_state, sharded)
        if self.donate:
            apply_updates_(sharded, updates)
            new = sharded
        else:
            new = sharded.replace(apply_updates(sharded, updates))
        metrics = {"loss": self._global_mean(loss.detach())}
        return new, opt_state, metrics

    def _global_mean(self, loss: torch.Tensor) -> float:
        loss = loss.reshape(1).float().clone()
        for axis in self.mesh.axis_names:  # the mean of equal-sized means, axis by axis
            if self.mesh.axis_size(axis) > 1:
                C.all_reduce(loss, self.mesh.group(axis), tag="metrics:loss")
        return float(loss.item())

    def _check(self, sharded: Any, opt_state: Any) -> None:
        if not isinstance(sharded, ShardedParams):
            raise TypeError(
                f"step(sharded, ...): expected the ShardedParams from shardfn.shard(), got {type(sharded).__name__}."
            )
        if sharded.mesh != self.mesh:
            raise ValueError(
                f"step(sharded, ...): the shards live on {sharded.mesh!r} but this step was built for "
                f"{self.mesh!r}. Shard with the same mesh you pass to jit_step."
            )
        if self.layout is None:
            self.layout = sharded.layout
        elif sharded.layout is not self.layout and sharded.layout != self.layout:
            raise ValueError(_OTHER_LAYOUT.format(first=self.layout, got=sharded.layout))
        check_opt_state(opt_state, sharded)


def check_opt_state(opt_state: Any, sharded: ShardedParams) -> None:
    """Every optimizer-state tensor under a parameter's key must be shaped like its shard."""
    leaves = sharded.layout.leaves
    problems = []
    for path, leaf in pytree.tree_flatten_with_path(opt_state)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        keys = [k.key for k in path if isinstance(k, pytree.MappingKey)]
        if not keys:
            continue
        name = keys[-1]
        where = f"opt_state{pytree.keystr(path)}"
        if name not in leaves:
            problems.append(f"  {where}: there is no parameter {name!r} in these shards")
        elif tuple(leaf.shape) != leaves[name].shard_shape:
            problems.append(
                f"  {where}: shape {tuple(leaf.shape)}, but the shard of {name!r} has shape "
                f"{leaves[name].shard_shape} on {sharded.mesh!r}"
            )
    if problems:
        raise ValueError(
            "step(sharded, opt_state, ...): the optimizer state does not match these shards:\n"
            + "\n".join(problems[:10])
            + ("\n  ..." if len(problems) > 10 else "")
            + "\nInitialise it from these shards: opt_state = opt.init(sharded)."
        )


def jit_step(
    loss_fn: Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor],
    mesh: Mesh,
    *,
    optimizer: GradientTransformation,
    donate: bool = True,
) -> Step:
    """Builds ``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``.

    ``loss_fn(params, batch)`` is written as for one device: it calls ``apply(params, ...)``
    and returns the mean loss over its batch. Each rank passes its own slice of the
    global batch (equal sizes); gradients are averaged over ranks, so a step equals one
    single-device step on the global batch. ``metrics["loss"]`` is the global mean loss.

    Args:
        loss_fn: ``(params, batch) -> scalar tensor``.
        mesh: the mesh the shards live on.
        optimizer: a :class:`shardfn.optim.GradientTransformation`, run on local shards.
        donate: update the shards in place (as JAX's ``donate_argnums``): the returned
            ``sharded`` is the same tensors, and the tree you passed in must not be used
            for anything but this call. ``False`` returns new tensors.

    Example:
        >>> step = jit_step(loss_fn, mesh, optimizer=shardfn.optim.adamw(3e-4))
        >>> sharded, opt_state, metrics = step(sharded, opt_state, batch)
    """
    if not callable(loss_fn):
        raise TypeError(f"jit_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"jit_step: mesh must be a shardfn.Mesh, got {type(mesh).__name__}")
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(
            f"jit_step: optimizer must have init and update functions (a GradientTransformation such as "
            f"shardfn.optim.adamw(3e-4)), got {type(optimizer).__name__}."
        )
    return Step(loss_fn, mesh, optimizer, donate)
