"""The runtime of a step: the one object that owns what lives while a step runs.

[Note: the runtime]
Each call of a step (or of ``jit_grad``'s function) builds one :class:`Runtime`; outside a
step, each call of ``apply`` on shards builds its own, and ``shardfn.bind`` one for its
block. It owns, for that step and no longer:

* the units of every sharded tree the step's forward runs (shardfn._group.gather), made on the
  first call of ``apply`` and shared by every later call in the step, so a unit that
  several calls use reduces once (shardfn._group.reduce);
* the reductions: the one in flight, and the reduced gradient shards the step collects;
* micro-batch accumulation (the step's ``StepOptions.accumulate``);
* the order in which units ran (the next step prefetches in it);
* the working copies of the buffers (shardfn._run.buffers);
* the step's collective log (``metrics["comm_bytes"]``) and the observers to report to.

The step in progress is found in the scope (:func:`current`; [Note: the scope] in
shardfn._comm.scope), by ``apply`` and by :func:`shardfn.optim.psum`, on the calling thread. Code that runs in backward
(reductions, regathers, saved-tensor hooks, recomputes) holds a reference to the runtime
instead, and takes from it all it would read from a context: the runtime's ``scope``
(where it runs, its pipelined run, whether it is recorded) and ``observers``, fixed when
the runtime is built ([Note: backward on device threads] in shardfn._comm.guard).

[Note: averaging gradients]
One rule, owned here: inside a step every gradient reduction *sums* over the ranks, and
the step multiplies each rank's loss by ``1 / (ranks x micro-batches)`` before backward
(:meth:`Runtime.loss_factor`), so gradients — and fp16 intermediates — have the
magnitudes of the global mean loss on one device. Outside a step (``apply`` under the
user's own autograd) a reduction averages and the loss is the user's own.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .._comm import collectives as C
from .._comm import guard as _guard
from .._comm.events import CollectiveLog, observe, observers
from .._comm.scope import here, within
from .._state.offload import wait_for_device
from .options import Accumulate, StepOptions
from .._parallel.agree import agree_on_optional

__all__ = ["Accumulate", "Runtime", "RunningUnit", "active", "current", "invariant"]


def invariant(ok: bool, message: str) -> None:
    """Raises ``AssertionError("[rank N] ...")`` when an internal invariant fails."""
    if not ok:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise AssertionError(f"[rank {rank}] shardfn internal error: {message}")


class RunningUnit(Protocol):
    """What the runtime and a unit's reduction (shardfn._group.reduce) use of a unit at run time,
    a shardfn._group.gather.Unit (see [Note: the life of a unit]). Named here, below both, so that
    neither imports the module of the unit, which imports them."""

    key: tuple[int, int]  # (index of its tree in the runtime, unit index)
    layout: Any  # the tree's shardfn._state.layout.Layout
    unit: Any  # its shardfn._state.layout.UnitLayout
    runtime: "Runtime"
    mesh: Any
    channel: Any  # the shardfn._comm.guard.Channel of its all-gathers and reduce-scatters
    rank: int  # this rank's row of an all-gather's output
    grads: Any  # its shardfn._group.reduce.UnitGrads

    @property
    def name(self) -> str: ...

    @property
    def device(self) -> torch.device: ...

    def prefetchable(self, forward: bool) -> bool: ...

    def prefetch(self, forward: bool) -> None: ...

    def cancel_prefetch(self) -> None: ...

    def start_micro_batch(self) -> None: ...

    def end(self) -> None: ...


class AfterForward(enum.Enum):
    """What a runtime does with a unit's gathered parameters after the unit's forward."""

    PLAN = "plan"  # what the layout resolved for the unit (UnitLayout.reshard)
    KEEP = "keep"  # keep every unit gathered until the runtime ends (keep_gathered=True; Unit.pinned)
    FREE = "free"  # let go after each forward, whatever the plan (bind: no backward follows)


# A runtime outside a step (apply on shards, bind): no overlap, no prefetch.
_OUTSIDE = StepOptions("apply", overlap=False, prefetch=0)


class Runtime:
    """What one step (or one call of ``apply`` outside a step) owns; see [Note: the runtime]."""

    def __init__(
        self,
        mesh: Any,
        options: StepOptions | None = None,
        *,
        order: list[tuple[int, int]] | None = None,
        owner: Any = None,
        buffers: Any = None,
        after_forward: AfterForward | None = None,
        run: Any = None,
        where: int | None = None,
    ):
        self.mesh = mesh
        self.in_step = options is not None  # a step's (or jit_grad's) runtime, with the step's options
        self.options = options if options is not None else _OUTSIDE  # [Note: step options]
        # what a unit does with its parameters after its forward
        self.after_forward = after_forward or (AfterForward.KEEP if self.options.keep_gathered else AfterForward.PLAN)
        self.order = list(order or [])  # (tree index, unit index) in the previous step's forward order
        self.seen: list[tuple[int, int]] = []  # ... and in this one
        self.last_micro_batch = True
        self.owner = owner  # the step's own sharded tree: its gradients are collected
        self.buffers = buffers  # shardfn._run.buffers.StepBuffers of the owner, in a step
        self.log = CollectiveLog()
        # A step reports to the observers active when it started, and to its own log.
        self.observers = (*observers(), self.log) if self.in_step else observers()
        # What its collectives' headers say, the step's pipelined run (shardfn._comm.pipelined) and
        # whether it is recorded: read here, on the calling thread, for backward to use.
        where = where if where is not None else _guard.Where.STEP if self.in_step else _guard.Where.APPLY
        self.scope = _guard.here()._replace(guarded=True, where=where, run=run)
        self._trees: list[tuple[Any, dict[int, RunningUnit]]] = []  # (sharded tree, its units by unit index)
        self._pending: list[tuple[Any, Any]] = []  # the reduction in flight: (work, buffers to keep alive)
        self.reduced: list[tuple[RunningUnit, Any]] = []  # (unit, reduced shard gradient), in order
        self.finished = 0  # ... of them, the first ones already in the master dtype (UnitGrads.to_master)
        self.owned: set[int] = set()  # storages of gradients handed out in a world of one

    @property
    def sharded(self) -> bool:
        """Whether ranks along the ``shard`` axis hold different shards of the step's tree."""
        return self.owner is not None and self.owner.layout.sharded

    # -- the rule of [Note: averaging gradients] ---------------------------------------

    @property
    def reduce_op(self) -> ReduceOp:
        return C.SUM if self.in_step else C.AVG

    def loss_factor(self, micro_batches: int) -> float:
        """What the step multiplies each micro-batch's loss by before backward."""
        return 1.0 / (self.mesh.data_size * micro_batches)  # (a tensor axis's ranks share one batch)

    def reduces_now(self) -> bool:
        """Whether the gradients accumulated so far are reduced in this backward."""
        return self.options.accumulate is Accumulate.REDUCE_EACH or self.last_micro_batch

    # -- units ---------------------------------------------------------------------------

    def units_of(self, tree: Any, build: Callable[[int], dict[int, RunningUnit]]) -> dict[int, RunningUnit]:
        """The units of ``tree`` in this runtime, built by ``build(tree index)`` on first use."""
        for t, units in self._trees:
            if t is tree:
                return units
        units = build(len(self._trees))
        self._trees.append((tree, units))
        return units

    def units(self) -> Iterator[RunningUnit]:
        for _, units in self._trees:
            yield from units.values()

    def _unit_at(self, key: tuple[int, int]) -> RunningUnit | None:
        i, index = key
        return self._trees[i][1].get(index) if i < len(self._trees) else None

    def prefetch_after(self, key: tuple[int, int], forward: bool) -> None:
        """[Note: prefetch] With ``jit_step(prefetch=d)`` (``True`` is 1), gathering a unit
        starts the all-gathers of the ``d`` units that run next: the next ones in the
        forward order recorded on the previous step, or, in backward, the previous ones
        that will be regathered. At most ``d`` units are in flight or waiting beside the
        running one, so FULL_SHARD holds at most ``d + 1`` units (tests/test_memory_plans.py
        asserts it); 0 gathers each unit only when it runs."""
        if not self.options.prefetch:
            return
        if forward:
            self.seen.append(key)
        order = self.order if forward else self.order[::-1]
        if key not in order:
            return
        i = order.index(key)
        for nxt in order[i + 1 : i + 1 + self.options.prefetch]:
            unit = self._unit_at(nxt)
            if unit is not None and unit.prefetchable(forward):
                unit.prefetch(forward)

    # -- reductions ----------------------------------------------------------------------

    def add_pending(self, work: Any, keepalive: Any, bucket: bool = False) -> None:
        """Tracks an asynchronous reduction, the only one in flight (a bucket's: one of several).

        Each pending reduction keeps its unit's unsharded gradient buffer alive, so the
        next unit's reduction waits for it before allocating its own buffer (see
        shardfn._group.reduce): holding them all until the end of backward would cost the whole
        model's unsharded gradients, and even two at once raise the peak of backward. A
        bucket's buffer is the gradients themselves (NO_SHARD: the reduced gradient is its
        part of the buffer), held to the update anyway: buckets do not wait for each other
        ([Note: buckets]).
        """
        invariant(bucket or not self._pending, "wait_pending() before starting another reduction")
        self._pending.append((work, keepalive))

    def wait_pending(self) -> None:
        while self._pending:
            work, _keepalive = self._pending.pop(0)
            work.wait()
        if self.owner is not None and self.owner.layout.offloaded:
            self._finish_reduced()  # each gradient to the host as soon as it is reduced ([Note: offload])

    def _finish_reduced(self) -> None:
        """Every reduction collected so far (all done) in the master dtype."""
        for i in range(self.finished, len(self.reduced)):
            unit, out = self.reduced[i]
            self.reduced[i] = (unit, unit.grads.to_master(out))
        self.finished = len(self.reduced)

    def start_micro_batch(self, last: bool) -> None:
        self.last_micro_batch = last
        for unit in self.units():
            unit.start_micro_batch()

    def end_backward(self, grads: dict[str, torch.Tensor]) -> None:
        """After a micro-batch's backward: every reduction done, the owner's gradients added
        into ``grads`` (leaf name -> shard gradient), in the order they were reduced.

        A unit whose graph node never ran backward (its output did not reach the loss)
        still reduces, with zero gradients, so every rank issues the same reductions.
        """
        self.wait_pending()
        for tree, units in self._trees:
            if tree is self.owner:
                if self.mesh.axis_size("tensor") > 1 and not self.scope.recording:
                    ran = [(u.unit.index, u.grads.acc is not None) for u in units.values() if u.unit.optional]
                    if ran:
                        agree_on_optional(ran, self.mesh)
                for unit in units.values():
                    unit.grads.flush(self.reduces_now())
                    self.wait_pending()
                for unit in units.values():  # a bucket some of whose units were not used ([Note: buckets])
                    bucket = unit.grads.bucket
                    if bucket is not None and bucket.ready and self.reduces_now():
                        bucket.issue()
                        self.wait_pending()
        self._finish_reduced()
        for unit, out in self.reduced:
            for name, g in unit.grads.shard_grads(out).items():
                grads[name] = g if name not in grads else grads[name].add_(g)
        self.reduced.clear()
        self.finished = 0
        if self.owner is not None and self.owner.layout.offloaded:
            wait_for_device(self.mesh.device)  # the gradients' copies to the host are done

    def settle(self) -> None:
        """Nothing in flight: no reduction, and no prefetched all-gather reading the shards."""
        self.wait_pending()
        for unit in self.units():
            unit.cancel_prefetch()

    def restart(self) -> None:
        """Back to the start of the step (a step that runs again, see shardfn._comm.pipelined)."""
        self.finish()
        self._trees.clear()
        self.reduced.clear()
        self.finished = 0
        self.seen.clear()

    def finish(self) -> list[tuple[int, int]]:
        """After the step: nothing in flight, nothing gathered; returns the order seen."""
        self.wait_pending()
        for unit in self.units():
            unit.end()
        return list(dict.fromkeys(self.seen)) if self.seen else self.order


def current() -> Runtime | None:
    """The runtime of the step in progress in this context, if any."""
    return here().runtime


@contextmanager
def active(rt: Runtime) -> Iterator[Runtime]:
    """Makes ``rt`` the step in progress for the block; an error in it reaches every rank
    (see [Note: the schedule guard])."""
    with within(runtime=rt, run=rt.scope.run), _guard.guarded(rt.mesh, rt.scope.where), observe(rt.log):
        yield rt

