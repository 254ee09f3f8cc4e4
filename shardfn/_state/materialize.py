"""Materialising state: deferred init unit by unit, and values sent from one rank.

[Note: deferred init]
A model built on the meta device has shapes but no values. ``shard(..., seed=s)``
materialises it unit by unit: every rank builds the current unit's modules on its device
(``to_empty``), seeds the default generator from ``(s, unit path)`` — a seed that does not
depend on the world size or on the order in which ranks run — calls each module's
``reset_parameters()`` (and ``init_fn(module)`` when given), keeps its shard of every
parameter and the whole of every buffer, and drops the rest before the next unit.
:func:`materialize` runs the same procedure on one device, so a sharded deferred init
equals it at every world size. Before initialising, floating-point tensors are filled
with NaN and the others with zeros: a parameter or floating-point buffer that no
``reset_parameters()`` or ``init_fn`` wrote is still all NaN afterwards, and is an error
naming it, rather than uninitialised memory that differs from rank to rank.

[Note: loading from rank 0]
``shard(..., src_rank=0)`` takes the values that rank 0 holds (the other ranks may pass
meta tensors): per unit, rank 0 packs the unit's shards into one buffer and scatters it
over the ``shard`` axis (then each shard is broadcast over ``replicate``), so no rank but
rank 0 ever holds more than its own shards. The buffers follow, one broadcast per dtype.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn as nn

from .._comm import collectives as C
from .._comm.events import Purpose
from .layout import Layout, UnitLayout, build_layout, unit_owner
from .packing import pack_leaf
from .plan import Plan
from .._parallel.tensor import local_state
from .tree import tree_info

__all__ = ["materialize"]

InitFn = Callable[[nn.Module], None]

_NOT_INITIALISED = (
    "{what}: after reset_parameters() and init_fn, these tensors of unit {unit!r} were never written: {names}. "
    "Their modules ({types}) initialise nothing themselves. Pass init_fn=... that sets them (for a Hugging Face "
    "model: init_fn=model._init_weights)."
)


def _unit_seed(seed: int, path: str) -> int:
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def unit_values(
    module: nn.Module, units: list[UnitLayout], seed: int, init_fn: InitFn | None, device: torch.device,
    what: str = "shard(seed=...)", only: set[str] | None = None,
) -> Iterator[tuple[UnitLayout, dict[str, torch.Tensor]]]:
    """Yields each unit's freshly initialised tensors, one unit at a time: its parameters
    (full) and the buffers of its modules, by name (every alias of a tied tensor).
    ``only``: the names that must have been initialised (default: all)."""
    work = copy.deepcopy(module)  # meta: costs nothing; the caller's tree stays untouched
    present = [u.path for u in units if u.path]  # units that kept no parameter belong to the root
    for unit in units:
        mods = [(name, m) for name, m in work.named_modules() if unit_owner(name, present) == unit.path]
        for _, m in mods:
            m.to_empty(device=device, recurse=False)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                with torch.no_grad():
                    t.fill_(float("nan") if t.is_floating_point() else 0)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_unit_seed(seed, unit.path))
            with torch.no_grad():
                for _, m in mods:
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
                    if init_fn is not None:
                        init_fn(m)
        values: dict[str, torch.Tensor] = {}
        for prefix, m in mods:
            for kind in (m.named_parameters(recurse=False), m.named_buffers(recurse=False)):
                for attr, t in kind:
                    values[f"{prefix}.{attr}" if prefix else attr] = t
        blank = [n for n, t in values.items() if (only is None or n in only) and t.is_floating_point() and t.numel()
                 and bool(t.isnan().all())]
        if blank:
            owners = sorted({type(m).__name__ for p, m in mods if any(n.rpartition(".")[0] == p for n in blank)})
            raise ValueError(_NOT_INITIALISED.format(what=what, unit=unit.name, names=", ".join(blank[:6]),
                                                     types=", ".join(owners)))
        yield unit, values
        del values
        for _, m in mods:  # back to meta: this unit's full values are freed before the next
            m.to_empty(device="meta", recurse=False)


def units_with_buffers(layout: Layout) -> list[UnitLayout]:
    """One unit per module path (a module split by dtype is initialised once, see [Note:
    mixed dtypes in a unit]), plus an empty root unit when only buffers live outside the units."""
    first: dict[str, UnitLayout] = {}
    for u in layout.units:
        first.setdefault(u.path, u)
    units = list(first.values())
    if not any(u.path == "" for u in units):
        units.insert(0, UnitLayout(-1, "", (), 0, torch.float32, 0, torch.float32, torch.float32))
    return units


def _take(values: Mapping[str, torch.Tensor], layout: Layout, out: dict[str, torch.Tensor], rank: int,
          device: torch.device) -> None:
    """This rank's share of one unit's values: the shards of its parameters, whole buffers."""
    for name, t in values.items():
        if name in layout.leaves:
            out[name] = layout.local_shard(name, t.detach(), rank, device)
        elif name in layout.buffers or name in layout.ignored:
            out[name] = t.detach().to(device, copy=True)


def deferred_state(
    module: nn.Module | None, layout: Layout, rank: int, device: torch.device, seed: int, init_fn: InitFn | None,
    tensor: tuple[int, int] = (1, 0),
) -> dict[str, torch.Tensor]:
    """This rank's shards and buffers, initialised unit by unit (see [Note: deferred init]);
    ``tensor``: the tensor axis's size and this rank's place on it (each tensor rank takes
    its piece of a split leaf's whole values, which every rank makes alike)."""
    if module is None:
        raise ValueError(
            "shard(seed=...): deferred init needs the module tree; pass the params that functionalize(model) returned."
        )
    out: dict[str, torch.Tensor] = {}
    for _, values in unit_values(module, units_with_buffers(layout), seed, init_fn, device):
        if tensor[0] > 1:
            values = local_state(values, layout.splits, *tensor)
        _take(values, layout, out, rank, device)
        del values  # no reference may outlive the unit: the generator frees it before the next
    return out


def scattered_state(params: Mapping[str, torch.Tensor], layout: Layout, mesh, src_rank: int) -> dict[str, torch.Tensor]:
    """Every rank's shards and buffers of the values on ``src_rank`` (see [Note: loading from rank 0])."""
    i_am_src = mesh.rank == src_rank
    world, device = layout.world, mesh.device
    # Agree before the first scatter that the source has real values: an error on the
    # source alone would leave the other ranks waiting in a collective.
    bad = [n for n, t in params.items() if t.is_meta] if i_am_src else []
    status = torch.tensor([len(bad)], dtype=torch.int64, device=device)
    C.all_reduce_mesh(status, mesh, Purpose.LOAD, op=C.MAX)
    if int(status):
        raise ValueError(
            f"[rank {mesh.rank}] shard(src_rank={src_rank}): rank {src_rank} must hold the real values of every "
            f"tensor of the state, but {len(bad) or int(status)} are on the meta device"
            f"{': ' + ', '.join(bad[:4]) if bad else ''}. Load the weights on that rank before calling shard()."
        )
    tensor = mesh.axis_size("tensor")
    data_src = src_rank // tensor  # the source's index among the data ranks (replicate x shard)
    replicate_size = mesh.axis_size("replicate") if "replicate" in mesh.axis_names else 1
    src_row = data_src // mesh.axis_size("shard")
    in_src_row = replicate_size == 1 or mesh.axis_rank("replicate") == src_row
    shard_src = data_src % mesh.axis_size("shard")
    # [Note: loading from one rank with a tensor axis]: the source's tensor group holds the values
    holder = i_am_src if tensor == 1 else mesh.data_rank == data_src
    out = {}
    for unit in layout.units:
        values = params if tensor == 1 else _tensor_piece(params, layout, mesh, src_rank, unit, holder)
        flat = torch.empty(unit.numel, dtype=unit.dtype, device=device)
        if not layout.sharded:  # NO_SHARD: everyone gets everything
            if holder:
                flat.copy_(torch.cat([values[n].reshape(-1).to(device) for n in unit.leaves]))
            if in_src_row:
                C.broadcast(flat, shard_src, mesh.channel("shard"), Purpose.LOAD, unit.name)
            if replicate_size > 1:
                C.broadcast(flat, src_row, mesh.channel("replicate"), Purpose.LOAD, unit.name)
        else:
            if in_src_row and layout.gathers:
                buf = None
                if holder:
                    buf = (torch.zeros if unit.flat else torch.empty)(world, unit.numel, dtype=unit.dtype, device=device)
                    for n in unit.leaves:
                        pack_leaf(buf, values[n].to(device), layout.leaves[n], world, layout.leaves[n].offset)
                C.scatter(flat, buf, shard_src, mesh.channel("shard"), Purpose.LOAD, unit.name)
            elif in_src_row:
                flat.copy_(torch.cat([values[n].reshape(-1).to(device) for n in unit.leaves]))
            if replicate_size > 1:
                C.broadcast(flat, src_row, mesh.channel("replicate"), Purpose.LOAD, unit.name)
        rank = layout.shard_rank(mesh)
        for n in unit.leaves:
            off, length = layout.piece(n, rank)
            out[n] = flat[off : off + length].view(layout.shard_shape(n, rank)).clone()
    # Buffers: one broadcast per dtype, of all of them laid end to end, from the source.
    # (and the ignored parameters, whole on every rank as buffers are: [Note: ignored parameters])
    whole = {**layout.buffers, **layout.ignored}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n, b in whole.items():
        by_dtype.setdefault(b.dtype, []).append(n)
    for dtype, names in by_dtype.items():
        shapes = [torch.Size(whole[n].shape) for n in names]
        flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype, device=device)
        if i_am_src:
            torch.cat([params[n].detach().reshape(-1).to(device) for n in names], out=flat)
        if flat.numel():
            C.broadcast_mesh(flat, mesh, src_rank, Purpose.LOAD)
        for n, t in zip(names, flat.split([s.numel() for s in shapes])):
            out[n] = t.view(whole[n].shape).clone()
    return out


