"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

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
checkpoint is moved to ``<path>.old`` first and removed only after the rename), so a
directory without ``shardfn.json`` is never taken for a checkpoint. A save killed between
the two renames leaves the last good checkpoint only at ``<path>.old``: ``load(path)`` and
``latest`` then read it there (read only: no rank renames anything while others load).

[Note: digests]
Format 3 records in ``shardfn.json`` the sha256 of every file DCP wrote (the ``.distcp``
files and ``.metadata``), computed by rank 0 after every rank has written (so the
directory must be on a filesystem all ranks share, as DCP already needs for ``.metadata``
and for loading at another world size), and the sha256 of ``shardfn.json``'s own content.
``load`` checks ``shardfn.json`` and ``.metadata`` on every rank before using them, and the
data files split among the ranks (file ``i`` on rank ``i % size``) inside DCP's planning
step, before any rank reads a tensor: DCP hands every rank's failure to every rank, so all
raise the same error and none loads corrupted values.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._comm import collectives as C
from .._comm import guard as G
from .._compat import written_files
from .export import write_config
from .._state.pieces import LoadPlanner, Pieces, SavePlanner
from .._state.sharded import ShardedParams
from .._state.split_pieces import global_shape, split_pieces
from .._state.verdict import check_verdict, unusable_on_failure
from ..optim._protocol import param_leaves

__all__ = ["latest", "load", "save"]

_FORMAT = "shardfn-checkpoint-3"
_READABLE = ("shardfn-checkpoint-1", "shardfn-checkpoint-2", _FORMAT)
_META = "shardfn.json"
_SELF = "meta_digest"  # shardfn.json's key for the digest of the rest of shardfn.json
_NO_BUFFERS = (
    "checkpoint.load({path!r}): the checkpoint holds no values for {n} persistent buffers of the model "
    "({names}); they keep the values of the tree loaded into. It was written by a shardfn that did not "
    "save buffers (format {fmt}): BatchNorm statistics and other running buffers are not restored. Save a "
    "new checkpoint to keep them."
)
_UNVERIFIED = (
    "Format {fmt} records no digests: the checkpoint is loaded unverified (a damaged file would load "
    "silently). Save it again to get a verified checkpoint."
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
                f"checkpoint.load: the metadata refers to {module}.{name}, which is not part of DCP's metadata; refusing to "
                "load it (the file may have been tampered with)."
            )
        return super().find_class(module, name)


class _Corrupt(ValueError):
    """Raised by a rank whose share of the data files fails its digest (args: the file names)."""


