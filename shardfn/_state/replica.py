"""ZeRO-1: the gathered parameters a SHARD_OPTIMIZER tree keeps between steps.

[Note: replicated parameters]
Under ``Strategy.SHARD_OPTIMIZER`` (ZeRO-1) every rank computes with the whole model, as
under NO_SHARD, but the optimizer state is sharded: the tree's shards are the master
values the optimizer updates, and each unit's full parameters (in the param dtype) are a
*replica* derived from them, kept with the tree from one step to the next. A step:

* forward and backward use the replica: no all-gather;
* each unit's gradients are reduce-scattered to this rank's shard (as SHARD_GRAD_OP);
* the optimizer updates the shards with its sharded state;
* each unit's updated shards are all-gathered into a new replica (:func:`refresh`).

So a step issues one reduce-scatter and one all-gather per unit (the first step one more
all-gather per unit, in forward: there is no replica yet), and each rank holds the full
parameters plus 1/N of the master values, gradients and optimizer state.

The replica is a cache, never the truth: the shards are. It is valid while every shard it
was gathered from is the same tensor at the same version (``_version``), so anything that
changes a shard outside the step (``checkpoint.load`` in place, ``apply_updates_`` after
``jit_grad``) makes the next use gather again instead of computing with stale values.
A tree made from another one's values (pytree utilities, ``replace``) keeps the replica of
each unit whose shards it still holds, and none for new tensors: its next step gathers those
units in forward ([Note: what a tree carries] in shardfn._state.sharded). The replica is set when
a tree is made (the step returns a new tree holding it) and never changed afterwards: a
``ShardedParams`` is immutable.
"""

from __future__ import annotations

from typing import Any

import torch

from .._comm import collectives as C
from .._comm.events import Purpose
from .packing import pack_shards, unpack_unit

__all__ = ["kept_for", "refresh", "replica_of"]


def _stamp(shards: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((id(s), s._version) for s in shards)


def replica_of(sharded: Any, index: int, shards: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Unit ``index``'s kept full parameters, if they are still those of ``shards``."""
    kept = sharded.replicas.get(index) if sharded.replicas else None
    if kept is None or kept[1] != _stamp(shards):
        return None
    return kept[0]


def kept_for(replicas: dict[int, Any] | None, sharded: Any) -> dict[int, Any] | None:
    """The units of ``replicas`` (of a tree of ``sharded``'s layout) whose shards in ``sharded``
    are the tensors they were gathered from, whatever their versions (see the note)."""
    if not replicas:
        return None
    units = {u.index: u for u in sharded.layout.units}
    kept = {i: (full, stamp) for i, (full, stamp) in replicas.items()
            if i in units and [id(sharded[n]) for n in units[i].leaves] == [ident for ident, _ in stamp]}
    return kept or None


def refresh(sharded: Any, to: Any, donated: bool) -> Any:
    """The tree with a new replica: every unit's (updated) shards all-gathered, one all-gather
    per unit, in layout order, cast to the param dtype on the way (see the note). A tree is
    never changed once made; a donated one (``jit_step(donate=True)``) hands its old replica
    over, so that the old and the new replica of one unit are alive at once, no more."""
    layout, mesh = sharded.layout, sharded.mesh
    if not layout.gathers:
        return sharded
    group, rank = mesh.channel("shard"), layout.shard_rank(mesh)
    replicas = sharded._donate_replicas() if donated else dict(sharded.replicas or {})
    with torch.no_grad():
        for u in layout.units:
            shards = [sharded[n] for n in u.leaves]
            out = torch.empty(layout.world, u.numel, dtype=u.param_dtype, device=mesh.device)
            pack_shards(out[rank], shards, layout.offloaded, to, u.name, layout.offsets(u, rank) if u.flat else None)
            C.all_gather(out.view(-1), out[rank], group, Purpose.REPLICA, u.name, to=to)
            # replaced unit by unit
            replicas[u.index] = (unpack_unit(out, [layout.leaves[n] for n in u.leaves], layout.world), _stamp(shards))
            del out
    return sharded._remade(sharded, _replicas=replicas)
