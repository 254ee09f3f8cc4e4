"""The gradients a step hands its optimizer: a tree of shard gradients with their norm.

``jit_grad`` (and the step that runs it) builds them; ``shardfn.optim.global_norm`` reads
the norm they carry instead of computing it again (see [Note: gradients as a tree] in
shardfn._grad).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ._tree import TensorTree

__all__ = ["Gradients"]


class Gradients(TensorTree):
    """The gradients a step hands its optimizer: name -> shard gradient, with their norm.

    ``global_norm`` is the L2 norm of the whole gradient over every rank's shards, which
    the step computes anyway (``metrics["grad_norm"]``, in its one metrics all-reduce).
    :func:`shardfn.optim.global_norm` of this tree reads it, so ``clip_by_global_norm`` needs no
    collective of its own. A transformation returns a new mapping, which carries no norm:
    its own norm is computed when asked.
    """

    __slots__ = ("global_norm",)

    def __init__(self, data: Mapping[str, torch.Tensor], global_norm: torch.Tensor):
        self._data = dict(data)
        self.global_norm = global_norm

    def __repr__(self) -> str:
        return f"Gradients({len(self)} leaves, global_norm={float(self.global_norm):.6g})"
