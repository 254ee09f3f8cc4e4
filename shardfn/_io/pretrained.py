"""Hugging Face weights in: safetensors straight into this rank's shards.

[Note: loading pretrained weights]
``shard(params, mesh, strategy, weights=path)`` builds the layout from ``params`` (real or
meta tensors: only names, shapes and dtypes are used), then each rank reads from the
safetensors files only the rows of each parameter it owns (``get_slice(key)[lo:hi]`` on the
memory-mapped file), unit by unit, casting to the parameter's dtype; persistent buffers are
read whole. No rank holds more than its shards plus one parameter's rows in flight.

Names are matched as ``model.load_state_dict`` would: a parameter or persistent buffer is
found under any of its ``state_dict()`` keys (a tied ``lm_head.weight`` under
``transformer.wte.weight``, which is how ``save_pretrained`` stores it). Every missing,
unexpected and mis-shaped key is listed in one error, raised on every rank (every rank
reads the same file headers, which the layout agreement checks), before any tensor is read.
Non-persistent buffers (rotary ``inv_freq``) are not in such files: they keep their values
when ``params`` holds real ones; meta ones are initialised as ``shard(seed=...)`` would
(``reset_parameters()``, then ``init_fn``: for a Hugging Face model pass
``init_fn=model._init_weights``), a unit at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from .._state.layout import Layout, unit_owner
from .._state.materialize import unit_values, units_with_buffers
from .safetensors import Source
from .._state.split_pieces import global_shape

__all__ = ["keys_of", "read_weights", "shape_of"]


def keys_of(layout: Layout) -> dict[str, list[str]]:
    """Tensor name -> the keys it may be found under: its state_dict() keys, itself first."""
    keys: dict[str, list[str]] = {n: [n] for n in (*layout.leaves, *layout.ignored, *layout.buffers)}
    for key, name in layout.state_dict_keys:
        if key not in keys[name]:
            keys[name].append(key)
    for name, aliases in layout.aliases.items():
        keys[name] += [a for a in aliases if a not in keys[name]]
    return keys


def shape_of(layout: Layout, name: str) -> tuple[int, ...]:
    """``name``'s shape in the model (a split leaf's whole shape, shardfn._parallel.tensor)."""
    return layout.buffers[name].shape if name in layout.buffers else global_shape(layout, name)


def match(source: Source, layout: Layout, mesh: Any) -> dict[str, str]:
    """Tensor name -> its key in ``source``; raises naming every key that does not fit."""
    found, missing, bad_shape = {}, [], []
    for name, keys in keys_of(layout).items():
        key = next((k for k in keys if k in source.entries), None)
        if key is not None:
            found[name] = key
            if source.entries[key][1] != tuple(shape_of(layout, name)):
                bad_shape.append(f"{key}: file {list(source.entries[key][1])}, model {list(shape_of(layout, name))}")
        elif name not in layout.buffers or layout.buffers[name].persistent:
            missing.append(name)
    used = set(found.values())
    unexpected = sorted(k for k in source.entries if k not in used)
    if missing or unexpected or bad_shape:
        parts = [f"{title} ({len(items)}):\n" + "\n".join(f"    {x}" for x in items)
                 for title, items in (("missing from the file", missing), ("in the file but not in the model",
                                      unexpected), ("shapes differ", bad_shape)) if items]
        # transformers writes a mixture of experts' fused 3-D weights one expert at a time
        per_expert = any(re.search(r"\.experts\.\d+\.", k) for k in unexpected) and any(
            re.search(r"\.experts\.[a-z_]+$", n) for n in missing)
        raise ValueError(
            f"shard(weights={source.path!r}) on {mesh!r}: the weights do not fit the model:\n  "
            + "\n  ".join(parts) + "\nBuild the model from the same config the weights were saved with "
            "(config.json next to them), and pass the params functionalize(model) returns for it."
            + ("\nThe file holds experts one at a time (transformers' own save_pretrained writes them so), and "
               "the model fuses them into 3-D weights, which shard(weights=) reads only as they are: load the "
               "model with transformers' from_pretrained and pass the params functionalize(model) returns, "
               "without weights= (or save it once with sf.save_pretrained, which writes the fused weights)."
               if per_expert else "")
        )
    return found


def read_weights(source: Source, layout: Layout, mesh: Any, params: Mapping[str, torch.Tensor],
                 module: nn.Module | None, init_fn: Any) -> dict[str, torch.Tensor]:
    """This rank's shards and buffers, read from ``source`` (see [Note: loading pretrained weights])."""
    found = match(source, layout, mesh)
    rank, device = layout.shard_rank(mesh), mesh.device
    out: dict[str, torch.Tensor] = {}
    for unit in layout.units:
        # a flat unit's pieces are read straight into its shard buffer ([Note: placements])
        buf = torch.zeros(unit.numel, dtype=unit.dtype, device=device) if unit.flat else None
        for name in unit.leaves:
            rows = _rows_of(source, found[name], layout, name, mesh)
            if buf is not None:
                off, n = layout.piece(name, rank)
                out[name] = _read_shard(rows, layout, name, rank, device, buf[off : off + n])
            else:
                out[name] = _read_shard(rows, layout, name, rank, device)
    for name, g in layout.ignored.items():  # whole on every rank ([Note: ignored parameters])
        out[name] = source.rows(found[name], 0, g.shape[0] if g.shape else 1).to(device, g.dtype, copy=True)
    rest = []
    for name, b in layout.buffers.items():
        if name in found:
            out[name] = source.rows(found[name], 0, b.shape[0] if b.shape else 1).to(device, b.dtype, copy=True)
        elif not params[name].is_meta:
            out[name] = params[name].detach().to(device, copy=True)
        else:
            rest.append(name)
    if rest:
        out.update(_init_buffers(rest, layout, module, init_fn, device))
    return out