def _digest(file: str) -> str:
    with open(file, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def _meta_digest(meta: Mapping[str, Any]) -> str:
    text = json.dumps({k: v for k, v in meta.items() if k != _SELF}, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _changed(path: str, digests: Mapping[str, str]) -> list[str]:
    """The files of ``digests`` under ``path`` that are missing or whose content changed."""
    return [name for name, want in digests.items()
            if not os.path.isfile(os.path.join(path, name)) or _digest(os.path.join(path, name)) != want]


def _corrupted(path: str, names: list[str]) -> ValueError:
    what = [f"  {os.path.join(path, n)}: " + ("changed since it was saved (sha256 mismatch)"
                                               if os.path.exists(os.path.join(path, n)) else "missing")
            for n in sorted(names)]
    return ValueError(
        f"checkpoint.load({path!r}): the checkpoint is damaged, nothing was loaded:\n" + "\n".join(what) + "\n"
        f"Do not use it: move {path!r} out of its directory and load the newest checkpoint that remains "
        "(shardfn.checkpoint.latest(directory) finds it), or restore the files from a backup."
    )


class _SafeReader(dcp.FileSystemReader):
    """DCP's reader, with a safe ``.metadata`` unpickler and, given ``check`` (file name ->
    digest), a check of those files in DCP's planning step, before any rank reads data."""

    def __init__(self, path: str, check: Mapping[str, str] | None = None) -> None:
        super().__init__(path)
        self._dir, self._check = path, dict(check or {})
        # A refused .metadata, kept to be raised as itself: torch 2.11's dcp.load catches what
        # read_metadata raises and fails later with "metadata is None" (2.13 passes it on).
        self.refused: pickle.UnpicklingError | None = None

    def prepare_local_plan(self, plan: Any) -> Any:
        bad = _changed(self._dir, self._check)
        if bad:
            raise _Corrupt(*bad)
        return super().prepare_local_plan(plan)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                self.refused = e
                raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _placements(sharded: ShardedParams) -> list:
    layout, mesh = sharded.layout, sharded.mesh
    if not layout.sharded:
        return [Replicate()] * mesh.ndim
    return [Shard(0) if axis == "shard" else Replicate() for axis in mesh.axis_names]


def _dtensor(local_shard: torch.Tensor, sharded: ShardedParams, name: str) -> DTensor | Pieces:
    """A DTensor view of this rank's real rows of a parameter-shaped shard; a flat shard's
    rectangles ([Note: flat shards in checkpoints])."""
    layout = sharded.layout
    if name in layout.ignored:  # whole on every rank, so written once ([Note: ignored parameters])
        return DTensor.from_local(local_shard, sharded.mesh.device_mesh, [Replicate()] * sharded.mesh.ndim)
    leaf = layout.leaves[name]
    rank, tensor_rank = layout.shard_rank(sharded.mesh), sharded.mesh.axis_rank("tensor")
    if leaf.flat:
        span = layout.units[leaf.unit].numel
        off, _ = leaf.piece(rank, span)
        flat = Pieces(leaf.shape, local_shard.reshape(-1), max(0, rank * span + off - leaf.start))
        return split_pieces(layout, name, None, 0, flat, tensor_rank) or flat
    local = local_shard[: layout.local_rows(name, rank)]
    split = split_pieces(layout, name, local, rank * leaf.chunk, None, tensor_rank)
    if split is not None:  # [Note: split leaves in checkpoints]
        return split
    shape = torch.Size(leaf.shape or (1,))  # a 0-d parameter is saved as one row
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, sharded.mesh.device_mesh, _placements(sharded), shape=shape, stride=stride)


def _persistent(sharded: ShardedParams) -> list[str]:
    return [n for n, b in sharded.layout.buffers.items() if b.persistent]


def _state_dict(sharded: ShardedParams, opt_state: Any, extra_tensors: Mapping[str, torch.Tensor],
                buffers: list[str] | None = None) -> dict[str, Any]:
    layout, rank = sharded.layout, sharded.layout.shard_rank(sharded.mesh)
    out: dict[str, Any] = {f"params/{n}": _dtensor(sharded[n].detach(), sharded, n) for n in sharded.params()}
    out.update({f"buffers/{n}": sharded[n].detach() for n in (_persistent(sharded) if buffers is None else buffers)})
    for path, name, leaf in param_leaves(opt_state):
        key = f"opt/{path}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"checkpoint: optimizer state leaf opt_state{path} is a {type(leaf).__name__}; "
                "only tensor leaves can be saved (shardfn.optim's optimizers keep tensors only; from_torch's "
                "state holds a torch optimizer: save state.optimizer.state_dict() yourself)."
            )
        if (name in layout.leaves or name in layout.ignored) and tuple(leaf.shape) == layout.shard_shape(name, rank):
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
        raise TypeError(f"checkpoint.save(sharded, ...): expected the ShardedParams from shard(), got {type(sharded).__name__}")
    extra = dict(extra or {})
    tensors = {k: v for k, v in extra.items() if isinstance(v, torch.Tensor)}
    values = {k: v for k, v in extra.items() if k not in tensors}
    try:
        json.dumps(values)
    except TypeError as e:
        raise TypeError(f"checkpoint.save: extra values must be tensors or JSON-serialisable ({e}).") from None
    check_verdict(sharded, "checkpoint.save(path, sharded, ...)")  # the same on every rank: nothing written
    with unusable_on_failure(sharded), G.guarded(sharded.mesh):  # an error on one rank reaches the others
        _save(os.fspath(path), sharded, opt_state, values, tensors)


