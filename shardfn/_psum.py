"""Mesh-aware reductions for code that runs on local shards inside a step (optimizers).

The analogue of ``jax.lax.psum`` inside ``shard_map``: an optimizer sees only this
rank's shard of each parameter and gradient, so a statistic over a whole parameter (its
norm, a trust ratio) is the sum of per-shard partial results over the ranks that hold
the other shards. :func:`psum` does that sum; outside a step, or when parameters are not
sharded (NO_SHARD, a world of one), it returns its input, so the same optimizer code runs
unchanged on one device.

[Note: padding]
Padding rows of a shard are zero in parameters and gradients (packing zeroes them and the
built-in optimizers keep them zero), so sums of squares over padded shards equal those
over the real parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

from typing import Any

import torch

from . import _collectives as C

__all__ = ["global_norm", "psum"]


@dataclasses.dataclass(eq=False)
class StepContext:
    mesh: object  # shardfn.Mesh
    sharded: bool  # whether ranks along the "shard" axis hold different shards
    # The step divides each rank's loss by the number of ranks before backward, so
    # gradient reductions sum: gradients (and fp16 intermediate magnitudes) are those
    # of the global mean loss, as on one device. Outside a step, reductions average.
    predivided: bool = False
    # Asynchronous gradient reductions still in flight: (work, buffers to keep alive).
    # The step waits for them right after each backward (see _Unit._reduce).
    overlap: bool = False
    pending: list = dataclasses.field(default_factory=list)
    # id() of the storages of the gradients handed out in a world of one (_Unit._own).
    owned: set = dataclasses.field(default_factory=set)
    # Prefetch (see _call [Note: prefetch]): the non-root units' forward order recorded
    # on the previous step, and the order seen in this one.
    prefetch: bool = False
    order: list = dataclasses.field(default_factory=list)
    seen: list = dataclasses.field(default_factory=list)
    units: dict = dataclasses.field(default_factory=dict)  # the sharded call's non-root units

    def add_pending(self, work: Any, keepalive: Any) -> None:
        """Tracks an asynchronous reduction, the only one in flight.

        Each pending reduction keeps its unit's unsharded gradient buffer alive, so the
        next unit's reduction waits for it before allocating its own buffer (see
        _Unit._reduce): holding them all until the end of backward would cost the whole
        model's unsharded gradients, and even two at once raise the peak of backward.
        """
        assert not self.pending, "wait_pending() before starting another reduction"
        self.pending.append((work, keepalive))

    def wait_pending(self) -> None:
        while self.pending:
            work, _keepalive = self.pending.pop(0)
            work.wait()
    norms: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # id(tree) -> global norm


_CONTEXT: list[StepContext] = []


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    _CONTEXT.append(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.remove(ctx)


def current() -> StepContext | None:
    return _CONTEXT[-1] if _CONTEXT else None


def psum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the ranks that hold the other shards of the parameters.

    Every rank must call it (it is a collective inside a step). Outside a step, or
    when parameters are replicated, it returns ``t`` unchanged.

    Example:
        >>> # inside an optimizer's update, on local shards:
        >>> param_norm = psum(p.square().sum()).sqrt()    # the norm of the whole parameter
    """
    ctx = current()
    if ctx is None or not ctx.sharded or ctx.mesh.axis_size("shard") == 1:
        return t
    out = t.detach().clone()
    C.all_reduce(out, ctx.mesh.group("shard"), tag="psum", op="sum")
    return out


def sum_of_squares(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's partial sum of squares of a tree of shards, in fp32."""
    parts = [t.detach().float().square().sum() for t in tree.values() if t is not None]
    return torch.stack(parts).sum() if parts else torch.zeros(())


def global_norm(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The L2 norm of a whole tree given as local shards (a 0-d fp32 tensor, every rank).

    Inside a step, the norm of the gradients the optimizer receives is computed once
    with the loss metric and reused here without a collective.

    Example:
        >>> norm = global_norm(grads)      # equals clip_grad_norm_'s total norm on one device
    """
    ctx = current()
    if ctx is not None and id(tree) in ctx.norms:
        return ctx.norms[id(tree)]
    return psum(sum_of_squares(tree)).sqrt()
