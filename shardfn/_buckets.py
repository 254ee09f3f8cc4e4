"""Buckets: neighbouring units share one collective.

[Note: buckets]
Every collective costs a latency and the host work of issuing and waiting for it,
whatever its size, and small units pay them unit by unit. So neighbouring units travel
together, up to ``Plan(bucket_bytes=...)`` bytes of the collective's buffer (0: every unit
alone). The 4 MiB default keeps nearly all the gain on small units and leaves units that
already amortise their latency alone, where a bucket would only add copies and peak
memory (measured in docs/strategies.md, "Choosing the size"). Which units share a bucket
is part of the layout, the same on every rank; a bucket is named after its first and last
units (``blocks.0..blocks.5``), and collectives and ``explain`` use that name.

Gradients (:func:`reduce_buckets`), taken from the last unit back (backward's order), the
first bucket up to 1 MiB (DDP's first bucket) so that communication starts early, one
reduce dtype per bucket, optional units alone (and, sharded, whole ones):

* NO_SHARD: one all-reduce per bucket (DDP's buckets). Each unit packs straight into its
  part of the bucket's buffer and its reduced gradient is its part of the result: no copy
  more than alone. Buckets do not wait for each other (their buffers are the gradients).
* FULL_SHARD, SHARD_GRAD_OP (not offloaded): one reduce-scatter per bucket of a ``[world, sum of gn]``
  buffer. A unit's gradients are a column block of it, not contiguous, so each unit packs
  into its own ``[world, gn]`` buffer as alone, and one cat per bucket lays them side by
  side (one copy of the bucket's unsharded gradients more than alone); this rank's reduced
  gradient of each unit is its part of the result. A bucket waits for the reduction before
  it, as a unit does, so one bucket's unsharded gradients are in flight at a time.
* The hybrid strategies reduce each unit alone (two collectives in a row).

Parameters (:func:`gather_buckets`), under FULL_SHARD and SHARD_GRAD_OP, in layout order:
the first member of a bucket that needs its parameters, or is prefetched, starts one
all-gather for the bucket; every member that is sharded goes in flight with it, and each
copies its columns of the output out when it is used (one copy of its gathered
parameters, W*n, which a flat unit's own all-gather does not need, and the pack of its
shards into the input, n); for the bucket these are two ops, one for the input (a foreach
copy of the members' shard buffers) and one for the output (a split into the members'
buffers, when the first member waits). The root unit and optional, rematerialised, whole, sub-group
resharded and offloaded units gather alone; SHARD_OPTIMIZER gathers no parameters in a
step. One param dtype and one reshard rule per bucket. The members of a bucket are
gathered together, so FULL_SHARD holds a bucket where it held a unit: choose
``bucket_bytes`` by the memory one bucket of gathered parameters may take.

A unit that some ranks skip (not run in the step) raises the same DivergenceError on every
rank, bucketed or alone, unless it is declared optional (``Plan(optional=...)``, alone in its
bucket): one rule, whatever the bucket sizes. Alone, its collectives differ; in a bucket they
would not, so a bucket's reduction carries in its header's detail which members this rank
did not run (:func:`skipped_detail`), and ranks that skipped different ones disagree there.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _collectives as C
from ._events import Purpose
from ._guard import unit_id
from ._packing import pack_shards, shard_buffer
from ._plan import Strategy

__all__ = ["FIRST_BUCKET_BYTES", "GatherBucket", "ReduceBucket", "gather_buckets", "reduce_buckets", "skipped_detail"]

FIRST_BUCKET_BYTES = 2**20


def reduce_buckets(layout: Any) -> tuple[tuple[int, ...], ...]:
    """The units whose gradient reductions travel together, as tuples of unit indices in
    layout order; every unit that reduces is in exactly one (see [Note: buckets])."""
    reducing = [u for u in layout.units if u.grad_numel]
    no_shard = layout.world == 1 and layout.replicas > 1
    sharded = layout.world > 1 and layout.replicas == 1 and not layout.offloaded
    if not ((no_shard or sharded) and layout.plan.bucket_bytes):
        return tuple((u.index,) for u in reducing)
    def solo(u: Any) -> bool:  # a unit that reduces in a bucket of its own
        return u.optional or (sharded and u.whole)

    out: list[list[int]] = []
    size, dtype = 0, None
    for u in reversed(reducing):
        nbytes = layout.world * u.grad_numel * u.reduce_dtype.itemsize  # the buffer: [world, gn]
        alone = solo(u) or (out and solo(layout.units[out[-1][0]]))
        cap = min(FIRST_BUCKET_BYTES, layout.plan.bucket_bytes) if len(out) == 1 else layout.plan.bucket_bytes
        if not out or alone or u.reduce_dtype != dtype or size + nbytes > cap:
            out.append([])
            size = 0
        out[-1].insert(0, u.index)
        size, dtype = size + nbytes, u.reduce_dtype
    return tuple(tuple(b) for b in reversed(out))


def gather_buckets(layout: Any) -> tuple[tuple[int, ...], ...]:
    """The units whose all-gathers travel together, as tuples of unit indices in layout
    order; every unit is in exactly one (see [Note: buckets])."""
    on = (layout.world > 1 and layout.replicas == 1 and layout.plan.bucket_bytes and not layout.offloaded
          and layout.strategy is not Strategy.SHARD_OPTIMIZER)
    out: list[list[int]] = []
    size, key = 0, None
    for u in layout.units:
        joins = bool(on and u.path and u.numel and not u.optional and u.remat is None and u.subgroup is None
                     and not u.whole)
        nbytes = layout.world * u.numel * u.param_dtype.itemsize
        mine = (u.param_dtype, bool(u.reshard)) if joins else None
        if mine is None or mine != key or size + nbytes > layout.plan.bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(u.index)
        size, key = size + nbytes, mine
    return tuple(tuple(b) for b in out)


class GatherBucket:
    """Units whose all-gathers travel together (see [Note: buckets]): the first member that
    needs its parameters starts one all-gather for all; each member in flight with it
    copies its columns out when used (shardfn._gather.Unit)."""

    __slots__ = ("units", "offsets", "numel", "name")

    def __init__(self, units: list[Any]):
        self.units = units
        self.offsets = [sum(u.unit.numel for u in units[:i]) for i in range(len(units))]
        self.numel = sum(u.unit.numel for u in units)
        self.name = units[0].layout.bucket_name(tuple(u.unit.index for u in units))

    def issue(self, purpose: Purpose) -> None:
        """One all-gather of every member's shards into a ``[world, numel]`` output; every
        member that is sharded goes in flight with it. The members' shard buffers go into
        this rank's row in one op (a unit whose shards are not one buffer packs its own)."""
        first = self.units[0]
        with torch.no_grad():
            out = torch.empty(first.layout.world, self.numel, dtype=first.unit.param_dtype, device=first.device)
            row = out[first.rank]
            parts = [row[off : off + u.unit.numel] for u, off in zip(self.units, self.offsets)]
            bases = [_shard_base(u) for u in self.units]
            if all(b is not None for b in bases):
                torch._foreach_copy_(parts, bases)  # cast to the param dtype on the way
            else:
                for unit, part in zip(self.units, parts):
                    pack_shards(part, unit.shards, False, unit.runtime.observers, unit.unit.name,
                                unit.layout.offsets(unit.unit, unit.rank) if unit.unit.flat else None)
            work = C.all_gather(out.view(-1), row, first.channel, purpose, self.name, async_op=True,
                                to=first.runtime.observers)
        flight = Flight(work, out, [u.unit.numel for u in self.units], self.name)
        for i, unit in enumerate(self.units):
            unit.take_flight(Share(flight, i))


