"""``jit_step(compile=True)``: regional compilation of each unit's forward and of the update.

[Note: what compile=True compiles]
``torch.compile`` (inductor) compiles, once per model:

* each unit module's own ``forward`` (regional compilation, as torchtitan compiles each
  block): the gather before it and the reshard after it are module hooks, outside the
  compiled region, so the collectives, the prefetch and the saved-tensor handles of
  [Note: how a sharded call works] work as in eager. The handles still apply: the compiled
  region is one autograd node whose saved tensors go through the active
  ``saved_tensors_hooks`` like any other's, so a gathered parameter it saves is kept as a
  handle and regathered in backward. Blocks of one class share one compiled graph (the
  parameters are the graph's inputs, not constants), so eight blocks compile once;
* the optimizer's in-place update (``update_``), with the step's scalars (learning rate,
  bias corrections) passed as inputs, not baked in, so a schedule or the step count does
  not recompile.

The root's own computation (embeddings, head, loss) runs eagerly. The first step compiles
(docs/compile.md says how long); later steps must not recompile. Compiled and eager
agree to float reassociation (inductor fuses elementwise chains and may reorder a
reduction): see docs/compile.md for the bound the tests use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ._comm.compiling import watch_compiles
from ._comm.scope import here

__all__ = ["Compiling", "backend_of", "compilable", "compile_stats"]


class Compiling(NamedTuple):
    """How the step in progress runs what :func:`compilable` wraps: fixed when its runtime
    is built, carried by its unit groups' context and, for an optimizer's kernel (which the
    step calls through the public ``update``), by the scope the step runs in."""

    backend: str | None = None  # jit_step(compile=...)'s torch.compile backend; None: eager
    recorded: bool = False  # a graph step being recorded ([Note: recording a step])
    split: bool = False  # the step's tree has split layers: a forward runs eagerly once first (its checks)


EAGER = Compiling()


def compilable(fn: Callable[..., Any], traced: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Wraps ``fn`` (a unit module's ``forward``, an optimizer's in-place kernel): compiled
    inside a step built with ``compile=True`` (with that step's backend), eager everywhere
    else (``apply`` outside a step, a step without it, an optimizer used on its own).

    ``traced``: what is compiled instead of ``fn``, with the same arguments except that
    every positional ``float`` arrives as a 0-d float32 tensor (a graph input, so a new
    learning rate does not recompile; dynamo would bake a float given to a foreach op into
    the graph). Pass by keyword what is constant."""
    compiled: dict[str, Callable[..., Any]] = {}

    def under(how: Compiling, *args: Any, **kwargs: Any) -> Any:
        """``fn`` as a step runs it (``how``, handed down: a remat recompute runs in backward,
        where no scope is read, [Note: backward on device threads] in shardfn._comm.guard)."""
        # while recorded, the scalars as values of the program ([Note: recording a step])
        if traced is not None and how.recorded:
            device = _device_of(args)  # made there: no host constant in a device program
            return traced(*(torch.full((), a, dtype=torch.float64, device=device) if isinstance(a, float) else a
                            for a in args), **kwargs)
        backend = how.backend
        if not backend:
            return fn(*args, **kwargs)
        if backend not in compiled:
            compiled[backend] = torch.compile(traced or fn, backend=backend)
            if traced is None and how.split:
                # once eagerly: the checks of split outputs and of a sequence region ([Note: a split
                # layer's output], [Note: the sequence region]), which a compiled forward cannot make
                return fn(*args, **kwargs)
        if traced is not None:
            args = tuple(torch.tensor(a, dtype=torch.float32) if isinstance(a, float) else a for a in args)
        return compiled[backend](*args, **kwargs)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return under(here().compiling or EAGER, *args, **kwargs)

    wrapped.under = under  # type: ignore[attr-defined]
    return wrapped


def _device_of(args: tuple[Any, ...]) -> torch.device:
    """The device of the first tensor in ``args`` (lists of tensors included); the CPU if none."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cpu")


def backend_of(compile: bool | str, what: str) -> str | None:
    """``jit_step(compile=...)``: ``True`` is inductor, ``False`` nothing, a string a
    ``torch.compile`` backend (``"aot_eager"`` traces without generating code: for finding
    whether a problem is inductor's)."""
    if compile is False or compile is None:
        return None
    if compile is not True and not isinstance(compile, str):
        raise TypeError(f"{what}(compile=...): True, False or a torch.compile backend name, got {compile!r}")
    known = torch._dynamo.list_backends(exclude_tags=())
    if compile is not True and compile not in known:
        raise ValueError(f"{what}(compile={compile!r}): not a torch.compile backend; choose one of {sorted(known)}, "
                         "or pass True for inductor.")
    watch_compiles()  # a rank that compiles is busy, not lost ([Note: compiling is not a hang])
    return "inductor" if compile is True else compile


def compile_stats() -> dict[str, Any]:
    """What ``torch.compile`` did in this process so far (all of it, not only shardfn's):
    ``graphs``, the number of graphs dynamo compiled (a recompilation adds one), and
    ``graph_breaks``, reason -> count. A step with ``compile=True`` that adds graphs after
    its first call recompiles; see docs/compile.md."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"])}
