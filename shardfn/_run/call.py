"""The sharded call: module hooks that gather units just in time.

[Note: how a sharded call works]
``apply(sharded, *args)`` runs ``functional_call`` on the meta module tree that
``functionalize`` kept, with the buffers of ``sharded`` (see [Note: the state tree]). The
root unit (parameters outside every unit) is gathered up front; every other unit just in
time, by hooks on its module (registered once, inert outside a sharded call): a forward
pre-hook applies the unit's :class:`shardfn._group.gather.GatherUnit`, whose forward all-gathers
and whose backward hands the gradients to the unit's reduction (shardfn._group.reduce [Note: one
reduction per unit]), and places the full parameters in the module; a forward hook puts
the meta parameters back.

A unit's gathered parameters can then be dropped after its forward with no recompute:
while the unit runs, ``saved_tensors_hooks`` (:func:`shardfn._group.gather.saved_handles`) pack
every saved tensor that lives in a gathered parameter as a small handle (unit, use, the
leaf it lies in, its size, stride and offset in that leaf) instead of a reference, so the
graph holds no gathered memory, and the first unpack of a handle in backward gathers the
unit again. When a unit lets go of its gathered parameters is one rule, in shardfn._group.gather
([Note: the life of a unit]); the hooks here and the handles only report the events it
reads. Every call of ``apply`` in one step shares the step's units (see [Note: the runtime]).

Step by step, and what FULL_SHARD and SHARD_GRAD_OP hold with and without prefetch:
docs/how-it-works.md, "A sharded call".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

from .._comm import guard as _guard
from .._comm.scope import here
from .._group.buckets import buckets_of
from .._compile import compilable
from .._comm.events import Purpose
from .._group.gather import Unit, saved_handles
from .._group.group import UnitGroup
from .._state.layout import Layout
from .._state.precision import cast_floating
from .remat import remat_forward
from .._state.replica import replica_of
from .runtime import Runtime
from .._parallel.sequence import (SEQUENCE_STYLES, blocks_of, check_closed, container_forward, region_check_hook,
    sequence_forward, sequence_parallel)
from .._parallel.experts import MOE, experts_forward
from .._parallel.tensor import heads_of, tp_forward
from .._parallel.call import REPLICATED, TensorCall
from .._state.tree import check_names

__all__ = ["Prepared", "Site", "bound", "sharded_call", "units_for"]


# -- module hooks -----------------------------------------------------------------------


class Site:
    """One hooked module of a model, as its hooks see the sharded call in progress: the
    call hands every site its units (one per dtype group; none if the module is not a unit
    of the call's layout) and what its split layers read (None: no call, or a recompute
    outside one) when it begins, and takes them back when it ends. The hooks read their
    own site: nothing is looked up ([Note: a site per hooked module])."""

    __slots__ = ("units", "tensor")

    def __init__(self) -> None:
        self.units: list[Unit] | tuple[()] = ()
        self.tensor: TensorCall | None = None


# [Note: a site per hooked module]
# A model's hooks are registered once per module, and the model function can be called on
# several trees (layouts) and in several steps; so each hook holds its module's Site, and a
# call binds every site of its apply for its block, restoring what it found after (a call
# made inside another's forward leaves the outer one's intact). Between calls every site is
# empty and every hook inert.


@contextlib.contextmanager
def bound(sites: dict[str, Site], units: dict[str, list[Unit]], tensor: TensorCall | None) -> Iterator[None]:
    """Every site in ``sites`` holds this call's ``units`` (by module path) and ``tensor`` for the block."""
    saved = [(site, site.units, site.tensor) for site in sites.values()]
    for path, site in sites.items():
        site.units = units.get(path, ())
        site.tensor = tensor
    try:
        yield
    finally:
        for site, u, t in saved:
            site.units, site.tensor = u, t


def _pre_hook(site: Site):
    def hook(module: nn.Module, args: Any) -> None:
        units = site.units
        if not units or units[0].unit.remat is not None:  # a remat unit gathers inside its checkpoint
            return
        for unit in units:
            if unit.use is None:  # SHARD_GRAD_OP reuses a unit called twice in one forward
                unit.start_use(Purpose.GATHER)
        # Handles only where the unit's memory can be dropped: a sharded strategy (NO_SHARD's
        # full parameters are the shards themselves). The first unit holds the hooks.
        hooks = saved_handles(units) if units[0].layout.sharded else None
        for i, unit in enumerate(units):
            unit.enter(hooks if i == 0 else None)

    return hook


def _post_hook(site: Site):
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        for unit in reversed(site.units):
            if unit.entered and unit.unit.remat is None:
                unit.exit()

    return hook


# -- the call ------------------------------------------------------------------------------


