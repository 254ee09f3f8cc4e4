"""Deferred initialisation and loading from rank 0: full parameters one unit at a time.

[Note: deferred init]
A model built on the meta device has shapes but no values. ``shard(..., seed=s)``
materialises it unit by unit: every rank builds the current unit's modules on its device
(``to_empty``), seeds the default generator from ``(s, unit path)`` — a seed that does not
depend on the world size or on the order in which ranks run — calls each module's
``reset_parameters()`` (and ``init_fn(module)`` when given), keeps its shard and drops the
rest before the next unit. :func:`materialize` runs the same procedure on one device, so a
sharded deferred init equals it at every world size.

[Note: loading from rank 0]
``shard(..., src_rank=0)`` takes the values that rank 0 holds (the other ranks may pass
meta tensors): per unit, rank 0 packs the unit's shards into one buffer and scatters it
over the ``shard`` axis (then each shard is broadcast over ``replicate``), so no rank but
rank 0 ever holds more than its own shards.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.nn as nn

from . import _collectives as C
from ._layout import Layout, UnitLayout, local_shard, pack_leaf

__all__ = ["materialize"]

InitFn = Callable[[nn.Module], None]


def _unit_seed(seed: int, path: str) -> int:
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _modules_of(module: nn.Module, path: str, unit_paths: list[str]) -> list[nn.Module]:
    """The modules whose own parameters belong to the unit at ``path`` ("" = root)."""
    inside = [p for p in unit_paths if p]

    def owner(name: str) -> str:
        return max((u for u in inside if name == u or name.startswith(u + ".")), key=len, default="")

    return [m for name, m in module.named_modules() if owner(name) == path]


def unit_values(
    module: nn.Module, units: list[UnitLayout], unit_paths: list[str], seed: int, init_fn: InitFn | None,
    device: torch.device,
) -> Iterator[tuple[UnitLayout, dict[str, torch.Tensor]]]:
    """Yields each unit's full, freshly initialised parameters, one unit at a time."""
    work = copy.deepcopy(module)  # meta: costs nothing; the caller's tree stays untouched
    for unit in units:
        mods = _modules_of(work, unit.path, unit_paths)
        for m in mods:
            m.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(_unit_seed(seed, unit.path))
            with torch.no_grad():
                for m in mods:
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
                    if init_fn is not None:
                        init_fn(m)
        # A tied leaf takes its value from its first name, whichever module that is.
        values = dict(work.named_parameters(remove_duplicate=False))
        yield unit, {n: values[n] for n in unit.leaves}
        del values
        for m in mods:  # back to meta: this unit's full values are freed before the next
            m.to_empty(device="meta", recurse=False)


def deferred_shards(
    module: nn.Module | None, layout: Layout, rank: int, device: torch.device, seed: int, init_fn: InitFn | None
) -> dict[str, torch.Tensor]:
    if module is None:
        raise ValueError(
            "shard(seed=...): deferred init needs the module tree; pass the params that functionalize(model) returned."
        )
    out = {}
    present = [u.path for u in layout.units if u.path]  # units that kept no leaf belong to the root
    for unit, full in unit_values(module, list(layout.units), present, seed, init_fn, device):
        out.update({n: local_shard(t.detach(), layout.leaves[n], rank, device) for n, t in full.items()})
        del full  # no reference may outlive the unit: the generator frees it before the next
    return out


