"""Reading rows of, and streaming tensors into, Hugging Face safetensors files.

[Note: streamed safetensors]
A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range in the data that follows, and the data. The
``safetensors`` package writes a file from a dict of tensors that all exist at once; an
export of a sharded model has only one unit of full tensors at a time. Every tensor's
shape and dtype is known before the first unit is gathered (the layout), so
:class:`Writer` plans the files (split at ``max_shard_size``, as ``save_pretrained``
does, with ``model.safetensors.index.json``), writes each header first and then each
tensor's bytes as it arrives, in the planned order. The files are read back with the
``safetensors`` package (tests) and by ``from_pretrained``.

Reading goes through ``safetensors.safe_open``: ``get_slice(key)[lo:hi]`` reads rows
``lo:hi`` of a tensor from the memory-mapped file and nothing else, which is what lets each
rank load only its own shards.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["Source", "Writer"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


class Source:
    """The tensors of one ``.safetensors`` file, a directory holding ``model.safetensors``,
    or a sharded set described by ``model.safetensors.index.json``: key -> (file, shape, dtype)."""

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        from safetensors import safe_open

        path = os.fspath(path)
        self.path, self._open, self._stack = path, safe_open, contextlib.ExitStack()
        if os.path.isdir(path):
            index, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
            if os.path.isfile(index):
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted({os.path.join(path, name) for name in weight_map.values()})
            elif os.path.isfile(single):
                files = [single]
            else:
                found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
                raise ValueError(
                    f"{what}: {path!r} holds neither {INDEX} nor {SINGLE}"
                    + (f" (it has {found[:4]}: pass one file's path)" if found else "")
                    + ". Point it at a directory written by save_pretrained (or shardfn.save_pretrained), "
                    "or at one .safetensors file."
                )
        elif os.path.isfile(path):
            files = [path]
        else:
            raise FileNotFoundError(
                f"{what}: no file or directory {path!r} on this rank. Every rank reads the weights itself: put them "
                "on a filesystem all nodes share, or copy them to the same path on every node.")
        self.entries: dict[str, tuple[str, tuple[int, ...], torch.dtype]] = {}
        self._handles: dict[str, Any] = {}
        for file in files:
            handle = self._handle(file)
            for key in handle.keys():
                piece = handle.get_slice(key)
                self.entries[key] = (file, tuple(piece.get_shape()), _DTYPES[piece.get_dtype()])

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(self._open(file, framework="pt", device="cpu"))
        return self._handles[file]

    def fingerprint(self) -> int:
        """A hash of every key, shape and dtype and of each tensor's first row (ranks must read
        the same weights: a node with a stale copy of other values differs here; how the
        tensors are split into files does not count)."""
        h = zlib.crc32(json.dumps(sorted((k, list(s), str(d)) for k, (_, s, d) in self.entries.items())).encode())
        for key in sorted(self.entries):
            row = self.rows(key, 0, 1).contiguous().reshape(-1)
            h = zlib.crc32(row.view(torch.uint8).numpy().tobytes() if row.numel() else b"", h)
        return h & 0x7FFFFFFF

    def rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of ``key`` (the whole tensor if it is 0-d), read from the file alone."""
        file, shape, _ = self.entries[key]
        if not shape:
            return self._handle(file).get_tensor(key)
        return self._handle(file).get_slice(key)[lo:hi]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


class Writer:
    """Writes tensors known in advance by (key, shape, dtype) into safetensors files, as they
    arrive, in that order (see [Note: streamed safetensors])."""

    def __init__(self, directory: str, plan: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_size: int, metadata: Mapping[str, str] | None = None) -> None:
        groups: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for key, shape, dtype in plan:
            nbytes = math.prod(shape) * dtype.itemsize
            if groups[-1] and size + nbytes > max_shard_size:
                groups.append([])
                size = 0
            groups[-1].append((key, shape, dtype))
            size += nbytes
        n = len(groups)
        names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.directory, self.total = directory, 0
        self._queue: list[tuple[str, str, int]] = []  # (key, file, bytes), in writing order
        self._headers: dict[str, bytes] = {}
        for name, group in zip(names, groups):
            header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
            offset = 0
            for key, shape, dtype in group:
                nbytes = math.prod(shape) * dtype.itemsize
                header[key] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                self._queue.append((key, name, nbytes))
                offset += nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
            self._headers[name] = len(text).to_bytes(8, "little") + text
            self.total += offset
        self.files = names
        self.file_of = {key: file for key, file, _ in self._queue}  # which file each tensor goes to
        self._next, self._file, self._name = 0, None, None

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want, name, nbytes = self._queue[self._next]
        if key != want:
            raise RuntimeError(f"safetensors writer: expected {want!r} next, got {key!r}")
        if name != self._name:
            self._close_file()
            self._file, self._name = open(os.path.join(self.directory, name), "wb"), name
            self._file.write(self._headers[name])
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != nbytes:
            raise RuntimeError(f"safetensors writer: {key!r} has {data.numel()} bytes, planned {nbytes}")
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """Closes the last file and writes the index when there are several files."""
        self._close_file()
        if self._next != len(self._queue):
            raise RuntimeError(f"safetensors writer: {len(self._queue) - self._next} tensors were never written")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": {k: f for k, f, _ in self._queue}}
            with open(os.path.join(self.directory, INDEX), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
