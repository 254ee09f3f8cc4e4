"""Ranks agreeing before they shard: the same layout, the same values.

Every rank builds its layout and reads its values alone; a difference (another model, a
seed set on one rank only, a different checkpoint) would otherwise surface as a hang or as
replicas that differ forever. Both checks are one small all-gather, and every rank raises.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from .._comm import collectives as C
from .._comm.events import Purpose
from .layout import Layout
from .._mesh import Mesh

__all__ = ["verify_agreement", "verify_same_values"]

_DISAGREE = (
    "[rank {rank}] shard(): ranks disagree about the layout (fingerprints by rank: {fps}). Every rank must "
    "call shard() with the same model, strategy, units and mesh, in the same order; ranks {bad} differ "
    "from rank 0. This is checked before any parameter collective, so nothing was corrupted."
)


def verify_agreement(layout: Layout, mesh: Mesh, salt: int = 0, hint: str = "") -> None:
    """Raises on every rank if any two ranks' layouts (or ``salt``) differ.

    One all-gather of an int64 per mesh axis, so every rank sees every fingerprint.
    """
    if mesh.size == 1 or mesh.backend == "fake":  # a fake world (planning) has one process and no data
        return
    fp = torch.tensor([layout.fingerprint() ^ salt], dtype=torch.int64, device=mesh.device)
    allfp = C.all_gather_mesh(fp, mesh, Purpose.LAYOUT).tolist()  # index i is mesh rank i
    if len(set(allfp)) > 1:
        bad = [r for r, f in enumerate(allfp) if f != allfp[0]]
        raise ValueError(_DISAGREE.format(rank=mesh.rank, fps=allfp, bad=bad) + (f"\nOn this rank: {hint}" if hint else ""))


_SAMPLE = 4096  # elements of each tensor that its value fingerprint reads


def _value_digest(t: torch.Tensor) -> int:
    """A fingerprint of a tensor's values: a hash of the bytes of up to 4096 elements spread
    over it (exact bytes, so the same values give the same digest on any hardware)."""
    flat = t.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE].contiguous().cpu()
    data = sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b""
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")


def verify_same_values(params: Mapping[str, torch.Tensor], layout: Layout, mesh: Mesh) -> None:
    """Raises on every rank if ranks pass different values for some tensor (a model built
    with a different seed on some rank): one all-gather of one int64 per tensor."""
    if mesh.size == 1 or mesh.backend == "fake":
        return
    names = [*layout.leaves, *layout.ignored, *layout.buffers]
    mine = torch.tensor([_value_digest(params[n]) for n in names], dtype=torch.int64, device=mesh.device)
    every = C.all_gather_mesh(mine, mesh, Purpose.LAYOUT).view(mesh.size, -1).cpu()
    differ = (every != every[0]).any(0).nonzero().flatten().tolist()
    if differ:
        first = names[differ[0]]
        groups: dict[int, list[int]] = {}
        for r in range(mesh.size):
            groups.setdefault(int(every[r, differ[0]]), []).append(r)
        raise ValueError(
            f"[rank {mesh.rank}] shard(): the ranks hold different values for {len(differ)} of the {len(names)} "
            f"tensors, first {first!r} (ranks {' vs '.join(str(g) for g in groups.values())} agree among "
            f"themselves). Every rank must pass the same initial values, or the replicas differ forever: seed every "
            f"rank the same before building the model (torch.manual_seed(0)), or pass shard(..., src_rank=0) to "
            f"take rank 0's values everywhere."
        )
