"""shard / gather, and the sharded tree they produce."""

from __future__ import annotations

import types

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .._comm import collectives as C
from .._comm.events import Purpose
from .layout import Layout
from .packing import kept_buffer, shard_buffer, unpack_leaf, with_gaps
from .._mesh import Mesh
from .offload import to_device_into
from .replica import kept_for
from .tree import TensorTree
from .verdict import check_alike, check_usable, unusable_on_failure

__all__ = ["ShardedParams", "gather", "shard"]

class ShardedParams(TensorTree):
    """This rank's state: a read-only mapping name -> tensor, plus its layout and mesh.

    Keys are the names of the model's state tree (see [Note: the state tree]): for each
    parameter, this rank's shard of it, shaped ``layout.shard_shape(name, rank)``: under
    ``Placement.FLAT`` (the default) a 1-D run of its elements (maybe empty), a view of its
    unit's shard buffer; under ``Placement.ROWS`` its dim-0 chunk, zero-padded (see
    [Note: placements]). For each buffer (``layout.buffers``), the whole buffer, replicated
    on every rank. It is a pytree node (``torch.utils._pytree``), so tree utilities see
    every tensor as a leaf.

    Example:
        >>> sharded = shard(params, mesh, "FULL_SHARD")
        >>> sharded["blocks.0.attn.qkv.weight"].shape     # (elements on this rank,)
        >>> print(sharded.layout)                          # units, bytes per rank, collectives
    """

    __slots__ = ("layout", "mesh", "module", "_replicas", "_verdict")

    def __init__(self, data: Mapping[str, torch.Tensor], layout: Layout, mesh: Mesh, module: nn.Module | None = None,
                 replicas: Mapping[int, Any] | None = None):
        self._data = dict(data)
        self.layout = layout
        self.mesh = mesh
        mesh.guard.learn(layout.names_by_id)  # so that a divergence names units only a peer ran
        self.module = module  # the model's module tree on the meta device (no state), when known
        # SHARD_OPTIMIZER's gathered units ([Note: replicated parameters]), set when the tree is
        # made (a step returns a new tree with them), never changed afterwards
        self._replicas: dict[int, Any] | None = dict(replicas) if replicas else None
        # the unread verdict of the step that made these values, with on_nonfinite="raise_next"
        # ([Note: a step that does not wait] in shardfn._state.verdict)
        self._verdict = None

    @property
    def replicas(self) -> Mapping[int, Any] | None:
        """SHARD_OPTIMIZER's kept full parameters by unit index (read-only; None for none)."""
        return types.MappingProxyType(self._replicas) if self._replicas is not None else None

    def replace(self, values: Mapping[str, torch.Tensor]) -> "ShardedParams":
        """A new tree with the same layout, some leaves replaced, carrying what this one knows
        (a step's unread verdict; SHARD_OPTIMIZER's replica of the units whose shards are the
        same): see [Note: what a tree carries]."""
        return self._remade({**self._data, **values})

    def _remade(self, data: Mapping[str, torch.Tensor], **changes: Any) -> "ShardedParams":
        """A tree of ``data`` with this one's fields, each carried by its rule, but those that
        ``changes`` sets (``reshard``: the layout and mesh) ([Note: what a tree carries])."""
        return _remade(data, _fields(self), **changes)

    def _with_verdict(self, verdict: Any) -> "ShardedParams":
        """This tree's values as a new tree that carries ``verdict``, the verdict of the step
        that made them (shardfn._state.verdict); its other fields as they are."""
        return self._remade(self._data, _verdict=verdict, _replicas=self._replicas)

    def _mark_unusable(self, verdict: Any) -> None:
        """A step on these values failed after its point of no return: they are not one model
        across the ranks (shardfn._state.verdict.Unusable) until a checkpoint is loaded into them."""
        self._verdict = verdict

    def _values_replaced(self) -> None:
        """Its values were overwritten in place (a checkpoint loaded into it): the verdict on
        the old ones goes (a replica goes by itself: shardfn._state.replica checks versions)."""
        self._verdict = None

    def _donate_replicas(self) -> dict[int, Any]:
        """Hands this donated tree's replica over, leaving it none (see shardfn._state.replica.refresh)."""
        kept, self._replicas = self._replicas or {}, None
        return kept

    def kept_tensors(self) -> list[torch.Tensor]:
        """Tensors the tree holds besides its leaves: SHARD_OPTIMIZER's replica of the full
        parameters (counted by :func:`shardfn.track_live_bytes`)."""
        return [t for full, _ in (self.replicas or {}).values() for t in full]

    def flat_units(self) -> list[tuple[torch.Tensor, tuple[str, ...]]]:
        """``(shard buffer, leaf names)`` of each trainable flat unit whose shards are still
        views of one buffer (see [Note: placements]; shardfn.optim [Note: fused updates])."""
        out = []
        for unit in self.layout.units:
            if unit.flat and unit.grad_numel and not self.layout.offloaded:
                base = kept_buffer([self._data[n] for n in unit.leaves], unit.numel, unit.dtype,
                                   self.layout.offsets(unit, self.layout.shard_rank(self.mesh)))
                if base is not None:
                    out.append((base, unit.leaves))
        return out

    def params(self) -> dict[str, torch.Tensor]:
        """The parameter shards only (no buffers); an ignored parameter whole."""
        return {n: self._data[n] for n in (*self.layout.leaves, *self.layout.ignored)}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers only."""
        return {n: self._data[n] for n in self.layout.buffers}

    def _set_buffers(self, values: Mapping[str, torch.Tensor]) -> None:
        # A module that replaced a buffer in a call outside a step (the in-place update of
        # a buffer reaches the tree by itself): the new tensor is the tree's from now on.
        self._data.update({n: v for n, v in values.items() if n in self.layout.buffers})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._data.values())

    def __repr__(self) -> str:
        buffers = f", {len(self.layout.buffers)} buffers" if self.layout.buffers else ""
        buffers += f", {len(self.layout.ignored)} ignored" if self.layout.ignored else ""
        return (
            f"ShardedParams({self.layout.strategy.value}, {len(self.layout.leaves)} parameters{buffers}, "
            f"{len(self.layout.units)} units, {self.nbytes / 2**20:.2f} MiB on rank {self.mesh.rank} of {self.mesh!r})"
        )


# [Note: what a tree carries]
# A tree is its values plus fields: its structure, which trees mapped together share, and
# what it knows of its values. Every path that makes a tree from another's values (pytree
# unflatten, replace, reshard, a step's refresh) goes through _remade, which carries each
# field by its rule here; a field in no table fails at import. The verdict is about the step
# that made the values, so it follows whatever is done to them. The replica is a cache of
# the shards that a step rebuilds when missing: a unit's is kept while the tree's shards of
# the unit are the tensors it was gathered from (replica_of checks versions at use), else
# dropped, so no tree holds a full copy of values it lacks. Trees mapped together make one
# with the first tree's fields: differing verdicts are read there (a non-finite one raises).
_STRUCTURE = ("layout", "mesh", "module")
# field -> its value in a new tree, from the fields of the tree it comes from and the new tree
_CARRIED: dict[str, Callable[[dict[str, Any], ShardedParams], Any]] = {
    "_verdict": lambda fields, tree: fields["_verdict"],
    "_replicas": lambda fields, tree: kept_for(fields["_replicas"], tree) if fields["layout"] is tree.layout else None,
}
if {*_STRUCTURE, *_CARRIED} != set(ShardedParams.__slots__):
    raise AssertionError(f"ShardedParams: every field must be structure or carried ([Note: what a tree carries]); "
                         f"unsorted: {sorted(set(ShardedParams.__slots__) - {*_STRUCTURE, *_CARRIED})}")


def _fields(tree: ShardedParams) -> dict[str, Any]:
    return {f: getattr(tree, f) for f in ShardedParams.__slots__}


def _remade(data: Mapping[str, torch.Tensor], fields: dict[str, Any], **changes: Any) -> ShardedParams:
    """A tree of ``data`` made from a tree with ``fields``; ``changes`` sets some fields."""
    assert set(changes) <= set(fields), f"[rank {fields['mesh'].rank}] not fields: {set(changes) - set(fields)}"
    tree = ShardedParams(data, *(changes.get(f, fields[f]) for f in _STRUCTURE))
    for name, carry in _CARRIED.items():
        setattr(tree, name, changes[name] if name in changes else carry(fields, tree))
    return tree


class _Context:
    """A flattened tree's keys and fields. Two are equal (the trees map together) when their
    keys and structure are; differing verdicts are read then ([Note: what a tree carries])."""

    __slots__ = ("keys", "fields")

    def __init__(self, keys: tuple[str, ...], fields: dict[str, Any]) -> None:
        self.keys, self.fields = keys, fields

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Context):
            return NotImplemented
        if self.keys != other.keys or any(self.fields[f] is not other.fields[f] and self.fields[f] != other.fields[f]
                                          for f in _STRUCTURE):
            return False
        check_alike(self.fields["_verdict"], other.fields["_verdict"], self.fields["mesh"].rank,
                    "tree_map over several ShardedParams (the result carries one verdict, so each is read)")
        return True

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        return f"<{len(self.keys)} leaves, {self.fields['layout'].strategy.value}, {self.fields['mesh']!r}>"


pytree.register_pytree_node(
    ShardedParams,
    lambda s: (list(s._data.values()), _Context(tuple(s._data), _fields(s))),
    lambda values, ctx: _remade(dict(zip(ctx.keys, values)), ctx.fields),
    serialized_type_name="shardfn.ShardedParams",
)


def unit_views(shards: dict[str, torch.Tensor], layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """[Note: placements]: the shards of each flat unit copied into one shard buffer of the
    unit, as views of it in order (so its all-gather sends the buffer as it is); the other
    units' shards as they are. ``shards`` is updated unit by unit, so that (when nothing else
    holds them) each unit's separate shards are freed before the next unit's buffer exists."""
    with torch.no_grad():
        for unit in layout.units:
            if not unit.flat or shard_buffer([shards[n] for n in unit.leaves], unit.numel, unit.dtype,
                                             layout.offsets(unit, rank)) is not None:
                continue  # (already laid out so)
            first = shards[unit.leaves[0]]
            buf = torch.zeros(unit.numel, dtype=unit.dtype, device=first.device)
            for n in unit.leaves:
                off, length = layout.piece(n, rank)
                view = buf[off : off + length]
                view.copy_(shards[n].detach().reshape(-1))
                shards[n] = view
    return shards


def gather(sharded: ShardedParams, *, rank0_only: bool = False, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict: exactly the keys of ``model.state_dict()``.

    Full parameters (a tied weight under each of its names, as ``state_dict()`` lists it)
    and the persistent buffers. Every rank must call it (it all-gathers unit by unit).
    With ``rank0_only`` the other ranks return ``{}``; ``device="cpu"`` moves each unit
    off the accelerator as it is gathered, so device memory stays near one unit.

    Example:
        >>> model.load_state_dict(gather(sharded, device="cpu"))     # strict, buffers included
    """
    if not isinstance(sharded, ShardedParams):
        raise TypeError(f"gather(sharded): expected the ShardedParams returned by shard(), got {type(sharded).__name__}")
    check_usable(sharded, "gather(sharded)")  # the same on every rank: nothing gathered
    layout, mesh = sharded.layout, sharded.mesh
    keep = not rank0_only or mesh.rank == 0
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad(), unusable_on_failure(sharded):
        # a split leaf's pieces are gathered over the tensor axis too, by every rank
        for _, full in full_units(layout, mesh, sharded, Purpose.STATE_DICT, unpack=keep or bool(layout.splits)):
            out.update(full)
        for s in layout.splits:
            out[s.leaf] = s.whole(out[s.leaf], mesh, Purpose.STATE_DICT, s.leaf)
        if not keep:
            out.clear()
        out = {n: t.to(device) if device is not None else t for n, t in out.items()}
        if keep:
            out.update({n: sharded[n].detach().to(device, copy=True) if device is not None else sharded[n].detach().clone()
                        for n, b in layout.buffers.items() if b.persistent})
    if not keep:
        return {}
    return {key: out[name] for key, name in layout.state_dict_keys if name in out}


