"""Hugging Face weights out: shards to a directory ``from_pretrained`` reads.

[Note: exporting pretrained weights]
:func:`save_pretrained` gathers one unit at a time (every rank takes part) and rank 0
streams its tensors into safetensors files planned from the layout before anything is
gathered (see [Note: streamed safetensors]): rank 0 holds one gathered unit, never the
model. A tensor with several names (tied weights) is written once, under its first
``state_dict()`` key, as ``save_pretrained`` does. A leaf split over the tensor axis is
joined from every tensor rank's piece (every rank unpacks its unit and all-gathers it).
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.nn as nn

from .._comm import collectives as C
from .._comm import guard as G
from .._comm.events import Purpose
from .._state.layout import Layout
from .pretrained import keys_of, shape_of
from .._memory import parse_size
from .safetensors import INDEX, Writer
from .._state.sharded import ShardedParams, full_units
from .._state.split_pieces import global_shape
from .._state.verdict import check_verdict, unusable_on_failure

__all__ = ["save_pretrained", "write_config"]


def write_config(module: nn.Module | None, directory: str) -> None:
    """``config.json`` of a Hugging Face model, next to its weights."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(directory, "config.json"))


def _stale(directory: str) -> list[str]:
    """Weight files an earlier export left (an old index would win over new files)."""
    pattern = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors$")
    return [n for n in os.listdir(directory) if pattern.fullmatch(n) or n == INDEX]


def save_pretrained(sharded: Any, directory: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    trainable_only: bool = False, max_shard_size: int | str = "5GB") -> list[str]:
    """Writes the model's weights where ``from_pretrained`` finds them; every rank calls it.

    Parameters and persistent buffers go into ``model.safetensors``, or, above
    ``max_shard_size``, into ``model-0000i-of-0000n.safetensors`` files with
    ``model.safetensors.index.json``; ``config.json`` is written when the model has a
    Hugging Face config. Rank 0 writes unit by unit as each is gathered (it holds one
    unit of full tensors, never the model; see [Note: exporting pretrained weights]).

    Args:
        sharded: the :class:`ShardedParams` to export.
        directory: created if needed; weight files of an earlier export there are replaced.
        dtype: cast floating-point tensors to it (e.g. ``torch.bfloat16``); default: as trained.
        trainable_only: only the parameters that require grad (LoRA adapters), no buffers.
        max_shard_size: bytes per file, an int or a string like ``"5GB"`` / ``"500MB"``.

    Returns:
        The weight files written (on rank 0; ``[]`` elsewhere).

    Example:
        >>> sf.save_pretrained(sharded, "out/")
        >>> GPT2LMHeadModel.from_pretrained("out/")
    """
    if not isinstance(sharded, ShardedParams):
        raise TypeError(f"save_pretrained(sharded, ...): expected the ShardedParams from shard(), got {type(sharded).__name__}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"save_pretrained(dtype={dtype}): give a floating-point dtype (torch.bfloat16, torch.float16).")
    limit, directory = parse_size(max_shard_size, "save_pretrained(max_shard_size=...)"), os.fspath(directory)
    layout, mesh = sharded.layout, sharded.mesh
    rank0 = mesh.rank == 0
    check_verdict(sharded, "save_pretrained(sharded, ...)")  # the same on every rank: nothing written
    with unusable_on_failure(sharded), G.guarded(mesh):  # a write that fails on rank 0 reaches the others
        keys = keys_of(layout)
        leaves = [n for u in layout.units for n in u.leaves if layout.leaves[n].requires_grad or not trainable_only]
        leaves += [n for n, g in layout.ignored.items() if g.requires_grad or not trainable_only]
        if not leaves:
            raise ValueError(f"save_pretrained(trainable_only={trainable_only}): nothing to write: no parameter "
                             "requires grad.")
        buffers = [] if trainable_only else [n for n, b in layout.buffers.items() if b.persistent]

        def cast(t_dtype: torch.dtype) -> torch.dtype:
            return dtype if dtype is not None and t_dtype.is_floating_point else t_dtype

        plan = [(keys[n][0], tuple(global_shape(layout, n) if n not in layout.buffers else shape_of(layout, n)),
                 cast(_dtype(layout, n))) for n in (*leaves, *buffers)]
        splits = {s.leaf: s for s in layout.splits}
        writer = None
        if rank0:
            os.makedirs(directory, exist_ok=True)
            for stale in _stale(directory):
                os.remove(os.path.join(directory, stale))
            writer = Writer(directory, plan, limit)
            write_config(sharded.module, directory)
        with torch.no_grad():
            # a split leaf's pieces are gathered over the tensor axis too, by every rank
            for _, full in full_units(layout, mesh, {n: sharded[n] for n in leaves}, Purpose.STATE_DICT,
                                      unpack=rank0 or bool(splits)):
                for n, t in full.items():
                    if n in splits:
                        t = splits[n].whole(t, mesh, Purpose.STATE_DICT, n)
                    if rank0:
                        writer.write(keys[n][0], t.to(cast(t.dtype)))
                del full
            if rank0:
                for n in buffers:
                    writer.write(keys[n][0], sharded[n].to(cast(sharded[n].dtype)))
                writer.finish()
        C.barrier_mesh(mesh)
    return writer.files if rank0 else []


def _dtype(layout: Layout, name: str) -> torch.dtype:
    return ({**layout.buffers, **layout.ignored}[name] if name not in layout.leaves else layout.leaves[name]).dtype
