"""Mesh-aware reductions for code that runs on local shards inside a step (optimizers).

The analogue of ``jax.lax.psum`` inside ``shard_map``: an optimizer sees only this
rank's shard of each parameter and gradient, so a statistic over a whole parameter (its
norm, a trust ratio) is the sum of per-shard partial results over the ranks that hold
the other shards. :func:`psum` does that sum; outside a step, or when parameters are not
sharded (NO_SHARD, a world of one), it returns its input, so the same optimizer code runs
unchanged on one device.

[Note: padding]
Padding rows of a shard are zero in parameters and gradients (packing zeroes them and the
built-in optimizers keep them zero), so sums of squares over padded shards equal those
over the real parameters.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _collectives as C
from ._events import Purpose
from ._runtime import current
from ._tree import TensorTree

__all__ = ["Gradients", "global_norm", "psum", "sum_of_squares"]


class Gradients(TensorTree):
    """The gradients a step hands its optimizer: name -> shard gradient, with their norm.

    ``global_norm`` is the L2 norm of the whole gradient over every rank's shards, which
    the step computes anyway (``metrics["grad_norm"]``, in its one metrics all-reduce).
    :func:`global_norm` of this tree reads it, so ``clip_by_global_norm`` needs no
    collective of its own. A transformation returns a new mapping, which carries no norm:
    its own norm is computed when asked.
    """

    __slots__ = ("global_norm",)

    def __init__(self, data: Mapping[str, torch.Tensor], global_norm: torch.Tensor):
        self._data = dict(data)
        self.global_norm = global_norm

    def __repr__(self) -> str:
        return f"Gradients({len(self)} leaves, global_norm={float(self.global_norm):.6g})"


def psum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the ranks that hold the other shards of the parameters.

    Every rank must call it (it is a collective inside a step). Outside a step, or
    when parameters are replicated, it returns ``t`` unchanged.

    Example:
        >>> # inside an optimizer's update, on local shards:
        >>> param_norm = psum(p.square().sum()).sqrt()    # the norm of the whole parameter
    """
    rt = current()
    if rt is None or not rt.sharded or rt.mesh.axis_size("shard") == 1:
        return t
    out = t.detach().clone()
    C.all_reduce(out, rt.mesh.group("shard"), Purpose.PSUM, op=C.SUM)
    return out


def sum_of_squares(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's partial sum of squares of a tree of shards, in fp32."""
    parts = [t.detach().float().square().sum() for t in tree.values() if t is not None]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def global_norm(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of a whole tree given as local shards (a 0-d fp32 tensor, every rank).

    For the :class:`Gradients` a step hands its optimizer, the norm the step computed
    (no collective); for any other tree, ``psum`` of the shards' sums of squares.

    Example:
        >>> norm = global_norm(grads)      # equals clip_grad_norm_'s total norm on one device
    """
    if isinstance(tree, Gradients):
        return tree.global_norm
    return psum(sum_of_squares(tree)).sqrt()
