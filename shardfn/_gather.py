"""Gathering: one unit's full parameters, from its shards, while they are needed.

A :class:`Unit` is a unit of the layout at run time, inside one runtime (a step, see
[Note: the runtime]): its shards, the full parameters while they are gathered, a
prefetched all-gather in flight, and its gradients (:class:`shardfn._reduce.UnitGrads`).
Every call of ``apply`` in a step uses the same :class:`Unit`. Each application of
:class:`GatherUnit` (one per call of the unit's module that builds a graph, one per call
otherwise) is a :class:`Use`: the full parameters autograd sees for that forward.

[Note: copies]
What one step copies per unit on one rank, and why each copy remains. n = unit.numel
(elements of a rank's shard buffer), W = world, g = the unit's all-gathers per step
(2 for a non-root unit under FULL_SHARD, else 1), gn = unit.grad_numel; p, r, m = bytes
per element of the param, reduce and master dtypes. Bytes are bytes written.
tests/test_copies.py counts every copy op of a step with a TorchDispatchMode and asserts
exactly these, derived from the layout.

gather, each of the g all-gathers (here: Unit._issue, Unit.all_gather):
  1. pack, 1 copy, n*p: the shards, cast to param dtype on the way, go straight into this
     rank's row of the all-gather output (torch.cat(out=)); the all-gather runs in place
     (NCCL and gloo take an input that is the rank's chunk of the output). Remains: the
     shards are separate tensors (one per parameter, owned by the optimizer) and one
     collective takes one buffer. Removed: the separate input buffer and, under mixed
     precision, a second copy (cat in the master dtype, then .to(param dtype)).
  2. unpack, 1 copy, W*n*p: one split_with_sizes_copy moves each leaf's columns into a
     [W, shard_numel] tensor of its own, whose first rows are the full parameter (a view;
     the padding rows, fewer than W per leaf, ride along). Inherent to a flat all-gather
     of dim-0 shards: a leaf's rows are spread over the W rows of the output, so its full
     tensor must be assembled (FSDP2 copies out the same way). Only a flat-parameter
     layout (FSDP1: shard the concatenation) avoids it, at the price of shards that are
     no longer per-parameter dim-0 chunks. Removed: one or two copy_ per leaf.
  NO_SHARD has no all-gather: the shard is the parameter, no copy; only when the param
  dtype differs, a cast (n*p in all), which is mixed precision itself: one per leaf for
  rows, one per unit for a flat unit (its shard buffer; the parameters are views of it).

reduce, once per unit and step (or micro-batch): see shardfn._reduce, copies 3 and 4.

Not ours: gloo's all-gather unflattens from an internal buffer; NCCL does not. (gloo's
reduce-scatter cloned its input and copied a chunk out; shardfn no longer uses it: see
[Note: reduce-scatter on gloo], which sums the received chunks straight into the output.) The model's own copies (in the test GPT, merging attention heads) are those of
a plain functional_call, which the test checks. The step copies a few scalars (metrics).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from . import _collectives as C
from ._events import Purpose, ResidencyEvent, UnitEvent, emit
from ._layout import Layout, UnitLayout
from ._packing import shard_buffer, unpack_unit
from ._offload import copy_stream, join_stream, pack_shards, to_device
from ._plan import RematMode
from ._reduce import UnitGrads
from ._runtime import invariant

__all__ = ["GatherUnit", "Unit", "Use"]


class Use:
    """One application of :class:`GatherUnit`: how many saved-tensor handles of the full
    parameters it produced backward still holds. Handles reference their use, so it must
    not reference the parameters: the graph would keep them alive (see _call.py)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = 0


