"""Packing: a unit's shards into a collective's buffer and its output back into parameters.

The layouts they follow are in :mod:`shardfn._state.layout` ([Note: dim-0 shards and unit
buffers], [Note: placements]); these are the only functions that move a unit's elements
between the two, so that [Note: copies] can count every copy.
"""

from __future__ import annotations

import bisect
import math
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._comm.events import Transfer, emit
from .offload import to_device_into

LeafLayout = Any  # shardfn._state.layout.LeafLayout (imported there from here: no cycle)

__all__ = [
    "kept_buffer", "kept_views", "leaf_holding", "leaves_by_storage", "local_shard", "pack_leaf", "pack_shards",
    "pack_unit", "shard_buffer", "storage_key", "unpack_leaf", "unpack_unit", "with_gaps",
]


def unpack_leaf(gathered: torch.Tensor, leaf: LeafLayout, world: int) -> torch.Tensor:
    """Full parameter from a ``[world, unit.numel]`` all-gather result (one copy; a flat
    leaf's is a view of it, see [Note: placements])."""
    if leaf.flat:
        return gathered.reshape(-1)[leaf.start : leaf.start + leaf.numel].view(leaf.shape)
    cols = gathered[:, leaf.offset : leaf.offset + leaf.shard_numel].view(world, leaf.chunk, leaf.row_numel)
    out = torch.empty((leaf.rows, leaf.row_numel), dtype=gathered.dtype, device=gathered.device)
    if leaf.chunk:
        q, rem = divmod(leaf.rows, leaf.chunk)
        out[: q * leaf.chunk].view(q, leaf.chunk, leaf.row_numel).copy_(cols[:q])
        if rem:
            out[q * leaf.chunk :].copy_(cols[q, :rem])
    return out.view(leaf.shape)


def unpack_unit(gathered: torch.Tensor, leaves: Sequence[LeafLayout], world: int) -> list[torch.Tensor]:
    """Every leaf's full parameter from a ``[world, unit.numel]`` all-gather result, in one copy.

    One ``split_with_sizes_copy`` moves each leaf's columns into a ``[world, shard_numel]``
    tensor of its own: rank after rank, that is the leaf's rows followed by its padding
    rows, so the full parameter is a view of its first ``rows`` rows (a few padding rows
    of memory per leaf, one kernel per unit). ``leaves`` are the unit's leaves in order.
    A flat unit's are views of ``gathered``, no copy ([Note: placements]).
    """
    if leaves and leaves[0].flat:
        return _flat_views(gathered.view(-1), leaves)
    outs = [gathered.new_empty((world, leaf.shard_numel)) for leaf in leaves]
    if outs:
        torch.split_with_sizes_copy(gathered, [leaf.shard_numel for leaf in leaves], dim=1, out=outs)
    return [t.view(-1)[: math.prod(leaf.shape)].view(leaf.shape) for t, leaf in zip(outs, leaves)]


def storage_key(t: torch.Tensor) -> int | None:
    """Which storage ``t`` lives in, as an int that no other live storage has (None: it has
    none). Not ``id(t.untyped_storage())``: that makes a Python object for the storage,
    which then lives as long as it does, and a step asks for every tensor autograd saves."""
    try:
        return torch._C._storage_id(t)  # (fake and meta tensors have one; a wrapper subclass may not)
    except (RuntimeError, NotImplementedError):
        return None


def leaves_by_storage(full: Sequence[torch.Tensor]) -> dict[int, tuple[list[int], list[tuple[int, int]]]]:
    """:func:`storage_key` of each storage a unit's gathered parameters ``full`` live in -> the storage
    offsets where those in it start, in order, and each one's ``(end, index)``: all of a flat
    unit's share one storage."""
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for i, t in enumerate(full):
        start = t.storage_offset()
        end = start + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else start
        spans.setdefault(storage_key(t), []).append((start, end, i))
    return {k: ([a for a, _, _ in sorted(v)], [(e, i) for _, e, i in sorted(v)]) for k, v in spans.items()}


def leaf_holding(t: torch.Tensor, full: Sequence[torch.Tensor],
                 by_storage: dict[int, tuple[list[int], list[tuple[int, int]]]]) -> int | None:
    """The index of the gathered parameter whose elements ``t`` (a tensor autograd saves)
    starts in, None if none: a view of parameter i is made again from parameter i, at its
    place in it, however a regather lays the unit's parameters out. One bisection of the
    starts, not a look at every parameter: this runs for every tensor a unit's forward saves."""
    found = by_storage.get(storage_key(t))
    if found is None:
        return None
    starts, ends = found
    k = bisect.bisect_right(starts, t.storage_offset()) - 1  # the last leaf that starts at or before it
    if k < 0:  # (the leaves of one storage are disjoint; an empty one sorts before its neighbour)
        return None
    end, i = ends[k]
    return i if t.storage_offset() < end and full[i].dtype == t.dtype else None