def _save(path: str, sharded: ShardedParams, opt_state: Any, values: dict[str, Any],
          tensors: dict[str, torch.Tensor]) -> None:
    partial, group, rank0 = path + ".partial", _group(sharded), sharded.mesh.rank == 0
    if rank0 and os.path.exists(partial):
        shutil.rmtree(partial)  # what a save that died left behind
    C.barrier_mesh(sharded.mesh)
    dcp.save(_state_dict(sharded, opt_state, tensors), checkpoint_id=partial, process_group=group,
             planner=SavePlanner())
    C.barrier_mesh(sharded.mesh)
    if rank0:
        files = written_files(partial)
        meta = {
            "format": _FORMAT,
            "strategy": sharded.layout.strategy.value,
            "mesh": list(sharded.mesh.shape),
            "params": {n: list(global_shape(sharded.layout, n)) for n in sharded.params()},
            "buffers": {n: list(sharded.layout.buffers[n].shape) for n in _persistent(sharded)},
            "extra": values,
            "extra_tensors": sorted(tensors),
            "digests": {name: _digest(os.path.join(partial, name)) for name in files},
        }
        meta[_SELF] = _meta_digest(meta)
        write_config(sharded.module, partial)  # a Hugging Face model's config: convert writes it out
        with open(os.path.join(partial, _META), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _publish(partial, path)
    C.barrier_mesh(sharded.mesh)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _META))


def _remove(path: str) -> None:
    # shardfn.json first, so that a removal cut short never leaves a directory that looks complete
    if _complete(path):
        os.remove(os.path.join(path, _META))
    if os.path.exists(path):
        shutil.rmtree(path)


