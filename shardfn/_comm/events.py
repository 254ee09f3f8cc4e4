"""Structured events: every collective shardfn issues, and every gather and free of a unit.

[Note: events]
An event is a small frozen record: a kind (an enum), the unit it concerns (``""`` for none,
``"<root>"`` for the root unit) and a purpose (why a collective ran); a collective also
carries its process group, its bytes and its dtype. Observers receive them:

* a :class:`CollectiveLog` from :func:`record_collectives` (tests, benchmarks, explain),
* a :class:`Residency` from :func:`track_residency` (which units hold gathered parameters),
* the log of the step in progress (``metrics["comm_bytes"]``).

The observers active in a block live in one ``ContextVar``, extended and reset by the
context managers below. A step captures the observers active when it starts, so the
events its backward emits (on CUDA autograd runs it on a device thread, where the
caller's context is not current) reach the same observers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from .scope import within

__all__ = [
    "Collective", "CollectiveCall", "CollectiveLog", "Purpose", "Residency", "ResidencyEvent", "Transfer", "UnitEvent",
    "emit", "marker", "record_collectives", "track_residency",
]


class Collective(str, enum.Enum):
    """Kinds of collective (a ``str`` enum: ``Collective.ALL_GATHER == "all_gather"``)."""

    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    SCATTER = "scatter"
    BARRIER = "barrier"  # no data: every rank has reached it (checkpoints)

    def __str__(self) -> str:
        return self.value


class Purpose(str, enum.Enum):
    """Why a collective ran."""

    GATHER = "gather"  # a unit's parameters for its forward
    REGATHER = "regather"  # the same again in backward (FULL_SHARD, or a remat recompute)
    REDUCE = "reduce"  # a unit's gradients
    METRICS = "metrics"  # the step's loss, gradient norm, buffer-change flags (and Mean counts, aux)
    MICRO_BATCHES = "micro_batches"  # ranks compare their numbers of micro-batches (MicroBatches)
    BUFFERS = "buffers"  # averaging buffers the forward changed
    PSUM = "psum"  # an optimizer's shardfn.optim.psum
    LAYOUT = "layout"  # shard(): ranks compare their layouts
    LOAD = "load"  # shard(src_rank=...): values sent from one rank
    STATE_DICT = "state_dict"  # gather(): full parameters
    RESHARD = "reshard"  # reshard(): a unit's full values, to be cut the new way
    CHECKPOINT = "checkpoint"  # checkpoint.save / load waiting for every rank
    TEST = "test"  # issued by a test
    STEP = "step"  # the header that opens a step (shardfn._comm.pipelined); no data
    USER = "user"  # Mesh.barrier / broadcast / reduce / all_gather, called by the training loop
    REPLICA = "replica"  # SHARD_OPTIMIZER: a unit's updated shards, gathered after the update
    TENSOR = "tensor"  # a tensor-parallel layer's all-reduce over the tensor axis (shardfn._parallel.tensor)
    EXIT = "exit"  # a context that issues collectives (bind) ends: every rank agrees it made the same calls; no data
    BATCH = "batch"  # the digests of a tensor group's batches (shardfn._parallel.agree)

    def __str__(self) -> str:
        return self.value


class UnitEvent(str, enum.Enum):
    """What happened to a unit's gathered parameters."""

    GATHER = "gather"
    REGATHER = "regather"
    PREFETCH = "prefetch"  # its all-gather was started early (the next unit to run)
    FREE = "free"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class CollectiveCall:
    """One collective on this rank."""

    kind: Collective
    group: tuple[int, ...]  # global ranks of the process group
    nbytes: int  # the full buffer it moves (see shardfn._comm.collectives [Note: accounting])
    dtype: torch.dtype
    purpose: Purpose
    unit: str = ""  # the unit's name, for per-unit collectives

    @property
    def tag(self) -> str:
        """Deprecated: ``"purpose:unit"``. Read ``purpose`` and ``unit``."""
        from .._deprecated import deprecated

        deprecated("CollectiveCall.tag", "call.purpose and call.unit (fields, not a string)")
        return label(self.purpose, self.unit)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Copies between host memory and the compute device on this rank (see [Note: offload])."""

    direction: str  # "to_device" or "to_host"
    nbytes: int  # bytes written at the destination
    unit: str = ""
    copies: int = 1  # copy ops


def label(purpose: Purpose, unit: str = "") -> str:
    """``"purpose:unit"`` (or ``"purpose"``): how a collective is named in displays and profiles."""
    return f"{purpose.value}:{unit}" if unit else purpose.value


class ResidencyEvent(NamedTuple):
    """``(event, unit)``; equal to the plain tuple ``("gather", "blocks.0")``."""

    event: UnitEvent
    unit: str


@dataclasses.dataclass(eq=False)
class CollectiveLog:
    """What a :func:`record_collectives` block saw, call by call.

    Example:
        >>> with record_collectives() as log:
        ...     step(sharded, opt_state, batch)
        >>> log.counts()["all_gather"], log.bytes()["reduce_scatter"]
    """

    calls: list[CollectiveCall] = dataclasses.field(default_factory=list)
    transfers: list[Transfer] = dataclasses.field(default_factory=list)  # host <-> device copies (offload)

    def counts(self, purpose: Purpose | str | None = None, unit: str | None = None) -> Counter[str]:
        """Collectives per kind, optionally only those of one purpose and/or unit."""
        return Counter(c.kind.value for c in self.select(purpose, unit))

    def bytes(self, purpose: Purpose | str | None = None, unit: str | None = None) -> Counter[str]:
        """Bytes per kind, optionally only those of one purpose and/or unit."""
        out: Counter[str] = Counter()
        for c in self.select(purpose, unit):
            out[c.kind.value] += c.nbytes
        return out

    def select(self, purpose: Purpose | str | None = None, unit: str | None = None) -> list[CollectiveCall]:
        return [c for c in self.calls if (purpose is None or c.purpose == purpose) and (unit is None or c.unit == unit)]

    def transfer_bytes(self) -> Counter[str]:
        """Bytes copied per direction (``"to_device"``, ``"to_host"``): see [Note: offload]."""
        out: Counter[str] = Counter()
        for t in self.transfers:
            out[t.direction] += t.nbytes
        return out

    def transfer_copies(self) -> Counter[str]:
        """Copy ops per direction."""
        out: Counter[str] = Counter()
        for t in self.transfers:
            out[t.direction] += t.copies
        return out

    def receive(self, event: Any) -> None:
        if isinstance(event, CollectiveCall):
            self.calls.append(event)
        elif isinstance(event, Transfer):
            self.transfers.append(event)


@dataclasses.dataclass(eq=False)
class Residency:
    """Which non-root units held gathered parameters, event by event (this process)."""

    live: set[str] = dataclasses.field(default_factory=set)
    max_live: int = 0
    events: list[ResidencyEvent] = dataclasses.field(default_factory=list)

    def receive(self, event: Any) -> None:
        if not isinstance(event, ResidencyEvent):
            return
        if event.event is UnitEvent.FREE:
            self.live.discard(event.unit)
        else:
            self.live.add(event.unit)
        self.max_live = max(self.max_live, len(self.live))
        self.events.append(event)


@contextlib.contextmanager
def observe(observer: Any) -> Iterator[Any]:
    """Adds ``observer`` (anything with ``receive(event)``) for the block."""
    with within(more_observers=(observer,)):
        yield observer


def emit(event: Any, to: tuple[Any, ...]) -> None:
    """Hands ``event`` to the observers ``to`` (the caller's scope's, handed down)."""
    for obs in to:
        obs.receive(event)


def record_collectives() -> contextlib.AbstractContextManager[CollectiveLog]:
    """Records every collective shardfn issues inside the block (this process only).

    Example:
        >>> with record_collectives() as log:
        ...     step(sharded, opt_state, batch)
        >>> log.counts(purpose="reduce")     # Counter({'reduce_scatter': 4})
    """
    return observe(CollectiveLog())


def track_residency() -> contextlib.AbstractContextManager[Residency]:
    """Records gathers and frees of non-root units inside the block.

    Example:
        >>> with track_residency() as r:
        ...     step(sharded, opt_state, batch)
        >>> r.max_live      # FULL_SHARD: 2 with prefetch (the running unit and the next), 1 without
    """
    return observe(Residency())


def marker(name: Any) -> Any:
    """A profiler range named ``name()`` (``name``: a callable, so that the label is built
    only when used), or a context that does nothing while no profiler runs: each range
    costs two dispatcher calls, and a step opens a few per unit (on a GPU, host time)."""
    if torch._C._autograd._profiler_enabled():  # (a private API, the same from torch 2.11 to 2.15)
        return torch.profiler.record_function(name())
    return contextlib.nullcontext()
