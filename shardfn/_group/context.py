"""What a unit group is handed by the runtime it runs in: one value, built once per runtime."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = ["AfterForward", "Context", "invariant"]


def invariant(ok: bool, message: str) -> None:
    """Raises ``AssertionError("[rank N] ...")`` when an internal invariant fails."""
    if not ok:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise AssertionError(f"[rank {rank}] shardfn internal error: {message}")


class AfterForward(enum.Enum):
    """What a runtime does with a unit's gathered parameters after the unit's forward."""

    PLAN = "plan"  # what the layout resolved for the unit (UnitLayout.reshard)
    KEEP = "keep"  # keep every unit gathered until the runtime ends (keep_gathered=True; Unit.pinned)
    FREE = "free"  # let go after each forward, whatever the plan (bind: no backward follows)


class Context(NamedTuple):
    """The step's context as its unit groups see it: fixed when the runtime is built, and
    carried into backward (no ContextVar is read there: [Note: backward on device threads]
    in shardfn._comm.guard)."""

    mesh: Any
    scope: Any  # shardfn._comm.scope.Scope: the header's where, the pipelined run, the communicator
    recorded: bool  # the mode: a graph step being recorded ([Note: recording a step])
    observers: tuple[Any, ...]  # where events go (the step's collective log among them)
    options: Any  # shardfn._run.options.StepOptions: overlap, prefetch, compile
    owner: Any  # the step's own sharded tree (None outside a step)
    reduce_op: ReduceOp  # SUM inside a step, AVG outside ([Note: averaging gradients])
    reduces_each: bool  # every micro-batch's backward reduces (Accumulate.REDUCE_EACH)
    after_forward: AfterForward
    owned: set[int]  # storages of gradients handed out in a world of one (UnitGrads.own)
    prefetch_after: Callable[[tuple[int, int], bool], None]  # the runtime's prefetch across its trees
    compiling: Any  # how its unit modules' forwards run (shardfn._compile.Compiling)
