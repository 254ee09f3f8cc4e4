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

from .layout import Layout, build_layout, unit_owner
from .._parallel.tensor import local_state, resolve_tensor_parallel
from .._mesh import Mesh
from .plan import Plan, RematMode, Strategy
from .precision import check_norm_precision
from .tree import check_names, tree_info
from .units import check_unit_modules

__all__ = ["ignored_names", "layout_for", "make_subgroups", "reshard_rules"]


def layout_for(state: Mapping[str, torch.Tensor], module: nn.Module | None, mesh: Mesh, plan: Plan,
               tensor_parallel: Any = None, ignored: Any = None) -> Layout:
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
    outside = ignored_names(ignored, module, info, mesh, plan, state)
    unit_paths = plan.units.resolve(module, [n for n in info.params if n not in outside])
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
    recomputed = sorted(n for n in outside if unit_owner(n, unit_paths) in remat_units)
    if recomputed:  # a recompute runs in backward, outside the call that binds them
        raise ValueError(f"shard(ignored=...) with remat=: {', '.join(recomputed[:3])} would be recomputed in "
                         f"unit {unit_owner(recomputed[0], unit_paths) or '<root>'!r}, which binds its units' "
                         "parameters only; leave that unit out of remat=, or those parameters out of ignored=.")
    layout = build_layout(plan, mesh.shape, world, mesh.data_size // world, state, unit_paths, info, unit_modules,
                          remat_units, frozenset(optional), reshard_rules(plan, unit_paths, world, mesh, remat_units),
                          outside)
    if styles:
        layout = dataclasses.replace(layout, tensor=styles, splits=splits)
    check_norm_precision(module, layout, mesh)
    return layout


# [Note: ignored parameters]
# shard(ignored=...) keeps parameters outside the plan, as FSDP's ignored modules: each stays
# whole on every rank in no unit (never gathered, no flat buffer, no cast), and the call binds
# it as it is. Its gradient is autograd's own (taken with the shards' in one autograd.grad),
# summed over the micro-batches, then over the data ranks by one all-reduce per dtype after
# the backward, so every rank steps it alike and the step equals one process; FSDP leaves that
# reduction to the user, whose replicas drift apart without it. Whole on every rank, it counts
# once in a sum over the shards: sum_of_squares takes it on the ranks that hold the first
# shards only (the step's grad norm, clip_by_global_norm, on_shards). Checkpoints hold it as
# a replicated tensor of its global shape, so it loads into a plan that shards it, and back.
def ignored_names(ignored: Any, module: nn.Module | None, info: Any, mesh: Mesh, plan: Plan,
                  state: Mapping[str, torch.Tensor]) -> frozenset[str]:
    """The parameters ``shard(ignored=...)`` keeps outside the plan ([Note: ignored parameters]):
    those named, and every parameter under the modules it names (paths or classes)."""
    if ignored is None:
        return frozenset()
    items = list(ignored) if isinstance(ignored, (list, tuple, set, frozenset)) else [ignored]
    names, paths, types = set(), [], []
    for item in items:
        if isinstance(item, str):
            (names.add(item) if item in info.params else paths.append(item))
        elif isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        else:
            raise TypeError(f"shard(ignored={ignored!r}): expected parameter names, module paths or module classes; "
                            f"got {item!r}.")
    if (paths or types) and module is None:
        raise ValueError(f"shard(ignored={ignored!r}): module paths and classes need the module tree; pass the params "
                         "that functionalize(model) returned, or name the parameters.")
    if types:
        paths += [p for p, m in module.named_modules() if p and isinstance(m, tuple(types))]

    def under(alias: str) -> bool:
        return any(alias.startswith(p + ".") for p in paths)

    every = [a for n in info.params for a in info.aliases.get(n, (n,))]
    empty = [p for p in paths if not any(a.startswith(p + ".") for a in every)]
    if empty:
        raise ValueError(f"shard(ignored=...): {', '.join(map(repr, empty[:4]))} names no parameter (neither a "
                         f"parameter's name nor a module holding one); parameters look like {list(info.params)[:3]}.")
    chosen = set(names)
    for n in info.params:
        inside = [under(a) for a in info.aliases.get(n, (n,))]
        if all(inside):
            chosen.add(n)
        elif any(inside) and n not in chosen:
            raise ValueError(f"shard(ignored=...): parameter {n!r} is tied across the ignored modules and others "
                             f"({', '.join(info.aliases[n])}); ignore every module that holds it, or none.")
    if not chosen:
        if types:
            raise ValueError(f"shard(ignored={ignored!r}): no module of those classes holds a parameter.")
        return frozenset()
    if mesh.axis_size("tensor") > 1:
        raise ValueError(f"shard(ignored=...): on {mesh!r}, a mesh with a 'tensor' axis: ignored parameters are "
                         "not split over it yet; leave ignored= out, or drop the tensor axis.")
    if plan.precision.param is not None or plan.precision.reduce is not None or plan.precision.overrides:
        raise ValueError(f"shard(ignored=...) with precision={plan.precision!r}: ignored parameters are not cast, so "
                         "a unit's computed dtype would meet theirs; leave precision= out, or ignored= out.")
    low = sorted(n for n in chosen if state[n].requires_grad and state[n].dtype != torch.float32)
    if low:
        raise ValueError(f"shard(ignored=...): {', '.join(low[:3])} train in {state[low[0]].dtype}: their gradients "
                         "would be summed over the ranks in that dtype, rounding otherwise than one process; keep "
                         "ignored parameters that train in float32, or freeze them.")
    if plan.offload.enabled:
        raise ValueError("shard(ignored=...) with offload=: ignored parameters stay on the device and the "
                         "optimizer runs on the host; offload without ignored=, or ignore without offload.")
    return frozenset(chosen)


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
