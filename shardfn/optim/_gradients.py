"""The gradients a step hands its optimizer: a tree of shard gradients with their norm.

``jit_grad`` (and the step that runs it) builds them; :func:`global_norm` reads the norm
they carry instead of computing it again (see [Note: gradients as a tree] in
shardfn._run.grad).

[Note: a norm that follows its gradients]
The norm a :class:`Gradients` carries is the step's, computed in its metrics all-reduce
for the gradients as handed over (after a ``Mean`` loss's rescale and the fp16 unscale,
which happen before the tree is made). A ``jit_grad`` user may change them in place
(masking, scaling) before clipping; the old norm would then clip silently wrong. So the
tree notes each tensor's version counter when it gets its norm, and a read of the norm
after any of them moved computes it again from what the tensors hold (one ``psum``: every
rank must read it, as any psum, inside ``on_shards`` or a step) and keeps that. The check
is on the host, so it holds in a recorded step too; a step's own gradients are not changed
before its optimizer reads their norm, so a step issues no collective for it. Writes that
bypass the version counter (through ``.data`` or a NumPy view) are not seen: change
gradients with tensor operations.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._psum import psum, sum_of_squares
from .._state.tree import TensorTree

__all__ = ["Gradients", "global_norm"]


class Gradients(TensorTree):
    """The gradients a step hands its optimizer: name -> shard gradient, with their norm.

    ``global_norm`` is the L2 norm of the whole gradient over every rank's shards, which
    the step computes anyway (``metrics["grad_norm"]``, in its one metrics all-reduce).
    :func:`shardfn.optim.global_norm` of this tree reads it, so ``clip_by_global_norm`` needs no
    collective of its own. After the tensors were changed in place, it is computed again
    (see [Note: a norm that follows its gradients]). A transformation returns a new
    mapping, which carries no norm: its own norm is computed when asked.
    """

    __slots__ = ("_norm", "_versions")

    def __init__(self, data: Mapping[str, torch.Tensor], global_norm: torch.Tensor):
        self._data = dict(data)
        self._norm = global_norm
        self._versions = self._stamp()

    def _stamp(self) -> tuple[int, ...]:
        return tuple(t._version for t in self._data.values())

    @property
    def global_norm(self) -> torch.Tensor:
        """The L2 norm of the gradients as they are now (0-d fp32, the same on every rank)."""
        if self._stamp() != self._versions:  # changed in place since the norm was taken
            self._norm = psum(sum_of_squares(self._data)).sqrt()
            self._versions = self._stamp()
        return self._norm

    def __repr__(self) -> str:
        current = self._stamp() == self._versions  # (a repr issues no collective)
        return f"Gradients({len(self)} leaves, global_norm={f'{float(self._norm):.6g}' if current else 'changed'})"


def global_norm(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of a whole tree given as local shards (a 0-d fp32 tensor, every rank).

    For the :class:`Gradients` a step hands its optimizer, the norm the step computed
    (no collective; computed again if they were changed in place); for any other tree,
    ``psum`` of the shards' sums of squares.

    Example:
        >>> norm = global_norm(grads)      # equals clip_grad_norm_'s total norm on one device
    """
    if isinstance(tree, Gradients):
        return tree.global_norm
    return psum(sum_of_squares(tree)).sqrt()
