"""The only module that issues ``torch.distributed`` collectives.

Every all-gather, reduce-scatter and all-reduce in shardfn goes through the three
functions below, so that tests (and ``metrics``) can count each collective and its
bytes exactly, and so that the CUDA/NCCL and CPU/gloo paths share one code path.

[Note: accounting]
Each call reports ``(kind, group_name, nbytes, dtype)`` to every active recorder,
where ``nbytes`` is the size of the *full* buffer the collective moves: the output of
an all-gather, the input of a reduce-scatter, the tensor of an all-reduce. These are
the "textbook" volumes (FULL_SHARD moves 2x the parameter bytes in all-gathers and
1x in reduce-scatters per step), independent of the backend's algorithm.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

__all__ = [
    "CollectiveLog", "all_gather", "all_reduce", "barrier", "broadcast", "reduce_scatter", "record_collectives", "scatter",
]


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    group: tuple[int, ...]  # global ranks of the process group
    nbytes: int
    dtype: torch.dtype
    tag: str  # what it was for: a unit name, "loss", "layout", ...


@dataclasses.dataclass(eq=False)
class CollectiveLog:
    """What a :func:`record_collectives` block saw, call by call.

    Example:
        >>> with record_collectives() as log:
        ...     step(sharded, opt_state, batch)
        >>> log.counts()["all_gather"], log.bytes()["reduce_scatter"]
    """

    calls: list[CollectiveCall] = dataclasses.field(default_factory=list)

    def counts(self, tag_prefix: str | None = None) -> Counter[str]:
        return Counter(c.kind for c in self._select(tag_prefix))

    def bytes(self, tag_prefix: str | None = None) -> Counter[str]:
        out: Counter[str] = Counter()
        for c in self._select(tag_prefix):
            out[c.kind] += c.nbytes
        return out

    def _select(self, tag_prefix: str | None) -> list[CollectiveCall]:
        if tag_prefix is None:
            return list(self.calls)
        return [c for c in self.calls if c.tag.startswith(tag_prefix)]


_RECORDERS: list[CollectiveLog] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    """Records every collective shardfn issues inside the block (this process only)."""
    log = CollectiveLog()
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


def _record(kind: str, group: ProcessGroup, t: torch.Tensor, tag: str) -> None:
    if _RECORDERS:
        ranks = tuple(dist.get_process_group_ranks(group))
        call = CollectiveCall(kind, ranks, t.numel() * t.element_size(), t.dtype, tag)
        for log in _RECORDERS:
            log.calls.append(call)


def _range(kind: str, tag: str):
    return torch.profiler.record_function(f"shardfn::{kind}[{tag}]")


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, tag: str, async_op: bool = False) -> Any:
    """``out`` (``group size * inp.numel()`` elements) receives every rank's ``inp``, rank-major."""
    _record("all_gather", group, out, tag)
    with _range("all_gather", tag):
        return dist.all_gather_single(out, inp, group=group, async_op=async_op)


_OPS = {"avg": ReduceOp.AVG, "sum": ReduceOp.SUM, "max": ReduceOp.MAX}


def reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, group: ProcessGroup, tag: str, op: str = "avg", async_op: bool = False
) -> Any:
    """``out`` receives this rank's chunk of the average (or ``op``) of ``inp`` over ``group``.

    With ``async_op`` it returns the work handle: ``out`` is valid after ``work.wait()``
    and ``inp`` must stay alive until then.
    """
    _record("reduce_scatter", group, inp, tag)
    with _range("reduce_scatter", tag):
        return dist.reduce_scatter_single(out, inp, op=_OPS[op], group=group, async_op=async_op)


def all_reduce(t: torch.Tensor, group: ProcessGroup, tag: str, op: str = "avg", async_op: bool = False) -> Any:
    """In-place all-reduce of ``t`` over ``group``: ``op`` is "avg", "sum" or "max"."""
    _record("all_reduce", group, t, tag)
    with _range("all_reduce", tag):
        return dist.all_reduce(t, op=_OPS[op], group=group, async_op=async_op)


def barrier(group: ProcessGroup | None) -> None:
    """Waits for every rank of ``group`` (checkpoint publication; not counted as traffic)."""
    with _range("barrier", "checkpoint"):
        dist.barrier(group=group)


def broadcast(t: torch.Tensor, group_src: int, group: ProcessGroup, tag: str) -> None:
    """``t`` on every rank of ``group`` becomes the ``t`` of its rank ``group_src``."""
    _record("broadcast", group, t, tag)
    with _range("broadcast", tag):
        dist.broadcast(t, group=group, group_src=group_src)


def scatter(out: torch.Tensor, inp: torch.Tensor | None, group_src: int, group: ProcessGroup, tag: str) -> None:
    """Rank ``r`` of ``group`` receives row ``r`` of ``inp`` (``[group size, n]``, given on ``group_src``)."""
    _record("scatter", group, out, tag)
    with _range("scatter", tag):
        dist.scatter(out, list(inp.unbind(0)) if inp is not None else None, group=group, group_src=group_src)
