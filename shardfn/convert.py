"""Converts between a shardfn checkpoint and a Hugging Face safetensors directory, in one process.

    python -m shardfn.convert CKPT_DIR OUT_DIR     # checkpoint -> directory from_pretrained reads
    python -m shardfn.convert HF_DIR CKPT_DIR      # safetensors (file or directory) -> checkpoint

The direction follows from the source: a directory with ``shardfn.json`` is a checkpoint
(:func:`shardfn.checkpoint.save`), anything else is read as safetensors. No process group
and no cluster: DCP reads and writes the checkpoint with ``no_dist=True``, at any world
size it was written with.

Checkpoint to safetensors: every file is checked against the digests recorded at save
time first; the parameters and persistent buffers are read through DCP one output file at
a time (``--max-shard-size``, default 5GB: so the process holds one file's worth, never
the model) and written under their parameter names (a tied weight once, as
``save_pretrained`` does), with ``config.json`` when the checkpoint has one. Optimizer
state and ``extra`` are not part of a model directory and are left out.

Safetensors to checkpoint: the tensors are written as one replicated DCP checkpoint that
:func:`shardfn.checkpoint.load` reads into any layout (0-d tensors as buffers, the rest as
parameters: ``load`` reads a model's persistent buffer from either).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp

from ._io.checkpoint import _FORMAT, _META, _SELF, _changed, _corrupted, _digest, _meta_digest, _publish, _read_meta
from ._io.checkpoint import _SafeReader
from ._compat import written_files
from ._memory import parse_size
from ._io.safetensors import Source, Writer

__all__ = ["checkpoint_to_safetensors", "main", "safetensors_to_checkpoint"]


def checkpoint_to_safetensors(src: str, dst: str, dtype: torch.dtype | None = None,
                              max_shard_size: int | str = "5GB") -> list[str]:
    """Writes the parameters and persistent buffers of checkpoint ``src`` into ``dst``; returns the files."""
    meta = _read_meta(src)
    damaged = _changed(src, meta.get("digests") or {})
    if damaged:
        raise _corrupted(src, damaged)
    stored = _SafeReader(src).read_metadata().state_dict_metadata
    names = [("params", n, tuple(s)) for n, s in meta["params"].items()]
    names += [("buffers", n, tuple(s)) for n, s in meta.get("buffers", {}).items()]

    def cast(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    plan = [(n, shape, cast(stored[f"{kind}/{n}"].properties.dtype)) for kind, n, shape in names]
    os.makedirs(dst, exist_ok=True)
    writer = Writer(dst, plan, parse_size(max_shard_size, "max_shard_size"))
    for file in writer.files:  # one output file's tensors in memory at a time
        group = [(kind, n, shape) for kind, n, shape in names if writer.file_of[n] == file]
        state = {f"{kind}/{n}": torch.empty(stored[f"{kind}/{n}"].size, dtype=stored[f"{kind}/{n}"].properties.dtype)
                 for kind, n, _ in group}
        dcp.load(state, storage_reader=_SafeReader(src), no_dist=True)
        for kind, n, shape in group:
            writer.write(n, state.pop(f"{kind}/{n}").reshape(shape).to(cast(stored[f"{kind}/{n}"].properties.dtype)))
    writer.finish()
    if os.path.isfile(os.path.join(src, "config.json")):
        shutil.copyfile(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    return writer.files


def safetensors_to_checkpoint(src: str, dst: str) -> int:
    """Writes the tensors of safetensors ``src`` as a shardfn checkpoint at ``dst``; returns how many."""
    source = Source(src, "shardfn.convert")
    try:
        state = {}
        for key, (_, shape, _) in source.entries.items():
            state[f"{'params' if shape else 'buffers'}/{key}"] = source.rows(key, 0, shape[0] if shape else 1).clone()
    finally:
        source.close()
    partial = dst + ".partial"
    if os.path.exists(partial):
        shutil.rmtree(partial)
    dcp.save(state, checkpoint_id=partial, no_dist=True)
    files = written_files(partial)
    meta = {
        "format": _FORMAT,
        "strategy": "NO_SHARD",
        "mesh": [1],
        "params": {k.split("/", 1)[1]: list(t.shape) for k, t in state.items() if k.startswith("params/")},
        "buffers": {k.split("/", 1)[1]: list(t.shape) for k, t in state.items() if k.startswith("buffers/")},
        "extra": {"converted_from": os.path.abspath(src)},
        "extra_tensors": [],
        "digests": {name: _digest(os.path.join(partial, name)) for name in files},
    }
    meta[_SELF] = _meta_digest(meta)
    config = os.path.join(src if os.path.isdir(src) else os.path.dirname(src), "config.json")
    if os.path.isfile(config):
        shutil.copyfile(config, os.path.join(partial, "config.json"))
    with open(os.path.join(partial, _META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    _publish(partial, dst)
    return len(state)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardfn.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a shardfn checkpoint directory, or safetensors (a file, or a directory of them)")
    p.add_argument("dst", help="the directory to write")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="checkpoint -> safetensors: cast "
                   "floating-point tensors")
    p.add_argument("--max-shard-size", default="5GB", help="checkpoint -> safetensors: bytes per file (default 5GB)")
    args = p.parse_args(argv)
    try:
        if os.path.isfile(os.path.join(args.src, _META)):
            files = checkpoint_to_safetensors(args.src, args.dst, getattr(torch, args.dtype) if args.dtype else None,
                                              args.max_shard_size)
            print(f"wrote {len(files)} safetensors file(s) to {args.dst} ({', '.join(files)}); optimizer state and "
                  "extra values are not part of a model directory and were left out")
        else:
            n = safetensors_to_checkpoint(args.src, args.dst)
            print(f"wrote a shardfn checkpoint of {n} tensors to {args.dst} (load it with shardfn.checkpoint.load)")
    except (ValueError, OSError) as e:
        print(f"shardfn.convert: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
