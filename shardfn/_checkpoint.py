"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), and exports.

[Note: checkpoint format]
A checkpoint is a directory written by DCP plus ``shardfn.json``. Each parameter is saved
as a DTensor built over this rank's shard without its padding rows: ``Shard(0)`` over
the ``shard`` axis (``Replicate()`` over ``replicate``, or everywhere under NO_SHARD).
shardfn's dim-0 chunks are DTensor's (ceil-sized chunks, the last ones short), so DCP
records every parameter by its global shape and offsets, and a load into any other
layout — world size, strategy, mesh — reads exactly the rows each rank needs.
Optimizer-state tensors stored under a parameter's name and shaped like its shard are
saved the same way; other state tensors (step counts, the loss scale) as replicated
tensors. Persistent buffers (those in ``model.state_dict()``) are saved whole, as
replicated tensors (DCP writes each once); non-persistent ones are rebuilt with the
model. ``extra`` keeps JSON-able values in ``shardfn.json`` and tensors (RNG states) in
DCP. Format 1 (before buffers were saved) still loads: its buffers keep the values of
the tree they are loaded into, with a warning that names them.

Saves are atomic: ranks write into ``<path>.partial``; after every rank is done, rank 0
writes ``shardfn.json`` last and renames the directory into place (an existing
checkpoint is moved aside first and removed only after the rename), so a save that dies
midway never damages the last good checkpoint, and a directory without ``shardfn.json``
is never taken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _collectives as C
from ._sharded import ShardedParams, gather
from .optim._protocol import param_leaves

__all__ = ["export_safetensors", "load", "save"]

_FORMAT = "shardfn-checkpoint-2"
_READABLE = ("shardfn-checkpoint-1", _FORMAT)
_META = "shardfn.json"
_NO_BUFFERS = (
    "checkpoint.load({path!r}): the checkpoint holds no values for {n} persistent buffers of the model "
    "({names}); they keep the values of the tree loaded into. It was written by a shardfn that did not "
    "save buffers (format {fmt}): BatchNorm statistics and other running buffers are not restored. Save a "
    "new checkpoint to keep them."
)


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: load only the classes DCP's metadata is made of.

    Everything else a checkpoint holds is tensors (read with ``weights_only=True``) and
    JSON, so loading a checkpoint never runs code from the file.
    """

    _TORCH = {"Size", "strided", "sparse_coo", "contiguous_format", "channels_last", "preserve_format"}

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
            or (module == "torch" and (name in self._TORCH or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                                  ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's metadata; refusing to "
                "load it (the file may have been tampered with)."
            )
        return super().find_class(module, name)


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _placements(sharded: ShardedParams) -> list:
    layout, mesh = sharded.layout, sharded.mesh
    if not layout.strategy.sharded:
        return [Replicate()] * mesh.ndim
    return [Shard(0) if axis == "shard" else Replicate() for axis in mesh.axis_names]


def _dtensor(local_shard: torch.Tensor, sharded: ShardedParams, name: str) -> DTensor:
    """A DTensor view of this rank's real rows of a parameter-shaped shard."""
    layout = sharded.layout
    leaf = layout.leaves[name]
    local = local_shard[: layout.local_rows(name, layout.shard_rank(sharded.mesh))]
    shape = torch.Size(leaf.shape or (1,))  # a 0-d parameter is saved as one row
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, sharded.mesh.device_mesh, _placements(sharded), shape=shape, stride=stride)


def _persistent(sharded: ShardedParams) -> list[str]:
    return [n for n, b in sharded.layout.buffers.items() if b.persistent]


def _state_dict(sharded: ShardedParams, opt_state: Any, extra_tensors: Mapping[str, torch.Tensor],
                buffers: list[str] | None = None) -> dict[str, Any]:
    leaves = sharded.layout.leaves
    out: dict[str, Any] = {f"params/{n}": _dtensor(sharded[n].detach(), sharded, n) for n in leaves}
    out.update({f"buffers/{n}": sharded[n].detach() for n in (_persistent(sharded) if buffers is None else buffers)})
    for path, name, leaf in param_leaves(opt_state):
        key = f"opt/{path}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"checkpoint: optimizer state leaf opt_state{path} is a {type(leaf).__name__}; "
                "only tensor leaves can be saved (shardfn.optim's optimizers keep tensors only; from_torch's "
                "state holds a torch optimizer: save state.optimizer.state_dict() yourself)."
            )
        if name in leaves and tuple(leaf.shape) == leaves[name].shard_shape:
            out[key] = _dtensor(leaf.detach(), sharded, name)
        else:
            out[key] = leaf
    out.update({f"extra/{k}": v for k, v in extra_tensors.items()})
    return out


