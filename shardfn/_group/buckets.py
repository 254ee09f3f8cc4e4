"""Buckets: neighbouring units share one collective.

[Note: buckets]
Every collective costs a latency and the host work of issuing and waiting for it, whatever
its size, and small units pay them unit by unit. So neighbouring units share one
collective, up to ``Plan(bucket_bytes=...)`` bytes of its buffer (0: every unit alone). A
bucket is not free: it adds copies, starts its first reduction later and, under
FULL_SHARD, is gathered and held where one unit was; the default keeps nearly all the gain
of small units and leaves alone units that already amortise their latency.

Which units share a bucket is part of the layout, the same on every rank, and a bucket is
named after its first and last units (``blocks.0..blocks.5``) in collectives and
``explain``. Gradients (shardfn._state.bucketing.reduce_buckets) fill from the last unit
back, backward's order, with a small first bucket (``FIRST_BUCKET_BYTES``, as DDP's) so that
communication starts early; parameters (``gather_buckets``) in layout order. A bucket has one dtype
and one reshard rule; a unit that cannot share a collective with its neighbours (an
optional one, an offloaded one, hybrid's two-step reduction, ...) travels alone.

A unit that some ranks skip raises the same DivergenceError on every rank, bucketed or
alone, unless it is declared optional: one rule, whatever the bucket sizes. Alone, its
collectives differ; in a bucket they would not, so a bucket's reduction carries in its
header's detail which members this rank did not run (:func:`skipped_detail`).

Strategy by strategy (what each reduces and gathers in a bucket, the copies a bucket adds,
which units travel alone) and the measurements behind the default: docs/strategies.md,
"Buckets: small units share a collective".
"""

from __future__ import annotations

from typing import Any

import torch

from .._comm.guard import unit_id
from .._state.packing import pack_shards, shard_buffer

__all__ = ["GatherBucket", "ReduceBucket", "buckets_of", "skipped_detail"]

class _Bucket:
    """Units that share one collective: their indices in the layout, each one's offset in the
    bucket's buffer, and the units at run time, which join as each is built."""

    __slots__ = ("members", "units", "offsets", "numel", "name")

    def __init__(self, layout: Any, members: tuple[int, ...], sizes: list[int]):
        self.members = members
        self.units: list[Any] = [None] * len(members)
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes)
        self.name = layout.bucket_name(members)

    def join(self, unit: Any) -> None:
        self.units[self.members.index(unit.unit.index)] = unit


class GatherBucket(_Bucket):
    """Units whose all-gathers travel together (see [Note: buckets]): the first member that
    needs its parameters has its unit group start one all-gather for all; each member in
    flight with it gets its columns when used (shardfn._group.group)."""

    __slots__ = ()

    def __init__(self, layout: Any, members: tuple[int, ...]):
        super().__init__(layout, members, [layout.units[i].numel for i in members])

    def packed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The all-gather's ``[world, numel]`` output and this rank's row, into which every
        member's shards go in one op (a unit whose shards are not one buffer packs its own);
        its unit group issues the all-gather (shardfn._group.group)."""
        first = self.units[0]
        out = torch.empty(first.layout.world, self.numel, dtype=first.unit.param_dtype, device=first.device)
        row = out[first.rank]
        parts = [row[off : off + u.unit.numel] for u, off in zip(self.units, self.offsets)]
        bases = [_shard_base(u) for u in self.units]
        if all(b is not None for b in bases):
            torch._foreach_copy_(parts, bases)  # cast to the param dtype on the way
        else:
            for unit, part in zip(self.units, parts):
                pack_shards(part, unit.shards, False, unit.group.ctx.observers, unit.unit.name,
                            unit.layout.offsets(unit.unit, unit.rank) if unit.unit.flat else None)
        return out, row


def _shard_base(unit: Any) -> torch.Tensor | None:
    """A flat unit's shard buffer, when its shards are views of one (shardfn._state.packing.shard_buffer)."""
    if not unit.unit.flat:
        return None
    offsets = unit.layout.offsets(unit.unit, unit.rank)
    return shard_buffer(unit.shards, unit.unit.numel, unit.shards[0].dtype, offsets)


class ReduceBucket(_Bucket):
    """Units whose gradients share one buffer and one collective (see [Note: buckets]):
    each unit packs its gradients (into its part of the buffer under NO_SHARD, into its own
    ``[world, gn]`` buffer under the sharded strategies); once the last one is ready its
    unit group issues the collective (shardfn._group.group), and each unit's reduced
    gradient is its part of the result."""

    __slots__ = ("buffer", "ready", "rows")

    def __init__(self, layout: Any, members: tuple[int, ...]):
        super().__init__(layout, members, [layout.units[i].grad_numel for i in members])
        self.rows = layout.world  # 1: NO_SHARD's all-reduce; else the reduce-scatter's world
        self.buffer: torch.Tensor | None = None  # NO_SHARD: allocated by the first unit to pack
        self.ready: list[Any] = []  # units whose gradients are all packed

    def part(self, unit: Any) -> torch.Tensor | None:
        """NO_SHARD: where ``unit`` packs its gradients (its part of the bucket's buffer);
        the sharded strategies: None (the unit packs into a buffer of its own)."""
        if self.rows > 1:
            return None
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=unit.unit.reduce_dtype, device=unit.device)
        i = self.units.index(unit)
        return self.buffer[self.offsets[i] : self.offsets[i] + unit.unit.grad_numel]

    def add(self, unit: Any) -> bool:
        """``unit``'s gradients are packed; True when every member's are (the bucket reduces)."""
        self.ready.append(unit)
        return len(self.ready) == len(self.units)

    def packed(self) -> torch.Tensor:
        """The sharded strategies: the members' ``[world, gn]`` buffers side by side in one
        ``[world, numel]`` buffer, zeros for a member this rank did not use."""
        parts = [u.grads.acc.view(self.rows, -1) if u in self.ready else
                 torch.zeros(self.rows, u.unit.grad_numel, dtype=u.unit.reduce_dtype, device=u.device)
                 for u in self.units]
        return torch.cat(parts, dim=1)


def skipped_detail(skipped: list[str]) -> int:
    """The header detail of a bucket's reduction whose members ``skipped`` this rank did not
    run: 0 for none, else the first one's name hash and how many (shardfn._comm.guard prints it)."""
    return unit_id(skipped[0]) | len(skipped) << 32 if skipped else 0


def buckets_of(layout: Any, reduce: bool) -> dict[int, tuple[GatherBucket | None, ReduceBucket | None]]:
    """Unit index -> the gather bucket and reduce bucket it travels in (None: alone), new for
    one runtime's units of a tree; reduce buckets only for a step's own tree (``reduce``).
    Each unit joins its buckets when it is built (shardfn._group.gather.Unit)."""
    out: dict[int, list[Any]] = {u.index: [None, None] for u in layout.units}
    for members in layout.gather_buckets:
        if len(members) > 1:
            bucket = GatherBucket(layout, members)
            for i in members:
                out[i][0] = bucket
    for members in layout.buckets if reduce else ():
        if len(members) > 1:
            bucket = ReduceBucket(layout, members)
            for i in members:
                out[i][1] = bucket
    return {i: (g, r) for i, (g, r) in out.items()}
