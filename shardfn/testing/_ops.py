"""Counting the ops a step dispatches: on a GPU, each is a kernel launch.

[Note: counting launches on a CPU]
On a GPU a small step's time is its kernel launches as much as its arithmetic, and every
extra op per leaf or per unit is one more launch. The count does not need a GPU: every aten
op a step dispatches passes a ``TorchDispatchMode``, on CPU as on CUDA, and the ones that
launch a kernel on a GPU are all of them except

* views (``OpOverload.is_view``: ``view``, ``t``, ``as_strided``, ``detach``, ...), which
  only make a new tensor header;
* allocations that write nothing (``empty``, ``empty_like``, ``empty_strided``,
  ``new_empty``, ``new_empty_strided``), ``lift_fresh``, and ``_unsafe_view`` (a view
  that autograd does not track as one);
* the profiler's markers (namespace ``profiler``: ``record_function``);
* the reads of a tensor's values by the host (``.item()``, ``float(t)``, ``bool(t)``: the op
  ``_local_scalar_dense``; ``torch.equal``; ``.tolist()`` and ``.numpy()``, which a CPU tensor
  answers without dispatching, so the block patches them): on a GPU each is a copy to the
  host and a synchronisation, unless the tensor lives on the host anyway (the schedule
  guard's headers). They are listed apart, with the tensor read, as ``reads``;
* the collectives (namespaces ``c10d``, and ``_c10d_functional`` in a recorded graph
  step, whose ``wait_tensor`` is not counted), counted apart as ``collectives``: what one
  costs depends on the backend, not on the dispatcher.

A GPU launches about one kernel per such op (a foreach op over many tensors, a matmul or
an attention may launch a few; ``benchmarks/gpu_check.py`` prints both counts). The count
is exact and deterministic, so tests can pin it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._comm.guard import HEADER

__all__ = ["OpCount", "count_ops"]

_READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
_NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
                        "_unsafe_view"})


@dataclasses.dataclass
class OpCount:
    """What a block of code dispatched: ``ops`` (name -> count) of the ops that launch a
    kernel on a GPU, ``collectives`` (name -> count), ``reads`` (``(how, tensor)`` for each read
    of a tensor's values by the host, in order: ``.item()`` and the like)."""

    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    collectives: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    reads: list[tuple[str, torch.Tensor]] = dataclasses.field(default_factory=list)

    @property
    def syncs(self) -> int:
        """How many reads there were (on a GPU, each of a tensor on the device synchronises)."""
        return len(self.reads)

    def device_reads(self, host: Sequence[torch.Tensor] = (), world: int = 1) -> list[tuple[str, torch.Tensor]]:
        """The reads that synchronise on a GPU: all but those of the tensors in ``host``
        (host tensors by design: a raise_next step's pinned verdict) and of shardfn's schedule-guard headers at this ``world``, which travel over
        gloo in host memory on any device."""
        headers = {(world, HEADER), (2 * HEADER,)}  # every rank's headers; the agreed extremes
        return [(how, t) for how, t in self.reads if not any(t is h for h in host)
                and not (t.dtype == torch.int64 and tuple(t.shape) in headers)]

    @property
    def total(self) -> int:
        """The ops that launch a kernel on a GPU (collectives and syncs not included)."""
        return sum(self.ops.values())

    def top(self, n: int = 8) -> str:
        """The ``n`` most frequent ops, as ``name count`` pairs."""
        return ", ".join(f"{k} {v}" for k, v in self.ops.most_common(n))


class _Counter(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace == "profiler":
            pass
        elif func.namespace in ("c10d", "_c10d_functional"):  # (a recorded step's are functional)
            if name != "wait_tensor":
                self.count.collectives[name] += 1
        elif name in _READS:
            self.count.reads.append((name, args[0]))
        elif not (func.is_view or name in _NO_KERNEL):
            self.count.ops[name] += 1
        return func(*args, **(kwargs or {}))


class count_ops:  # noqa: N801 - a context manager, used like a function
    """Counts the ops dispatched inside the block ([Note: counting launches on a CPU]).

    Example:
        >>> with count_ops() as c:
        ...     sharded, opt_state, metrics = step(sharded, opt_state, batch)
        >>> c.total, c.collectives, c.top()
    """

    def __init__(self) -> None:
        self.count = OpCount()
        self._mode = _Counter(self.count)
        self._patched: dict[str, Any] = {}

    def __enter__(self) -> OpCount:
        for how in ("tolist", "numpy"):  # answered without dispatching on a CPU: see the note
            self._patched[how] = getattr(torch.Tensor, how)
            setattr(torch.Tensor, how, self._reader(how, self._patched[how]))
        self._mode.__enter__()
        return self.count

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for how, method in self._patched.items():
            setattr(torch.Tensor, how, method)
        self._patched.clear()

    def _reader(self, how: str, method: Any) -> Any:
        reads = self.count.reads

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.append((how, tensor))
            return method(tensor, *args, **kwargs)

        return read
