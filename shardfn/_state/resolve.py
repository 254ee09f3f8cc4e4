"""A plan resolved against a mesh and a state: the layout every rank agrees on.

``shard`` and ``reshard`` call :func:`layout_for` with the state (or meta tensors of its
shapes), then :func:`make_subgroups` once the ranks agree on the layout. The strategy's
rules are turned into per-unit facts here (which units, remat, what each unit does after
its forward), so the runtime reads the layout and not the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from .layout import Layout, build_layout
from .._parallel.tensor import local_state, resolve_tensor_parallel
from .._mesh import Mesh
from .plan import Plan, RematMode, Strategy
from .precision import check_norm_precision
from .tree import check_names, tree_info
from .units import check_unit_modules

__all__ = ["layout_for", "make_subgroups", "reshard_rules"]


def layout_for(state: Mapping[str, torch.Tensor], module: nn.Module | None, mesh: Mesh, plan: Plan,
               tensor_parallel: Any = None) -> Layout:
    """The layout of ``state`` (full tensors, or meta tensors of their shapes) under ``plan``
    on ``mesh``: units and remat resolved against the module tree, the mesh checked. With
    ``tensor_parallel`` (shardfn._parallel.tensor) the split leaves are laid out by their local pieces."""
    tensor = mesh.axis_size("tensor")
    styles, splits = resolve_tensor_parallel(tensor_parallel, module, state, tensor)
    if tensor > 1:
        state = local_state(state, splits, tensor, 0)  # (every tensor rank's piece has the same shape)
    info = tree_info(module, list(state))
    if module is not None:
        check_names(state.keys(), info.names, what="shard(params, ...)")
    unit_paths = plan.units.resolve(module, list(info.params))
    optional = plan.optional.resolve(module, list(info.params)) if plan.optional is not None else []
    unit_paths += [p for p in optional if p not in unit_paths]
    _check_optional_split(styles, optional)
    check_unit_modules(module, unit_paths)
    _check_mesh(plan.strategy, mesh)
    world = mesh.axis_size("shard") if plan.strategy.sharded else 1
    unit_modules = {p: module.get_submodule(p) for p in unit_paths} if module is not None else {}
    if module is not None:
        unit_modules[""] = module
    remat_units = plan.remat.select(module, list(info.params), unit_paths) if plan.remat is not None else {}
    layout = build_layout(plan, mesh.shape, world, mesh.data_size // world, state, unit_paths, info, unit_modules,
                          remat_units, frozenset(optional), reshard_rules(plan, unit_paths, world, mesh, remat_units))
    if styles:
        layout = dataclasses.replace(layout, tensor=styles, splits=splits)
    check_norm_precision(module, layout, mesh)
    return layout


def make_subgroups(layout: Layout, mesh: Mesh) -> None:
    """The process groups the layout's units reshard to after forward (every rank, in the
    same order, once the ranks agree on the layout: creating a group is collective)."""
    for size in sorted({u.subgroup for u in layout.units if u.subgroup is not None}):
        mesh.subgroup(size)


def reshard_rules(plan: Plan, unit_paths: list[str], world: int, mesh: Mesh,
                  remat: Mapping[str, Any]) -> dict[str, bool | int]:
    """Unit path -> what it does after its forward (``UnitLayout.reshard``).

    The strategy's rule (FULL_SHARD and HYBRID_SHARD let go, SHARD_GRAD_OP and
    HYBRID_SHARD_ZERO2 keep), replaced by ``Plan(reshard_after_forward=...)``: a bool for
    every unit, an int k to keep each unit sharded over groups of k ranks of the shard
    axis after forward (ZeRO++'s hpZ, FSDP2's ``reshard_after_forward=int``: backward's
    all-gather stays within the group, e.g. one node), or a dict unit name -> either, for
    those units (the others follow the strategy). The root unit always keeps its
    parameters into backward (see ``Layout.collectives_per_step``).
    """
    default = plan.strategy.reshard_after_forward
    rule = plan.reshard_after_forward
    if rule is None:
        return {p: default for p in unit_paths}
    if not plan.strategy.sharded:
        raise ValueError(f"shard(): reshard_after_forward={rule!r} with NO_SHARD, whose parameters are never sharded. "
                         "Drop it, or use FULL_SHARD / SHARD_GRAD_OP.")
    given = dict(rule) if isinstance(rule, tuple) else {p: rule for p in unit_paths}
    unknown = [k for k in given if k not in unit_paths]
    if unknown:
        raise ValueError(f"shard(): reshard_after_forward names {unknown}, which are not units of this plan; the "
                         f"units are {unit_paths[:8]}{' ...' if len(unit_paths) > 8 else ''} (the root unit always "
                         "keeps its parameters into backward).")
    for name, k in given.items():
        if k is True or k is False:
            continue
        if not (1 < k < world and world % k == 0):
            raise ValueError(
                f"shard(): reshard_after_forward={k} for {name!r}: a sub-group size must divide the {world} ranks "
                f"of the shard axis of {mesh!r} and lie strictly between 1 and {world} (e.g. the ranks of one "
                "node). Pass True to reshard over every rank, False to keep the parameters.")
        if remat.get(name) is RematMode.SELECTIVE:  # its secondary copy would be one op the replay lacks
            raise ValueError(
                f"shard(): reshard_after_forward={k} for {name!r}, which selective remat recomputes: selective "
                "remat replays the unit's ops one for one, and a sub-group reshard adds a copy to the forward only. "
                "Use Remat(mode='full') for it, or reshard_after_forward=True.")
    return {p: given.get(p, default) for p in unit_paths}


def _check_mesh(strategy: Strategy, mesh: Mesh) -> None:
    if strategy.hybrid and "replicate" not in mesh.axis_names:
        raise ValueError(
            f"shard(): {strategy.value} shards over the 'shard' axis and replicates over 'replicate' of a 2-D mesh, "
            f"but {mesh!r} is 1-D. Build the mesh with Mesh.from_env(replicate=R) (or replicate='nodes'), "
            "or use FULL_SHARD / SHARD_GRAD_OP on this mesh."
        )
    if not strategy.hybrid and "replicate" in mesh.axis_names:
        raise ValueError(
            f"shard(): {strategy.value} runs on a 1-D mesh, but {mesh!r} is 2-D. Use HYBRID_SHARD (or "
            "HYBRID_SHARD_ZERO2) on a 2-D mesh, or build a 1-D mesh with Mesh.from_env()."
        )


def _check_optional_split(styles: tuple[tuple[str, str], ...], optional: list[str]) -> None:
    """A split layer inside an optional unit is refused: its tensor collectives would run on
    the tensor groups whose data chose the unit only, and the ranks' histories of collectives
    (the schedule guard's, [Note: the schedule guard]) would differ by data."""
    inside = [(p, o) for p, _ in styles for o in optional if p == o or p.startswith(o + ".")]
    if inside:
        path, unit = inside[0]
        raise ValueError(f"shard(): {path!r} is split over the mesh's 'tensor' axis inside the optional unit {unit!r}: "
                         "its tensor collectives would run only where the data chose that unit, and the ranks could "
                         "not agree on one order of collectives. Leave the optional units' layers out of "
                         "tensor_parallel (split the layers around them), or drop optional= for that unit.")