def sharded_call(apply: Any, sharded: Any, args: tuple, kwargs: dict, method: str | None = None) -> Any:
    """``apply(sharded, *args, **kwargs)``: see [Note: how a sharded call works]. A public
    call: the step it runs in, if any, is found in its scope, read here once ([Note: the scope]).
    ``method``: the module's method to run instead of ``forward`` (``apply.method``)."""
    rt = here().runtime
    if rt is not None:
        return _call(apply, sharded, rt, args, kwargs, method)
    # Outside a step: a runtime for this call alone; an error in it reaches every rank.
    if sharded.mesh.size > 1:
        sharded.mesh.guard.check_alive("apply(sharded, ...)")
    with _guard.guarded(sharded.mesh, _guard.Where.APPLY) as scope, sharded.mesh.random.drawing(sharded.mesh, scope):
        return _call(apply, sharded, Runtime(sharded.mesh, scope), args, kwargs, method)


def _call(apply: Any, sharded: Any, rt: Runtime, args: tuple, kwargs: dict, method: str | None = None) -> Any:
    layout: Layout = sharded.layout
    store = rt.in_step and sharded is rt.owner
    prepared = _prepare(apply, layout)
    units = units_for(apply, sharded, rt, prepared)
    roots = units.get("", [])
    # Buffers: the step's working copies for the step's own tree, else the tree's own.
    buffers = rt.buffers.work if store and rt.buffers is not None else {n: sharded[n] for n in layout.buffers}
    state: dict[str, torch.Tensor] = dict(buffers)
    state.update({n: sharded[n] for n in layout.ignored})  # whole, as they are ([Note: ignored parameters])
    for root in roots:
        state.update(zip(root.unit.leaves, root.start_use(Purpose.GATHER)))
    precision = layout.plan.precision
    if precision.cast_inputs:
        args, kwargs = cast_floating((args, kwargs), precision.param)
    call = TensorCall.of(layout, rt)  # what its split layers read (shardfn._parallel.tensor, shardfn._parallel.sequence)
    try:
        state.update({alias: state[n] for n, aliases in prepared.ties if n in state for alias in aliases})
        with bound(apply.sites, units, call):
            if method is None:
                out = functional_call(apply.module, state, args, kwargs, tie_weights=False, strict=False)
            else:  # the same state in place, around another method of the module
                with _reparametrize_module(apply.module, state, tie_weights=False, strict=False):
                    out = getattr(apply.module, method)(*args, **kwargs)
        if call.sequence:
            check_closed(call)
        # A module that *replaced* a buffer (rather than updating it in place) left the new
        # tensor in ``state`` (functional_call writes it back): keep it in the tree.
        replaced = {n: state[n] for n in layout.buffers if state[n] is not buffers[n]}
        if replaced:
            if store and rt.buffers is not None:
                rt.buffers.work.update(replaced)
            else:
                sharded._set_buffers(replaced)
        return cast_floating(out, precision.output)
    finally:
        for u in (u for group in units.values() for u in reversed(group)):
            if u.entered:  # the unit's forward raised: undo its hooks and parameters
                u.exit()
            u.end_use()  # forward is over: only saved handles (and what the unit keeps) remain


def _again(sites: dict[str, Site], site: Site) -> Any:
    """What re-enters the sharded call in progress at ``site`` (its split layers' layout and
    runtime) around a rematerialised unit's recompute, which runs in backward, after the call."""
    tensor = site.tensor  # (not its inputs: they are activations)

    def again() -> Any:
        # the forward checked the region; the recompute runs inside it, in backward, where
        # no unit is found by its hooks (the remat unit's own are its recompute's)
        return bound(sites, {}, None if tensor is None else tensor.again())

    return again


class Prepared(NamedTuple):
    """What a model function keeps for one layout, made on its first sharded call: static,
    the model's and not a step's ([Note: a site per hooked module] for what a call binds)."""

    layout: Layout
    slots: dict[int, list[tuple[nn.Module, str, int]]]  # unit index -> where its full tensors go
    ties: list[tuple[str, tuple[str, ...]]]  # (name, its other names) of each tensor held under several