def _shard_base(unit: Any) -> torch.Tensor | None:
    """A flat unit's shard buffer, when its shards are views of one (shardfn._packing.shard_buffer)."""
    if not unit.unit.flat:
        return None
    offsets = unit.layout.offsets(unit.unit, unit.rank)
    return shard_buffer(unit.shards, unit.unit.numel, unit.shards[0].dtype, offsets)


class Flight:
    """A bucket's all-gather in flight. Waited for once, by the first member to need it;
    then its output is split into one ``[world, n]`` buffer per member in one copy (what a
    member's own all-gather would have produced) and let go."""

    __slots__ = ("work", "out", "sizes", "parts", "name")

    def __init__(self, work: Any, out: torch.Tensor, sizes: list[int], name: str):
        self.work, self.out, self.sizes, self.name = work, out, sizes, name
        self.parts: list[torch.Tensor | None] = []

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self.parts = list(torch.split_with_sizes_copy(self.out, self.sizes, dim=1))
            self.out = None


class Share:
    """A member's handle on its bucket's all-gather: ``wait()`` for it, then ``columns()``,
    the member's ``[world, n]`` part (handed over once)."""

    __slots__ = ("flight", "index")

    def __init__(self, flight: Flight, index: int):
        self.flight, self.index = flight, index

    def wait(self) -> None:
        self.flight.wait()

    def columns(self) -> torch.Tensor:
        part, self.flight.parts[self.index] = self.flight.parts[self.index], None
        return part