def _group(sharded: ShardedParams):
    # A mesh over the whole world uses the default group; a 1-D sub-mesh its own.
    import torch.distributed as dist

    return None if sharded.mesh.size == dist.get_world_size() else sharded.mesh.group("shard")


def save(path: str | os.PathLike, sharded: ShardedParams, opt_state: Any = None, extra: Mapping[str, Any] | None = None) -> None:
    """Saves parameters, persistent buffers, optimizer state and ``extra`` at ``path``.

    Every rank calls it and writes only its own shards (buffers are written once).
    ``opt_state`` may be ``None`` (parameters and buffers only). ``extra`` holds user
    metadata: JSON-able values (step, data position) and tensors (RNG states). The
    checkpoint loads at any world size and strategy (see :func:`load`).

    Example:
        >>> save("ckpt/step-100", sharded, opt_state, extra={"step": 100, "rng": torch.get_rng_state()})
    """
    if not isinstance(sharded, ShardedParams):
        raise TypeError(f"checkpoint.save expects the ShardedParams from shard(), got {type(sharded).__name__}")
    extra = dict(extra or {})
    tensors = {k: v for k, v in extra.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in extra.items() if k not in tensors}
    try:
        json.dumps(values)
    except TypeError as e:
        raise TypeError(f"checkpoint.save: extra values must be tensors or JSON-serialisable ({e}).") from None
    path = os.fspath(path)
    partial, group, rank0 = path + ".partial", _group(sharded), sharded.mesh.rank == 0
    if rank0 and os.path.exists(partial):
        shutil.rmtree(partial)  # what a save that died left behind
    C.barrier(group)
    dcp.save(_state_dict(sharded, opt_state, tensors), checkpoint_id=partial, process_group=group)
    C.barrier(group)
    if rank0:
        meta = {
            "format": _FORMAT,
            "strategy": sharded.layout.strategy.value,
            "mesh": list(sharded.mesh.shape),
            "params": {n: list(leaf.shape) for n, leaf in sharded.layout.leaves.items()},
            "buffers": {n: list(sharded.layout.buffers[n].shape) for n in _persistent(sharded)},
            "extra": values,
            "extra_tensors": sorted(tensors),
        }
        with open(os.path.join(partial, _META), "w") as f:
            json.dump(meta, f, indent=1)
        _publish(partial, path)
    C.barrier(group)


