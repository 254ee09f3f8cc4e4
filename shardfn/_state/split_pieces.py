"""Where a tensor-parallel tree's pieces lie in the global tensors, for checkpoints.

[Note: split leaves in checkpoints]
A split leaf ([Note: hand-written tensor collectives] in shardfn._parallel.tensor) is held by each
tensor rank as one block of the global tensor: the ``t``-th of the tensor size's equal blocks
along its split dim. FSDP then shards that block as it shards any leaf, so each rectangle of
a rank's shard ([Note: flat shards in checkpoints]), in the block's own coordinates, lies in
the global tensor at the same place shifted by ``t`` blocks along the split dim. So a
checkpoint records a split leaf by its global shape and global offsets, as any other leaf,
and loads into any layout, with or without a tensor axis. A whole leaf is the same on every
tensor rank: its rectangles are the same on each, and DCP's planner writes them once.
"""

from __future__ import annotations

from typing import Any

import torch

from .pieces import Pieces

__all__ = ["global_shape", "split_pieces"]


def _split(layout: Any, name: str) -> Any:
    """Leaf ``name``'s shardfn._parallel.ops.Split if the tree splits it over the tensor axis."""
    return next((s for s in layout.splits if s.leaf == name), None)


def global_shape(layout: Any, name: str) -> tuple[int, ...]:
    """Leaf ``name``'s shape in the model (its tensor rank's block's shape is the layout's)."""
    if name in layout.ignored:  # (whole on every rank: [Note: ignored parameters])
        return layout.ignored[name].shape
    split = _split(layout, name)
    return layout.leaves[name].shape if split is None else tuple(split.shape)


def split_pieces(layout: Any, name: str, rows: torch.Tensor | None, first_row: int, flat: Pieces | None,
                 tensor_rank: int) -> Pieces | None:
    """This rank's piece of split leaf ``name`` as rectangles of the global tensor, or None if
    the leaf is not split: its real ``rows`` of the block from row ``first_row`` on (row
    placement), or the block's rectangles ``flat`` (flat placement)."""
    split = _split(layout, name)
    if split is None:
        return None
    dim = split.dim
    block = layout.leaves[name].shape[dim]
    if flat is not None:
        rects = flat.rects
    else:
        at = torch.Size([first_row] + [0] * (rows.dim() - 1))
        rects = [(at, rows)] if rows.numel() else []
    # a packed leaf's rectangle is cut where its parts meet ([Note: packed splits])
    shifted = [(torch.Size(o if d != dim else whole for d, o in enumerate(offsets)), view.narrow(dim, mine - offsets[dim], k))
               for offsets, view in rects
               for mine, whole, k in split.runs(offsets[dim], offsets[dim] + view.shape[dim], tensor_rank, block)]
    return Pieces.of(tuple(split.shape), shifted)