def units_for(apply: Any, sharded: Any, rt: Runtime, prepared: Prepared) -> dict[str, list[Unit]]:
    """The units of ``sharded`` in runtime ``rt`` (built on first use), by module path:
    one per dtype group of the module's parameters (see [Note: mixed dtypes in a unit])."""
    layout: Layout = sharded.layout
    slots = prepared.slots

    def build(group: UnitGroup) -> None:
        buckets = buckets_of(layout, reduce=group.store)
        for u in layout.units:
            shards = [sharded[n] for n in u.leaves]
            # [Note: replicated parameters]; an optional unit is gathered when built (pin), as before any replica
            replica = replica_of(sharded, u.index, shards) if layout.keeps_replica and not u.optional else None
            group.units[u.index] = Unit(layout, u, (group.index, u.index), shards, sharded.mesh, slots[u.index], group,
                                        replica, *buckets[u.index])
        for unit in group.units.values():  # every rank gathers them here, in layout order, run or not
            if unit.unit.optional:
                unit.pin()

    by_path: dict[str, list[Unit]] = {}
    for unit in rt.group_of(sharded, build).units.values():
        by_path.setdefault(unit.unit.path, []).append(unit)
    return by_path


def _site(apply: Any, path: str) -> Site:
    site = apply.sites.get(path)
    if site is None:
        site = apply.sites[path] = Site()
    return site


def _prepare(apply: Any, layout: Layout) -> Prepared:
    """Checks ``layout`` against the model once, registers unit hooks, returns the slots.

    A slot ``(submodule, attribute, leaf index)`` is one place a unit's full tensor goes;
    a weight tied within one unit has several.
    """
    cached = apply.prepared.get(id(layout))
    if cached is not None and cached.layout is layout:
        return cached
    check_names([*layout.leaves, *layout.ignored, *layout.buffers], apply.names, what="apply(sharded, ...)")
    slots: dict[int, list[tuple[nn.Module, str, int]]] = {}
    for u in layout.units:
        slots[u.index] = []
        if u.path == "":
            continue
        try:
            m = apply.module.get_submodule(u.path)
        except AttributeError:
            raise ValueError(
                f"apply(sharded, ...): unit {u.path!r} of the layout is not a module of this model. "
                "Pass params sharded from this model's functionalize()."
            ) from None
        if u.path not in apply.hooked:
            site = _site(apply, u.path)
            m.register_forward_pre_hook(_pre_hook(site))
            m.register_forward_hook(_post_hook(site), always_call=True)
            # Inert unless the unit is rematerialised in the active call's layout; compiled
            # only in a step built with compile=True.
            m.forward = remat_forward(lambda site=site: site.units, m, compilable(m.forward),
                                      functools.partial(_again, apply.sites, site))
            apply.hooked.add(u.path)
        for i, leaf in enumerate(u.leaves):
            for alias in layout.aliases.get(leaf, (leaf,)):
                sub_path, _, attr = alias.rpartition(".")
                slots[u.index].append((apply.module.get_submodule(sub_path), attr, i))
    _prepare_tensor(apply, layout)
    prepared = apply.prepared[id(layout)] = Prepared(layout, slots, _ties(apply.module))
    return prepared


def _ties(module: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """Each name of a tensor the module holds under several names, with its other names:
    the untying ``functional_call(tie_weights=True)`` does at every call, done once (the
    meta module tree of ``apply`` never changes), so a call passes every name itself."""
    names: dict[int, list[str]] = {}
    for n, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(n)
    return [(n, tuple(m for m in group if m != n)) for group in names.values() if len(group) > 1 for n in group]


def _prepare_tensor(apply: Any, layout: Layout) -> None:
    """Split layers' forwards ([Note: hand-written tensor collectives]) and the sequence
    region's ([Note: the sequence region]); each inert in other layouts' calls."""

    def hook(key: str, path: str, make: Any) -> None:
        if key + path not in apply.hooked:
            m = apply.module.get_submodule(path)
            site = _site(apply, path)
            m.forward = make(m, lambda: site.tensor)
            apply.hooked.add(key + path)

    styles = dict(layout.tensor)
    weights = {n for n, _ in apply.module.named_parameters()}  # (an experts module's styled parameters: no forward)
    for path, style in styles.items():
        if path in weights:
            continue
        if style == MOE:
            hook("tensor:", path, lambda m, now, p=path: experts_forward(now, p, m))
        elif style in SEQUENCE_STYLES:
            hook("sequence:", path, lambda m, now, p=path: sequence_forward(now, p, m))
        elif style != REPLICATED:  # (runs as it is: only its gradients are summed, after backward)
            hook("tensor:", path, lambda m, now, p=path: tp_forward(now, p, m, heads_of(apply.module, p) is not None))
    if not sequence_parallel(layout):
        return
    for path in blocks_of(styles):
        hook("block:", path, lambda m, now, p=path: container_forward(now, p, m))
    for path, m in apply.module.named_modules():
        if path not in styles and "region:" + path not in apply.hooked and any(True for _ in m.parameters(recurse=False)):
            site = _site(apply, path)
            m.register_forward_pre_hook(region_check_hook(lambda site=site: site.tensor, path))
            apply.hooked.add("region:" + path)
