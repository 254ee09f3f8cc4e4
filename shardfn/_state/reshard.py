"""reshard: the same state under another plan or mesh of the same world, in memory.

[Note: resharding]
``reshard`` computes the target layout exactly as ``shard`` does (from the layout's global
shapes and the module tree the tree keeps), checks that every rank agrees on it, then
moves the values unit by unit: one all-gather of the old unit's shards gives its full
tensors (a NO_SHARD source already holds them), from which each rank keeps its rows under
the new layout. Optimizer-state tensors laid out like the parameter shards (AdamW's
moments, SGD's momentum) move the same way, one all-gather per unit and state tensor
group; scalars (step counts, the loss scale) stay as they are. A leaf split over a tensor
axis is joined from its tensor ranks' pieces, and cut again for the target's tensor rank
when the target splits it. Only copies: the result is bitwise the same state. At most one
unit's full values live at a time, beside the old and the new shards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .._comm.events import Purpose
from .tree import Params
from .layout import Layout
from .._mesh import Mesh
from .offload import place_on_host
from .plan import Plan, Strategy, make_plan
from .agreement import verify_agreement
from .resolve import layout_for, make_subgroups
from .sharded import ShardedParams, full_units, unit_views
from .split_pieces import global_shape
from .._parallel.tensor import local_state

__all__ = ["reshard"]


def reshard(
    sharded: ShardedParams,
    opt_state: Any = None,
    plan: Plan | Strategy | str | None = None,
    *,
    mesh: Mesh | None = None,
    units: Any = None,
    precision: Any = None,
    remat: Any = None,
    optional: Any = None,
    offload: Any = None,
    reshard_after_forward: Any = None,
    placement: Any = None,
    bucket_bytes: Any = None,
    tensor_parallel: Any = None,
) -> tuple[ShardedParams, Any]:
    """The same parameters, buffers and optimizer state under another plan or mesh.

    Every rank calls it. The world stays the same (to change the number of ranks, save a
    checkpoint and load it there). Build a new step for the result: a step belongs to one
    layout.

    Args:
        sharded: this rank's state (from :func:`shardfn.shard` or a step).
        opt_state: its optimizer state, or ``None``. Tensors laid out like the shards move
            with them; other leaves (counts, the loss scale) are kept.
        plan: the target strategy or :class:`shardfn.Plan`; default the current plan.
        mesh: the target mesh (same number of ranks; e.g. a 2-D mesh for HYBRID_SHARD);
            default the current one.
        units, precision, remat, optional, offload, reshard_after_forward, placement, bucket_bytes:
            :class:`shardfn.Plan`'s fields, as in :func:`shardfn.shard`: each one given
            replaces the plan's.
        tensor_parallel: the layers to split when the target mesh has a ``"tensor"`` axis,
            as in :func:`shardfn.shard`; default the tree's own (a tree without a tensor
            axis must name them). Ignored on a mesh without one: the leaves become whole.

    Returns:
        ``(sharded, opt_state)`` under the new layout, bitwise equal to the inputs as full
        tensors (see [Note: resharding]); new tensors, sharing no memory with the inputs.

    Example:
        >>> sharded, opt_state = shardfn.reshard(sharded, opt_state, "SHARD_GRAD_OP")
        >>> step = shardfn.jit_step(loss_fn, mesh, optimizer=opt)
    """
    if not isinstance(sharded, ShardedParams):
        raise TypeError(f"reshard(sharded, ...): expected the ShardedParams from shard(), got {type(sharded).__name__}")
    old, old_mesh = sharded.layout, sharded.mesh
    mesh = mesh or old_mesh
    if mesh.size != old_mesh.size:
        raise ValueError(
            f"reshard(): {mesh!r} has {mesh.size} ranks and the shards live on {old_mesh!r} with {old_mesh.size}. "
            "reshard keeps the world; to change the number of ranks, save a checkpoint (shardfn.checkpoint.save) "
            "and load it into shards made on the new world."
        )
    plan = make_plan(plan if plan is not None else old.plan, units=units, precision=precision, remat=remat,
                     optional=optional, offload=offload, reshard_after_forward=reshard_after_forward,
                     placement=placement, bucket_bytes=bucket_bytes)
    # What shard() needs to build the layout: the global shapes (meta) and the buffers.
    stand_in = Params({
        n: torch.empty(global_shape(old, n), dtype=leaf.dtype, device="meta").requires_grad_(leaf.requires_grad)
        for n, leaf in old.leaves.items()
    })
    stand_in.update({n: torch.empty(g.shape, dtype=g.dtype, device="meta").requires_grad_(g.requires_grad)
                     for n, g in old.ignored.items()})
    stand_in.update({n: sharded[n] for n in old.buffers})
    if mesh.axis_size("tensor") > 1 and tensor_parallel is None and old.tensor:
        tensor_parallel = dict(old.tensor)  # the same layers split, over the target's tensor axis
    layout = layout_for(stand_in, sharded.module, mesh, plan,
                        tensor_parallel if mesh.axis_size("tensor") > 1 else None, list(old.ignored) or None)
    verify_agreement(layout, mesh)
    make_subgroups(layout, mesh)
    params = _move(old, old_mesh, sharded.params(), layout, mesh)
    if not layout.offloaded:
        unit_views(params, layout, layout.shard_rank(mesh))
    for n, leaf in (*layout.leaves.items(), *layout.ignored.items()):
        params[n].requires_grad_(leaf.requires_grad)
    buffers = {n: sharded[n].detach().clone() for n in layout.buffers}
    # the same values: what the tree knows of them goes with them ([Note: what a tree carries])
    new = sharded._remade({**params, **buffers}, layout=layout, mesh=mesh)
    return new, _move_state(opt_state, old, old_mesh, layout, mesh)


def _move(old: Layout, old_mesh: Mesh, values: dict[str, torch.Tensor], new: Layout, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Leaf name -> its shard under ``new``, from shards under ``old`` (one unit at a time)."""
    rank, old_splits = new.shard_rank(mesh), {s.leaf: s for s in old.splits}
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for _, full in full_units(old, old_mesh, values, Purpose.RESHARD):
            for n, t in full.items():
                if n in new.ignored:  # whole before and after ([Note: ignored parameters])
                    out[n] = t
                    continue
                if n in old_splits:  # the whole leaf from its tensor ranks' pieces (every rank)
                    t = old_splits[n].whole(t, old_mesh, Purpose.RESHARD, n)
                t = local_state({n: t}, [s for s in new.splits if s.leaf == n], mesh.axis_size("tensor"),
                                mesh.axis_rank("tensor"))[n]
                out[n] = new.local_shard(n, t, rank, t.device)
                if new.offloaded:  # [Note: offload]
                    out[n] = place_on_host(out[n], mesh.device)
            del full
    return out