def _rows_of(source: Source, key: str, layout: Layout, name: str, mesh: Any) -> Callable[[int, int], torch.Tensor]:
    """``rows(lo, hi)``: rows of leaf ``name`` as this rank's layout holds it, read from
    ``key`` of the file: for a split leaf, of this tensor rank's block (shardfn._parallel.tensor)."""
    split = next((s for s in layout.splits if s.leaf == name), None)
    if split is None:
        return lambda lo, hi: source.rows(key, lo, hi)
    tensor, rank = mesh.axis_size("tensor"), mesh.axis_rank("tensor")
    if split.dim == 0:  # the piece's rows: a run of the file's rows per packed part ([Note: packed splits])
        block = split.shape[0] // tensor
        return lambda lo, hi: torch.cat([source.rows(key, at, at + k) for _, at, k in split.runs(lo, hi, rank, block)])
    return lambda lo, hi: split.piece(source.rows(key, lo, hi), tensor, rank)


def _read_shard(rows_of: Callable[[int, int], torch.Tensor], layout: Layout, name: str, rank: int,
                device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of ``name`` from ``rows_of`` (:func:`_rows_of`; a flat one written into ``out``)."""
    leaf = layout.leaves[name]
    if leaf.flat:  # a run of the flattened parameter: the rows it touches, then the run ([Note: placements])
        span = layout.units[leaf.unit].numel
        off, n = leaf.piece(rank, span)
        shard = torch.zeros(n, dtype=leaf.dtype, device=device) if out is None else out
        if n:
            lo = rank * span + off - leaf.start
            inner = leaf.row_numel
            first, end = lo // inner, -(-(lo + n) // inner)
            rows = rows_of(first, end).reshape(-1)
            shard.copy_(rows[lo - first * inner : lo - first * inner + n])
        return shard
    shard = torch.zeros(leaf.shard_shape, dtype=leaf.dtype, device=device)
    k = leaf.local_rows(rank)
    if k:
        rows = rows_of(rank * leaf.chunk, rank * leaf.chunk + k)
        shard[:k].copy_(rows.reshape(k, *leaf.shape[1:]))
    return shard


def _init_buffers(names: list[str], layout: Layout, module: nn.Module | None, init_fn: Any,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """Meta non-persistent buffers, initialised as deferred init does, one unit at a time."""
    if module is None:
        raise ValueError(
            f"shard(weights=...): the non-persistent buffers {names[:4]} are on the meta device and are not in the "
            "file; pass the params functionalize(model) returned (its module tree initialises them)."
        )
    present = [u.path for u in layout.units if u.path]
    owners = {unit_owner(n, present) for n in names}
    units = [u for u in units_with_buffers(layout) if u.path in owners]
    out = {}
    for _, values in unit_values(module, units, 0, init_fn, device, what="shard(weights=...)", only=set(names)):
        out.update({n: values[n].detach().clone() for n in names if n in values})
    return out
