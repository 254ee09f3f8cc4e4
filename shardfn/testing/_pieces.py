"""What each rank is given and holds in an equivalence check: its slice of every global
batch, and its shards of the state."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .._run.batch import Whole
from .._state.sharded import ShardedParams

__all__ = ["local_shards", "split_batch"]


def split_batch(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous slice (dim 0) of every tensor in a global batch pytree; a
    :class:`shardfn.Whole` leaf goes whole to every rank, a :class:`shardfn.Batched` one is
    sliced and stays marked."""

    def take(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        n = t.shape[0]
        if n % world:
            raise ValueError(
                f"split_batch: a global batch of {n} rows does not split evenly over {world} ranks; use a "
                f"global batch size that every tested world size divides (for 1..4: a multiple of 12)."
            )
        b = n // world
        return t[rank * b : (rank + 1) * b]

    return pytree.tree_map(lambda t: t if isinstance(t, Whole) else take(t), batch, is_leaf=lambda t: isinstance(t, Whole))


def local_shards(sharded: ShardedParams) -> dict[str, tuple[torch.Tensor, int, int]]:
    """This rank's shard of every parameter as ``(shard, first row, real rows)`` (a flat shard:
    ``(shard, first element, -1)``), as :func:`compare` reads them."""
    layout = sharded.layout
    rank = layout.shard_rank(sharded.mesh)
    shards = {}
    for n, leaf in layout.leaves.items():
        if leaf.flat:  # a 1-D piece of the flattened parameter ([Note: placements]): (shard, first element, -1)
            span = layout.units[leaf.unit].numel
            off, _ = leaf.piece(rank, span)
            shards[n] = (sharded[n].detach().clone(), max(0, rank * span + off - leaf.start), -1)
        else:
            shards[n] = (sharded[n].detach().clone(), rank * leaf.chunk if layout.gathers else 0,
                         layout.local_rows(n, rank))
    return shards
