"""The gather-on-enter / reshard-on-exit / regather-in-backward machinery.

[Note: how a sharded call works]
``apply(sharded, *args)`` runs ``functional_call`` on the meta-parameter module tree
that ``functionalize`` kept. The root unit (parameters outside every unit) is gathered
up front and passed in the parameter dict. Every other unit's module carries a forward
pre-hook and a forward hook (registered once, inert outside a sharded call):

* pre-hook: ``_GatherUnit.apply(*shards)`` all-gathers the unit's flat shard buffer and
  returns the full parameters, which are placed in the module for the duration of its
  forward. ``_GatherUnit``'s backward is the unit's reduce-scatter (all-reduce under
  NO_SHARD): it runs exactly once, when autograd has accumulated the gradient of every
  full parameter of the unit, and returns gradients shaped like the shards.
* while the unit runs, a ``saved_tensors_hooks`` pair is active. Any tensor autograd
  saves that lives in a gathered parameter's storage (the weight itself, ``weight.t()``,
  ...) is packed as a small handle (unit, leaf, size, stride, offset) instead of a
  reference; other saved tensors (activations) pass through untouched.
* forward hook: the module gets its meta parameters back. Under FULL_SHARD the unit
  drops its gathered tensors: with no references left in the graph their memory is
  freed at once. Under SHARD_GRAD_OP the unit keeps them until its backward.
* in backward, the first unpack of a handle gathers the unit again (a plain all-gather,
  no recompute of the forward) and rebuilds the view; the last unpack drops the unit's
  reference (the consuming node holds the view until it is done), and
  ``_GatherUnit.backward`` reduce-scatters the gradients (asynchronously inside a step,
  see [Note: overlapped reductions]).

So FULL_SHARD holds at most the running unit's parameters (plus the root's) in forward
and in backward, gathering each non-root unit twice per step, with no recompute.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint
from torch.func import functional_call

from . import _buffers
from . import _collectives as C
from . import _psum
from ._layout import Layout, UnitLayout, pack_unit, unpack_unit
from ._precision import cast_floating

__all__ = ["Residency", "accumulate_locally", "sharded_call", "track_residency"]


# -- residency accounting ----------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Residency:
    """Which non-root units held gathered parameters, event by event (this process)."""

    live: set[str] = dataclasses.field(default_factory=set)
    max_live: int = 0
    events: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (event, unit)

    def note(self, event: str, unit: str) -> None:
        if event in ("gather", "regather", "prefetch"):
            self.live.add(unit)
        else:
            self.live.discard(unit)
        self.max_live = max(self.max_live, len(self.live))
        self.events.append((event, unit))


_TRACKERS: list[Residency] = []


@contextlib.contextmanager
def track_residency() -> Iterator[Residency]:
    """Records gathers and frees of non-root units inside the block.

    Example:
        >>> with track_residency() as r:
        ...     step(sharded, opt_state, batch)
        >>> r.max_live      # 1 under FULL_SHARD: one unit gathered at a time
    """
    r = Residency()
    _TRACKERS.append(r)
    try:
        yield r
    finally:
        _TRACKERS.remove(r)


# -- one unit within one call ------------------------------------------------------------

# [Note: copies]
# What one step copies per unit on one rank, and why each copy remains. n = unit.numel
# (elements of a rank's shard buffer), W = world, g = the unit's all-gathers per step
# (2 for a non-root unit under FULL_SHARD, else 1), gn = unit.grad_numel; p, r, m = bytes
# per element of the param, reduce and master dtypes. Bytes are bytes written.
# tests/test_copies.py counts every copy op of a step with a TorchDispatchMode and asserts
# exactly these, derived from the layout.
#
# gather, each of the g all-gathers (_issue, all_gather):
#   1. pack, 1 copy, n*p: the shards, cast to param dtype on the way, go straight into this
#      rank's row of the all-gather output (torch.cat(out=)); the all-gather runs in place
#      (NCCL and gloo take an input that is the rank's chunk of the output). Remains: the
#      shards are separate tensors (one per parameter, owned by the optimizer) and one
#      collective takes one buffer. Removed: the separate input buffer and, under mixed
#      precision, a second copy (cat in the master dtype, then .to(param dtype)).
#   2. unpack, 1 copy, W*n*p: one split_with_sizes_copy moves each leaf's columns into a
#      [W, shard_numel] tensor of its own, whose first rows are the full parameter (a view;
#      the padding rows, fewer than W per leaf, ride along). Inherent to a flat all-gather
#      of dim-0 shards: a leaf's rows are spread over the W rows of the output, so its full
#      tensor must be assembled (FSDP2 copies out the same way). Only a flat-parameter
#      layout (FSDP1: shard the concatenation) avoids it, at the price of shards that are
#      no longer per-parameter dim-0 chunks. Removed: one or two copy_ per leaf.
#   NO_SHARD has no all-gather: the shard is the parameter, no copy; only when the param
#   dtype differs, one cast per leaf (n*p in all), which is mixed precision itself.
#
# reduce, once per step (_reduce; trainable leaves only):
#   3. pack, 1 copy, W*gn*r: one _chunk_cat writes every gradient into its columns of every
#      rank's row, cast to the reduce dtype on the way, padding rows zeroed. Remains:
#      autograd hands back one tensor per parameter and the collective takes one buffer
#      (FSDP2: the same copy-in). Removed: one or two copy_ and a zero fill per leaf, plus
#      the hidden copy reshape made of a non-contiguous gradient.
#   4. cast back, only if the reduce dtype is not the master dtype: 1 copy, gn*m (autograd
#      wants a leaf's gradient in the leaf's dtype). None for Precision(param=bf16,
#      reduce=fp32) or in fp32.
#   A world of one without replicas reduces nothing and packs nothing (_Unit._own):
#   autograd's gradients become the shards' gradients as they are; only the casts of 4.
#   (to the reduce dtype, back to the master dtype, leaf by leaf) remain, and a clone of
#   a gradient that is non-contiguous or shares memory with another one.
#   The reduce-scatter writes a fresh shard-sized output, not a view of its input: the
#   optimizer's gradients are views of it, and a view would keep the W-times larger input
#   alive until the update.
#
# Not ours: gloo's reduce_scatter_tensor clones its input, all-reduces the clone and copies
# this rank's chunk into the output (that last copy, gn*r, shows up at wait(); the test
# counts it apart), and its all-gather unflattens from an internal buffer; NCCL does
# neither. The model's own copies (in the test GPT, merging attention heads) are those of
# a plain functional_call, which the test checks. The step copies a few scalars (metrics).


class _Unit:
    """A unit's runtime state during one sharded call (and its backward)."""

    __slots__ = (
        "layout", "unit", "shards", "group", "replicate_group", "slots", "full", "storages", "outputs", "originals",
        "hooks", "pending", "range", "calls", "inflight", "rank",
    )

    def __init__(self, layout: Layout, unit: UnitLayout, shards: list[torch.Tensor], mesh: Any, slots: list):
        self.layout = layout
        self.unit = unit
        self.shards = shards
        self.group = mesh.group("shard")  # all-gathers and reduce-scatters
        self.rank = mesh.axis_rank("shard")  # this rank's row of an all-gather's output
        # Gradients are averaged over the other ranks holding the same shard: the
        # "replicate" axis of a 2-D mesh, or the whole 1-D mesh under NO_SHARD.
        self.replicate_group = mesh.group("replicate") if mesh.ndim == 2 else self.group
        self.slots: list[tuple[nn.Module, str, int]] = slots  # where each full tensor goes
        self.full: list[torch.Tensor] | None = None  # gathered parameters, while live
        self.storages: dict[int, int] = {}  # id() of their storages -> leaf index (fake tensors have no data_ptr)
        self.outputs: tuple[torch.Tensor, ...] | None = None  # _GatherUnit's outputs, during forward
        self.originals: list[torch.Tensor] | None = None  # the module's own tensors, while entered
        self.hooks: Any = None
        self.pending = 0  # handles packed and not yet unpacked
        self.range: Any = None  # the profiler range of the unit's forward, while entered
        self.calls = 0  # forward gathers in this call (more than one: the unit runs twice)
        self.inflight: Any = None  # a prefetched all-gather: (work, input, output); input is a row of output

    @property
    def entered(self) -> bool:
        return self.originals is not None

    def enter(self) -> None:
        """Places the gathered parameters into the module; packs saved ones as handles.

        A rematerialised unit's saved tensors belong to its checkpoint (which keeps none
        and recomputes, gather included), so it gets no handles of ours.
        """
        assert self.outputs is not None
        self.range = torch.profiler.record_function(f"shardfn::forward[{self.unit.name}]")
        self.range.__enter__()
        self.originals = [sub._parameters[attr] for sub, attr, _ in self.slots]
        for sub, attr, i in self.slots:
            sub._parameters[attr] = self.outputs[i]
        if self.layout.strategy.sharded and not self.unit.remat:
            self.hooks = _saved_tensor_hooks(self)
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
        if self.layout.strategy.reshard_after_forward:
            self.outputs = None
            self.release("free")

    @property
    def is_root(self) -> bool:
        return self.unit.path == ""

    def _note(self, event: str) -> None:
        if not self.is_root:
            for r in _TRACKERS:
                r.note(event, self.unit.name)

    def _issue(self, event: str, async_op: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Starts the unit's all-gather: ``(work, input, output)``, output ``[world, numel]``.

        One copy (see [Note: copies]): the shards are written, cast to ``param_dtype``
        on the way (the collective moves param-dtype elements, see _precision), straight
        into this rank's row of the output, and the all-gather runs in place.
        """
        world, numel = self.layout.world, self.unit.numel
        with torch.no_grad():
            out = torch.empty(world, numel, dtype=self.unit.param_dtype, device=self.shards[0].device)
            mine = out[self.rank]
            torch.cat([s.detach().reshape(-1) for s in self.shards], out=mine)
            work = C.all_gather(out.view(-1), mine, self.group, tag=f"{event}:{self.unit.name}", async_op=async_op)
        return work, mine, out

    def prefetch(self, event: str) -> None:
        """Starts this unit's all-gather now; :meth:`all_gather` will wait for it."""
        if self.layout.world > 1 and self.full is None and self.inflight is None:
            self.inflight = self._issue(event, async_op=True)
            self._note("prefetch")

    def all_gather(self, event: str) -> list[torch.Tensor]:
        """Full parameters of the unit (no autograd); one all-gather of the flat shards."""
        lay, world = self.layout, self.layout.world
        leaves = [lay.leaves[n] for n in self.unit.leaves]
        with torch.no_grad():
            if world == 1:  # NO_SHARD, or a world of one: the shard is the parameter
                full = [s.detach().view(leaf.shape).to(self.unit.param_dtype) for s, leaf in zip(self.shards, leaves)]
            else:
                if self.inflight is not None:
                    work, _, out = self.inflight
                    work.wait()
                    self.inflight = None
                else:
                    _, _, out = self._issue(event, async_op=False)
                full = unpack_unit(out, leaves, world)  # one copy: FSDP2's copy-out
        self.full = full
        self.storages = {id(t.untyped_storage()): i for i, t in enumerate(full)}
        self._note(event)
        return full

    def release(self, event: str) -> None:
        if self.full is not None:
            self.full = None
            self.storages = {}
            self._note(event)

    def reduce(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        with torch.profiler.record_function(f"shardfn::backward_reduce[{self.unit.name}]"):
            return self._reduce(grads)

    def _reduce(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        """Gradients of the full parameters -> averaged gradients of this rank's shards.

        Only trainable leaves enter the buffer. Inside :func:`accumulate_locally` the
        packed buffer is added to a local accumulator instead, and reduced only on the
        last micro-batch (one reduce-scatter per unit per step).
        """
        lay, unit = self.layout, self.unit
        leaves = [lay.leaves[n] for n in unit.leaves]
        world, tag = lay.world, f"reduce:{unit.name}"
        device = self.shards[0].device
        step = _psum.current()
        if step is not None:  # the previous unit's reduction: done, and its buffer freed, before this one's exists
            step.wait_pending()
        if world == 1 and lay.replicas == 1 and not _ACCUMULATORS:
            return self._own(grads, leaves, step)
        buf = torch.empty(world, unit.grad_numel, dtype=unit.reduce_dtype, device=device)
        # One copy (see [Note: copies]): each gradient straight into its columns of every
        # rank's row, cast to the reduce dtype on the way, padding rows zeroed.
        pack_unit(buf, [
            g if g is not None else torch.zeros(leaf.shape, dtype=unit.param_dtype, device=device)
            for g, leaf in zip(grads, leaves)
            if leaf.grad_offset >= 0
        ], world)
        acc = _ACCUMULATORS[-1] if _ACCUMULATORS else None
        if acc is not None:
            previous = acc.buffers.pop(unit.path, None)
            if previous is not None:
                buf = previous.add_(buf)
            if not acc.last:
                acc.buffers[unit.path] = buf
                return [None] * len(leaves)
        op = "sum" if step is not None and step.predivided else "avg"
        # [Note: overlapped reductions] Inside a step, a unit's single reduction is issued
        # asynchronously, so it runs while autograd computes the next unit; the next
        # unit's reduction (or the step, after the backward) waits for it, so at most one
        # unsharded gradient buffer is in flight. Only when nothing reads the gradient
        # before then: one collective (not hybrid's two in a row), no cast back to the master
        # dtype, and a unit gathered once (a second use would add into the gradient).
        asynchronous = (
            step is not None and step.overlap and self.calls == 1 and unit.reduce_dtype == unit.dtype
            and (world == 1) != (lay.replicas == 1)
        )
        work = None
        if world == 1:
            out = buf.view(-1)
        else:
            out = torch.empty(unit.grad_numel, dtype=unit.reduce_dtype, device=device)
            work = C.reduce_scatter(out, buf.view(-1), self.group, tag=tag, op=op, async_op=asynchronous)
        if lay.replicas > 1:  # NO_SHARD, and the hybrid strategies' replicate axis
            work = C.all_reduce(out, self.replicate_group, tag=tag, op=op, async_op=asynchronous)
        if asynchronous and work is not None:
            step.add_pending(work, (buf, out))
        out = out.to(unit.dtype)  # the master dtype, whatever the reduce dtype was
        return [
            out[leaf.grad_offset : leaf.grad_offset + leaf.shard_numel].view(leaf.shard_shape)
            if leaf.grad_offset >= 0
            else None
            for leaf in leaves
        ]

    def _own(self, grads: tuple[torch.Tensor | None, ...], leaves: list, step: Any) -> list[torch.Tensor | None]:
        """A world of one, nothing to reduce: autograd's gradients are the shards' own.

        No buffer and no copy (see [Note: copies]) unless one is needed: the casts to the
        reduce dtype and back to the master dtype, a non-contiguous gradient, or one whose
        memory another gradient of the step shares (autograd may hand the same tensor to
        two parameters, ``x + a + b``; the step adds micro-batch gradients into the first
        and the in-place optimizer uses them as scratch, so each must own its memory).
        """
        unit, device = self.unit, self.shards[0].device
        owned = step.owned if step is not None else set()
        out: list[torch.Tensor | None] = []
        for g, leaf in zip(grads, leaves):
            if leaf.grad_offset < 0:
                out.append(None)
                continue
            if g is None:
                out.append(torch.zeros(leaf.shard_shape, dtype=unit.dtype, device=device))
                continue
            g = g.detach().to(unit.reduce_dtype).to(unit.dtype)
            if not g.is_contiguous() or id(g.untyped_storage()) in owned:
                g = g.clone(memory_format=torch.contiguous_format)
            owned.add(id(g.untyped_storage()))
            out.append(g.view(leaf.shard_shape))
        return out


class _Accumulator:
    """Unit gradient buffers kept across micro-batches (see :func:`accumulate_locally`)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.last = False


_ACCUMULATORS: list[_Accumulator] = []


@contextlib.contextmanager
def accumulate_locally() -> Iterator[_Accumulator]:
    """Backward passes inside the block add unit gradients to local buffers, unreduced.

    Set ``acc.last = True`` before the last backward: that one reduces the sums (one
    reduce-scatter per unit). Costs a full unsharded gradient buffer per unit meanwhile.
    """
    acc = _Accumulator()
    _ACCUMULATORS.append(acc)
    try:
        yield acc
    finally:
        _ACCUMULATORS.remove(acc)


class _GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit. Backward: reduce-scatter its gradients."""

    @staticmethod
    def forward(ctx, unit: _Unit, event: str, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.unit = unit
        full = unit.full if unit.full is not None else unit.all_gather(event)
        # Fresh tensor objects on the same storage: autograd attaches this node to them,
        # and a second application (a recompute that reuses the kept parameters) must
        # not rewire the tensors of the first.
        return tuple(t.detach() for t in full)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        unit: _Unit = ctx.unit
        shard_grads = unit.reduce(grads)
        unit.release("free")
        return (None, None, *shard_grads)


# -- saved tensors: handles instead of references (FULL_SHARD) ----------------------------


class _Handle:
    __slots__ = ("unit", "index", "size", "stride", "offset")

    def __init__(self, unit: _Unit, index: int, t: torch.Tensor):
        self.unit, self.index = unit, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


def _saved_tensor_hooks(unit: _Unit):
    def pack(t: torch.Tensor) -> Any:
        if unit.storages and not t.is_sparse:
            index = unit.storages.get(id(t.untyped_storage()))
            if index is not None and unit.full is not None and t.dtype == unit.full[index].dtype:
                unit.pending += 1
                return _Handle(unit, index, t)
        return t

    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        u = packed.unit
        if u.full is None:
            full = u.all_gather("regather")
            _prefetch_after(u.unit.path, forward=False)
        else:
            full = u.full
        view = full[packed.index].detach().as_strided(packed.size, packed.stride, packed.offset)
        u.pending -= 1
        if u.pending == 0 and not u.entered:
            # The last saved use of the unit's parameters is being handed out: drop our
            # reference now (the node holds the view until it is done). This also frees
            # units whose parameters are all frozen, whose _GatherUnit has no backward.
            u.release("free")
        return view

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# -- the call ------------------------------------------------------------------------------

_ACTIVE: list[dict[str, _Unit]] = []  # the units of the sharded call in progress


def _active_unit(path: str) -> _Unit | None:
    return _ACTIVE[-1].get(path) if _ACTIVE else None


def _pre_hook(path: str):
    def hook(module: nn.Module, args: Any) -> None:
        unit = _active_unit(path)
        if unit is None or unit.unit.remat:  # a remat unit gathers inside its checkpoint
            return
        if unit.outputs is None:  # SHARD_GRAD_OP reuses a unit called twice in one forward
            unit.outputs = _GatherUnit.apply(unit, "gather", *unit.shards)
            unit.calls += 1
            _prefetch_after(path, forward=True)
        unit.enter()

    return hook


def _prefetch_after(path: str, forward: bool) -> None:
    """[Note: prefetch] With ``jit_step(prefetch=True)``, gathering a unit starts the
    all-gather of the unit that runs next: the next one in the forward order recorded on
    the previous step, or, in backward, the previous one that will be regathered. At most
    one unit is in flight beside the running one, so FULL_SHARD holds about two units."""
    step = _psum.current()
    if step is None or not step.prefetch or (forward and not _ACTIVE):
        return
    if forward:
        step.seen.append(path)
    order = step.order if forward else step.order[::-1]
    if path not in order:
        return
    i = order.index(path)
    units = _ACTIVE[-1] if forward else step.units
    for nxt in order[i + 1 : i + 2]:
        unit = units.get(nxt)
        if unit is not None and unit.unit.remat != "selective" and (forward or _regathers(unit)):
            unit.prefetch("regather" if not forward else "gather")


def _regathers(unit: _Unit) -> bool:
    """Whether backward will gather ``unit`` again: it holds handles to its parameters, or
    it is rematerialised, ran this forward and was resharded after it (the recompute gathers).

    Selectively rematerialised units are neither prefetched nor prefetch from inside their
    region: selective checkpointing replays the region's ops one for one, and a gather
    that was prefetched in forward (no copy in the region) but not in the recompute, or
    the reverse, would break that replay."""
    if unit.unit.remat:
        return unit.calls > 0 and unit.layout.strategy.reshard_after_forward
    return unit.pending > 0


def _post_hook(path: str):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        unit = _active_unit(path)
        if unit is not None and unit.entered and not unit.unit.remat:
            unit.exit()

    return hook


def _remat_forward(path: str, forward: Any):
    """The unit module's forward, run under ``torch.utils.checkpoint`` in a sharded call.

    The checkpointed region gathers the unit, runs the original forward and reshards,
    so the recompute in backward gathers again (FULL_SHARD) or reuses the kept
    parameters (SHARD_GRAD_OP) without any handle of ours.
    """

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        unit = _active_unit(path)
        if unit is None or not unit.unit.remat:
            return forward(*args, **kwargs)

        def region(*args: Any, **kwargs: Any) -> Any:
            event = "regather" if torch._C._current_graph_task_id() != -1 else "gather"
            unit.outputs = _GatherUnit.apply(unit, event, *unit.shards)
            unit.calls += event == "gather"
            if unit.unit.remat != "selective":
                _prefetch_after(path, forward=event == "gather")
            unit.enter()
            try:
                return forward(*args, **kwargs)
            finally:
                unit.exit()
                if not unit.layout.strategy.reshard_after_forward:
                    unit.outputs = None  # the kept parameters live on in unit.full

        context_fn = _selective(unit.layout.plan.remat.save) if unit.unit.remat == "selective" else _noop_contexts
        return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return wrapped


def _noop_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def _selective(save: tuple[str, ...]):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = {getattr(torch.ops.aten, name).default for name in save if hasattr(torch.ops.aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


def sharded_call(apply: Any, sharded: Any, args: tuple, kwargs: dict) -> Any:
    """``apply(sharded, *args, **kwargs)``: see [Note: how a sharded call works]."""
    layout: Layout = sharded.layout
    slots = _prepare(apply, layout)
    _buffers.note(apply)
    units = {u.path: _Unit(layout, u, [sharded[n] for n in u.leaves], sharded.mesh, slots[u.path]) for u in layout.units}
    params: dict[str, torch.Tensor] = {}
    root = units.pop("", None)
    if root is not None:
        params.update(zip(root.unit.leaves, _GatherUnit.apply(root, "gather", *root.shards)))
        root.calls = 1
    precision = layout.plan.precision
    if precision.cast_inputs:
        args, kwargs = cast_floating((args, kwargs), precision.param)
    step = _psum.current()
    if step is not None:
        step.units = units  # for prefetching regathers in backward
    _ACTIVE.append(units)
    try:
        out = functional_call(apply.module, {**params, **apply.buffers}, args, kwargs, tie_weights=True, strict=False)
        return cast_floating(out, precision.output)
    finally:
        _ACTIVE.pop()
        for u in units.values():
            if u.entered:  # the unit's forward raised: undo its hooks and parameters
                u.exit()
            u.outputs = None  # forward is over: only saved handles (and u.full) remain
        if root is not None:
            # The graph holds what backward needs; the call itself no longer does.
            root.release("free")


def _prepare(apply: Any, layout: Layout) -> dict[str, list[tuple[nn.Module, str, int]]]:
    """Checks ``layout`` against the model once, registers unit hooks, returns the slots.

    A slot ``(submodule, attribute, leaf index)`` is one place a unit's full tensor goes;
    a weight tied within one unit has several.
    """
    cached = apply.prepared.get(id(layout))
    if cached is not None and cached[0] is layout:
        return cached[1]
    from ._functionalize import check_names

    check_names(layout.leaves.keys(), apply.param_names, what="apply(sharded, ...)")
    aliases: dict[int, list[str]] = {}
    for name, p in apply.module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    names_of = {names[0]: names for names in aliases.values()}
    slots: dict[str, list[tuple[nn.Module, str, int]]] = {}
    for u in layout.units:
        if u.path == "":
            slots[""] = []
            continue
        try:
            m = apply.module.get_submodule(u.path)
        except AttributeError:
            raise ValueError(
                f"apply(sharded, ...): unit {u.path!r} of the layout is not a module of this model. "
                "Pass params sharded from this model's functionalize()."
            ) from None
        if u.path not in apply.hooked:
            m.register_forward_pre_hook(_pre_hook(u.path))
            m.register_forward_hook(_post_hook(u.path), always_call=True)
            # Inert unless the unit is rematerialised in the active call's layout.
            m.forward = _remat_forward(u.path, m.forward)
            apply.hooked.add(u.path)
        slots[u.path] = []
        for i, leaf in enumerate(u.leaves):
            for alias in names_of.get(leaf, [leaf]):
                sub_path, _, attr = alias.rpartition(".")
                slots[u.path].append((apply.module.get_submodule(sub_path), attr, i))
    apply.prepared[id(layout)] = (layout, slots)
    return slots