def _publish(partial: str, path: str) -> None:
    old = path + ".old"
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(partial, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def _read_meta(path: str) -> dict[str, Any]:
    meta_file, dcp_file = os.path.join(path, _META), os.path.join(path, ".metadata")
    missing = [f for f in (meta_file, dcp_file) if not os.path.exists(f)]
    if missing:
        hint = " A save that did not finish leaves <path>.partial instead." if os.path.exists(path + ".partial") else ""
        raise ValueError(
            f"checkpoint.load: {path!r} is not a complete shardfn checkpoint: missing {missing}.{hint} "
            "Load an earlier checkpoint."
        )
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format") not in _READABLE:
        raise ValueError(
            f"checkpoint.load: {meta_file} has format {meta.get('format')!r}; this shardfn reads {list(_READABLE)}."
        )
    return meta


def load(path: str | os.PathLike, sharded: ShardedParams, opt_state: Any = None) -> tuple[ShardedParams, Any, dict[str, Any]]:
    """Loads a checkpoint into the layout of ``sharded`` and ``opt_state``.

    ``sharded`` and ``opt_state`` give the target layout (any world size, strategy or
    mesh; build them as for training, e.g. ``shard(params, mesh, ...)`` and
    ``opt.init(sharded)``); their values (parameters, persistent buffers, optimizer
    state; ``opt_state`` may be ``None``) are replaced in place and returned, with the
    ``extra`` that was saved.

    Raises:
        ValueError: the checkpoint is incomplete or damaged, or its parameters' or
            buffers' names or shapes differ from ``sharded``'s (every differing one is
            named).

    A checkpoint of format 1 (written before buffers were saved) loads with a warning
    naming the buffers it lacks; they keep the values ``sharded`` has.

    Example:
        >>> sharded, opt_state, extra = load("ckpt/step-100", sharded, opt_state)
    """
    path = os.fspath(path)
    meta = _read_meta(path)
    saved = {n: tuple(s) for n, s in meta["params"].items()}
    target = {n: leaf.shape for n, leaf in sharded.layout.leaves.items()}
    problems = [f"  {n}: missing from the checkpoint" for n in target if n not in saved]
    problems += [f"  {n}: in the checkpoint but not in these params" for n in saved if n not in target]
    problems += [
        f"  {n}: checkpoint shape {saved[n]}, these params {target[n]}" for n in target if n in saved and saved[n] != target[n]
    ]
    saved_buffers = {n: tuple(s) for n, s in meta.get("buffers", {}).items()}
    persistent = _persistent(sharded)
    target_buffers = {n: sharded.layout.buffers[n].shape for n in persistent}
    problems += [f"  {n}: buffer in the checkpoint but not in these params" for n in saved_buffers
                 if n not in target_buffers]
    problems += [f"  {n}: checkpoint buffer shape {saved_buffers[n]}, these params {target_buffers[n]}"
                 for n in target_buffers if n in saved_buffers and saved_buffers[n] != target_buffers[n]]
    if problems:
        raise ValueError(f"checkpoint.load({path!r}): the parameters do not match:\n" + "\n".join(problems))
    lacking = [n for n in persistent if n not in saved_buffers]
    if lacking:
        warnings.warn(_NO_BUFFERS.format(path=path, n=len(lacking), names=", ".join(lacking[:8]) + (" ..." if len(lacking) > 8 else ""),
                                         fmt=meta["format"].rsplit("-", 1)[-1]), stacklevel=2)
    extra_tensors = {k: torch.empty(0) for k in meta["extra_tensors"]}
    state = _state_dict(sharded, opt_state, extra_tensors, [n for n in persistent if n in saved_buffers])
    for k in extra_tensors:  # their sizes come from the checkpoint's own metadata
        state.pop(f"extra/{k}")
    _dcp_load(path, state, sharded)
    extra = dict(meta["extra"])
    if extra_tensors:
        extra.update(_load_extra_tensors(path, list(extra_tensors), sharded))
    return sharded, opt_state, extra


def _load_extra_tensors(path: str, keys: list[str], sharded: ShardedParams) -> dict[str, torch.Tensor]:
    md = _SafeReader(path).read_metadata()
    state = {}
    for k in keys:
        info = md.state_dict_metadata[f"extra/{k}"]
        state[f"extra/{k}"] = torch.empty(info.size, dtype=info.properties.dtype)
    _dcp_load(path, state, sharded)
    return {k: state[f"extra/{k}"] for k in keys}


def _dcp_load(path: str, state: dict[str, Any], sharded: ShardedParams) -> None:
    # DCP reports any rank's failure on every rank, as a BaseException: make it a ValueError.
    try:
        dcp.load(state, storage_reader=_SafeReader(path), process_group=_group(sharded))
    except CheckpointException as e:
        raise ValueError(f"checkpoint.load({path!r}) failed: {e}") from None


def export_safetensors(path: str | os.PathLike, sharded: ShardedParams) -> None:
    """Writes the full state dict to one safetensors file (rank 0 writes; all ranks call).

    Full parameters and persistent buffers, gathered unit by unit to CPU on rank 0
    (:func:`shardfn.gather`), so no accelerator holds more than one unit of full
    parameters. A tensor with several names (tied weights) is written once, under its
    first name, as ``safetensors.torch.save_model`` does (safetensors refuses shared
    tensors); load it with ``load_state_dict(..., strict=False)`` or re-tie after
    loading. Needs ``pip install safetensors``.
    """
    full = gather(sharded, rank0_only=True, device="cpu")
    if sharded.mesh.rank == 0:
        from safetensors.torch import save_file

        once: dict[str, str] = {}  # each tensor under its first state-dict key
        for key, name in sharded.layout.state_dict_keys:
            once.setdefault(name, key)
        save_file({key: full[key].contiguous() for key in once.values() if key in full}, os.fspath(path))
    C.barrier(_group(sharded))

