"""Live tensor bytes: the memory measure shardfn's tests, benchmarks and planner share.

[Note: live bytes]
Process RSS says little on CPU (glibc keeps freed memory), and CUDA's allocator
statistics exist only on CUDA. What is exact, repeatable and the same on every backend
(fake tensors included, which is what lets :func:`shardfn.explain` plan a run that does
not fit this machine) is the sum of the sizes of the tensor storages that are alive.

:func:`track_live_bytes` counts it with a ``TorchDispatchMode``: every storage an op
returns is counted once (keyed by the storage object, which torch keeps unique per
storage) and uncounted by a weak-reference callback when it dies; storages resized in
place (``resize_``, ``resize_storage_bytes_``: how FSDP2 frees gathered parameters) are
recounted (the storage method is wrapped while the block runs, since it bypasses the
dispatcher). A tensor subclass such as DTensor is counted by its inner tensors (its own
storage is a global-sized wrapper that holds no data). Tensors that existed before the block are counted with :meth:`LiveBytes.add`.
It sees the ops of the thread that entered it; on CPU autograd runs the backward on
that thread too.

Host and device (see [Note: offload]): every storage is also classed as host memory or
compute-device memory, so that an offloaded run says what the accelerator holds
(``device_peak``) apart from what the host holds (``host_peak``). A storage is host
memory when it is a CPU storage and the compute device is not (``compute=`` a CUDA
device), or when shardfn placed it there (:func:`mark_host`: offloaded shards, gradients
copied back, the optimizer state), or when an op made it from host memory (the
optimizer's temporaries) or inside :func:`on_host` (the schedule guard's headers, which
its gloo control group keeps in host memory): on a CPU-only machine, where both are the CPU, the marks are
what tells them apart. Without offload everything is device memory.
"""

from __future__ import annotations

import contextlib
import re
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["LiveBytes", "parse_size", "track_live_bytes"]


def parse_size(size: int | str, what: str) -> int:
    """Bytes in ``size``: a positive int, or a string of a number and a unit, ``"40GiB"``,
    ``"80GB"``, ``"500MB"``, ``"512KiB"``, ``"2TB"`` (K, M, G, T: powers of 1000; with ``i``,
    of 1024), ``"1000B"``. ``what`` names the argument in the error."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", size, re.I) if isinstance(size, str) else None
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"{what}: {size!r} is not a size: give bytes as a positive int, or a string such as "
                         "'40GiB', '80GB' or '500MB'.")
    unit = m.group(2).upper()
    scale = (1024 if m.group(3) else 1000) ** ("KMGT".find(unit) + 1) if unit else 1
    return int(float(m.group(1)) * scale)

_RESIZES = {torch.ops.aten.resize_.default, torch.ops.inductor.resize_storage_bytes_.default}

# Storages shardfn placed in host memory: id -> weak reference (see the note above).
_HOST: dict[int, weakref.ref] = {}
_ACTIVE: list["LiveBytes"] = []  # trackers running now, told when a storage is marked


@contextlib.contextmanager
def on_host():
    """What ops make inside the block is host memory (for :class:`LiveBytes`): the schedule
    guard's headers, which travel over its gloo control group whatever the device is. The
    trackers running now are told, each of them (nested blocks count)."""
    told = list(_ACTIVE)
    for mode in told:
        mode.on_host += 1
    try:
        yield
    finally:
        for mode in told:
            mode.on_host -= 1


def mark_host(t: torch.Tensor) -> None:
    """Marks ``t``'s storage as host memory (for :class:`LiveBytes`' host/device split)."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return
    key = id(s)
    if key in _HOST and _HOST[key]() is s:
        return
    _HOST[key] = weakref.ref(s, lambda _r, key=key: _HOST.pop(key, None))
    for mode in _ACTIVE:
        mode._reclass(key, host=True)


def is_marked_host(s: torch.UntypedStorage) -> bool:
    ref = _HOST.get(id(s))
    return ref is not None and ref() is s


