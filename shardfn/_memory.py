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
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["LiveBytes", "track_live_bytes"]

_RESIZES = {torch.ops.aten.resize_.default, torch.ops.inductor.resize_storage_bytes_.default}


class LiveBytes(TorchDispatchMode):
    """The bytes of live tensor storages, now (``current``) and at most (``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}

    def add(self, *trees: Any) -> int:
        """Counts the tensors in ``trees`` (alive before the block); returns the bytes added."""
        before = self.current
        for t in _tensors(trees):
            self._count(t)
        return self.current - before

    def reset_peak(self) -> None:
        self.peak = self.current

    def _count(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor's data is its inner (local) tensors
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._count(inner)
            return
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, ...: not storage-backed
            return
        self._count_storage(s)

    def _count_storage(self, s: torch.UntypedStorage) -> None:
        key = id(s)
        n = s.nbytes()
        old = self._sizes.get(key)
        if old is None:
            self._refs[key] = weakref.ref(s, lambda _r, key=key: self._free(key))
            old = 0
        self._sizes[key] = n
        self.current += n - old
        self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _RESIZES:
            self._count(args[0])
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t)
        return out


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in a pytree, looking into any Mapping (``ShardedParams`` is one)."""
    if isinstance(tree, Mapping) and not isinstance(tree, dict):
        tree = dict(tree)
    for leaf in pytree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, Mapping) and not isinstance(x, dict)):
        if isinstance(leaf, Mapping):
            yield from _tensors(leaf)
        elif isinstance(leaf, torch.Tensor):
            yield leaf


@contextlib.contextmanager
def track_live_bytes(*trees: Any) -> Iterator[LiveBytes]:
    """Counts live tensor bytes inside the block; ``trees`` are counted from the start.

    Example:
        >>> with track_live_bytes(sharded, opt_state) as mem:
        ...     sharded, opt_state, _ = step(sharded, opt_state, batch)
        >>> mem.peak          # bytes: shards + optimizer state + the step's transients
    """
    mode = LiveBytes()
    mode.add(*trees)
    resize = torch.UntypedStorage.resize_

    def counted_resize(storage, size):  # storage-level resizes bypass the dispatcher
        out = resize(storage, size)
        if id(storage) in mode._sizes:
            mode._count_storage(storage)
        return out

    torch.UntypedStorage.resize_ = counted_resize
    try:
        with mode:
            yield mode
    finally:
        torch.UntypedStorage.resize_ = resize
