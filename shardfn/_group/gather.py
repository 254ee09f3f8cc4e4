"""Gathering: one unit's full parameters, from its shards, while they are needed.

A :class:`Unit` is a unit of the layout in one runtime ([Note: the runtime]), shared by
every call of ``apply`` in a step: its shards, its gathered parameters, an all-gather in
flight, its gradients (shardfn._group.reduce.UnitGrads). Each application of :class:`GatherUnit`
is a :class:`Use`: the full parameters autograd sees for one forward.

[Note: copies]
What one step copies per unit on one rank, and why each copy remains: the layout decides
every copy, so tests/test_copies.py counts every copy op of a step (a TorchDispatchMode)
and asserts exactly these, derived from the layout. n = unit.numel (elements of a rank's
shard buffer), W = world, g = the unit's all-gathers per step (2 for a non-root unit under
FULL_SHARD, else 1), gn = unit.grad_numel; p, r, m = bytes per element of the param,
reduce and master dtypes. Bytes are bytes written.

gather, each of the g all-gathers (Unit._issue, Unit._gather):
  Placement.FLAT: none; the shard buffer is the all-gather's input and the parameters are
     views of its output ([Note: placements]); only a cast to the param dtype, n*p.
  Placement.ROWS: 1. pack, n*p: the shards, cast on the way, straight into this rank's row
     of the output (the all-gather runs in place): one collective takes one buffer.
     2. unpack, W*n*p: one split_with_sizes_copy assembles each leaf from its columns of
     the W rows, inherent to a flat all-gather of dim-0 shards (FSDP2 copies out the same way).
  NO_SHARD has no all-gather: a cast only when the param dtype differs (n*p in all).
reduce, once per unit and step (or micro-batch): copies 3 and 4, in shardfn._group.reduce.

A unit in a bucket ([Note: buckets]) adds a pack of its shards into the bucket's input
(n*p) and the copy of its columns out of the bucket's output (W*n*p). Not ours: gloo's
all-gather unflattens from an internal buffer; the model's own copies are those of a
plain functional_call. Why each copy remains, and what was removed: docs/how-it-works.md,
"Copies".

[Note: the life of a unit]
A unit is in one of three states, and its gathered parameters are dropped by one rule,
:meth:`Unit.settle`, asked after every event that can end a need for them, so that no
other place decides when gathered memory is freed::

                 prefetch                  wait
    SHARDED ----------------> IN_FLIGHT ----------> GATHERED
       ^  ^                       |                   |  ^
       |  +----- cancel ----------+                   |  | reuse (a later use, a
       |                                              |  | recompute, a saved handle)
       |       gather / regather (not prefetched)     |  |
       +-------------------------------------------->-+--+
       |                                              |
       +------------ release: settle() finds ---------+
                     nothing holding it, or the runtime ends (end)

What holds a GATHERED unit has a name, a :class:`Hold` (:meth:`Unit.held_by`); residency
(:class:`State`) and the phase are kept apart, as FSDP2 keeps them. The events settle()
hears, each Hold strategy by strategy, and prefetch: docs/how-it-works.md, "The life of a unit".
"""

from __future__ import annotations

import enum
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn

from .._comm.events import Purpose, ResidencyEvent, UnitEvent, emit, marker
from .._state.layout import Layout, UnitLayout
from .._state.offload import copy_stream, join_stream, to_device
from .._state.packing import kept_buffer, kept_views, leaf_holding, leaves_by_storage, pack_shards, storage_key, unpack_unit
from .._state.plan import RematMode
from .._comm.recording import relative_view
from .context import AfterForward, invariant
from .group import UnitGroup
from .reduce import UnitGrads

__all__ = ["GatherUnit", "Hold", "State", "Unit", "Use", "saved_handles"]


class State(enum.Enum):
    """Where a unit is in its life (see [Note: the life of a unit])."""

    SHARDED = "sharded"  # only this rank's shards
    IN_FLIGHT = "in flight"  # an all-gather started ahead of the unit's use (prefetch)
    GATHERED = "gathered"  # the full parameters, held


class Hold(enum.Enum):
    """Why a gathered unit is kept, asked in this order (:meth:`Unit.held_by`; see [Note: the
    life of a unit]): what ties its residency to the phase (forward, or backward running)."""

    PINNED = "pinned"  # an optional unit, or every unit with keep_gathered: until the runtime ends
    ENTERED = "entered"  # its module is running with the parameters in place
    IN_USE = "in use"  # a use's forward is in progress
    READ = "read"  # it reshards after forward: backward is reading one use's saved handles
    FORWARD = "forward"  # it is kept after forward: backward has not begun
    SAVED = "saved"  # kept after forward: backward has saved handles still to read
    RECOMPUTE = "recompute"  # kept after forward and rematerialised: a recompute is still to run