class LiveBytes(TorchDispatchMode):
    """The bytes of live tensor storages, now (``current``) and at most (``peak``); and
    the same split into compute-device memory (``device_current``, ``device_peak``) and
    host memory (``host_current``, ``host_peak``), see the module's note."""

    def __init__(self, compute: torch.device | str | None = None) -> None:
        super().__init__()
        self.compute = torch.device(compute) if compute is not None else None
        self.current = 0
        self.peak = 0
        self.host_current = 0
        self.host_peak = 0
        self.device_peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._host: set[int] = set()  # ... of those, the host storages
        self._refs: dict[int, weakref.ref] = {}
        self.on_host = 0  # inside how many shardfn._memory.on_host blocks: what ops make is host memory

    @property
    def device_current(self) -> int:
        return self.current - self.host_current

    def add(self, *trees: Any) -> int:
        """Counts the tensors in ``trees`` (alive before the block); returns the bytes added."""
        before = self.current
        for t in _tensors(trees):
            self._count(t)
        return self.current - before

    def reset_peak(self) -> None:
        self.peak = self.current
        self.host_peak = self.host_current
        self.device_peak = self.device_current

    def _is_host(self, s: torch.UntypedStorage) -> bool:
        if s.device.type == "cpu" and self.compute is not None and self.compute.type not in ("cpu", "meta"):
            return True
        return is_marked_host(s)

    def _reclass(self, key: int, host: bool) -> None:
        """A counted storage turned out to be host memory (marked after it was made)."""
        if key in self._sizes and host and key not in self._host:
            self._host.add(key)
            self.host_current += self._sizes[key]
            self._peaks()

    def _peaks(self) -> None:
        self.peak = max(self.peak, self.current)
        self.host_peak = max(self.host_peak, self.host_current)
        self.device_peak = max(self.device_peak, self.device_current)

    def _count(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor's data is its inner (local) tensors
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        if t.is_meta and not is_fake(t):  # shapes without memory (a step checks structures on them)
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ...: not storage-backed
            return
        self._count_storage(s)

    def _count_storage(self, s: torch.UntypedStorage, host: bool = False) -> None:
        key = id(s)
        n = s.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(s, lambda _r, key=key: self._free(key))
            old = 0
            if host or self._is_host(s):
                self._host.add(key)
        self._sizes[key] = n
        self.current += n - old
        if key in self._host:
            self.host_current += n - old
        self._peaks()

    def _free(self, key: int) -> None:
        n = self._sizes.pop(key, 0)
        self.current -= n
        if key in self._host:
            self._host.discard(key)
            self.host_current -= n
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _RESIZES:
            self._count(args[0])
        # What an op makes from host memory is host memory (the optimizer's temporaries on
        # offloaded shards); what it makes from nothing or from device memory is not.
        host = self.on_host > 0 or bool(self._host) and any(
            isinstance(a, torch.Tensor) and not is_traceable_wrapper_subclass(a) and _storage_key(a) in self._host
            for a in pytree.tree_leaves((args, kwargs)))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count_new(t, host)
        return out

    def _count_new(self, t: torch.Tensor, host: bool) -> None:
        if not host or is_traceable_wrapper_subclass(t) or t.is_meta:
            self._count(t)
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        if s.device.type == "cpu":
            self._count_storage(s, host=True)
        else:
            self._count_storage(s)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in a pytree, looking into any Mapping (``ShardedParams`` is one)."""
    if isinstance(tree, Mapping) and not isinstance(tree, dict):
        yield from getattr(tree, "kept_tensors", list)()  # what a tree holds besides its leaves
        tree = dict(tree)
    for leaf in pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Mapping) and not isinstance(x, dict)):
        if isinstance(leaf, Mapping):
            yield from _tensors(leaf)
        elif isinstance(leaf, torch.Tensor):
            yield leaf


@contextlib.contextmanager
def track_live_bytes(*trees: Any, compute: torch.device | str | None = None) -> Iterator[LiveBytes]:
    """Counts live tensor bytes inside the block; ``trees`` are counted from the start.

    ``compute``: the compute device (``mesh.device``); with a CUDA device every CPU
    storage counts as host memory. On a CPU mesh, host memory is what offload marked.

    Example:
        >>> with track_live_bytes(sharded, opt_state) as mem:
        ...     sharded, opt_state, _ = step(sharded, opt_state, batch)
        >>> mem.peak          # bytes: shards + optimizer state + the step's transients
        >>> mem.device_peak   # ... of them in compute-device memory (less with offload)
    """
    mode = LiveBytes(compute)
    mode.add(*trees)
    resize = torch.UntypedStorage.resize_

    def counted_resize(storage, size):  # storage-level resizes bypass the dispatcher
        out = resize(storage, size)
        if id(storage) in mode._sizes:
            mode._count_storage(storage)
        return out

    torch.UntypedStorage.resize_ = counted_resize
    _ACTIVE.append(mode)
    try:
        with mode:
            yield mode
    finally:
        _ACTIVE.remove(mode)
        torch.UntypedStorage.resize_ = resize