def _tensor_piece(params: Mapping[str, torch.Tensor], layout: Layout, mesh, src_rank: int, unit: UnitLayout,
                  holder: bool) -> dict[str, torch.Tensor]:
    """On the ranks of the source's tensor group: this tensor rank's values of ``unit``'s
    leaves (a split leaf's block), from the source's whole values; nothing elsewhere.

    [Note: loading from one rank with a tensor axis]
    With a tensor axis, ``src_rank`` holds whole values and each tensor rank needs its own
    block of a split leaf. The source broadcasts each unit's whole leaves over its tensor
    group (one collective per unit: the group's other ranks hold one unit's whole values at a
    time, not the model), every rank of the group cuts its block, and each then does what
    the source does without a tensor axis for the ranks of its own tensor rank: scatter the
    unit over the shard axis, and the replicate axis broadcasts it on.
    """
    if not holder:
        return {}
    whole = {s.leaf: s.shape for s in layout.splits}
    shapes = [torch.Size(whole.get(n, layout.leaves[n].shape)) for n in unit.leaves]
    flat = torch.empty(sum(s.numel() for s in shapes), dtype=unit.dtype, device=mesh.device)
    if mesh.rank == src_rank:
        torch.cat([params[n].detach().reshape(-1).to(flat) for n in unit.leaves], out=flat)
    C.broadcast(flat, src_rank % mesh.axis_size("tensor"), mesh.channel("tensor"), Purpose.LOAD, unit.name)
    full = {n: t.view(shape) for n, t, shape in zip(unit.leaves, flat.split([s.numel() for s in shapes]), shapes)}
    return local_state(full, layout.splits, mesh.axis_size("tensor"), mesh.axis_rank("tensor"))