def _publish(partial: str, path: str) -> None:
    """Renames ``partial`` to ``path``; at every moment one of ``path`` and ``<path>.old`` is
    the last good checkpoint (see [Note: checkpoint format])."""
    old = path + ".old"
    if os.path.exists(old):  # left by a save that died: keep whichever of the two is complete
        _remove(path if _complete(old) and not _complete(path) else old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(partial, path)
    if os.path.exists(old):
        _remove(old)


def _recover(path: str) -> str:
    """``path``, or ``<path>.old`` when a save to ``path`` died between its two renames."""
    old = path + ".old"
    if _complete(path) or not _complete(old):
        return path
    warnings.warn(
        f"checkpoint.load({path!r}): no checkpoint there, but {old!r} holds one: a save to {path!r} was "
        f"interrupted after moving the last good checkpoint aside. Loading {old!r}; the next save to {path!r} "
        "removes it.", stacklevel=3)
    return old


def _read_meta(path: str) -> dict[str, Any]:
    meta_file, dcp_file = os.path.join(path, _META), os.path.join(path, ".metadata")
    missing = [f for f in (meta_file, dcp_file) if not os.path.exists(f)]
    if missing:
        hint = " A save that did not finish leaves <path>.partial instead." if os.path.exists(path + ".partial") else ""
        raise ValueError(
            f"checkpoint.load: {path!r} is not a complete shardfn checkpoint: missing {missing}.{hint} "
            "Load an earlier checkpoint."
        )
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
        readable = meta.get("format") in _READABLE
    except (ValueError, AttributeError):  # not UTF-8, not JSON, or not a JSON object
        raise _corrupted(path, [_META]) from None
    if not readable:
        raise ValueError(
            f"checkpoint.load: {meta_file} has format {meta.get('format')!r}; this shardfn reads {list(_READABLE)}."
        )
    verified = meta.get(_SELF) == _meta_digest(meta) and ".metadata" in meta.get("digests", {})
    if meta["format"] == _FORMAT and not verified:
        raise _corrupted(path, [_META])
    return meta


def load(path: str | os.PathLike, sharded: ShardedParams, opt_state: Any = None) -> tuple[ShardedParams, Any, dict[str, Any]]:
    """Loads a checkpoint into the layout of ``sharded`` and ``opt_state``.

    ``sharded`` and ``opt_state`` give the target layout (any world size, strategy or
    mesh; build them as for training, e.g. ``shard(params, mesh, ...)`` and
    ``opt.init(sharded)``); their values (parameters, persistent buffers, optimizer
    state; ``opt_state`` may be ``None``) are replaced in place and returned, with the
    ``extra`` that was saved.

    Before anything is read, every file is checked against the sha256 digests recorded
    at save time; a damaged file raises on every rank, naming the file. If ``path`` holds
    no checkpoint but ``<path>.old`` does (a save to ``path`` died between its two
    renames), that one is loaded, with a warning naming both.

    Raises:
        ValueError: the checkpoint is incomplete, damaged (every damaged file is named),
            or its parameters' or buffers' names or shapes differ from ``sharded``'s
            (every differing one is named).

    Checkpoints of formats 1 and 2 (no digests) load with one warning that they are
    unverified; format 1 (written before buffers were saved) also names the buffers it
    lacks; they keep the values ``sharded`` has.

    Example:
        >>> sharded, opt_state, extra = load("ckpt/step-100", sharded, opt_state)
    """
    with G.guarded(sharded.mesh):  # an error on one rank reaches the others at the barrier below
        return _load(_recover(os.fspath(path)), sharded, opt_state)


def _load(path: str, sharded: ShardedParams, opt_state: Any) -> tuple[ShardedParams, Any, dict[str, Any]]:
    meta = _read_meta(path)
    saved = {n: tuple(s) for n, s in meta["params"].items()}
    target = {n: global_shape(sharded.layout, n) for n in sharded.params()}
    saved_buffers = {n: tuple(s) for n, s in meta.get("buffers", {}).items()}
    persistent = _persistent(sharded)
    # A checkpoint converted from safetensors (shardfn.convert) cannot tell buffers from
    # parameters and lists its tensors as parameters: a buffer of the model is read from there.
    moved = [n for n in persistent if n in saved and n not in saved_buffers and n not in target]
    saved_buffers.update({n: saved.pop(n) for n in moved})
    problems = [f"  {n}: missing from the checkpoint" for n in target if n not in saved]
    problems += [f"  {n}: in the checkpoint but not in these params" for n in saved if n not in target]
    problems += [
        f"  {n}: checkpoint shape {saved[n]}, these params {target[n]}" for n in target if n in saved and saved[n] != target[n]
    ]
    target_buffers = {n: sharded.layout.buffers[n].shape for n in persistent}
    problems += [f"  {n}: buffer in the checkpoint but not in these params" for n in saved_buffers
                 if n not in target_buffers]
    problems += [f"  {n}: checkpoint buffer shape {saved_buffers[n]}, these params {target_buffers[n]}"
                 for n in target_buffers if n in saved_buffers and saved_buffers[n] != target_buffers[n]]
    if problems:
        raise ValueError(f"checkpoint.load({path!r}): the parameters do not match:\n" + "\n".join(problems))
    lacking = [n for n in persistent if n not in saved_buffers]
    digests, fmt = meta.get("digests"), meta["format"].rsplit("-", 1)[-1]
    notes = [f"checkpoint.load({path!r}):"]
    if lacking:
        names = ", ".join(lacking[:8]) + (" ..." if len(lacking) > 8 else "")
        notes = [_NO_BUFFERS.format(path=path, n=len(lacking), names=names, fmt=fmt)]
    if digests is None:
        notes.append(_UNVERIFIED.format(fmt=fmt))
    if len(notes) > 1 or lacking:  # one warning per load
        warnings.warn(" ".join(notes), stacklevel=3)
    if digests and _changed(path, {".metadata": digests[".metadata"]}):  # every rank: it unpickles it
        raise _corrupted(path, [".metadata"])
    data = sorted(n for n in digests or {} if n != ".metadata")
    mine = {n: digests[n] for n in data[sharded.mesh.rank :: sharded.mesh.size]}
    extra_tensors = {k: torch.empty(0) for k in meta["extra_tensors"]}
    state = _state_dict(sharded, opt_state, extra_tensors, [n for n in persistent if n in saved_buffers])
    for k in extra_tensors:  # their sizes come from the checkpoint's own metadata
        state.pop(f"extra/{k}")
    state.update({f"params/{n}": state.pop(f"buffers/{n}") for n in moved})
    # every rank must be about to load the same checkpoint (a directory all ranks share)
    C.barrier_mesh(sharded.mesh, detail=zlib.crc32(json.dumps(meta, sort_keys=True).encode()) & 0x7FFFFFFF)
    _dcp_load(path, state, sharded, check=mine)
    extra = dict(meta["extra"])
    if extra_tensors:
        extra.update(_load_extra_tensors(path, list(extra_tensors), sharded))
    sharded._values_replaced()  # its values are the checkpoint's now (shardfn._state.verdict)
    return sharded, opt_state, extra


def _step_of(path: str, name: str) -> int | None:
    try:
        with open(os.path.join(path, _META), encoding="utf-8") as f:
            step = json.load(f)["extra"]["step"]
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    except (ValueError, KeyError, TypeError):
        pass  # a damaged shardfn.json: load says so
    digits = re.findall(r"\d+", name)
    return int(digits[-1]) if digits else None


def latest(directory: str | os.PathLike) -> str | None:
    """The path of the newest complete checkpoint in ``directory``, or ``None`` if it has none.

    A checkpoint is a child directory holding ``shardfn.json`` (written last by
    :func:`save`); ``*.partial`` directories (saves that did not finish) are ignored. A
    checkpoint left at ``<name>.old`` by a save to ``<name>`` that died between its two
    renames counts as ``<name>``, and :func:`load` finds it there. Newest means the largest
    step: ``extra["step"]`` if the checkpoint was saved with an integer one, else the last
    number in its name (``step-000100`` is 100); checkpoints with neither come before all
    others, and equal steps are ordered by name (the greatest wins). The file modification
    times are never used. It reads only ``shardfn.json``: :func:`load` verifies the digests.

    Example, a loop that resumes where it stopped, so that ``torchrun --max-restarts 3
    train.py`` continues after a rank dies::

        path = shardfn.checkpoint.latest("ckpt")
        start = 1
        if path is not None:
            sharded, opt_state, extra = shardfn.checkpoint.load(path, sharded, opt_state)
            start = extra["step"] + 1
        for n in range(start, steps + 1):
            sharded, opt_state, _ = step(sharded, opt_state, next_batch())
            if n % 100 == 0:
                shardfn.checkpoint.save(f"ckpt/step-{n:06d}", sharded, opt_state, extra={"step": n})
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found: dict[str, int | None] = {}
    for name in os.listdir(directory):
        here, base = os.path.join(directory, name), name.removesuffix(".old")
        published = base != name and _complete(os.path.join(directory, base))  # this .old is about to go
        if name.endswith(".partial") or not _complete(here) or published:
            continue
        found[base] = _step_of(here, base)
    if not found:
        return None
    return os.path.join(directory, max(found, key=lambda b: (found[b] is not None, found[b] or 0, b)))


def _load_extra_tensors(path: str, keys: list[str], sharded: ShardedParams) -> dict[str, torch.Tensor]:
    md = _SafeReader(path).read_metadata()
    state = {}
    for k in keys:
        info = md.state_dict_metadata[f"extra/{k}"]
        state[f"extra/{k}"] = torch.empty(info.size, dtype=info.properties.dtype)
    _dcp_load(path, state, sharded)
    return {k: state[f"extra/{k}"] for k in keys}


def _dcp_load(path: str, state: dict[str, Any], sharded: ShardedParams, check: Mapping[str, str] | None = None) -> None:
    # DCP reports any rank's failure on every rank, as a BaseException: make it a ValueError.
    reader = _SafeReader(path, check)
    try:
        dcp.load(state, storage_reader=reader, process_group=_group(sharded), planner=LoadPlanner())
    except CheckpointException as e:
        damaged = sorted({name for exc, _ in e.failures.values() if isinstance(exc, _Corrupt) for name in exc.args})
        if damaged:
            raise _corrupted(path, damaged) from None
        if reader.refused is not None:  # every rank read the same .metadata and refused it
            raise ValueError(f"checkpoint.load({path!r}) failed: {reader.refused}") from None
        raise ValueError(f"checkpoint.load({path!r}) failed: {e}") from None
