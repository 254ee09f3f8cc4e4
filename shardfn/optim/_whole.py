"""What an optimizer that needs whole parameters may rely on, and the error when it may not.

[Note: whole-parameter optimizers]
An elementwise update (SGD, AdamW) gives the same result on any cut of a parameter, so it
runs on shards. Muon orthogonalises a whole matrix and Adafactor factors its second moment
by rows and columns: on a row block or a flat piece of a matrix they compute something
else, silently (2 ranks, FULL_SHARD: ``from_torch(torch.optim.Muon)`` ended 8.3e-2 away from
one-process Muon after 3 steps). So such a transformation calls :func:`require_whole` in its
``init``: every parameter it will update must be whole where its shard lives (``placement=
shardfn.whole(...)`` puts each such parameter whole on one rank, nothing of it elsewhere)
or not cut at all (NO_SHARD, a world of one). The layout is the same on every rank, so
every rank raises the same error, at ``init`` and again in a step's structure check,
before any state changes. A leaf split over the mesh's ``tensor`` axis (shardfn._parallel.tensor) is
never whole on one rank: a transformation that gathers its pieces itself (Muon: one
all-gather of the update's pieces over the tensor group, which holds the same placement on
every rank) passes ``tensor_ok=True``; for the others it stays cut.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["full_shape", "require_whole", "split_of", "whole_tensor"]

_CUT = (
    "{what}: {n} parameter(s) are cut into shards across the ranks of {mesh}, but {what} needs each one whole "
    "on one rank ({why}):\n{rows}\nFixes: shard with placement=shardfn.whole(lambda name, shape: len(shape) >= 2) "
    "(each matrix lives whole on one rank, spread over the ranks; any strategy), or use NO_SHARD; or give "
    "these parameters an elementwise optimizer (shardfn.optim.partition)."
)


def split_of(params: Mapping[str, torch.Tensor], name: str) -> Any:
    """Parameter ``name``'s shardfn._parallel.ops.Split if it is split over the tensor axis, else None."""
    return next((s for s in getattr(getattr(params, "layout", None), "splits", ()) if s.leaf == name), None)


def full_shape(params: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The global shape of parameter ``name``: from the layout of shards (a split leaf's
    whole, not this tensor rank's piece), else the tensor's."""
    split = split_of(params, name)
    return tuple(split.shape) if split is not None else _piece_shape(params, name)


def _piece_shape(params: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    """The shape of this tensor rank's piece of ``name`` (its global shape unless split)."""
    layout = getattr(params, "layout", None)
    if layout is not None and name in layout.leaves:
        return tuple(layout.leaves[name].shape)
    return tuple(params[name].shape)


def _cut(params: Mapping[str, torch.Tensor], name: str, tensor_ok: bool = False) -> bool:
    layout = getattr(params, "layout", None)
    if split_of(params, name) is not None and not tensor_ok:
        return True  # split over the tensor axis, and the caller does not gather its pieces (see the note)
    if layout is None or name not in layout.leaves or not layout.gathers:
        return False
    leaf = layout.leaves[name]
    return not (leaf.flat and layout.units[leaf.unit].whole)


def require_whole(params: Mapping[str, torch.Tensor], names: Iterable[str], what: str, why: str,
                  tensor_ok: bool = False) -> None:
    """Raises one ``ValueError`` naming every parameter of ``names`` that is cut across ranks
    (see the note); call it in ``init`` of a transformation that needs whole parameters.
    ``tensor_ok``: the caller gathers the pieces of a leaf split over the tensor axis itself."""
    cut = [n for n in names if _cut(params, n, tensor_ok)]
    split = [] if tensor_ok else [n for n in cut if split_of(params, n) is not None]
    if split:
        raise ValueError(f"{what}: {len(split)} parameter(s) are split over the mesh's 'tensor' axis "
                         f"({', '.join(split[:4])}{' ...' if len(split) > 4 else ''}), and {what} needs each one "
                         f"whole ({why}), and it does not gather their pieces. Use shardfn.optim.muon (it gathers "
                         "a split matrix over the tensor axis), or give them an elementwise optimizer "
                         "(shardfn.optim.partition); see docs/tensor-parallel.md.")
    if cut:
        rows = "\n".join(f"  {n}: shape {list(full_shape(params, n))}" for n in cut[:12])
        rows += f"\n  ... and {len(cut) - 12} more" if len(cut) > 12 else ""
        raise ValueError(_CUT.format(what=what, n=len(cut), mesh=getattr(params, "mesh", "the mesh"), why=why,
                                     rows=rows))


def whole_tensor(t: torch.Tensor, params: Mapping[str, Any], name: str) -> torch.Tensor | None:
    """``t`` (a shard, or a tensor shaped like it) as the whole parameter where this rank
    holds it (this tensor rank's whole piece of a split one), ``None`` where it holds nothing of it (a whole parameter on another rank)."""
    if t.numel() == 0:
        return None
    return t.view(_piece_shape(params, name))


def local_elements(t: torch.Tensor, params: Mapping[str, Any], name: str) -> tuple[torch.Tensor, int]:
    """``(elements, first)``: this rank's real elements of parameter ``name`` in ``t`` (its
    shard, or a tensor shaped like it) as a 1-D view, and the index of the first one in the
    parameter's row-major order. A flat shard is a run of them; a row shard's real rows come
    first (its padding rows are left out); an unsharded one is all of them."""
    layout = getattr(params, "layout", None)
    flat = t.reshape(-1)
    if layout is None or name not in layout.leaves or not layout.gathers:
        return flat, 0
    leaf = layout.leaves[name]
    rank = layout.shard_rank(params.mesh)
    if leaf.flat:
        span = layout.units[leaf.unit].numel
        off, n = leaf.piece(rank, span)
        return flat, (rank * span + off - leaf.start) if n else 0
    rows = leaf.local_rows(rank)
    return flat[: rows * leaf.row_numel], rank * leaf.chunk * leaf.row_numel