def materialize(model: nn.Module, seed: int, *, units=None, init_fn: InitFn | None = None,
                device: torch.device | str = "cpu") -> nn.Module:
    """Initialises a meta-device ``model`` in place on one device, exactly as ``shard(..., seed=seed)``.

    The single-device counterpart of deferred init: the same unit-by-unit seeding, so
    ``gather(shard(params, mesh, ..., seed=s))`` equals ``materialize(model, s)`` at every
    world size, buffers included. ``units`` must be the unit policy given to ``shard``.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(cfg)
        >>> materialize(model, seed=0)
    """
    info = tree_info(model)
    plan = Plan("FULL_SHARD", units=units)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    unit_paths = plan.units.resolve(model, list(info.params))
    layout = build_layout(plan, (1,), 1, 1, state, unit_paths, info)
    values: dict[str, torch.Tensor] = {}
    for _, full in unit_values(model, units_with_buffers(layout), seed, init_fn, torch.device(device),
                               what="materialize"):
        values.update({n: t.detach().clone() for n, t in full.items()})
        del full
    # Put the values in place without breaking ties: every name of one tensor gets the
    # same new tensor.
    fresh: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in fresh:
            fresh[id(p)] = nn.Parameter(values[name], requires_grad=p.requires_grad)
        sub_path, _, attr = name.rpartition(".")
        model.get_submodule(sub_path)._parameters[attr] = fresh[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in fresh:
            fresh[id(b)] = values[name]
        sub_path, _, attr = name.rpartition(".")
        model.get_submodule(sub_path)._buffers[attr] = fresh[id(b)]
    return model
