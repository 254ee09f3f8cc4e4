"""The scope: what the running code runs under, as one value.

[Note: the scope]
Everything shardfn once read from the air is one :class:`Scope` value: whether the code is
in a guarded region and what kind (``guarded``, ``where``), the step's pipelined run, the
communicator of its mode (``comm``: eager, or recorded while a graph step is recorded), the
runtime of the step or the call of ``apply`` in progress, the shards ``on_shards`` names,
and the observers events go to. One ContextVar holds it, set by the public entry points
(a step, ``apply``, ``bind``, ``on_shards``, ``record_collectives``) with :func:`within`.
A public call reads it once where it begins (:func:`here`), or takes it from the guarded
region it opens (shardfn._comm.guard.guarded yields it); below, it is passed as a value.
Code that runs in backward never reads it ([Note: backward on device threads] in
shardfn._comm.guard): its runtime carries the scope it was built in.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

from .communicator import EAGER

__all__ = ["Scope", "Where", "here", "within"]


class Where:
    """What a rank is doing when it issues a collective (the header's ``where``)."""

    OTHER, STEP, APPLY, BIND = 0, 1, 2, 3
    NAMES = {0: "outside a step (shard, gather, a checkpoint)", 1: "in a step", 2: "in apply outside a step",
             3: "inside `with shardfn.bind(...)`"}


class Scope(NamedTuple):
    """What the running code runs under; see [Note: the scope]."""

    guarded: bool = False  # inside a guarded region (the outermost reports errors to peers)
    where: int = Where.OTHER  # what the region is: its collectives' headers say so
    run: Any = None  # the step in progress, if it checks its schedule (a shardfn._comm.pipelined.Run)
    comm: Any = EAGER  # how its data collectives start: EAGER, or RECORDED while a graph step is recorded
    runtime: Any = None  # the runtime of the step (or call of apply) in progress: shardfn._run.runtime
    shards: Any = None  # (mesh, whether the shard axis holds different shards, the layout), set by on_shards
    observers: tuple[Any, ...] = ()  # what events are handed to (shardfn._comm.events)
    compiling: Any = None  # how the step in progress compiles (shardfn._compile.Compiling); None: eager


_SCOPE: contextvars.ContextVar[Scope] = contextvars.ContextVar("shardfn_scope", default=Scope())


def here() -> Scope:
    """The scope of the calling thread: read where a public entry point begins, never in
    backward ([Note: backward on device threads])."""
    return _SCOPE.get()


@contextlib.contextmanager
def within(more_observers: tuple[Any, ...] = (), **changes: Any) -> Iterator[tuple[Scope, Scope]]:
    """The block runs in the calling scope with ``changes`` made to it, and
    ``more_observers`` added to its observers; yields ``(the calling scope, the block's)``,
    so that a region that nests (shardfn._comm.guard.guarded) learns what it is inside of
    without looking it up again."""
    outer = _SCOPE.get()
    if more_observers:
        changes["observers"] = (*changes.get("observers", outer.observers), *more_observers)
    scope = outer._replace(**changes)
    token = _SCOPE.set(scope)
    try:
        yield outer, scope
    finally:
        _SCOPE.reset(token)