class Unit:
    """A unit's runtime state for one runtime (one step, or one call outside a step)."""

    __slots__ = (
        "layout", "unit", "key", "shards", "group", "rank", "replicate_group", "slots", "runtime", "full", "storages",
        "inflight", "use", "outputs", "originals", "hooks", "range", "handles", "calls", "grads", "pinned", "device",
        "secondary", "mesh", "replica",
    )

    def __init__(self, layout: Layout, unit: UnitLayout, key: tuple[int, int], shards: list[torch.Tensor], mesh: Any,
                 slots: list, runtime: Any, store: bool):
        self.layout = layout
        self.unit = unit
        self.key = key  # (index of its tree in the runtime, unit index): the prefetch order's entries
        self.shards = shards
        self.group = mesh.group("shard")  # all-gathers and reduce-scatters
        self.rank = layout.shard_rank(mesh)  # this rank's row of an all-gather's output
        # Gradients are averaged over the other ranks holding the same shard: the
        # "replicate" axis of a 2-D mesh, or the whole 1-D mesh under NO_SHARD.
        self.replicate_group = mesh.group("replicate") if mesh.ndim == 2 else self.group
        self.slots: list[tuple[nn.Module, str, int]] = slots  # where each full tensor goes
        self.device = mesh.device  # where gathered parameters live (the shards may be in host memory: offload)
        self.mesh = mesh
        self.runtime = runtime
        self.full: list[torch.Tensor] | None = None  # gathered parameters, while live
        self.storages: dict[int, int] = {}  # id() of their storages -> leaf index (fake tensors have no data_ptr)
        self.inflight: Any = None  # a prefetched all-gather: (work, input, output); input is a row of output
        self.use: Use | None = None  # the use whose parameters the module holds (or reuses) in this call
        self.outputs: tuple[torch.Tensor, ...] | None = None  # that use's full parameters, while the call runs
        self.originals: list[torch.Tensor] | None = None  # the module's own tensors, while entered
        self.hooks: Any = None
        self.range: Any = None  # the profiler range of the unit's forward, while entered
        self.handles = 0  # saved-tensor handles of all uses not yet unpacked
        self.calls = 0  # forward gathers in this micro-batch (remat units prefetch a regather only if > 0)
        self.grads = UnitGrads(self, store)
        # gathered for the whole runtime: an optional unit (see pin), or every unit of a
        # step that keeps them gathered across its micro-batches (jit_step(keep_gathered=True))
        self.pinned = runtime.keep_gathered
        # this rank's 1/k of the gathered unit, kept from forward to backward when the unit
        # reshards to a sub-group of k ranks (UnitLayout.reshard = k; see _issue)
        self.secondary: torch.Tensor | None = None
        self.replica: list[torch.Tensor] | None = None  # SHARD_OPTIMIZER: the tree's kept full parameters

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def is_root(self) -> bool:
        return self.unit.path == ""

    @property
    def reshards(self) -> bool:
        """Whether the unit lets go of its gathered parameters after its forward."""
        if self.pinned:
            return False
        rule = self.runtime.reshard_after_forward
        return bool(self.unit.reshard) if rule is None else rule

    @property
    def entered(self) -> bool:
        return self.originals is not None

    def _note(self, event: UnitEvent) -> None:
        if not self.is_root:
            emit(ResidencyEvent(event, self.unit.name), self.runtime.observers)

    # -- gathering -----------------------------------------------------------------------

    def _issue(self, purpose: Purpose, async_op: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Starts the unit's all-gather: ``(work, input, output)``, output ``[world, numel]``.

        One copy (see [Note: copies]): the shards are written, cast to ``param_dtype``
        on the way (the collective moves param-dtype elements, see _precision), straight
        into this rank's row of the output, and the all-gather runs in place.
        """
        world, numel = self.layout.world, self.unit.numel
        if purpose is Purpose.REGATHER and self.secondary is not None:
            # Resharded to a sub-group after forward: gathered within it (ZeRO++'s hpZ).
            group, _ = self.mesh.subgroup(self.unit.subgroup)
            with torch.no_grad():
                out = torch.empty(world, numel, dtype=self.unit.param_dtype, device=self.device)
                work = C.all_gather(out.view(-1), self.secondary, group, purpose, self.unit.name, async_op=async_op,
                                    to=self.runtime.observers)
            return work, self.secondary, out
        with torch.no_grad(), copy_stream(self.device) if self.layout.offloaded else nullcontext():
            out = torch.empty(world, numel, dtype=self.unit.param_dtype, device=self.device)
            # offloaded shards live in host memory: copied to the device (counted) in any case
            flat = self.unit.flat and not self.layout.offloaded
            offsets = self.layout.offsets(self.unit, self.rank) if self.unit.flat else None
            mine = shard_buffer(self.shards, numel, self.unit.param_dtype, offsets) if flat else None
            if mine is None:  # ROWS, or shards that are not views of one buffer: one pack (see [Note: copies])
                mine = out[self.rank]
                pack_shards(mine, self.shards, self.layout.offloaded, self.runtime.observers, self.unit.name, offsets)
            work = C.all_gather(out.view(-1), mine, self.group, purpose, self.unit.name, async_op=async_op,
                                to=self.runtime.observers)
        return work, mine, out

    def prefetchable(self, forward: bool) -> bool:
        """Whether the runtime may start this unit's all-gather early (see [Note: prefetch]).

        Forward: any unit but a selectively rematerialised one. Backward: only a unit that
        backward will gather again: one holding saved-tensor handles, or a fully
        rematerialised unit that ran this forward and was resharded after it (its
        recompute gathers). Selectively rematerialised units are neither prefetched nor
        prefetch from inside their region: selective checkpointing replays the region's
        ops one for one, and a gather that was prefetched in forward (no copy in the
        region) but not in the recompute, or the reverse, would break that replay.
        """
        if self.unit.remat is RematMode.SELECTIVE:
            return False
        if forward:
            return True
        if self.unit.remat is not None:
            return self.calls > 0 and bool(self.unit.reshard)
        return self.handles > 0

    def prefetch(self, forward: bool) -> None:
        """Starts this unit's all-gather now; :meth:`all_gather` will wait for it."""
        if self.layout.world > 1 and self.full is None and self.inflight is None and self.replica is None:
            self.inflight = self._issue(Purpose.GATHER if forward else Purpose.REGATHER, async_op=True)
            self._note(UnitEvent.PREFETCH)

    def cancel_prefetch(self) -> None:
        """Waits for a prefetch that was never used (the order changed); drops it."""
        if self.inflight is not None:
            self.inflight[0].wait()
            self.inflight = None

    def all_gather(self, purpose: Purpose) -> list[torch.Tensor]:
        """Full parameters of the unit (no autograd); one all-gather of the flat shards."""
        lay, world = self.layout, self.layout.world
        leaves = [lay.leaves[n] for n in self.unit.leaves]
        with torch.no_grad():
            if self.replica is not None:  # [Note: replicated parameters]: gathered after the last update
                full = self.replica
            elif world == 1 and self.layout.offloaded:  # no all-gather: each leaf copied to the device
                full = [to_device(s.detach().view(leaf.shape), self.device, self.unit.param_dtype,
                                  self.runtime.observers, self.unit.name) for s, leaf in zip(self.shards, leaves)]
            elif world == 1:  # NO_SHARD, or a world of one: the shard is the parameter
                base = shard_buffer(self.shards, self.unit.numel, self.shards[0].dtype,
                                    self.layout.offsets(self.unit, 0)) if self.unit.flat and self.shards else None
                if base is not None:  # a flat unit: one cast of its buffer (if any), the parameters views of it
                    full = unpack_unit(base.detach().to(self.unit.param_dtype).view(1, -1), leaves, 1)
                else:
                    full = [s.detach().view(leaf.shape).to(self.unit.param_dtype)
                            for s, leaf in zip(self.shards, leaves)]
            else:
                if self.inflight is not None:
                    work, _, out = self.inflight
                    work.wait()
                    self.inflight = None
                else:
                    _, _, out = self._issue(purpose, async_op=False)
                if self.layout.offloaded:
                    join_stream(out)
                k = self.unit.subgroup
                if purpose is Purpose.GATHER and k is not None and self.reshards:
                    # keep this rank's piece of the sub-group's share (one copy of world / k rows)
                    _, index = self.mesh.subgroup(k)
                    self.secondary = out.view(-1).chunk(k)[index].clone()
                full = unpack_unit(out, leaves, world)  # one copy: FSDP2's copy-out
        self.full = full
        self.storages = {id(t.untyped_storage()): i for i, t in enumerate(full)}
        self._note(UnitEvent.GATHER if purpose is Purpose.GATHER else UnitEvent.REGATHER)
        return full

    def pin(self) -> None:
        """An optional unit (``Plan(optional=...)``): gathered now, when the runtime builds
        its units, and kept until the runtime ends, so that every rank gathers it once at
        the same point whether its forward runs it or not."""
        self.all_gather(Purpose.GATHER)
        self.pinned = True

    def release(self, force: bool = False) -> None:
        """Drops this unit's reference to its gathered parameters (freed once unreferenced);
        a pinned unit keeps them until the runtime ends (``force``)."""
        if force:
            self.secondary = None
        if self.pinned and not force:
            return
        if self.full is not None:
            self.full = None
            self.storages = {}
            self._note(UnitEvent.FREE)

    def release_if_unused(self) -> None:
        """Releases the gathered parameters when nothing will read them again: no module
        call is running, no saved handle is left and no graph node awaits its backward."""
        if not self.entered and self.handles == 0 and self.grads.nodes == 0 and not self.pinned:
            self.release()

    # -- one forward of the unit's module ----------------------------------------------

    def start_use(self, purpose: Purpose) -> tuple[torch.Tensor, ...]:
        """Applies :class:`GatherUnit`: gathers (or reuses) the full parameters for a forward.

        They become ``self.outputs`` of a new ``self.use`` until the use ends
        (:meth:`end_use`). A use that builds a graph node (grad enabled, a trainable shard,
        and not a remat recompute in backward, whose node backward never runs) is counted:
        the unit's gradients are reduced after the last counted use's backward
        (shardfn._reduce).
        """
        builds_graph = torch.is_grad_enabled() and any(s.requires_grad for s in self.shards)
        if builds_graph and torch._C._current_graph_task_id() == -1:
            self.grads.count_node()
        self.use = Use()
        self.outputs = GatherUnit.apply(self, purpose, *self.shards)
        if purpose is Purpose.GATHER:
            self.calls += 1
        return self.outputs

    def end_use(self) -> None:
        """The current use's forward is over: only the graph (through handles) refers to it."""
        self.use = None
        self.outputs = None

    def enter(self, handles: Any) -> None:
        """Places the current use's parameters into the module; ``handles``: the
        saved-tensor hooks to run the module under (None for none)."""
        outputs = self.outputs
        invariant(outputs is not None, f"unit {self.unit.name!r} entered without gathered parameters")
        self.range = torch.profiler.record_function(f"shardfn::forward[{self.unit.name}]")
        self.range.__enter__()
        self.originals = [sub._parameters[attr] for sub, attr, _ in self.slots]
        for sub, attr, i in self.slots:
            sub._parameters[attr] = outputs[i]
        if handles is not None:
            self.hooks = handles
            self.hooks.__enter__()

    def exit(self) -> None:
        """Restores the module; under FULL_SHARD, lets go of the gathered parameters."""
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None
        for (sub, attr, _), t in zip(self.slots, self.originals or []):
            sub._parameters[attr] = t
        self.originals = None
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.reshards:
            self.end_use()
            self.release()


class GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit. Backward: its gradients go to the unit's reduction."""

    @staticmethod
    def forward(ctx, unit: Unit, purpose: Purpose, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        full = unit.full if unit.full is not None else unit.all_gather(purpose)
        # Fresh tensor objects on the same storage: autograd attaches this node to them,
        # and a second application (a recompute that reuses the kept parameters) must
        # not rewire the tensors of the first.
        return tuple(t.detach() for t in full)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        unit: Unit = ctx.unit
        shard_grads = unit.grads.backward(grads)
        if unit.grads.nodes == 0:
            unit.secondary = None  # the unit's last backward: no regather to come
        unit.release_if_unused()
        return (None, None, *shard_grads)
