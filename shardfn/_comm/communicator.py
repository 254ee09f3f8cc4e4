"""One communicator per mode: how a collective is started, eagerly or in a recorded step.

[Note: one communicator per mode]
A step picks its communicator once, when its scope is made (shardfn._comm.guard.here):
:data:`EAGER`, which starts torch.distributed's collectives (gloo's reduce-scatter as
paired sends, [Note: reduce-scatter on gloo]), or :data:`RECORDED`, whose functional
collectives a recorded program holds ([Note: recording a step]). Both have the same three
methods, each returning what is waited for, so no collective asks which mode it is in:
shardfn._comm.collectives agrees on each call and accounts for it, then hands it to the
scope's communicator; the pipelined guard's play-out starts its collectives through
:data:`EAGER` too. A fake process group (explain) needs no communicator of its own: its
channels are off and its collectives do nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .._compat import all_gather_single, reduce_scatter_single

__all__ = ["EAGER", "RECORDED", "Eager", "Recorded"]

AVG, SUM, MAX, MIN = ReduceOp.AVG, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN


class Eager:
    """Collectives started as they run. Each returns its work handle (a reduce-scatter:
    ``(work, finish)``, where ``finish``, or None, completes ``out`` once ``work`` is done).
    Every eager collective shardfn issues starts here, the play-out included, so that all
    ranks issue the same transfers."""

    recorded = False

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, ch: Any) -> Any:
        return all_gather_single(out, inp, group=ch.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, ch: Any, op: ReduceOp) -> tuple[Any, Any]:
        group = ch.group
        if op in (SUM, AVG) and group.size() > 1 and inp.device.type == "cpu" and "gloo" in str(dist.get_backend(group)):
            return _reduce_scatter_gloo(out, inp, group, op)
        return reduce_scatter_single(out, inp, op=op, group=group, async_op=True), None

    def all_reduce(self, t: torch.Tensor, ch: Any, op: ReduceOp) -> Any:
        return dist.all_reduce(t, op=op, group=ch.group, async_op=True)

    # Outside a step only (never recorded): loading, checkpoints.

    def broadcast(self, t: torch.Tensor, ch: Any, group_src: int) -> Any:
        return dist.broadcast(t, group=ch.group, group_src=group_src, async_op=True)

    def scatter(self, out: torch.Tensor, inp: torch.Tensor | None, ch: Any, group_src: int) -> Any:
        rows = list(inp.unbind(0)) if inp is not None else None
        return dist.scatter(out, rows, group=ch.group, group_src=group_src, async_op=True)

    def barrier(self, ch: Any) -> Any:
        return dist.barrier(group=ch.group, async_op=True)


class Recorded:
    """Collectives in a recorded step: the functional ones, writing the buffer the eager
    ones write (an all-gather straight into ``out``: a copy of every gathered unit less)."""

    recorded = True

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, ch: Any) -> Any:
        return _Functional(out, _F.all_gather_into_tensor_out(inp.reshape(-1), ch.size, ch.group.group_name,
                                                              out=out.view(-1)))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, ch: Any, op: ReduceOp) -> tuple[Any, Any]:
        return _reduce_scatter_recorded(out, inp.reshape(-1), ch, op), None

    def all_reduce(self, t: torch.Tensor, ch: Any, op: ReduceOp) -> Any:
        return _Functional(t, _F.all_reduce(t, _OPS[op], ch.group.group_name))


EAGER, RECORDED = Eager(), Recorded()


def _reduce_scatter_gloo(out: torch.Tensor, inp: torch.Tensor, group: Any, op: ReduceOp) -> tuple[Any, Any]:
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


def _reduce_scatter_recorded(out: torch.Tensor, flat: torch.Tensor, ch: Any, op: ReduceOp) -> _Functional:
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
