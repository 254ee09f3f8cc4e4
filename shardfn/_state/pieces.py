"""A flat shard as DCP chunks: the rectangles of the global tensor it covers.

[Note: flat shards in checkpoints]
A checkpoint records each parameter by its global shape and the chunks (offsets, sizes)
each rank wrote ([Note: checkpoint format]), whatever the layout, so that a load into any
other layout reads exactly what it needs. A row-placed shard is one chunk (DTensor's
``Shard(0)``). A flat shard ([Note: placements] in shardfn._state.layout) is a range of the
parameter's elements in row-major order, which is not one rectangle: the tail of a row, full
rows, the head of a row, recursively over the dimensions, so at most ``2 * ndim - 1``
rectangles, each of which is a contiguous run of the range (a view of the shard). So a
checkpoint of flat shards has the same format as one of row shards: either loads into the
other, at any world size. :class:`Pieces` carries the rectangles; DCP's planners are taught
to find them (:class:`SavePlanner`, :class:`LoadPlanner`), and DCP reads into them in place.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

__all__ = ["LoadPlanner", "Pieces", "SavePlanner", "rectangles"]


def rectangles(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of the rectangles that elements ``[lo, hi)`` of a row-major tensor
    of ``shape`` make up, in element order; each is a contiguous run of them."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner

    def within(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in rectangles(shape[1:], a, b)]

    if first == last:
        return within(first, lo - first * inner, hi - first * inner)
    out = []
    if lo % inner:
        out += within(first, lo % inner, inner)
        first += 1
    end = hi // inner  # rows [first, end) are whole
    if end > first:
        out.append(((first, *[0] * (len(shape) - 1)), (end - first, *shape[1:])))
    if hi % inner:
        out += within(end, 0, hi % inner)
    return out


class Pieces:
    """Rectangles of a global tensor held by this rank: ``(offsets, view)`` pairs, views of
    a flat shard (written from on save, read into on load)."""

    def __init__(self, shape: tuple[int, ...], shard: torch.Tensor, lo: int):
        """``shard``: this rank's elements ``[lo, lo + shard.numel())`` of the tensor (1-D)."""
        self.shape = torch.Size(shape or (1,))  # a 0-d parameter is saved as one row, as row shards are
        self.rects: list[tuple[torch.Size, torch.Tensor]] = []
        at = 0
        for offsets, sizes in rectangles(tuple(self.shape), lo, lo + shard.numel()):
            n = math.prod(sizes)
            self.rects.append((torch.Size(offsets), shard[at : at + n].view(sizes)))
            at += n

    @classmethod
    def of(cls, shape: tuple[int, ...], rects: list[tuple[torch.Size, torch.Tensor]]) -> "Pieces":
        """Pieces of a tensor of ``shape`` given as ``(offsets, view)`` rectangles."""
        out = cls.__new__(cls)
        out.shape, out.rects = torch.Size(shape), list(rects)
        return out

    def write_items(self, fqn: str) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.shape),
            properties=TensorProperties.create_from_tensor(t), size=self.shape)) for offsets, t in self.rects]

    # DCP's planners build their items from these two (as they do for a DTensor)
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return self.write_items(fqn)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=t.shape) for offsets, t in self.rects]

    def at(self, offsets: torch.Size | None) -> torch.Tensor:
        for o, t in self.rects:
            if o == offsets:
                return t
        raise AssertionError(f"shardfn internal error: no rectangle of this shard starts at {offsets}")


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the rectangles of :class:`Pieces`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also reads into the rectangles of :class:`Pieces`."""

    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # DCP's set-up (torch 2.11-2.15) rewrites the state dict in place and knows tensors only:
        # any other value becomes None. Put the pieces back, in it and in the planner's copy.
        pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        super().set_up_planner(state_dict, *args, **kwargs)
        state_dict.update(pieces)
        self.state_dict.update(pieces)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.at(index.offset) if isinstance(obj, Pieces) else super().lookup_tensor(index)