class Use:
    """One application of :class:`GatherUnit`: how many of its saved-tensor handles backward still
    holds. Handles reference their use, so it must not reference the parameters (:func:`saved_handles`)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = 0


class _Entry:
    """A module running with the unit's parameters in place: what to put back after."""

    __slots__ = ("originals", "hooks", "range")

    def __init__(self, originals: list[torch.Tensor], hooks: Any, range_: Any):
        self.originals, self.hooks, self.range = originals, hooks, range_


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Unit:
    """A unit's runtime state for one runtime (one step, or one call outside a step)."""

    __slots__ = (
        "layout", "unit", "leaves", "key", "shards", "slots", "mesh", "channel", "rank", "group", "grads", "replica",
        # where it is in its life (see [Note: the life of a unit])
        "state", "full", "storages", "own", "secondary", "use", "outputs", "entry", "handles", "reading",
        "calls", "pinned", "bucket",
    )

    def __init__(self, layout: Layout, unit: UnitLayout, key: tuple[int, int], shards: list[torch.Tensor], mesh: Any,
                 slots: list, group: UnitGroup, replica: list[torch.Tensor] | None = None,
                 bucket: Any = None, reduce_bucket: Any = None):
        self.layout = layout
        self.unit = unit
        self.leaves = [layout.leaves[n] for n in unit.leaves]  # their LeafLayouts, in unit order
        self.key = key  # (index of its tree in the runtime, unit index): the prefetch order's entries
        self.shards = shards
        self.slots: list[tuple[nn.Module, str, int]] = slots  # where each full tensor goes
        self.mesh = mesh
        self.channel = mesh.channel("shard")  # all-gathers and reduce-scatters
        self.rank = layout.shard_rank(mesh)  # this rank's row of an all-gather's output
        self.group = group  # its unit group, the owner of its reductions in flight ([Note: the unit group])
        self.grads = UnitGrads(self, reduce_bucket)
        self.replica = replica  # SHARD_OPTIMIZER: the tree's kept full parameters, if still those of the shards
        self.state = State.SHARDED
        self.full: list[torch.Tensor] | None = None  # GATHERED: the full parameters
        self.storages: dict[int, Any] = {}  # GATHERED: their storages (storage_key) -> where each leaf lies in it
        self.own = False  # GATHERED: the full parameters are views of the shards themselves ([Note: nothing to drop])
        self.secondary: torch.Tensor | None = None  # resharded to k ranks: this rank's 1/k (see _issue)
        self.use: Use | None = None  # the use in progress
        self.outputs: tuple[torch.Tensor, ...] | None = None  # that use's full parameters, while it runs
        self.entry: _Entry | None = None  # while the module runs
        self.handles = 0  # saved-tensor handles of all uses not yet read
        self.reading: Use | None = None  # the use whose handles backward is reading
        self.calls = 0  # forward gathers in this micro-batch (remat units prefetch a regather only if > 0)
        self.pinned = group.ctx.after_forward is AfterForward.KEEP
        self.bucket = bucket  # the shardfn._group.buckets.GatherBucket it gathers with, if any ([Note: buckets])
        for b in (bucket, reduce_bucket):
            if b is not None:
                b.join(self)

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def device(self) -> torch.device:
        """Where gathered parameters live (the shards may be in host memory: offload)."""
        return self.mesh.device

    @property
    def is_root(self) -> bool:
        return self.unit.path == ""

    @property
    def reshards(self) -> bool:
        """Whether the unit lets go of its gathered parameters after its forward."""
        if self.pinned:
            return False
        return self.group.ctx.after_forward is AfterForward.FREE or bool(self.unit.reshard)

    @property
    def entered(self) -> bool:
        return self.entry is not None

    def _note(self, event: UnitEvent) -> None:
        if not self.is_root:
            emit(ResidencyEvent(event, self.unit.name), self.group.ctx.observers)

    # -- the one rule of release ------------------------------------------------------------

    def held_by(self) -> Hold | None:
        """What still needs the gathered parameters, if anything (see [Note: the life of a unit])."""
        if self.pinned:
            return Hold.PINNED
        if self.entry is not None:
            return Hold.ENTERED
        if self.use is not None:
            return Hold.IN_USE
        if self.is_root:  # its parameters went to functional_call: the graph holds what backward needs
            return None
        if self.reshards:
            return Hold.READ if self.reading is not None else None
        if not _in_backward():
            return Hold.FORWARD
        if self.handles > 0:
            return Hold.SAVED
        return Hold.RECOMPUTE if self.unit.remat is not None and self.grads.nodes > 0 else None

    def settle(self) -> None:
        """Releases the gathered parameters unless something holds them; called after every
        event that can end a need for them."""
        if self.state is State.GATHERED and self.held_by() is None:
            self._release()

    def _release(self) -> None:
        self.state, self.full, self.storages, self.own = State.SHARDED, None, {}, False
        self._note(UnitEvent.FREE)

    def start_micro_batch(self) -> None:
        self.calls = 0

    def end(self) -> None:
        """The runtime ends: nothing in flight, nothing gathered, pinned or not."""
        self.cancel_prefetch()
        self.secondary = None
        if self.state is State.GATHERED:
            self._release()

    # -- gathering -----------------------------------------------------------------------

    def staging(self, purpose: Purpose) -> Any:
        """Where its all-gather's input is made: offloaded shards are copied to the device on
        the copy stream (counted in any case); else where the step runs."""
        regather = purpose is Purpose.REGATHER and self.secondary is not None
        return copy_stream(self.device) if self.layout.offloaded and not regather else nullcontext()

    def gather_buffers(self, purpose: Purpose) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The unit's all-gather: a ``[world, numel]`` output of ``param_dtype``, this rank's
        input (the shard buffer as it is, flat; else one pack of the shards into this rank's
        row: [Note: copies]) and the channel it runs on."""
        world, numel = self.layout.world, self.unit.numel
        out = torch.empty(world, numel, dtype=self.unit.param_dtype, device=self.device)
        if purpose is Purpose.REGATHER and self.secondary is not None:
            # Resharded to a sub-group after forward: gathered within it (ZeRO++'s hpZ).
            group, _ = self.mesh.subgroup(self.unit.subgroup)
            return out, self.secondary, group
        # offloaded shards live in host memory: copied to the device (counted) in any case
        flat = self.unit.flat and not self.layout.offloaded
        offsets = self.layout.offsets(self.unit, self.rank) if self.unit.flat else None
        mine = kept_buffer(self.shards, numel, self.unit.param_dtype, offsets) if flat else None
        if mine is None:  # ROWS, or shards that are not views of one buffer: one pack (see [Note: copies])
            mine = out[self.rank]
            pack_shards(mine, self.shards, self.layout.offloaded, self.group.ctx.observers, self.unit.name, offsets)
        return out, mine, self.channel

    def prefetchable(self, forward: bool) -> bool:
        """Whether the runtime may start this unit's all-gather early (see [Note: prefetch]).

        Forward: any unit but a selectively rematerialised one. Backward: a unit backward will
        gather again (holding saved handles, or fully rematerialised, run and resharded). A
        selectively rematerialised unit neither is prefetched nor prefetches from its region:
        selective checkpointing replays the region's ops one for one, and a gather prefetched
        in forward but not in the recompute (or the reverse) would break that replay.
        """
        if self.unit.remat is RematMode.SELECTIVE:
            return False
        if forward:
            return True
        if self.unit.remat is not None:
            return self.calls > 0 and bool(self.unit.reshard)
        return self.handles > 0

    def prefetch(self, forward: bool) -> None:
        """SHARDED -> IN_FLIGHT: its group starts this unit's all-gather (its bucket's) now;
        :meth:`_gather` has the group wait for it."""
        if self.layout.gathers and self.state is State.SHARDED and self.replica is None:
            self.group.prefetch(self, Purpose.GATHER if forward else Purpose.REGATHER)

    def took_flight(self) -> bool:
        """SHARDED -> IN_FLIGHT, its all-gather (its bucket's) started by its group; a member
        of a bucket gathered already keeps what it has (False)."""
        if self.state is not State.SHARDED:
            return False
        self.state = State.IN_FLIGHT
        self._note(UnitEvent.PREFETCH)
        return True

    def cancel_prefetch(self) -> None:
        """IN_FLIGHT -> SHARDED: its group waits for a prefetch that was never used (the order changed)."""
        if self.state is State.IN_FLIGHT:
            self.group.cancel(self)
            self.state = State.SHARDED

    def _prefetch_next(self, forward: bool) -> None:
        """Starts the all-gathers of the units that run after this one (see :meth:`prefetchable`;
        the root is gathered before every unit and is not in their order)."""
        if not self.is_root and self.unit.remat is not RematMode.SELECTIVE:
            self.group.ctx.prefetch_after(self.key, forward)

    def _gather(self, purpose: Purpose) -> list[torch.Tensor]:
        """SHARDED or IN_FLIGHT -> GATHERED: the full parameters of the unit (no autograd),
        from one all-gather of the flat shards."""
        if self.state is State.GATHERED:
            invariant(False, f"unit {self.unit.name!r} gathered twice")
        lay, world, storages, own, leaves = self.layout, self.layout.world, None, False, self.leaves
        with torch.no_grad() if torch.is_grad_enabled() else nullcontext():  # (GatherUnit's forward runs without)
            if self.replica is not None:  # [Note: replicated parameters]: gathered after the last update
                full = self.replica
            elif not lay.gathers and lay.offloaded:  # no all-gather: each leaf copied to the device
                full = [to_device(s.detach().view(leaf.shape), self.device, self.unit.param_dtype,
                                  self.group.ctx.observers, self.unit.name) for s, leaf in zip(self.shards, leaves)]
            elif not lay.gathers:  # NO_SHARD, or a world of one: the shard is the parameter
                # a flat unit whose shards are views of one buffer: one cast of it (if any), the parameters views of it
                found = kept_views(self.shards, (lay, self.unit), self.unit.numel, lay.offsets(self.unit, 0), leaves,
                                   self.unit.param_dtype, keep=not self.group.ctx.recorded) if self.unit.flat else None
                if found is not None:
                    full, storages = found
                    own = storages is not None  # (kept views of the shard buffer: no cast, no recording)
                else:
                    full = [s.detach().view(leaf.shape).to(self.unit.param_dtype)
                            for s, leaf in zip(self.shards, leaves)]
            else:
                if self.state is State.SHARDED and self.bucket is not None:
                    self.group.prefetch(self, purpose)  # the bucket's all-gather, waited for just below
                if self.state is State.IN_FLIGHT:
                    out = self.group.gathered(self)  # a bucket's member: its part ([Note: buckets])
                else:
                    out = self.group.gather(self, purpose)
                if self.layout.offloaded:
                    join_stream(out)
                k = self.unit.subgroup
                if purpose is Purpose.GATHER and k is not None and self.reshards:
                    # keep this rank's piece of the sub-group's share (one copy of world / k rows)
                    _, index = self.mesh.subgroup(k)
                    self.secondary = out.view(-1).chunk(k)[index].clone()
                full = unpack_unit(out, leaves, world)  # one copy: FSDP2's copy-out
        self.state, self.full, self.own = State.GATHERED, full, own
        self.storages = storages if storages is not None else leaves_by_storage(full)
        self._note(UnitEvent.GATHER if purpose is Purpose.GATHER else UnitEvent.REGATHER)
        return full

    def pin(self) -> None:
        """An optional unit (``Plan(optional=...)``): gathered now, when the runtime builds
        its units, and held until the runtime ends, so that every rank gathers it once at
        the same point whether its forward runs it or not."""
        self._gather(Purpose.GATHER)
        self.pinned = True

    # -- one forward of the unit's module ----------------------------------------------

    def start_use(self, purpose: Purpose) -> tuple[torch.Tensor, ...]:
        """Applies :class:`GatherUnit`: gathers (or reuses) the full parameters for a forward,
        then starts the next units' all-gathers.

        They become ``self.outputs`` of a new ``self.use`` until the use ends
        (:meth:`end_use`). A use that builds a graph node (grad enabled, a trainable shard,
        and not a remat recompute in backward, whose node backward never runs) is counted:
        the unit's gradients are reduced after the last counted use's backward
        (shardfn._group.reduce).
        """
        builds_graph = torch.is_grad_enabled() and any(s.requires_grad for s in self.shards)
        if builds_graph and not _in_backward():
            self.grads.count_node()
        self.use = Use()
        self.outputs = GatherUnit.apply(self, purpose, *self.shards)
        if purpose is Purpose.GATHER:
            self.calls += 1
        self._prefetch_next(forward=purpose is Purpose.GATHER)
        return self.outputs

    def end_use(self) -> None:
        """The current use's forward is over: only the graph (through handles) refers to it."""
        self.use = None
        self.outputs = None
        self.settle()

    def enter(self, handles: Any) -> None:
        """Places the current use's parameters into the module; ``handles``: the
        saved-tensor hooks to run the module under (None for none)."""
        outputs = self.outputs
        if outputs is None:
            invariant(False, f"unit {self.unit.name!r} entered without gathered parameters")
        range_ = marker(lambda: f"shardfn::forward[{self.unit.name}]")
        range_.__enter__()
        self.entry = _Entry([sub._parameters[attr] for sub, attr, _ in self.slots], handles, range_)
        for sub, attr, i in self.slots:
            sub._parameters[attr] = outputs[i]
        if handles is not None:
            handles.__enter__()

    def exit(self) -> None:
        """Restores the module. The use ends here unless the unit keeps its parameters
        after forward outside remat (then it ends with the sharded call)."""
        entry, self.entry = self.entry, None
        if entry is None:
            invariant(False, f"unit {self.unit.name!r} exited without entering")
        if entry.hooks is not None:
            entry.hooks.__exit__(None, None, None)
        for (sub, attr, _), t in zip(self.slots, entry.originals):
            sub._parameters[attr] = t
        entry.range.__exit__(None, None, None)
        if self.reshards or self.unit.remat is not None:
            self.end_use()
        else:
            self.settle()

    # -- saved handles, read in backward ----------------------------------------------------

    def read(self, handle: _Handle) -> torch.Tensor:
        """Backward reads a saved parameter: regathered (then the units before it prefetched)
        if the unit let go of it after forward."""
        if self.state is not State.GATHERED:
            self._gather(Purpose.REGATHER)
            self._prefetch_next(forward=False)
        # (the gathered parameters were made without autograd: no detach needed for a fresh view)
        full = self.full[handle.index]
        view = full if handle.kind == 1 else full.t() if handle.kind == 2 else full.as_strided(
            handle.size, handle.stride, full.storage_offset() + handle.offset)  # its place in the leaf
        self.handles -= 1
        handle.use.pending -= 1
        # the node that reads it holds the view until it is done
        self.reading = handle.use if handle.use.pending > 0 else (None if self.reading is handle.use else self.reading)
        self.settle()
        return view


class _Handle:
    """A saved tensor that lives in a gathered parameter's storage, packed without a
    reference to it (see [Note: how a sharded call works]), at its offset in its leaf."""

    __slots__ = ("unit", "use", "index", "size", "stride", "offset", "kind")

    def __init__(self, unit: Unit, index: int, t: torch.Tensor, kind: int = 0):
        self.unit, self.use, self.index = unit, unit.use, index  # (a regather may lay the leaves out anew)
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset() - unit.full[index].storage_offset()
        self.kind = kind  # how it is made again: 0 by its offsets; 1 the parameter; 2 its transpose


def saved_handles(units: list[Unit]) -> Any:
    """Saved-tensor hooks that pack the gathered parameters of ``units`` (one module's, several for several
    dtypes: [Note: mixed dtypes in a unit]) as :class:`_Handle`; everything else autograd saves passes through.
    None where every unit's parameters are the shards themselves ([Note: nothing to drop])."""

    # [Note: nothing to drop]
    # Where nothing is gathered and nothing cast (a world of one, a flat unit's kept views of
    # its shard buffer), the full parameters are the shards' own memory: dropping them frees
    # nothing, so saved tensors stay plain references to it (the same values backward reads)
    # and backward never gathers the unit again. A cast or a recorded step still packs handles.
    if all(unit.own for unit in units):
        return None

    def pack(t: torch.Tensor) -> Any:
        if t.is_sparse:
            return t
        storage = storage_key(t)  # (most are activations: one look-up for all units)
        for unit in units:
            index = leaf_holding(t, unit.full, unit.storages) if storage in unit.storages else None
            if index is not None:
                found = relative_view(t, unit.full) if unit.group.ctx.recorded else (index, 0)
                if found is None:
                    return t
                index, kind = found
                unit.handles += 1
                unit.use.pending += 1
                return _Handle(unit, index, t, kind)
        return t

    def unpack(packed: Any) -> torch.Tensor:
        return packed.unit.read(packed) if isinstance(packed, _Handle) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit. Backward: its gradients go to the unit's reduction."""

    @staticmethod
    def forward(ctx, unit: Unit, purpose: Purpose, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        full = unit.full if unit.state is State.GATHERED else unit._gather(purpose)
        # Fresh tensor objects on the same storage: autograd attaches this node to them,
        # and a second application (a recompute that reuses the kept parameters) must
        # not rewire the tensors of the first.
        return tuple([t.detach() for t in full])

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        unit: Unit = ctx.unit
        shard_grads = unit.group.backward(unit, grads)
        if unit.grads.nodes == 0:
            unit.secondary = None  # the unit's last backward: no regather to come
        unit.settle()
        return (None, None, *shard_grads)
