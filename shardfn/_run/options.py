"""A step's options: checked and decided once, when ``jit_step`` or ``jit_grad`` builds it.

[Note: step options]
Every option of a step is one field of a frozen :class:`StepOptions`, made when the step
is built, in the form the code reads (an enum, an int, a backend name): a step compares
enums and never re-parses a string, and nothing changes an option once the step exists.
What lives only while one step runs belongs to that step's runtime (shardfn._run.runtime).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from .._mesh import Mesh
from .._state.plan import parse_enum

__all__ = ["Accumulate", "Aux", "OnNonfinite", "StepOptions", "check_options"]


class Accumulate(enum.Enum):
    """How ``jit_step(micro_batches=k)`` accumulates gradients over micro-batches."""

    REDUCE_EACH = "reduce_each"  # reduce every micro-batch's gradients; sum the shards
    LOCAL = "local"  # sum unreduced unit gradients locally; reduce once, on the last micro-batch

    @classmethod
    def parse(cls, value: "Accumulate | str") -> "Accumulate":
        return parse_enum(cls, value, "jit_step(accumulate=...)")


class Aux(enum.Enum):
    """What ``loss_fn`` returns and ``metrics["aux"]`` holds (``jit_step(aux=...)``)."""

    NONE = "none"  # loss_fn returns the loss (``aux=None``)
    RANK = "rank"  # it returns (loss, aux); metrics["aux"] is this rank's
    MEAN = "mean"  # the same, averaged over micro-batches and ranks

    @classmethod
    def parse(cls, value: "Aux | str | None") -> "Aux":
        return cls.NONE if value is None else parse_enum(cls, value, "jit_step(aux=...)")


class OnNonfinite(enum.Enum):
    """What a step does when the global loss or gradient norm is not finite (``jit_step(on_nonfinite=...)``)."""

    RAISE = "raise"  # raise on every rank before anything is updated
    SKIP = "skip"  # update nothing, on every rank; metrics["skipped"] says so
    RAISE_NEXT = "raise_next"  # read nothing now; the next call on the tree raises ([Note: a step that does not wait])

    @classmethod
    def parse(cls, value: "OnNonfinite | str") -> "OnNonfinite":
        return parse_enum(cls, value, "jit_step(on_nonfinite=...)")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a step (or a grad function) runs; see :func:`shardfn.jit_step` for each option."""

    what: str  # how errors name the caller: "step" or "grad_fn"
    micro_batches: int = 1
    accumulate: Accumulate = Accumulate.REDUCE_EACH
    sync_buffers: bool = True
    overlap: bool = True
    prefetch: int = 1  # units gathered ahead of the running one
    aux: Aux = Aux.NONE
    keep_gathered: bool = False
    compile: str | None = None  # a torch.compile backend for each unit's forward
    on_nonfinite: OnNonfinite = OnNonfinite.RAISE
    donate: bool = True

    @property
    def read_metrics(self) -> bool:
        """Whether the step reads the loss and norm on the host before its update (all but raise_next)."""
        return self.on_nonfinite is not OnNonfinite.RAISE_NEXT


_AUX = (None, "rank", "mean", *Aux)  # what aux= accepts


def check_options(loss_fn: Any, mesh: Any, micro_batches: int, accumulate: Accumulate | str, aux: Any,
                  what: str, prefetch: Any = True) -> Accumulate:
    """The arguments jit_step and jit_grad share, checked; returns ``accumulate`` parsed."""
    if not (isinstance(prefetch, int) and prefetch >= 0):  # a bool is an int: True is 1
        raise ValueError(f"{what}(prefetch={prefetch!r}): how many units to gather ahead of the running one: "
                         "0 (or False), 1 (or True), 2, ...")
    if not callable(loss_fn):
        raise TypeError(f"{what}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{what}: mesh must be a shardfn.Mesh, got {type(mesh).__name__}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"{what}: micro_batches must be a positive int, got {micro_batches!r}")
    if aux not in _AUX:
        raise ValueError(f"{what}(aux={aux!r}): None (loss_fn returns the loss), \"rank\" (it returns (loss, aux); "
                         "metrics['aux'] is this rank's) or \"mean\" (the same, averaged over micro-batches and ranks).")
    return Accumulate.parse(accumulate)
