"""What the ranks of a tensor group must agree on: their batch, and the optional units they ran.

[Note: one batch per tensor group]
The ranks of a tensor group split each layer of one batch between them, so another batch
on one rank would add its partial sums into the others' without an error. An eager step
checks it without reading the device: each rank digests its batch where it lies (each
leaf's bits, weighted by position, summed modulo a prime, with the leaves' shapes and
dtypes), the digests travel in one all-gather on the tensor axis among the step's other
collectives (pipelined with them: no header of its own), and whether this rank's group saw
two digests rides on the metrics all-reduce as one more number. A step that reads its
metrics raises DivergenceError there, on every rank, before its update; a ``raise_next``
step carries it in its verdict, and what uses the shards next raises ([Note: a step that
does not wait] in shardfn._state.verdict). A graph step runs with a tensor axis on CPU meshes
only, and checks a CRC of the batch in one header before its program, on the host.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._comm import collectives as C
from .._comm import guard as G
from .._errors import DivergenceError
from .._comm.events import Purpose

__all__ = ["agree_on_batch", "agree_on_optional", "batch_digests", "other_batches"]

_PRIME = 2**31 - 1  # (bits mod P) x (weight mod P) < 2**62: no int64 overflows
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_OTHER_BATCHES = (
    "[rank {rank}] shardfn: the ranks of tensor group {ranks} got different batches (digests {digests}): they split "
    "each layer of one batch between them, and each rank's partial sums of another input would be added together. "
    "Give every rank of a tensor group the same batch: split_batch(batch, mesh.data_rank, mesh.data_size)."
)
_ANOTHER_GROUP = (
    "[rank {rank}] shardfn: the ranks of another tensor group got different batches (this group, {ranks}, agreed: "
    "digests {digests}), and this step's gradients are summed over all of them. Give every rank of a tensor group "
    "the same batch: split_batch(batch, mesh.data_rank, mesh.data_size)."
)
_NOTHING_CHANGED = " Nothing was updated."


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` as int64 numbers that differ where their bits differ."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.reshape(-1)
    if t.is_floating_point():
        t = t.contiguous().view(_INTS[t.element_size()])
    return t.to(torch.int64)


def batch_digests(batch: Any, rt: Any) -> torch.Tensor | None:
    """Every tensor rank's digest of its batch, ``[tensor size]`` int64 on the mesh's device,
    from one all-gather on the tensor axis; no value is read ([Note: one batch per tensor
    group]). None on a planning run's fake group (no values)."""
    mesh = rt.mesh
    ch = mesh.channel("tensor")
    if ch.off:
        return None
    total = torch.zeros((), dtype=torch.int64, device=mesh.device)
    shapes = []
    for i, leaf in enumerate(t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)):
        shapes.append((tuple(leaf.shape), str(leaf.dtype)))
        bits = _bits(leaf).remainder(_PRIME)
        weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device).mul_(48271 + 2 * i).add_(i + 1)
        digest = bits.mul_(weights.remainder_(_PRIME)).remainder_(_PRIME).sum().remainder(_PRIME)
        total = total + digest.to(total.device)
    total = total + zlib.crc32(repr(shapes).encode())
    got = torch.empty(ch.size, dtype=torch.int64, device=mesh.device)
    C.all_gather(got, total.reshape(1), ch, Purpose.BATCH, "", to=rt.observers, scope=rt.scope)
    return got


def other_batches(digests: torch.Tensor, mesh: Any) -> DivergenceError:
    """The error of a step in which a tensor group saw two digests (this rank's group's
    ``digests``, read on the host, as errors are)."""
    mine = digests.tolist()
    message = (_OTHER_BATCHES if len(set(mine)) > 1 else _ANOTHER_GROUP).format(
        rank=mesh.rank, ranks=list(mesh.channel("tensor").ranks), digests=mine)
    return DivergenceError(message + _NOTHING_CHANGED)


def agree_on_batch(batch: Any, mesh: Any, scope: G.Scope) -> None:
    """A graph step's check, before its program, on the host: raises DivergenceError on
    every rank of this rank's tensor group unless all of them got the same batch (a CRC-32
    of each tensor leaf's bytes in one header on the tensor axis). ``scope``: the caller's."""
    ch = mesh.channel("tensor")
    if ch.off:  # a planning run's fake group: no values to compare, nothing to exchange (as every guard header)
        return
    digest = 0
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().reshape(-1).cpu().contiguous().view(torch.uint8)
            digest = zlib.crc32(data.numpy().tobytes(), zlib.crc32(repr((leaf.shape, leaf.dtype)).encode(), digest))
    _agree(ch, mesh, digest, "the batch of a tensor group", _OTHER_BATCHES, scope)


def _agree(ch: Any, mesh: Any, digest: int, what: str, message: str, scope: G.Scope) -> None:
    """One header on the tensor axis with this rank's ``digest``; ranks whose digests differ
    all raise DivergenceError with ``message``, before anything changes."""
    digests = G.exchange_details(ch, digest, what, scope)
    if len(set(digests)) > 1:
        raise G.told(DivergenceError(message.format(rank=mesh.rank, ranks=list(ch.ranks), digests=digests)), ch)


_OTHER_UNITS = (
    "[rank {rank}] shardfn: the ranks of tensor group {ranks} ran different optional units in this step (digests "
    "{digests} of which ran): they hold the same values of the units' unsplit leaves, and a unit's gradients from "
    "one rank and none from another would leave them different without an error. A tensor group's ranks see one "
    "batch, so they skip a unit together unless the choice depends on something else (a random draw, the rank): "
    "make it depend on the batch alone."
)


def agree_on_optional(ran: list[tuple[int, bool]], mesh: Any, scope: G.Scope) -> None:
    """Raises DivergenceError on every rank of this rank's tensor group unless all of them
    ran the same optional units (``(unit index, whether its backward ran)``), before any of
    those units is reduced: one header on the tensor axis after each backward. ``scope``:
    the step's runtime's."""
    ch = mesh.channel("tensor")
    if ch.off:
        return
    _agree(ch, mesh, zlib.crc32(repr(ran).encode()), "the optional units a tensor group ran", _OTHER_UNITS, scope)