class ReduceBucket:
    """Units whose gradients share one buffer and one collective (see [Note: buckets]):
    each unit packs its gradients (into its part of the buffer under NO_SHARD, into its own
    ``[world, gn]`` buffer under the sharded strategies); the last one ready issues the
    collective, and each unit's reduced gradient is its part of the result."""

    __slots__ = ("units", "offsets", "numel", "name", "buffer", "ready", "rows")

    def __init__(self, units: list[Any]):
        self.units = units
        self.offsets = [sum(u.unit.grad_numel for u in units[:i]) for i in range(len(units))]
        self.numel = sum(u.unit.grad_numel for u in units)
        self.name = units[0].layout.bucket_name(tuple(u.unit.index for u in units))
        self.rows = units[0].layout.world  # 1: NO_SHARD's all-reduce; else the reduce-scatter's world
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

    def add(self, unit: Any) -> None:
        self.ready.append(unit)
        if len(self.ready) == len(self.units):
            self.issue()

    def issue(self) -> None:
        """One collective for the bucket. Called early, after a backward, for a bucket some of
        whose units this rank did not use: its parts of them are zero, and its header names
        them, so the ranks agree on the step only if every rank skipped the same ones (a
        rank that used none of a bucket's units issues nothing: the ranks diverge too)."""
        first = self.units[0]
        rt, ready = first.runtime, self.ready
        detail = skipped_detail([u.unit.name for u in self.units if u not in ready])
        if self.rows == 1:
            for unit in self.units:
                if unit not in ready:
                    self.part(unit).zero_()
            out = buf = self.buffer
            work = C.all_reduce(buf, first.grads.replicate, Purpose.REDUCE, self.name, op=rt.reduce_op,
                                async_op=rt.overlap, to=rt.observers, detail=detail)
        else:
            rt.wait_pending()  # one bucket's unsharded gradients in flight at a time
            parts = [u.grads.acc.view(self.rows, -1) if u in ready else
                     torch.zeros(self.rows, u.unit.grad_numel, dtype=u.unit.reduce_dtype, device=u.device)
                     for u in self.units]
            buf = torch.cat(parts, dim=1)
            del parts
            out = torch.empty(self.numel, dtype=first.unit.reduce_dtype, device=buf.device)
            work = C.reduce_scatter(out, buf.view(-1), first.channel, Purpose.REDUCE, self.name, op=rt.reduce_op,
                                    async_op=rt.overlap, to=rt.observers, detail=detail)
        if rt.overlap:
            rt.add_pending(work, (buf, out), bucket=self.rows == 1)
        for unit, off in zip(self.units, self.offsets):
            rt.reduced.append((unit, out[off : off + unit.unit.grad_numel]))
            unit.grads.acc = None
        self.buffer, self.ready = None, []


def skipped_detail(skipped: list[str]) -> int:
    """The header detail of a bucket's reduction whose members ``skipped`` this rank did not
    run: 0 for none, else the first one's name hash and how many (shardfn._guard prints it)."""
    return unit_id(skipped[0]) | len(skipped) << 32 if skipped else 0


def attach_buckets(units: dict[int, Any], reduce: bool) -> None:
    """Gives the units of a tree in a runtime their gather buckets, and, for a step's own
    tree (``reduce``), their reduce buckets (those of more than one unit)."""
    layout = next(iter(units.values())).layout if units else None
    if layout is None:
        return
    for members in layout.gather_buckets:
        if len(members) > 1:
            bucket = GatherBucket([units[i] for i in members])
            for unit in bucket.units:
                unit.bucket = bucket
    for members in layout.buckets if reduce else ():
        if len(members) > 1:
            bucket = ReduceBucket([units[i] for i in members])
            for unit in bucket.units:
                unit.grads.bucket = bucket
