"""Remat: a unit's forward under ``torch.utils.checkpoint``, gather included.

[Note: remat of a unit]
A rematerialised unit's module runs its forward inside a non-reentrant checkpoint whose
region gathers the unit, runs the original forward and reshards. So the recompute in
backward gathers again (FULL_SHARD) or reuses the kept parameters (SHARD_GRAD_OP)
without any saved-tensor handle of ours: the checkpoint keeps only the region's inputs
(full remat) or also the outputs of the ops the policy saves (selective remat). The
recompute's GatherUnit node is never run backward (the original forward's node is), so
it does not count as a use of the unit (shardfn._group.reduce).

Buffers: the recompute runs in backward, after ``functional_call`` has put the module
tree's meta buffers back. The region keeps copies of the unit's buffers as the original
forward found them and runs the recompute on those: it computes what the forward computed,
and a running statistic it updates (BatchNorm in train mode) is updated once, by the
original forward, not again by the recompute.

[Note: random ops in a program]
A recorded step holds each random op (dropout's ``bernoulli_``, ``rand_like``) as an op on
torch's generator, so every replay draws fresh values, the ones the eager step draws from
the same generator state. Inductor would generate its own random numbers (other values):
a graph step compiles with ``fallback_random`` (shardfn._program.graph), for that compile only.
Remat: an eager recompute draws the forward's values again because the checkpoint resets
the generator first, a host action that a recording cannot hold; recorded, the recompute
would draw new values and backward would use another mask than the forward. So while a
step is recorded, a rematerialised unit's forward keeps a copy of each random op's result
and its recompute takes those copies, in order, instead of drawing (:class:`_SameDraws`):
as compilers do with random ops (they save them, not recompute), at the cost of holding
them from forward to backward. An attention op with ``dropout_p=0`` draws nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from .._comm.events import Purpose
from .._state.plan import RematMode
from .._comm.recording import Unrecordable

__all__ = ["remat_forward"]


def remat_forward(active_units: Callable[[], list[Any]], module: torch.nn.Module,
                  forward: Callable[..., Any], call: Callable[[], Callable[[], Any]]) -> Callable[..., Any]:
    """Wraps a unit module's ``forward`` (a :func:`shardfn._compile.compilable` one): inert
    unless ``active_units()`` (the module's units in the sharded call in progress, one per
    dtype group) are rematerialised. ``call()``,
    asked in forward, gives what re-enters that sharded call around the recompute (its split
    layers, shardfn._parallel.tensor: a recompute outside it would run them whole, other ops)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        units = active_units()
        if not units:  # outside a sharded call of a layout with this unit
            return forward(*args, **kwargs)
        unit = units[0]
        # The forward as the call's runtime runs it (compiled or not), in the recompute too,
        # which runs in backward ([Note: backward on device threads] in shardfn._comm.guard).
        if unit.unit.remat is None:
            return forward.under(unit.group.ctx.compiling, *args, **kwargs)
        run = functools.partial(forward.under, unit.group.ctx.compiling)
        selective = unit.unit.remat is RematMode.SELECTIVE
        # The unit's buffers as this forward finds them (functional_call has put the tree's in);
        # without grad there is no backward, so no recompute to keep them for.
        kept = [(sub, name, t.detach().clone()) for sub in module.modules() for name, t in sub._buffers.items()
                if t is not None] if torch.is_grad_enabled() else []

        draws = _SameDraws() if unit.group.ctx.recorded else None  # [Note: random ops in a program]
        again = call()

        def region(*args: Any, **kwargs: Any) -> Any:
            recompute = torch._C._current_graph_task_id() != -1
            for u in units:
                u.start_use(Purpose.REGATHER if recompute else Purpose.GATHER)
                u.enter(None)
            swapped = [(sub, name, sub._buffers[name]) for sub, name, _ in kept] if recompute else []
            for sub, name, t in kept if recompute else ():
                sub._buffers[name] = t  # (no op here: selective remat replays the region's ops one for one)
            try:
                with again() if recompute else contextlib.nullcontext():
                    if draws is None:
                        return run(*args, **kwargs)
                    with draws.again() if recompute else draws:
                        return run(*args, **kwargs)
            finally:
                for sub, name, t in swapped:
                    sub._buffers[name] = t
                for u in reversed(units):
                    u.exit()  # the use ends; a kept unit holds its parameters (Unit.holds)

        if selective and unit.group.ctx.recorded:
            raise Unrecordable("selective remat chooses what to save by dispatch modes that a recorded step cannot hold",
                               "full remat (Remat() without mode='selective')", frozen=False)
        context_fn = _selective(unit.layout.plan.remat.save) if selective else torch.utils.checkpoint.noop_context_fn
        return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return wrapped


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func`` on these arguments gives a result that depends on random draws: a
    seeded op, unless its probability leaves nothing to chance (attention's ``dropout_p``
    0, dropout's ``p`` 0 or not training, a Bernoulli ``p`` of 0 or 1: what dropout with
    ``p=0`` runs as on the CPU)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    given = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    name = func._overloadpacket.__name__
    if "dropout_p" in given:
        return given["dropout_p"] != 0
    if name == "native_dropout":
        return given.get("p") != 0 and given.get("train") is not False
    if name.startswith("bernoulli") and isinstance(given.get("p"), (int, float)):
        return 0 < given["p"] < 1
    return True


def _selective(save: tuple[str, ...]):
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = {getattr(torch.ops.aten, name).default for name in save}  # names checked by Remat

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


class _SameDraws(TorchDispatchMode):
    """While recording: keeps a copy of each random op's result in a unit's forward; in
    :meth:`again` (its recompute) returns those copies, in order, and draws nothing
    ([Note: random ops in a program])."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[Any, Any]] = []  # (op, copies of its results)
        self.replaying = False
        self.next = 0

    def again(self) -> _SameDraws:
        self.replaying, self.next = True, 0
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        if not self.replaying:
            out = func(*args, **kwargs)
            self.kept.append((func, pytree.tree_map_only(torch.Tensor, torch.clone, out)))
            return out
        if self.next >= len(self.kept) or self.kept[self.next][0] is not func:
            raise AssertionError(f"shardfn internal error: a rematerialised unit's recompute drew {func} as its random "
                                 f"op {self.next}; its forward drew {[f for f, _ in self.kept]}")
        kept = self.kept[self.next][1]
        self.next += 1
        if not func._schema.is_mutable:
            return pytree.tree_map_only(torch.Tensor, torch.clone, kept)
        given = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs  # in place or out=: written into
        written = [given[a.name] for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        for target, value in zip(written, kept if isinstance(kept, (list, tuple)) else [kept]):
            target.copy_(value)
        return written[0] if len(written) == 1 else tuple(written)
