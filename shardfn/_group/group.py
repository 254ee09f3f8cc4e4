"""A unit group: the units of one sharded tree in one runtime, and their reductions in flight.

[Note: the unit group]
A runtime holds one :class:`UnitGroup` per sharded tree its forward runs, and the group
is the one holder of what its units have in flight. It makes no decision of its own about
when to gather or free (that is each unit's one rule, [Note: the life of a unit]): a unit
asks it to start, wait for or cancel its all-gather (its bucket's, [Note: buckets]), and
hands it its gradients; the group issues each reduction, alone or with its bucket, keeps
the one in flight and waits for it before the next one's buffer exists. The step collects
the reduced shard gradients from the group of its own tree at the end of each backward.
Units and buckets hold buffers, never a handle, and reach the step only through the
group's :class:`~shardfn._group.context.Context`, a value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._comm import collectives as C
from .._comm.events import Purpose, marker
from .._parallel.agree import agree_on_optional
from .buckets import ReduceBucket, skipped_detail
from .context import Context, invariant

__all__ = ["UnitGroup"]


class _Flight:
    """A bucket's all-gather in flight (the group waits for it, once, for the first member
    that needs it): then its output, split into one ``[world, n]`` buffer per member in one
    copy (what each member's own all-gather would have produced)."""

    __slots__ = ("work", "out", "sizes", "name", "parts")

    def __init__(self, work: Any, out: torch.Tensor, sizes: list[int], name: str):
        self.work, self.out, self.sizes, self.name = work, out, sizes, name
        self.parts: list[torch.Tensor | None] = []


class _Gathering(NamedTuple):
    """A unit's all-gather in flight: its own (``out`` the ``[world, numel]`` output, ``keep``
    the input, alive until done), or its part of a bucket's (``flight``, at ``index``)."""

    work: Any = None
    out: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    flight: _Flight | None = None
    index: int = 0


class UnitGroup:
    """The units of one sharded tree in one runtime; see [Note: the unit group]."""

    __slots__ = ("ctx", "index", "store", "units", "last_micro_batch", "_gathering", "_pending", "reduced", "finished",
                 "offloaded")

    def __init__(self, ctx: Context, index: int, store: bool, offloaded: bool):
        self.ctx = ctx
        self.index = index  # of its tree in the runtime: the first half of its units' keys
        self.store = store  # the step's own tree: reduced once a backward, collected by the step
        self.offloaded = offloaded  # its gradients go to the host as each reduction is done ([Note: offload])
        self.units: dict[int, Any] = {}  # unit index -> shardfn._group.gather.Unit
        self.last_micro_batch = True
        self._gathering: dict[int, _Gathering] = {}  # unit index -> its all-gather in flight
        self._pending: list[tuple[Any, Any]] = []  # reductions in flight: (work, buffers to keep alive)
        self.reduced: list[tuple[Any, Any]] = []  # (unit, reduced shard gradient), in order
        self.finished = 0  # ... of them, the first ones already in the master dtype

    def reduces_now(self) -> bool:
        """Whether the gradients accumulated so far are reduced in this backward."""
        return self.ctx.reduces_each or self.last_micro_batch

    def start_micro_batch(self, last: bool) -> None:
        self.last_micro_batch = last
        for unit in self.units.values():
            unit.start_micro_batch()

    # -- all-gathers ---------------------------------------------------------------------

    def gather(self, unit: Any, purpose: Purpose) -> torch.Tensor:
        """The unit's all-gather, now (not prefetched): its ``[world, numel]`` output."""
        return self._all_gather(unit, purpose, async_op=False).out

    def prefetch(self, unit: Any, purpose: Purpose) -> None:
        """Starts the unit's all-gather (its bucket's: every sharded member goes in flight with
        it); :meth:`gathered` gives its output."""
        bucket = unit.bucket
        if bucket is None:
            self._gathering[unit.unit.index] = self._all_gather(unit, purpose, async_op=True)
            unit.took_flight()
            return
        ctx, first = self.ctx, bucket.units[0]
        with torch.no_grad():
            out, row = bucket.packed()
            work = C.all_gather(out.view(-1), row, first.channel, purpose, bucket.name, async_op=True,
                                to=ctx.observers, scope=ctx.scope)
        flight = _Flight(work, out, [u.unit.numel for u in bucket.units], bucket.name)
        for i, member in enumerate(bucket.units):
            if member.took_flight():  # (a member gathered already keeps what it has)
                self._gathering[member.unit.index] = _Gathering(flight=flight, index=i)

    def gathered(self, unit: Any) -> torch.Tensor:
        """The unit's all-gather in flight, done: its ``[world, numel]`` output (a bucket
        member: its columns of the bucket's, handed over once)."""
        g = self._gathering[unit.unit.index]
        self._wait(g)  # (kept in flight until done: a wait that raises is waited for again at the end)
        del self._gathering[unit.unit.index]
        if g.flight is None:
            return g.out
        part, g.flight.parts[g.index] = g.flight.parts[g.index], None
        return part

    def cancel(self, unit: Any) -> None:
        """Waits for a prefetch that was never used (the order changed)."""
        self._wait(self._gathering[unit.unit.index])
        del self._gathering[unit.unit.index]

    def _wait(self, g: _Gathering) -> None:
        if g.flight is None:
            g.work.wait()
        else:
            self._land(g.flight)

    def in_flight(self, unit: Any) -> bool:
        """Whether the unit's all-gather (its bucket's) is in flight, not yet handed over."""
        return unit.unit.index in self._gathering

    def _all_gather(self, unit: Any, purpose: Purpose, async_op: bool) -> _Gathering:
        ctx = self.ctx
        with torch.no_grad(), unit.staging(purpose):
            out, mine, ch = unit.gather_buffers(purpose)
            work = C.all_gather(out.view(-1), mine, ch, purpose, unit.name, async_op=async_op, to=ctx.observers,
                                scope=ctx.scope)
        return _Gathering(work, out, mine)

    def _land(self, flight: _Flight) -> None:
        """A bucket's all-gather done (waited for once), its output split among the members."""
        if flight.work is not None:
            flight.work.wait()
            flight.work = None
            flight.parts = list(torch.split_with_sizes_copy(flight.out, flight.sizes, dim=1))
            flight.out = None

    # -- a unit's backward ---------------------------------------------------------------

    def backward(self, unit: Any, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """One node's backward: this use's gradients of the full parameters. Returns the shard
        gradients autograd gets: this use's, reduced, outside a step; none inside one (the
        step collects the unit's one reduction: [Note: one reduction per unit])."""
        g = unit.grads
        with marker(lambda: f"shardfn::backward_reduce[{unit.name}]"):
            g.nodes = max(0, g.nodes - 1)
            if not self.store:
                g.acc = None
                g.accumulate(grads, self.ctx.owned)
                return g.shard_grads_list(g.to_master(self._issue(unit, asynchronous=False), self.ctx.observers))
            self._accumulate(unit, grads)
            # an optional unit reduces at the end of backward, on every rank (see flush)
            if g.nodes == 0 and self.reduces_now() and not unit.unit.optional:
                self._reduce(unit)
        return [None] * len(unit.unit.leaves)

    def _accumulate(self, unit: Any, grads: tuple[torch.Tensor | None, ...]) -> None:
        if not unit.grads.plain and unit.grads.bucket is None:
            self.wait_pending()  # the previous unit's reduction done, and its buffer freed, before this one's exists
        unit.grads.accumulate(grads, self.ctx.owned)

    def _flush(self, unit: Any, now: bool) -> None:
        """After a backward: reduce what the last use's backward did not."""
        g = unit.grads
        g.nodes = 0
        if now and (g.graphed or g.acc is not None or unit.unit.optional):
            if g.acc is None:
                self._accumulate(unit, tuple(None for _ in unit.unit.leaves))
            self._reduce(unit)

    def _reduce(self, unit: Any) -> None:
        """Reduces the unit's accumulated gradients once (with its bucket's, when it has one)."""
        bucket = unit.grads.bucket
        if bucket is not None:
            if bucket.add(unit):
                self._issue_bucket(bucket)
        else:
            self.reduced.append((unit, self._issue(unit, asynchronous=self.ctx.options.overlap)))
        unit.grads.graphed = False

    # -- the collectives -----------------------------------------------------------------

    def _issue(self, unit: Any, asynchronous: bool) -> Any:
        """The reduction of the unit's accumulated buffer: a flat shard-sized tensor in the
        reduce dtype (valid once the pending work is done), or, in a world of one, the
        per-leaf gradients."""
        g = unit.grads
        buf, g.acc = g.acc, None
        if g.plain:
            return buf
        lay, u, ctx = unit.layout, unit.unit, self.ctx
        single = lay.reduction.scatters != lay.reduction.all_reduces  # one collective
        asynchronous = asynchronous and single and self.store
        work = None
        if not lay.reduction.scatters:
            out = buf.view(-1)
        else:
            out = torch.empty(u.grad_numel, dtype=u.reduce_dtype, device=buf.device)
            work = C.reduce_scatter(out, buf.view(-1), unit.channel, Purpose.REDUCE, u.name, op=ctx.reduce_op,
                                    async_op=asynchronous, to=ctx.observers, scope=ctx.scope)
        if lay.reduction.all_reduces:  # NO_SHARD, and the hybrid strategies' replicate axis
            work = C.all_reduce(out, g.replicate, Purpose.REDUCE, u.name, op=ctx.reduce_op, async_op=asynchronous,
                                to=ctx.observers, scope=ctx.scope)
        if asynchronous and work is not None:
            self._add_pending(work, (buf, out))
        return out

    def _issue_bucket(self, bucket: ReduceBucket) -> None:
        """One collective for a bucket. Called early, after a backward, for a bucket some of
        whose units this rank did not use: its parts of them are zero, and its header names
        them, so the ranks agree on the step only if every rank skipped the same ones (a
        rank that used none of a bucket's units issues nothing: the ranks diverge too)."""
        first, ctx, ready = bucket.units[0], self.ctx, bucket.ready
        detail = skipped_detail([u.unit.name for u in bucket.units if u not in ready])
        overlap = ctx.options.overlap
        if bucket.rows == 1:
            for unit in bucket.units:
                if unit not in ready:
                    bucket.part(unit).zero_()
            out = buf = bucket.buffer
            work = C.all_reduce(buf, first.grads.replicate, Purpose.REDUCE, bucket.name, op=ctx.reduce_op,
                                async_op=overlap, to=ctx.observers, detail=detail, scope=ctx.scope)
        else:
            self.wait_pending()  # one bucket's unsharded gradients in flight at a time
            buf = bucket.packed()
            out = torch.empty(bucket.numel, dtype=first.unit.reduce_dtype, device=buf.device)
            work = C.reduce_scatter(out, buf.view(-1), first.channel, Purpose.REDUCE, bucket.name, op=ctx.reduce_op,
                                    async_op=overlap, to=ctx.observers, detail=detail, scope=ctx.scope)
        if overlap:
            self._add_pending(work, (buf, out), bucket=bucket.rows == 1)
        for unit, off in zip(bucket.units, bucket.offsets):
            self.reduced.append((unit, out[off : off + unit.unit.grad_numel]))
            unit.grads.acc = None
        bucket.buffer, bucket.ready = None, []

    def _add_pending(self, work: Any, keepalive: Any, bucket: bool = False) -> None:
        """Tracks an asynchronous reduction, the only one in flight (a bucket's: one of several).

        Each pending reduction keeps its unit's unsharded gradient buffer alive, so the
        next unit's reduction waits for it before allocating its own buffer: holding them
        all until the end of backward would cost the whole model's unsharded gradients, and
        even two at once raise the peak of backward. A bucket's buffer is the gradients
        themselves (NO_SHARD: the reduced gradient is its part of the buffer), held to the
        update anyway: buckets do not wait for each other ([Note: buckets]).
        """
        invariant(bucket or not self._pending, "wait_pending() before starting another reduction")
        self._pending.append((work, keepalive))

    def wait_pending(self) -> None:
        while self._pending:
            work, _keepalive = self._pending.pop(0)
            work.wait()
        if self.offloaded:
            self._finish_reduced()  # each gradient to the host as soon as it is reduced ([Note: offload])

    def _finish_reduced(self) -> None:
        """Every reduction collected so far (all done) in the master dtype."""
        for i in range(self.finished, len(self.reduced)):
            unit, out = self.reduced[i]
            self.reduced[i] = (unit, unit.grads.to_master(out, self.ctx.observers))
        self.finished = len(self.reduced)

    def end_backward(self, grads: dict[str, torch.Tensor]) -> None:
        """After a micro-batch's backward of the step's own tree: every reduction done, its
        gradients added into ``grads`` (leaf name -> shard gradient), in the order reduced.

        A unit whose graph node never ran backward (its output did not reach the loss)
        still reduces, with zero gradients, so every rank issues the same reductions.
        """
        self.wait_pending()
        mesh = self.ctx.mesh
        if mesh.axis_size("tensor") > 1 and not self.ctx.recorded:
            ran = [(u.unit.index, u.grads.acc is not None) for u in self.units.values() if u.unit.optional]
            if ran:
                agree_on_optional(ran, mesh, self.ctx.scope)
        now = self.reduces_now()
        for unit in self.units.values():
            self._flush(unit, now)
            self.wait_pending()
        for unit in self.units.values():  # a bucket some of whose units were not used ([Note: buckets])
            bucket = unit.grads.bucket
            if bucket is not None and bucket.ready and now:
                self._issue_bucket(bucket)
                self.wait_pending()
        self._finish_reduced()
        for unit, out in self.reduced:
            for name, g in unit.grads.shard_grads(out).items():
                grads[name] = g if name not in grads else grads[name].add_(g)
        self.reduced.clear()
        self.finished = 0

    # -- the end ----------------------------------------------------------------------------

    def settle(self) -> None:
        """Nothing in flight: no reduction, and no prefetched all-gather reading the shards."""
        self.wait_pending()
        for unit in self.units.values():
            unit.cancel_prefetch()

    def finish(self) -> None:
        """Nothing in flight, nothing gathered."""
        self.wait_pending()
        for unit in self.units.values():
            unit.end()
