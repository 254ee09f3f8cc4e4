"""Optimizer state laid out like the shards, and in-place updates run once per buffer.

[Note: fused updates]
A flat unit's shards are views of one shard buffer ([Note: placements] in
shardfn._state.layout), its gradients views of one reduced buffer at the same offsets. State
built by :func:`zeros_like_views` is laid out the same way: the moments of a unit's leaves
are views of one zero buffer of the unit's shape. An elementwise in-place update
(``adamw``'s and ``sgd``'s ``update_``) may then run once on the buffers instead of once
per leaf: one kernel per unit and operation, where a per-leaf loop issues one per leaf
(on a GPU, each is a launch). :func:`fused_groups` finds the units where that is exact:

* ``params`` is the whole tree (``ShardedParams.flat_units`` lists its flat units whose
  shards are still views of one buffer), and every leaf of the unit is being updated (a
  ``masked`` optimizer passes a subset, which is never fused);
* in the gradients and in every state dict, the unit's leaves are views of one contiguous
  buffer of the unit's size (or of such a window of a larger one: a bucket's reduced
  gradients), at the same offsets as in the shard buffer, in the dtype the update needs.

The elements of a buffer that no leaf covers are the unit's padding: zero in the shards
(``shard`` writes zeros), the gradients (the reduction sums zeros there) and the state,
so an elementwise update leaves them zero (AdamW: a zero moment over ``eps``; SGD: zero).
Every other leaf goes through the per-leaf lists as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["fused_groups", "zeros_like_views"]


def zeros_like_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``zeros_like`` of each tensor, where tensors that are views of one buffer become
    views of one new zero buffer at the same offsets (see the note)."""
    new: dict[int, torch.Tensor] = {}
    out = {}
    for k, t in tensors.items():
        base = t._base
        if base is None or t.is_meta or not base.is_contiguous():
            out[k] = torch.zeros_like(t)
            continue
        if id(base) not in new:
            new[id(base)] = torch.zeros_like(base)
        out[k] = new[id(base)].as_strided(t.shape, t.stride(), t.storage_offset() - base.storage_offset())
    return out


def _at(view: torch.Tensor, base: torch.Tensor) -> int | None:
    """``view``'s element offset in ``base`` (a buffer, or a window of one) when it is a
    contiguous view inside it, else None."""
    root = base._base if base._base is not None else base
    if view._base is not root or not view.is_contiguous():
        return None
    at = view.storage_offset() - base.storage_offset()
    return at if 0 <= at and at + view.numel() <= base.numel() else None


def _window(t: torch.Tensor | None, param: torch.Tensor, base: torch.Tensor) -> torch.Tensor | None:
    """The unit-sized window of ``t``'s contiguous base that holds the unit's leaves where
    ``param`` sits in ``base`` (the whole base, or, for gradients reduced in a bucket
    ([Note: buckets]), the unit's part of the bucket's output); None if there is none."""
    tb = t._base if t is not None else None
    if tb is None or tb.dim() != 1 or not tb.is_contiguous():
        return None
    start = tb.numel() if _at(t, tb) is None or _at(param, base) is None else _at(t, tb) - _at(param, base)
    if start < 0 or start + base.numel() > tb.numel():
        return None
    return tb[start : start + base.numel()]


def fused_groups(keys: Sequence[str], params: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor],
                 states: Sequence[Mapping[str, torch.Tensor]], dtype: torch.dtype | None = None,
                 ) -> tuple[list[tuple[tuple[str, ...], list[torch.Tensor]]], list[str]]:
    """``(groups, rest)``: each group is ``(its keys, [param buffer, grad buffer, *state
    buffers])`` for a unit whose update may run on its buffers (see the note); ``rest`` are
    the other keys, in order. ``dtype``: the dtype the gradients must have (the state's)."""
    flat_units = getattr(params, "flat_units", None)
    if flat_units is None:
        return [], list(keys)
    wanted = set(keys)
    groups, fused = [], set()
    for base, names in flat_units():
        if not names or not set(names) <= wanted:
            continue
        first = names[0]
        trees = [grads, *states]
        bases = []
        for tree in trees:  # (the first that has no window ends the look: per-leaf gradients at world 1)
            bases.append(_window(tree[first] if first in tree else None, params[first], base))
            if bases[-1] is None:
                break
        if bases[-1] is None or (dtype is not None and bases[0].dtype != dtype):
            continue
        placed = [n for n in names if params[n].numel()]  # (an empty piece's offset does not matter)
        if all(_at(tree[n], b) == _at(params[n], base) is not None for n in placed for tree, b in zip(trees, bases)):
            groups.append((tuple(names), [base.view(-1), *bases]))
            fused.update(names)
    return groups, [k for k in keys if k not in fused]