def full_units(layout: Layout, mesh: Mesh, values: Mapping[str, torch.Tensor], purpose: Purpose,
               unpack: bool = True) -> Iterator[tuple[Any, dict[str, torch.Tensor]]]:
    """Each unit's full values, one unit at a time (every rank must iterate to the end).

    ``values`` maps leaf names to tensors shaped like their shards (the parameters, or an
    optimizer state's moments); a unit with none of them is skipped, and a leaf of the unit
    it lacks travels as zeros. One all-gather of the flat buffer per unit; ``unpack=False``
    takes part without unpacking (and yields nothing). Last, ``(None, values)`` of the
    ignored parameters among ``values``, whole already ([Note: ignored parameters]).
    """
    # One send and one receive buffer per dtype, sized for the largest unit and reused: each
    # rank holds one gathered unit at most, whenever the backend lets go of the last one's.
    # The dtype is the values' own, not the unit's (fp32 moments of a bf16 unit): each buffer
    # is sized by the units whose values travel in it.
    largest: dict[torch.dtype, int] = {}
    for unit in layout.units:
        present = [values[n] for n in unit.leaves if n in values]
        if present:
            largest[present[0].dtype] = max(largest.get(present[0].dtype, 0), unit.numel)
    buffers: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
    for unit in layout.units:
        names = [n for n in unit.leaves if n in values]
        if not names:
            continue
        if not layout.gathers:  # the shard is the whole tensor: nothing to gather
            if unpack:
                yield unit, {n: values[n].detach().reshape(layout.leaves[n].shape).clone() for n in names}
            continue
        ref = values[names[0]]
        if ref.dtype not in buffers:
            n_max = largest[ref.dtype]
            buffers[ref.dtype] = (torch.empty(n_max, dtype=ref.dtype, device=mesh.device),
                                  torch.empty(layout.world * n_max, dtype=ref.dtype, device=mesh.device))
        send, receive = buffers[ref.dtype]
        flat, got = send[: unit.numel], receive[: layout.world * unit.numel]
        rank = layout.shard_rank(mesh)
        parts = [(values[n].detach() if n in values else torch.zeros(layout.shard_shape(n, rank), dtype=ref.dtype,
                                                                     device=ref.device)).reshape(-1)
                 for n in unit.leaves]
        if unit.flat:  # each piece at its offset, zeros between and after ([Note: placements])
            parts = [p.to(flat.device) for p in parts]
            torch.cat(with_gaps(list(zip(layout.offsets(unit, rank), parts)), unit.numel, flat), out=flat)
        elif ref.device == flat.device:
            torch.cat(parts, out=flat)
        else:  # offloaded values (host memory): copied to the device, where the collective runs
            to_device_into(flat, parts, (), unit.name)
        C.all_gather(got, flat, mesh.channel("shard"), purpose, unit.name)
        if unpack:  # ranks that return nothing do not unpack
            # (a flat leaf is a view of the receive buffer, which the next unit reuses: copied)
            full = {n: unpack_leaf(got.view(layout.world, unit.numel), layout.leaves[n], layout.world) for n in names}
            if unit.flat:
                full = {n: t.clone() for n, t in full.items()}
            yield unit, full
            del full  # not kept alive by this frame while the next unit is gathered
    whole = {n: values[n].detach().clone() for n in layout.ignored if n in values}
    if whole and unpack:
        yield None, whole
