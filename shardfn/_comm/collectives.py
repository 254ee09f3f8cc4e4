"""The only module that issues ``torch.distributed`` collectives.

Every all-gather, reduce-scatter, all-reduce, broadcast and scatter in shardfn goes
through the functions below, so that tests (and ``metrics``) can count each collective
and its bytes exactly, and so that the CUDA/NCCL and CPU/gloo paths share one code path.
(:mod:`shardfn._mesh` also talks to ``torch.distributed``, to start the process group and
build meshes; it issues no collective.)

[Note: accounting]
Each call emits a :class:`shardfn._comm.events.CollectiveCall` (kind, process group, bytes,
dtype, purpose, unit) to the observers (see [Note: events]), where the bytes are the size
of the *full* buffer the collective moves: the output of an all-gather, the input of a
reduce-scatter, the tensor of an all-reduce. These are the "textbook" volumes
(FULL_SHARD moves twice the parameter bytes in all-gathers and once in reduce-scatters
per step), independent of the backend's algorithm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from . import guard as G
from .._compat import all_gather_single, reduce_scatter_single
from .events import Collective, CollectiveCall, Purpose, emit, label, marker, observers

__all__ = [
    "AVG", "MAX", "MIN", "SUM", "all_gather", "all_gather_mesh", "all_reduce", "all_reduce_mesh", "barrier",
    "barrier_mesh", "broadcast", "broadcast_mesh", "issue_all_gather", "issue_all_reduce", "issue_reduce_scatter",
    "reduce_scatter", "scatter",
]

AVG, SUM, MAX, MIN = ReduceOp.AVG, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN


def _record(kind: Collective, ch: G.Channel, t: torch.Tensor, purpose: Purpose, unit: str, to: Any,
            scope: G.Scope, detail: int = 0, op: ReduceOp | None = None) -> None:
    """Agrees on the collective with the other ranks (see [Note: the schedule guard]; in a
    step, [Note: the pipelined guard]), then reports it."""
    if scope.run is not None:
        scope.run.collective(ch, kind, purpose, unit, t, op, detail, scope)
    else:
        G.agree(ch, kind, purpose, unit, t.numel() * t.element_size(), detail, t.dtype, scope)
    to = observers() if to is None else to
    if to:
        call = CollectiveCall(kind, ch.ranks, t.numel() * t.element_size(), t.dtype,
                              purpose, unit)
        emit(call, to)


def _range(kind: Collective, purpose: Purpose, unit: str):
    return marker(lambda: f"shardfn::{kind.value}[{label(purpose, unit)}]")


def all_gather(out: torch.Tensor, inp: torch.Tensor, ch: G.Channel, purpose: Purpose, unit: str = "",
               async_op: bool = False, to: Any = None, detail: int = 0, scope: G.Scope | None = None) -> Any:
    """``out`` (``group size * inp.numel()`` elements) receives every rank's ``inp``, rank-major.

    ``to``: the observers to report to (default: those active here; a step passes its own).
    ``detail``: a number every rank must agree on (a hash of the shape of ``inp``).
    ``scope``: the caller's shardfn._comm.guard.Scope (default: the calling thread's); a runtime
    passes its own, which holds in backward too ([Note: backward on device threads]).
    """
    scope = G.here() if scope is None else scope
    _record(Collective.ALL_GATHER, ch, out, purpose, unit, to, scope, detail)
    with _range(Collective.ALL_GATHER, purpose, unit):
        if scope.recording:  # straight into ``out``, as eagerly: a copy of every gathered unit less
            work = _Functional(out, _F.all_gather_into_tensor_out(inp.reshape(-1), ch.size, ch.group.group_name,
                                                                  out=out.view(-1)))
        else:
            work = issue_all_gather(out, inp, ch.group)
    return _done(work, ch, async_op, Collective.ALL_GATHER, purpose, unit)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, ch: G.Channel, purpose: Purpose, unit: str = "",
                   op: ReduceOp = AVG, async_op: bool = False, to: Any = None, detail: int = 0,
                   scope: G.Scope | None = None) -> Any:
    """``out`` receives this rank's chunk of the average (or ``op``) of ``inp`` over ``ch``'s group.

    With ``async_op`` it returns the work handle: ``out`` is valid after ``work.wait()``
    and ``inp`` must stay alive until then. ``detail``: a number every rank must agree on.
    ``scope``: as :func:`all_gather`'s.
    """
    scope = G.here() if scope is None else scope
    _record(Collective.REDUCE_SCATTER, ch, inp, purpose, unit, to, scope, detail, op)
    with _range(Collective.REDUCE_SCATTER, purpose, unit):
        if scope.recording:
            work, finish = _reduce_scatter_recorded(out, inp.reshape(-1), ch, op), None
        else:
            work, finish = issue_reduce_scatter(out, inp, ch.group, op)
    if async_op:
        return G.Pending(work, ch, f"{Collective.REDUCE_SCATTER.value} ({G.label(purpose, unit)})", finish)
    _done(work, ch, False, Collective.REDUCE_SCATTER, purpose, unit)
    if finish is not None:
        finish()
    return None


def issue_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> tuple[Any, Any]:
    """Starts a reduce-scatter, unrecorded: ``(work, finish)``, where ``finish`` (or None)
    completes ``out`` once ``work`` is done. Every reduce-scatter shardfn issues starts here
    (the pipelined guard's playing out included), so that all ranks issue the same transfers."""
    if op in (SUM, AVG) and group.size() > 1 and inp.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
        return _reduce_scatter_gloo(out, inp, group, op)
    return reduce_scatter_single(out, inp, op=op, group=group, async_op=True), None


def issue_all_gather(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup) -> Any:
    """Starts an all-gather, unrecorded: its work handle. Every eager all-gather shardfn
    issues starts here, the pipelined guard's playing out included (as every reduce-scatter
    at :func:`issue_reduce_scatter`), so that only this module calls torch.distributed."""
    return all_gather_single(out, inp, group=group, async_op=True)


def issue_all_reduce(t: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> Any:
    """Starts an in-place all-reduce, unrecorded: its work handle. Every eager all-reduce
    shardfn issues starts here (see :func:`issue_all_gather`)."""
    return dist.all_reduce(t, op=op, group=group, async_op=True)


def _reduce_scatter_gloo(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, op: ReduceOp) -> tuple[Any, Any]:
    """[Note: reduce-scatter on gloo] gloo's reduce-scatter copies its input, all-reduces the
    copy (every rank sends and receives twice the bytes a reduce-scatter needs) and copies
    its chunk out, which makes it slower than an all-reduce of the same buffer. Instead each
    rank sends every peer the chunk that peer owns and receives its own chunk from each peer
    (paired sends and receives: (n - 1) / n of the input each way, the reduce-scatter's
    textbook traffic), then adds them up, faster than gloo does (docs/benchmarks.md,
    "Reduce-scatter on gloo"). One peer's chunk is received straight into the output, so
    the receive buffers hold n - 2 chunks (none at world 2), where gloo held a full copy.

    [Note: the order of the sum] Every chunk is summed in rank order, ``((g0 + g1) + g2) +
    ...``, whichever rank owns it, so the result is bit for bit what one process gets by
    adding the ranks' gradients left to right (fp32 addition is commutative but not
    associative: at world 3, ``(g2 + g1) + g0`` and ``(g0 + g1) + g2`` can differ in the
    last bit, and a bf16 model downstream can turn that bit into a bf16 rounding). The
    output starts as the lower of ranks 0 and 1 that is not this one (``g1 + g0`` equals
    ``g0 + g1`` exactly), and the other chunks are added in rank order."""
    n, me = group.size(), dist.get_rank(group)
    chunks, flat = inp.view(n, -1), out.view(-1)
    first = 1 if me == 0 else 0  # the peer whose chunk lands in the output itself
    peers = [r for r in range(n) if r not in (me, first)]
    bufs = dict(zip(peers, torch.empty((n - 2, chunks.shape[1]), dtype=inp.dtype, device=inp.device).unbind(0)))
    recv = {first: flat, **bufs}
    ops = []
    for i in range(1, n):  # send to me + i while receiving from me - i: every pair meets in the same round
        to, frm = (me + i) % n, (me - i) % n
        ops += [dist.P2POp(dist.isend, chunks[to], dist.get_global_rank(group, to), group),
                dist.P2POp(dist.irecv, recv[frm], dist.get_global_rank(group, frm), group)]
    work = _Works(dist.batch_isend_irecv(ops))

    def finish() -> None:
        for r in range(n):
            if r != first:
                flat.add_(chunks[me] if r == me else bufs[r])
        if op == AVG:
            out.div_(n)

    return work, finish


_F = torch.ops._c10d_functional
_OPS = {SUM: "sum", AVG: "avg", MAX: "max", MIN: "min"}


class _Functional:
    """A functional collective in a recorded step ([Note: recording a step]): waiting
    copies its result (through ``then``, the local part that completes it) into the buffer
    the eager collective writes in place."""

    def __init__(self, out: torch.Tensor, result: torch.Tensor, then: Any = None):
        self.out, self.result, self.then = out, result, then

    def wait(self, timeout: Any = None) -> bool:
        if self.result is not None:
            done, self.result = _F.wait_tensor(self.result), None
            if self.then is not None:
                self.out.copy_(self.then(done).view(self.out.shape))
            elif not torch._C._is_alias_of(done, self.out):  # (an ``_out`` collective wrote ``out`` itself)
                self.out.copy_(done.view(self.out.shape))
        return True


def _reduce_scatter_recorded(out: torch.Tensor, flat: torch.Tensor, ch: G.Channel, op: ReduceOp) -> _Functional:
    """A reduce-scatter in a recorded step. On gloo, as eagerly, not gloo's own ([Note:
    reduce-scatter on gloo]): a graph has no sends, so every rank's chunks travel in one
    all-to-all (the same bytes as the paired sends), then are summed in rank order, as the
    eager path sums them ([Note: the order of the sum])."""
    n = ch.size
    if not (op in (SUM, AVG) and n > 1 and flat.device.type == "cpu" and "gloo" in str(dist.get_backend(ch.group))):
        return _Functional(out, _F.reduce_scatter_tensor(flat, _OPS[op], n, ch.group.group_name))

    def add(received: torch.Tensor) -> torch.Tensor:
        rows = received.view(n, -1)  # row r: rank r's chunk of this rank's part
        total = rows[0] + rows[1]
        for r in range(2, n):
            total.add_(rows[r])
        return total.div_(n) if op == AVG else total

    sizes = [flat.numel() // n] * n
    return _Functional(out, _F.all_to_all_single(flat, sizes, sizes, ch.group.group_name), add)


class _Works:
    """Several work handles waited as one (a batch of sends and receives)."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


def all_reduce(t: torch.Tensor, ch: G.Channel, purpose: Purpose, unit: str = "", op: ReduceOp = AVG,
               async_op: bool = False, to: Any = None, detail: int = 0, scope: G.Scope | None = None) -> Any:
    """In-place all-reduce of ``t`` over ``ch``'s group (``AVG``, ``SUM`` or ``MAX``).

    ``detail``: a number every rank must agree on, checked with the collective's header
    (the step's metrics all-reduce passes the batch's rows). ``scope``: as :func:`all_gather`'s."""
    scope = G.here() if scope is None else scope
    _record(Collective.ALL_REDUCE, ch, t, purpose, unit, to, scope, detail, op)
    with _range(Collective.ALL_REDUCE, purpose, unit):
        if scope.recording:
            work = _Functional(t, _F.all_reduce(t, _OPS[op], ch.group.group_name))
        else:
            work = issue_all_reduce(t, ch.group, op)
    return _done(work, ch, async_op, Collective.ALL_REDUCE, purpose, unit)


def broadcast(t: torch.Tensor, group_src: int, ch: G.Channel, purpose: Purpose, unit: str = "") -> None:
    """``t`` on every rank of ``ch`` becomes the ``t`` of its rank ``group_src``."""
    _record(Collective.BROADCAST, ch, t, purpose, unit, None, G.here())
    with _range(Collective.BROADCAST, purpose, unit):
        work = dist.broadcast(t, group=ch.group, group_src=group_src, async_op=True)
    _done(work, ch, False, Collective.BROADCAST, purpose, unit)


def scatter(out: torch.Tensor, inp: torch.Tensor | None, group_src: int, ch: G.Channel, purpose: Purpose,
            unit: str = "") -> None:
    """Rank ``r`` of ``ch`` receives row ``r`` of ``inp`` (``[group size, n]``, given on ``group_src``)."""
    _record(Collective.SCATTER, ch, out, purpose, unit, None, G.here())
    with _range(Collective.SCATTER, purpose, unit):
        work = dist.scatter(out, list(inp.unbind(0)) if inp is not None else None, group=ch.group, group_src=group_src,
                            async_op=True)
    _done(work, ch, False, Collective.SCATTER, purpose, unit)


def barrier(ch: G.Channel, detail: int = 0) -> None:
    """Waits for every rank of ``ch`` (checkpoint publication; not counted as traffic).

    ``detail``: a number every rank must agree on (a checkpoint's digest)."""
    G.agree(ch, Collective.BARRIER, Purpose.CHECKPOINT, "", 0, detail)
    with torch.profiler.record_function("shardfn::barrier[checkpoint]"):
        work = dist.barrier(group=ch.group, async_op=True)
    _done(work, ch, False, Collective.BARRIER, Purpose.CHECKPOINT, "")


def _done(work: Any, ch: G.Channel, async_op: bool, kind: Collective, purpose: Purpose, unit: str) -> Any:
    """The handle of an asynchronous collective (waited for as shardfn._comm.guard.wait does), or,
    for a blocking one, None once it is waited for: a barrier on the host, within the step
    timeout; a data collective on NCCL on the stream ([Note: waiting on NCCL])."""
    what = f"{kind.value} ({G.label(purpose, unit)})"
    if async_op:
        return G.Pending(work, ch, what)
    G.wait(work, ch, what, host=kind is Collective.BARRIER)
    return None


# -- over every axis of a mesh ------------------------------------------------------------


def all_reduce_mesh(t: torch.Tensor, mesh: Any, purpose: Purpose, op: ReduceOp = SUM, to: Any = None,
                    detail: int = 0) -> None:
    """In-place all-reduce of ``t`` over the whole mesh: one collective per axis of size > 1.

    ``SUM`` and ``MAX`` over every axis in turn are the sum and max over all ranks; so is
    ``AVG`` the average (every rank of an axis holds the same count of ranks below it).
    """
    for axis in mesh.axis_names:
        if mesh.axis_size(axis) > 1:
            all_reduce(t, mesh.channel(axis), purpose, op=op, to=to, detail=detail)


def barrier_mesh(mesh: Any, detail: int = 0) -> None:
    """A barrier over every axis of the mesh (see :func:`barrier`), so that an error on one
    rank reaches the others through the same groups (see [Note: the schedule guard])."""
    for axis in mesh.axis_names:
        if mesh.axis_size(axis) > 1:
            barrier(mesh.channel(axis), detail)


def all_gather_mesh(t: torch.Tensor, mesh: Any, purpose: Purpose, detail: int = 0) -> torch.Tensor:
    """Every rank's ``t`` (flat), in mesh-rank order: one all-gather per axis of size > 1.

    First over ``shard``, then over ``replicate`` of the whole gathered ``shard`` row, so
    every rank ends with every rank's values, row-major over ``(replicate, shard)``.
    """
    out = t.reshape(-1)
    for axis in reversed(mesh.axis_names):
        n = mesh.axis_size(axis)
        if n > 1:
            gathered = torch.empty(n * out.numel(), dtype=out.dtype, device=out.device)
            all_gather(gathered, out, mesh.channel(axis), purpose, detail=detail)
            out = gathered
    return out


def broadcast_mesh(t: torch.Tensor, mesh: Any, src_rank: int, purpose: Purpose) -> None:
    """``t`` on every rank of the mesh becomes the ``t`` of mesh rank ``src_rank``.

    Axis by axis, outermost first: every group of the axis broadcasts from the source's
    index on it (only the groups through the source carry its values yet), so after the
    last axis every rank holds the source's ``t``. On a 2-D mesh: down the source's column
    (``replicate``), then along every row (``shard``).
    """
    coords, rest = [], src_rank
    for axis in reversed(mesh.axis_names):
        coords.append(rest % mesh.axis_size(axis))
        rest //= mesh.axis_size(axis)
    for axis, index in zip(mesh.axis_names, reversed(coords)):
        if mesh.axis_size(axis) > 1:
            broadcast(t, index, mesh.channel(axis), purpose)