def _flat_views(flat: torch.Tensor, leaves: Sequence[LeafLayout]) -> list[torch.Tensor]:
    """A flat unit's leaves as views of its global buffer: one split of the buffer (gaps
    and the padding its own pieces), then a reshape of the leaves that are not 1-D; on a
    GPU, as on a CPU, the host's cost per gather is what this saves (each view is a call)."""
    sizes, leaf_at, at = [], [0] * len(leaves), 0
    for i in sorted(range(len(leaves)), key=lambda i: leaves[i].start):  # (a whole unit's are not in unit order)
        leaf = leaves[i]
        if leaf.start > at:
            sizes.append(leaf.start - at)
        leaf_at[i] = len(sizes)
        sizes.append(leaf.numel)
        at = leaf.start + leaf.numel
    if flat.numel() > at:
        sizes.append(flat.numel() - at)
    parts = flat.split_with_sizes(sizes)
    return [parts[i] if len(leaf.shape) == 1 else parts[i].view(leaf.shape) for i, leaf in zip(leaf_at, leaves)]


def pack_unit(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], world: int,
              starts: Sequence[int] | None = None) -> None:
    """Writes full-shaped tensors, laid end to end, into a ``[world, n]`` buffer, in one copy.

    The inverse of :func:`unpack_unit` (``n`` is the sum of their shard sizes): one
    ``_chunk_cat`` splits each tensor into ``world`` dim-0 chunks of ``ceil(rows / world)``
    rows, zero padding included, writes chunk ``r`` into row ``r``, and casts to the
    buffer's dtype on the way. The tensors need not be contiguous. ``starts``: a flat
    unit's global buffer ([Note: placements]), each tensor at its start: one ``cat`` of the
    flattened tensors and the zeros of the padding.
    """
    if starts is not None:
        out = buffer.view(-1)
        parts = with_gaps(list(zip(starts, (t.reshape(-1) for t in tensors))), out.numel(), out)
        if parts:
            torch.cat(parts, out=out)
        return
    parts = [t.reshape(1) if t.dim() == 0 else t for t in tensors if t.numel()]  # empty: no columns
    if parts:
        torch._chunk_cat(parts, dim=0, num_chunks=world, out=buffer)


def pack_leaf(buffer: torch.Tensor, full: torch.Tensor, leaf: LeafLayout, world: int, offset: int) -> None:
    """Writes a full-shaped tensor at column ``offset`` of a ``[world, n]`` buffer, zero
    padding (a flat leaf: at its place in the global buffer; ``offset`` unused)."""
    if leaf.flat:
        buffer.view(-1)[leaf.start : leaf.start + leaf.numel].copy_(full.reshape(-1))
        return
    cols = buffer[:, offset : offset + leaf.shard_numel].view(world, leaf.chunk, leaf.row_numel)
    if not leaf.chunk:
        return
    src = full.reshape(leaf.rows, leaf.row_numel)
    q, rem = divmod(leaf.rows, leaf.chunk)
    cols[:q].copy_(src[: q * leaf.chunk].view(q, leaf.chunk, leaf.row_numel))
    if q < world:
        cols[q, :rem].copy_(src[q * leaf.chunk :])
        cols[q, rem:].zero_()
        cols[q + 1 :].zero_()


def with_gaps(parts: Sequence[tuple[int, torch.Tensor]], total: int, like: torch.Tensor) -> list[torch.Tensor]:
    """1-D tensors at their offsets in a run of ``total`` elements, zeros between and after
    them: the list to ``torch.cat`` (see [Note: placements])."""
    out, at = [], 0
    for off, t in sorted(((o, t) for o, t in parts if t.numel()), key=lambda p: p[0]):
        if off > at:
            out.append(like.new_zeros(off - at))
        out.append(t)
        at = off + t.numel()
    if total > at:
        out.append(like.new_zeros(total - at))
    return out


def pack_shards(out: torch.Tensor, shards: Sequence[torch.Tensor], offloaded: bool, to: Any, unit: str,
                offsets: Sequence[int] | None = None) -> None:
    """This rank's row of a unit's all-gather output (``out``, flat): its shards one after
    the other, cast to ``out``'s dtype; from host memory when ``offloaded`` (one counted copy
    per shard), else one ``torch.cat`` (see [Note: copies]). ``offsets``: a flat unit's, each
    shard at its offset, zeros between and after them ([Note: placements])."""
    parts = [s.detach().reshape(-1) for s in shards]
    if offsets is None:
        if offloaded:
            to_device_into(out, shards, to, unit)
        else:
            torch.cat(parts, out=out)
        return
    if offloaded:
        out.zero_()
        for off, p in zip(offsets, parts):
            out[off : off + p.numel()].copy_(p, non_blocking=True)
        emit(Transfer("to_device", sum(p.numel() for p in parts) * out.element_size(), unit, len(parts)), to)
    else:
        torch.cat(with_gaps(list(zip(offsets, parts)), out.numel(), out), out=out)