def _move_state(opt_state: Any, old: Layout, old_mesh: Mesh, new: Layout, mesh: Mesh) -> Any:
    if opt_state is None:
        return None
    flat, spec = pytree.tree_flatten_with_path(opt_state)
    groups: dict[str, dict[str, int]] = {}  # container path -> leaf name -> index in flat
    for i, (path, leaf) in enumerate(flat):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"reshard(): optimizer state leaf opt_state{pytree.keystr(path)} is a {type(leaf).__name__}, not a "
                "tensor (from_torch's state holds a torch optimizer): it cannot be resharded. Re-initialise it with "
                "opt.init(new_sharded), or keep shardfn.optim's optimizers."
            )
        key = path[-1] if path else None
        name = key.key if isinstance(key, pytree.MappingKey) else None
        if name in old.leaves and tuple(leaf.shape) == old.shard_shape(name, old.shard_rank(old_mesh)):
            groups.setdefault(pytree.keystr(path[:-1]), {})[name] = i
    # New tensors throughout, moved or not (counts, the loss scale): a step that updates the
    # result in place must not reach into the state it came from.
    leaves = [leaf.detach().clone() for _, leaf in flat]
    for members in groups.values():
        moved = _move(old, old_mesh, {n: leaves[i] for n, i in members.items()}, new, mesh)
        for n, i in members.items():
            leaves[i] = moved[n]
    return pytree.tree_unflatten(leaves, spec)
