"""Reducing: a unit's gradients, from every use in a step, into this rank's shard gradients.

[Note: one reduction per unit]
A unit may be used several times in one step: its module called twice in one forward,
``apply`` called twice in one ``loss_fn``, or once per micro-batch. Inside a step each
use's :class:`shardfn._group.gather.GatherUnit` node adds its gradients into the unit's unsharded
buffer (copy 3 of [Note: copies]) and returns nothing to autograd; after the backward of
the unit's last use (the count of nodes built in forward reaches zero) the buffer is
reduced once. So every use's contribution is in the one reduction, and nothing reads a
gradient before its collective is done. The price is the unsharded buffer, held from the
backward of the first use to that of the last (with ``accumulate=LOCAL``, over the
micro-batches).

Every rank must issue the same reductions in the same order, so a reduction that might
not come, or would come at a point that depends on the rank's data, is made after the
backward instead, on every rank in unit order: a node whose backward never ran (its output
did not reach the loss) leaves its unit to be reduced then with zero gradients, and an
optional unit (``Plan(optional=...)``) is reduced only then, with zeros where this rank did
not run it.

Outside a step (``apply`` under the user's own autograd) each node reduces its own use's
gradients at once, averaging, and hands them to autograd: the sum of the reduced uses is
the reduction of their sum. Case by case: docs/how-it-works.md, "Several calls of
``apply``: one reduction per unit".

[Note: overlapped reductions]
Inside a step a unit's reduction is issued asynchronously when it is one collective (not
hybrid's two in a row), so it runs while autograd computes the next unit; the next unit's
reduction waits for it before allocating its buffer, and the runtime waits for the last
right after the backward, so at most one unsharded gradient buffer is in flight.

[Note: copies], continued: reduce, once per unit and step (or micro-batch; trainable leaves only):
  3. pack, 1 copy, W*gn*r: one _chunk_cat writes every gradient into its columns of every
     rank's row, cast to the reduce dtype on the way, padding rows zeroed. Remains:
     autograd hands back one tensor per parameter and the collective takes one buffer
     (FSDP2: the same copy-in). Removed: one or two copy_ and a zero fill per leaf, plus
     the hidden copy reshape made of a non-contiguous gradient. (A second use of the unit
     in the step packs into a temporary buffer and adds it: one more copy and an add.)
  4. cast back, only if the reduce dtype is not the master dtype: 1 copy, gn*m (autograd
     and the optimizer want a leaf's gradient in the leaf's dtype). None for
     Precision(param=bf16, reduce=fp32) or in fp32.
  A world of one without replicas reduces nothing and packs nothing (UnitGrads._own):
  autograd's gradients become the shards' gradients as they are; only the casts of 4.
  (to the reduce dtype, back to the master dtype, leaf by leaf) remain, and a clone of
  a gradient that is non-contiguous or shares memory with another one. A flat unit
  whose gradients are cast makes them once per unit: one cat into a gn-element buffer
  in the reduce dtype (gn*r), and the cast of that buffer to the master dtype (gn*m)
  where they differ; the gradients are views of it (one kernel each, not one per leaf).
  The reduce-scatter writes a fresh shard-sized output, not a view of its input: the
  optimizer's gradients are views of it, and a view would keep the W-times larger input
  alive until the update.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._state.plan import Reduction
from .._state.offload import to_host
from .._state.packing import pack_unit, storage_key

__all__ = ["UnitGrads"]


class UnitGrads:
    """The gradients of one unit during a runtime (see [Note: one reduction per unit]): what
    its backward packs, and the shard gradients a reduction gives. Its reductions are
    issued and waited for by its unit group (shardfn._group.group)."""

    __slots__ = ("unit", "nodes", "graphed", "acc", "replicate", "bucket", "plain")

    def __init__(self, unit: Any, bucket: Any = None):
        self.unit = unit
        # Gradients are averaged over the other ranks holding the same shard: the
        # "replicate" axis of the mesh, or the shard axis under NO_SHARD.
        self.replicate = unit.mesh.channel("replicate") if "replicate" in unit.mesh.axis_names else unit.channel
        self.nodes = 0  # GatherUnit nodes built in forward whose backward has not run
        self.graphed = False  # a node was built since the last reduction
        self.acc: Any = None  # the unsharded gradient buffer (a world of one: a list of per-leaf gradients)
        self.bucket = bucket  # the shardfn._group.buckets.ReduceBucket it reduces in ([Note: buckets]), in a step
        # a world of one without replicas: nothing to reduce (see [Note: copies] 4.)
        self.plain = unit.layout.reduction is Reduction.NONE

    def count_node(self) -> None:
        self.nodes += 1
        self.graphed = True

    def accumulate(self, grads: tuple[torch.Tensor | None, ...], owned: set[int]) -> None:
        """Adds one use's gradients: packed into the unsharded buffer, or, in a world of one,
        kept as the shards' own (``owned``: the storages of gradients handed out so far)."""
        unit = self.unit
        lay, u, leaves = unit.layout, unit.unit, unit.leaves
        device = unit.device  # the compute device (the shards may be in host memory: offload)
        if self.plain:
            self._own(grads, leaves, device, owned)
            return
        buf = self._packed(grads, leaves, lay.world, device)
        self.acc = buf if self.acc is None else self.acc.add_(buf)

    def _packed(self, grads: tuple[torch.Tensor | None, ...], leaves: list, rows: int,
                device: torch.device) -> torch.Tensor:
        """One copy (see [Note: copies]): the unit's gradients in a ``[rows, grad_numel]``
        buffer of the reduce dtype, each straight into its columns of every rank's row
        (``rows``: the world) or, in a flat unit, at its offset; cast on the way, padding zeroed."""
        u = self.unit.unit
        part = self.bucket.part(self.unit) if self.bucket is not None and self.acc is None else None
        if part is not None:  # NO_SHARD: straight into the unit's part of the bucket's buffer
            buf = part.view(1, -1)
        else:
            buf = torch.empty(rows, u.grad_numel, dtype=u.reduce_dtype, device=device)
        kept = [(g, leaf) for g, leaf in zip(grads, leaves) if leaf.grad_offset >= 0]
        pack_unit(buf, [g if g is not None else torch.zeros(leaf.shape, dtype=u.param_dtype, device=device)
                        for g, leaf in kept], rows, [leaf.start for _, leaf in kept] if u.flat else None)
        return buf

    def _own(self, grads: tuple[torch.Tensor | None, ...], leaves: list, device: torch.device, owned: set[int]) -> None:
        """A world of one, nothing to reduce: autograd's gradients are the shards' own.

        No buffer and no copy (see [Note: copies]) unless one is needed: the casts to the
        reduce dtype and back to the master dtype, a non-contiguous gradient, or one whose
        memory another gradient of the step shares (autograd may hand the same tensor to
        two parameters, ``x + a + b``; the step adds micro-batch gradients into the first
        and the in-place optimizer uses them as scratch, so each must own its memory).
        """
        u = self.unit.unit
        if self.acc is None and u.flat and any(
                g is not None and (g.dtype != u.reduce_dtype or u.reduce_dtype != u.dtype) for g in grads):
            # a flat unit whose gradients are cast: one cast for the unit, into one buffer
            # (the shard's layout), not one per leaf
            flat = self._packed(grads, leaves, 1, device).view(-1).to(u.dtype)
            owned.add(storage_key(flat))
            self.acc = [flat[leaf.start:leaf.start + math.prod(leaf.shape)].view(
                self.unit.layout.shard_shape(leaf.path, self.unit.rank)) if leaf.grad_offset >= 0 else None
                for leaf in leaves]
            return
        acc = self.acc or [None] * len(leaves)
        layout, rank, reduce_dtype, cast = self.unit.layout, self.unit.rank, u.reduce_dtype, u.reduce_dtype != u.dtype
        for j, (g, leaf) in enumerate(zip(grads, leaves)):
            if leaf.grad_offset < 0:
                continue
            shape = layout.shard_shape(leaf.path, rank)
            if g is None:
                g = torch.zeros(shape, dtype=u.dtype, device=device)
                key = storage_key(g)
            else:
                g = g.detach() if g.requires_grad else g
                if cast or g.dtype != reduce_dtype:  # (else both casts return g)
                    g = g.to(reduce_dtype).to(u.dtype)
                key = storage_key(g) if acc[j] is None else None
                if acc[j] is None and (key in owned or not g.is_contiguous()):
                    g = g.clone(memory_format=torch.contiguous_format)
                    key = storage_key(g)
            if acc[j] is None:
                owned.add(key)
                acc[j] = g if g.shape == shape else g.view(shape)  # (a leaf's own shape: a 1-D or an unflattened one)
            else:
                acc[j].add_(g.view(shape))
        self.acc = acc

    def to_master(self, out: Any, to: tuple[Any, ...]) -> Any:
        """A finished reduction in the master dtype (copy 4, when the reduce dtype differs);
        with offload, copied to the host in that dtype instead (one copy per unit, per leaf
        in a world of one: see [Note: offload])."""
        lay, u = self.unit.layout, self.unit.unit
        if isinstance(out, list):
            return [to_host(g, g.dtype, to, u.name) if g is not None else None for g in out] if lay.offloaded else out
        return to_host(out, u.dtype, to, u.name) if lay.offloaded else out.to(u.dtype)

    def shard_grads_list(self, out: Any) -> list[torch.Tensor | None]:
        """The shard gradient of every leaf of the unit (``None`` for frozen ones), from a
        reduction that :meth:`to_master` finished."""
        u, leaves = self.unit.unit, self.unit.leaves
        if isinstance(out, list):
            return out
        if u.flat:  # [Note: placements]: the gradient shard buffer is laid out as the shard buffer
            pieces = [leaf.piece(self.unit.rank, u.numel) for leaf in leaves]
            return [out[off : off + n] if leaf.grad_offset >= 0 else None for leaf, (off, n) in zip(leaves, pieces)]
        return [
            out[leaf.grad_offset : leaf.grad_offset + leaf.shard_numel].view(leaf.shard_shape)
            if leaf.grad_offset >= 0 else None
            for leaf in leaves
        ]

    def shard_grads(self, out: Any) -> dict[str, torch.Tensor]:
        """Leaf name -> shard gradient, trainable leaves only."""
        return {n: g for n, g in zip(self.unit.unit.leaves, self.shard_grads_list(out)) if g is not None}