def local_shard(full: torch.Tensor, leaf: LeafLayout, rank: int, device: torch.device, span: int = 0) -> torch.Tensor:
    """This rank's zero-padded dim-0 chunk of ``full``, as a new tensor on ``device``; a
    flat leaf's 1-D piece, in a unit of shard buffers of ``span`` elements."""
    if leaf.flat:
        off, n = leaf.piece(rank, span)
        lo = rank * span + off - leaf.start
        return full.detach().reshape(-1)[lo : lo + n].to(device, copy=True)
    shard = torch.zeros(leaf.shard_shape, dtype=full.dtype, device=device)
    k = leaf.local_rows(rank)
    if k:
        start = rank * leaf.chunk
        src = full.reshape(leaf.rows, *leaf.shape[1:])[start : start + k]
        shard[:k].copy_(src)
    return shard


def shard_buffer(shards: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
                 offsets: Sequence[int]) -> torch.Tensor | None:
    """The flat unit's shard buffer that ``shards`` are views of, each at its offset, when it
    is one contiguous tensor of ``numel`` elements in ``dtype`` (as :func:`shardfn.shard` lays
    them out, and in-place updates keep them); else None, and the caller packs them.

    The all-gather then sends it as it is: no copy ([Note: placements]); a recorded step's
    program takes these buffers as its inputs ([Note: recording a step])."""
    base = shards[0]._base if shards else None
    if base is None or base.dtype != dtype or base.dim() != 1 or base.numel() != numel or not base.is_contiguous():
        return None
    for s, off in zip(shards, offsets):
        if not s.numel():  # a leaf with no elements on this rank
            continue
        if s._base is not base or s.storage_offset() != base.storage_offset() + off or (
                s.numel() > 1 and s.stride() != (1,)):
            return None
    return base


# [Note: kept views]
# Finding a flat unit's shard buffer and making its leaves' views of it cost the host a call
# per leaf, at every gather (twice a step under FULL_SHARD) and in every optimizer update.
# Both depend only on which tensor objects the shards are, never on their values (an in-place
# update or a load shows through a view), so they are kept per unit, keyed weakly by its
# first shard (they go with the tree's tensors, holding no memory of their own), and used
# only while every shard is the same object and for the same layout: a new tree, a
# reshard or a copy has new tensors. A cast is a copy of the current values: never kept.
# Nothing changes a shard's metadata in place (set_, resize_); a recording makes its own views.
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()


class _Kept:
    """What :func:`kept_buffer` and :func:`kept_views` know of one unit's shards."""

    __slots__ = ("shards", "buffer_for", "buffer", "views_for", "views")

    def __init__(self, shards: Sequence[torch.Tensor]):
        self.shards = tuple(weakref.ref(s) for s in shards)
        self.buffer_for: Any = None
        self.buffer: torch.Tensor | None = None
        self.views_for: Any = None
        self.views: Any = None


def _kept(shards: Sequence[torch.Tensor]) -> _Kept:
    kept = _KEPT.get(shards[0])
    if kept is None or len(kept.shards) != len(shards) or not all(
            map(operator.is_, map(weakref.ref.__call__, kept.shards), shards)):
        kept = _KEPT[shards[0]] = _Kept(shards)
    return kept


def _buffer(kept: _Kept, shards: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
            offsets: Sequence[int]) -> torch.Tensor | None:
    key = (numel, dtype, tuple(offsets))
    if kept.buffer_for != key:
        kept.buffer, kept.buffer_for = shard_buffer(shards, numel, dtype, offsets), key
    return kept.buffer


def kept_buffer(shards: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
                offsets: Sequence[int]) -> torch.Tensor | None:
    """:func:`shard_buffer`, found once for the same shards ([Note: kept views])."""
    return _buffer(_kept(shards), shards, numel, dtype, offsets) if shards else None


def kept_views(shards: Sequence[torch.Tensor], key: tuple, numel: int, offsets: Sequence[int],
               leaves: Sequence[LeafLayout], dtype: torch.dtype, keep: bool) -> tuple[list[torch.Tensor], dict | None] | None:
    """A flat unit's parameters in ``dtype`` from its shards' buffer (:func:`kept_buffer` in
    their own dtype; None if they are not views of one), and where each lies
    (:func:`leaves_by_storage`, None if not kept): views of the buffer in its own dtype,
    made once for the same shards and ``key`` (the objects their layout is made of, compared
    by identity) while ``keep``; a cast, every time ([Note: kept views])."""
    if not shards:
        return None
    kept = _kept(shards)
    base = _buffer(kept, shards, numel, shards[0].dtype, offsets)
    if base is None:
        return None
    if base.dtype != dtype or not keep:
        return unpack_unit(base.detach().to(dtype).view(1, -1), leaves, 1), None
    was = kept.views_for
    if was is None or len(was) != len(key) or any(a is not b for a, b in zip(was, key)):
        full = unpack_unit(base.detach().view(1, -1), leaves, 1)
        kept.views, kept.views_for = (full, leaves_by_storage(full)), key
    return kept.views
