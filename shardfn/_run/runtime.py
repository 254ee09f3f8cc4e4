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

The step in progress is found in the scope ([Note: the scope] in shardfn._comm.scope) by
the public calls made inside it, ``apply`` and :func:`shardfn.optim.psum`, on the calling
thread. Code that runs in backward
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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed import ReduceOp

from .._comm import collectives as C
from .._comm import guard as _guard
from .._comm.events import CollectiveLog, observe
from .._comm.scope import Scope, within
from .._compile import Compiling
from .._group.context import AfterForward, Context
from .._group.group import UnitGroup
from .._state.offload import wait_for_device
from .options import Accumulate, StepOptions

__all__ = ["Accumulate", "AfterForward", "Runtime", "active"]


# A runtime outside a step (apply on shards, bind): no overlap, no prefetch.
_OUTSIDE = StepOptions("apply", overlap=False, prefetch=0)


class Runtime:
    """What one step (or one call of ``apply`` outside a step) owns; see [Note: the runtime]."""

    def __init__(
        self,
        mesh: Any,
        outer: Scope,
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
        self._places: tuple[dict, dict] | None = None  # where each key is in ``order`` (prefetch_after)
        self.last_micro_batch = True
        self.owner = owner  # the step's own sharded tree: its gradients are collected
        self.buffers = buffers  # shardfn._run.buffers.StepBuffers of the owner, in a step
        self.log = CollectiveLog()
        # A step reports to the observers of the scope it starts in (``outer``, handed down
        # from where its public call began: [Note: the scope]), and to its own log.
        self.observers = (*outer.observers, self.log) if self.in_step else outer.observers
        # What its collectives' headers say, the step's pipelined run (shardfn._comm.pipelined) and
        # whether it is recorded: read here, on the calling thread, for backward to use.
        where = where if where is not None else _guard.Where.STEP if self.in_step else _guard.Where.APPLY
        self.scope = outer._replace(guarded=True, where=where, run=run, observers=self.observers)
        self._trees: list[tuple[Any, UnitGroup]] = []  # (sharded tree, its unit group)
        # What its unit groups are handed: one value, carried into backward ([Note: the unit group])
        self.ctx = Context(mesh, self.scope, self.scope.comm.recorded, self.observers, self.options, owner, self.reduce_op,
                           self.options.accumulate is Accumulate.REDUCE_EACH, self.after_forward, set(),
                           self.prefetch_after, Compiling(self.options.compile, self.scope.comm.recorded,
                                                          bool(owner is not None and owner.layout.tensor)))

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

    # -- units ---------------------------------------------------------------------------

    def group_of(self, tree: Any, build: Callable[[UnitGroup], None]) -> UnitGroup:
        """The unit group of ``tree`` in this runtime, its units built by ``build(group)`` on first use."""
        for t, group in self._trees:
            if t is tree:
                return group
        store = self.in_step and tree is self.owner
        group = UnitGroup(self.ctx, len(self._trees), store, store and tree.layout.offloaded)
        group.last_micro_batch = self.last_micro_batch
        self._trees.append((tree, group))
        build(group)
        return group

    def units(self) -> Iterator[Any]:
        for _, group in self._trees:
            yield from group.units.values()

    def _unit_at(self, key: tuple[int, int]) -> Any:
        i, index = key
        return self._trees[i][1].units.get(index) if i < len(self._trees) else None

    def prefetch_after(self, key: tuple[int, int], forward: bool) -> None:
        """[Note: prefetch] With ``jit_step(prefetch=d)`` (``True`` is 1), gathering a unit
        starts the all-gathers of the ``d`` units that run next: the next ones in the
        forward order recorded on the previous step, or, in backward, the previous ones
        that will be regathered. At most ``d`` units are in flight or waiting beside the
        running one, so FULL_SHARD holds at most ``d + 1`` units (tests/test_memory_plans.py
        asserts it); 0 gathers each unit only when it runs."""
        d = self.options.prefetch
        if not d:
            return
        if forward:
            self.seen.append(key)
        if not any(tree.layout.gathers for tree, _ in self._trees):  # (a unit that gathers nothing prefetches nothing)
            return
        if self._places is None:  # each key's first place in the order, and its last (backward's first)
            first: dict[tuple[int, int], int] = {}
            for i, k in enumerate(self.order):
                first.setdefault(k, i)
            self._places = (first, {k: i for i, k in enumerate(self.order)})
        i = self._places[0 if forward else 1].get(key)
        if i is None:
            return
        for nxt in self.order[i + 1 : i + 1 + d] if forward else self.order[max(0, i - d) : i][::-1]:
            unit = self._unit_at(nxt)
            if unit is not None and unit.prefetchable(forward):
                unit.prefetch(forward)

    # -- reductions: each group's own ([Note: the unit group]) -------------------------------

    def start_micro_batch(self, last: bool) -> None:
        self.last_micro_batch = last
        for _, group in self._trees:
            group.start_micro_batch(last)

    def end_backward(self, grads: dict[str, torch.Tensor]) -> None:
        """After a micro-batch's backward: every reduction done, the owner's gradients added
        into ``grads`` (leaf name -> shard gradient), in the order they were reduced."""
        for _, group in self._trees:
            if group.store:  # (the other trees reduced each use as it ran: nothing in flight)
                group.end_backward(grads)
        if self.owner is not None and self.owner.layout.offloaded:
            wait_for_device(self.mesh.device)  # the gradients' copies to the host are done

    def settle(self) -> None:
        """Nothing in flight: no reduction, and no prefetched all-gather reading the shards."""
        for _, group in self._trees:
            group.settle()

    def restart(self) -> None:
        """Back to the start of the step (a step that runs again, see shardfn._comm.pipelined)."""
        self.finish()
        self._trees.clear()
        self.seen.clear()

    def finish(self) -> list[tuple[int, int]]:
        """After the step: nothing in flight, nothing gathered; returns the order seen."""
        for _, group in self._trees:
            group.finish()
        return list(dict.fromkeys(self.seen)) if self.seen else self.order


@contextmanager
def active(rt: Runtime) -> Iterator[Runtime]:
    """Makes ``rt`` the step in progress for the block; an error in it reaches every rank
    (see [Note: the schedule guard])."""
    with within(runtime=rt, run=rt.scope.run, shards=(rt.mesh, rt.sharded, rt.owner.layout if rt.owner is not None else None), compiling=rt.ctx.compiling), \
            _guard.guarded(rt.mesh, rt.scope.where), \
            observe(rt.log):
        yield rt

