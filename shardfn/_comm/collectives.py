"""Every collective shardfn issues: agreed on, accounted for, then started by the scope's communicator.

Every all-gather, reduce-scatter, all-reduce, broadcast and scatter in shardfn goes
through the functions below, so that tests (and ``metrics``) can count each collective
and its bytes exactly, and so that the CUDA/NCCL and CPU/gloo paths share one code path.
How a data collective starts is the communicator's, one per mode, chosen once for a
step ([Note: one communicator per mode] in shardfn._comm.communicator).
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
from torch.distributed import ReduceOp

from . import guard as G
from .communicator import EAGER
from .events import Collective, CollectiveCall, Purpose, emit, label, marker
from .scope import Scope, here

__all__ = [
    "AVG", "MAX", "MIN", "SUM", "all_gather", "all_gather_mesh", "all_reduce", "all_reduce_mesh", "barrier",
    "barrier_mesh", "broadcast", "broadcast_mesh", "reduce_scatter", "scatter",
]

AVG, SUM, MAX, MIN = ReduceOp.AVG, ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN


def _scope(scope: Scope | None) -> Scope:
    """The caller's scope: the one it hands down, or, for a call that begins outside every
    step and region that hands one down (``shard``, a checkpoint, ``mesh.broadcast``), the
    calling thread's, read here once for the collective ([Note: the scope])."""
    return here() if scope is None else scope


def _record(kind: Collective, ch: G.Channel, t: torch.Tensor, purpose: Purpose, unit: str, to: Any,
            scope: Scope, detail: int = 0, op: ReduceOp | None = None) -> None:
    """Agrees on the collective with the other ranks (see [Note: the schedule guard]; in a
    step, [Note: the pipelined guard]), then reports it to ``to`` (None: the scope's observers)."""
    if scope.run is not None:
        scope.run.collective(ch, kind, purpose, unit, t, op, detail, scope)
    else:
        G.agree(ch, kind, purpose, unit, t.numel() * t.element_size(), detail, t.dtype, scope)
    to = scope.observers if to is None else to
    if to:
        call = CollectiveCall(kind, ch.ranks, t.numel() * t.element_size(), t.dtype,
                              purpose, unit)
        emit(call, to)


def _range(kind: Collective, purpose: Purpose, unit: str):
    return marker(lambda: f"shardfn::{kind.value}[{label(purpose, unit)}]")


def all_gather(out: torch.Tensor, inp: torch.Tensor, ch: G.Channel, purpose: Purpose, unit: str = "",
               async_op: bool = False, to: Any = None, detail: int = 0, scope: Scope | None = None) -> Any:
    """``out`` (``group size * inp.numel()`` elements) receives every rank's ``inp``, rank-major.

    ``to``: the observers to report to (default: the scope's; a step passes its own).
    ``detail``: a number every rank must agree on (a hash of the shape of ``inp``).
    ``scope``: the caller's shardfn._comm.scope.Scope (see :func:`_scope`); a runtime passes
    its own, which holds in backward too ([Note: backward on device threads]).
    """
    scope = _scope(scope)
    _record(Collective.ALL_GATHER, ch, out, purpose, unit, to, scope, detail)
    with _range(Collective.ALL_GATHER, purpose, unit):
        work = scope.comm.all_gather(out, inp, ch)
    return _done(work, ch, async_op, Collective.ALL_GATHER, purpose, unit)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, ch: G.Channel, purpose: Purpose, unit: str = "",
                   op: ReduceOp = AVG, async_op: bool = False, to: Any = None, detail: int = 0,
                   scope: Scope | None = None) -> Any:
    """``out`` receives this rank's chunk of the average (or ``op``) of ``inp`` over ``ch``'s group.

    With ``async_op`` it returns the work handle: ``out`` is valid after ``work.wait()``
    and ``inp`` must stay alive until then. ``detail``: a number every rank must agree on.
    ``scope``: as :func:`all_gather`'s.
    """
    scope = _scope(scope)
    _record(Collective.REDUCE_SCATTER, ch, inp, purpose, unit, to, scope, detail, op)
    with _range(Collective.REDUCE_SCATTER, purpose, unit):
        work, finish = scope.comm.reduce_scatter(out, inp, ch, op)
    if async_op:
        return G.Pending(work, ch, f"{Collective.REDUCE_SCATTER.value} ({G.label(purpose, unit)})", finish)
    _done(work, ch, False, Collective.REDUCE_SCATTER, purpose, unit)
    if finish is not None:
        finish()
    return None