def scattered_shards(params: Mapping[str, torch.Tensor], layout: Layout, mesh, src_rank: int) -> dict[str, torch.Tensor]:
    """Every rank's shards of the values on ``src_rank`` (see [Note: loading from rank 0])."""
    i_am_src = mesh.rank == src_rank
    world, device = layout.world, mesh.device
    # Agree before the first scatter that the source has real values: an error on the
    # source alone would leave the other ranks waiting in a collective.
    bad = [n for n, t in params.items() if t.is_meta] if i_am_src else []
    status = torch.tensor([len(bad)], dtype=torch.int64, device=device)
    for axis in reversed(mesh.axis_names):  # from the source along its shard row, then its column
        if mesh.axis_size(axis) > 1:
            C.all_reduce(status, mesh.group(axis), tag="load:check", op="max")
    if int(status):
        raise ValueError(
            f"[rank {mesh.rank}] shard(src_rank={src_rank}): rank {src_rank} must hold the real values of every "
            f"parameter, but {len(bad) or int(status)} are on the meta device{': ' + ', '.join(bad[:4]) if bad else ''}. "
            "Load the weights on that rank before calling shard()."
        )
    src_row = src_rank // mesh.axis_size("shard") if mesh.ndim == 2 else 0
    in_src_row = mesh.ndim == 1 or mesh.axis_rank("replicate") == src_row
    shard_src = src_rank % mesh.axis_size("shard") if layout.strategy.sharded else src_rank
    out = {}
    for unit in layout.units:
        flat = torch.empty(unit.numel, dtype=unit.dtype, device=device)
        if not layout.strategy.sharded:  # NO_SHARD: everyone gets everything
            if i_am_src:
                flat.copy_(torch.cat([params[n].reshape(-1).to(device) for n in unit.leaves]))
            C.broadcast(flat, src_rank, mesh.group("shard"), tag=f"load:{unit.name}")
        else:
            if in_src_row and world > 1:
                buf = None
                if i_am_src:
                    buf = torch.empty(world, unit.numel, dtype=unit.dtype, device=device)
                    for n in unit.leaves:
                        pack_leaf(buf, params[n].to(device), layout.leaves[n], world, layout.leaves[n].offset)
                C.scatter(flat, buf, shard_src, mesh.group("shard"), tag=f"load:{unit.name}")
            elif in_src_row:
                flat.copy_(torch.cat([params[n].reshape(-1).to(device) for n in unit.leaves]))
            if mesh.ndim == 2 and mesh.axis_size("replicate") > 1:
                C.broadcast(flat, src_row, mesh.group("replicate"), tag=f"load:{unit.name}")
        for n in unit.leaves:
            leaf = layout.leaves[n]
            out[n] = flat[leaf.offset : leaf.offset + leaf.shard_numel].view(leaf.shard_shape).clone()
    return out


def materialize(model: nn.Module, seed: int, *, units=None, init_fn: InitFn | None = None,
                device: torch.device | str = "cpu") -> nn.Module:
    """Initialises a meta-device ``model`` in place on one device, exactly as ``shard(..., seed=seed)``.

    The single-device counterpart of deferred init: the same unit-by-unit seeding, so
    ``gather(shard(params, mesh, ..., seed=s))`` equals ``materialize(model, s)`` at every
    world size. ``units`` must be the unit policy given to ``shard``.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(cfg)
        >>> materialize(model, seed=0)
    """
    from ._functionalize import functionalize
    from ._layout import build_layout
    from ._plan import Plan
    from ._sharded import _aliases

    params, _ = functionalize(model)
    plan = Plan("FULL_SHARD", units=units)
    unit_paths = plan.units.resolve(params.module, list(params))
    layout = build_layout(plan, (1,), 1, 1, params, unit_paths, _aliases(params.module, params))
    values = {}
    present = [u.path for u in layout.units if u.path]
    for _, full in unit_values(params.module, list(layout.units), present, seed, init_fn, torch.device(device)):
        values.update({n: t.detach().clone() for n, t in full.items()})
        del full
    # Put the values in place without breaking ties: every name of one parameter gets
    # the same new Parameter.
    fresh: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in fresh:
            fresh[id(p)] = nn.Parameter(values[name], requires_grad=p.requires_grad)
        sub_path, _, attr = name.rpartition(".")
        model.get_submodule(sub_path)._parameters[attr] = fresh[id(p)]
    for sub in model.modules():  # buffers: allocated, not initialised (see init_fn)
        for k, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[k] = torch.empty_like(b, device=device)
    return model