def all_reduce(t: torch.Tensor, ch: G.Channel, purpose: Purpose, unit: str = "", op: ReduceOp = AVG,
               async_op: bool = False, to: Any = None, detail: int = 0, scope: Scope | None = None) -> Any:
    """In-place all-reduce of ``t`` over ``ch``'s group (``AVG``, ``SUM`` or ``MAX``).

    ``detail``: a number every rank must agree on, checked with the collective's header
    (the step's metrics all-reduce passes the batch's rows). ``scope``: as :func:`all_gather`'s."""
    scope = _scope(scope)
    _record(Collective.ALL_REDUCE, ch, t, purpose, unit, to, scope, detail, op)
    with _range(Collective.ALL_REDUCE, purpose, unit):
        work = scope.comm.all_reduce(t, ch, op)
    return _done(work, ch, async_op, Collective.ALL_REDUCE, purpose, unit)


def broadcast(t: torch.Tensor, group_src: int, ch: G.Channel, purpose: Purpose, unit: str = "",
              scope: Scope | None = None) -> None:
    """``t`` on every rank of ``ch`` becomes the ``t`` of its rank ``group_src``."""
    _record(Collective.BROADCAST, ch, t, purpose, unit, None, _scope(scope))
    with _range(Collective.BROADCAST, purpose, unit):
        work = EAGER.broadcast(t, ch, group_src)
    _done(work, ch, False, Collective.BROADCAST, purpose, unit)


def scatter(out: torch.Tensor, inp: torch.Tensor | None, group_src: int, ch: G.Channel, purpose: Purpose,
            unit: str = "", scope: Scope | None = None) -> None:
    """Rank ``r`` of ``ch`` receives row ``r`` of ``inp`` (``[group size, n]``, given on ``group_src``)."""
    _record(Collective.SCATTER, ch, out, purpose, unit, None, _scope(scope))
    with _range(Collective.SCATTER, purpose, unit):
        work = EAGER.scatter(out, inp, ch, group_src)
    _done(work, ch, False, Collective.SCATTER, purpose, unit)


def barrier(ch: G.Channel, detail: int = 0, scope: Scope | None = None) -> None:
    """Waits for every rank of ``ch`` (checkpoint publication; not counted as traffic).

    ``detail``: a number every rank must agree on (a checkpoint's digest)."""
    G.agree(ch, Collective.BARRIER, Purpose.CHECKPOINT, "", 0, detail, None, _scope(scope))
    with torch.profiler.record_function("shardfn::barrier[checkpoint]"):
        work = EAGER.barrier(ch)
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
                    detail: int = 0, scope: Scope | None = None) -> None:
    """In-place all-reduce of ``t`` over the whole mesh: one collective per axis of size > 1.

    ``SUM`` and ``MAX`` over every axis in turn are the sum and max over all ranks; so is
    ``AVG`` the average (every rank of an axis holds the same count of ranks below it).
    """
    scope = _scope(scope)
    for axis in mesh.axis_names:
        if mesh.axis_size(axis) > 1:
            all_reduce(t, mesh.channel(axis), purpose, op=op, to=to, detail=detail, scope=scope)


def barrier_mesh(mesh: Any, detail: int = 0, scope: Scope | None = None) -> None:
    """A barrier over every axis of the mesh (see :func:`barrier`), so that an error on one
    rank reaches the others through the same groups (see [Note: the schedule guard])."""
    scope = _scope(scope)
    for axis in mesh.axis_names:
        if mesh.axis_size(axis) > 1:
            barrier(mesh.channel(axis), detail, scope)


def all_gather_mesh(t: torch.Tensor, mesh: Any, purpose: Purpose, detail: int = 0,
                    scope: Scope | None = None) -> torch.Tensor:
    """Every rank's ``t`` (flat), in mesh-rank order: one all-gather per axis of size > 1.

    First over ``shard``, then over ``replicate`` of the whole gathered ``shard`` row, so
    every rank ends with every rank's values, row-major over ``(replicate, shard)``.
    """
    out, scope = t.reshape(-1), _scope(scope)
    for axis in reversed(mesh.axis_names):
        n = mesh.axis_size(axis)
        if n > 1:
            gathered = torch.empty(n * out.numel(), dtype=out.dtype, device=out.device)
            all_gather(gathered, out, mesh.channel(axis), purpose, detail=detail, scope=scope)
            out = gathered
    return out


def broadcast_mesh(t: torch.Tensor, mesh: Any, src_rank: int, purpose: Purpose, scope: Scope | None = None) -> None:
    """``t`` on every rank of the mesh becomes the ``t`` of mesh rank ``src_rank``.

    Axis by axis, outermost first: every group of the axis broadcasts from the source's
    index on it (only the groups through the source carry its values yet), so after the
    last axis every rank holds the source's ``t``. On a 2-D mesh: down the source's column
    (``replicate``), then along every row (``shard``).
    """
    coords, rest, scope = [], src_rank, _scope(scope)
    for axis in reversed(mesh.axis_names):
        coords.append(rest % mesh.axis_size(axis))
        rest //= mesh.axis_size(axis)
    for axis, index in zip(mesh.axis_names, reversed(coords)):
        if mesh.axis_size(axis) > 1:
            broadcast(t, index, mesh.channel(axis), purpose, scope=scope)
