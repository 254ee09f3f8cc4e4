"""A step's verdict on its own loss and gradient norm, read later: ``on_nonfinite="raise_next"``.

[Note: a step that does not wait]
On a GPU the host runs ahead of the device: it queues a step's kernels and goes on while
they run. Reading a value of the device (``.item()``, ``.tolist()``, ``bool(t)``) stops the
host until the device has caught up, and the device then idles while the host queues what
follows. A step that checks its loss and gradient norm before its in-place update
(``on_nonfinite="raise"``, the default, and ``"skip"``) must read them there: one read per step.

With ``on_nonfinite="raise_next"`` the step reads nothing. ``metrics["loss"]`` and
``["grad_norm"]`` stay 0-d device tensors, the update runs whatever they are, and the two
values leave for the host by a copy that does not wait (pinned memory and an event on
CUDA): a :class:`Verdict`, attached to the shards the step returns. What uses those shards
next (the next step, after its own backward; ``checkpoint.save``; ``save_pretrained``)
reads it, and if a value was not finite raises ``FloatingPointError`` on every rank (the
values came out of an all-reduce, so every rank holds the same verdict) before it changes
or writes anything, and keeps raising for those shards until ``checkpoint.load`` replaces
them. Every tree made from them carries the verdict on ([Note: what a tree carries] in
shardfn._sharded).

What else reads the device in such a step follows one rule: a value computed on the device
is read only where it must become a Python number to decide what the host does next. So a
``Mean`` loss's count is checked on the device (the verdict reports a bad one), step counts
live on the host, and what remains reads because a decision needs it: which floating-point
buffers the forward changed (``sync_buffers``), and an optimizer whose step sizes are
Python numbers computed from device values. Which trees and optimizers do what:
docs/training.md, "Metrics".
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._errors import PeerError

__all__ = ["Unusable", "Verdict", "check_alike", "check_usable", "check_verdict", "unusable_on_failure"]

_NOT_FINITE = (
    "[rank {rank}] {call}: the last step on these shards had a global loss ({loss}) or gradient norm ({norm}) that is "
    "not finite, and its update is in them and in its optimizer state: with jit_step(..., "
    "on_nonfinite=\"raise_next\") a step does not wait to read its values, so what uses the shards next tells. "
    "Nothing was changed or written. Load a checkpoint from before that step (checkpoint.load(path, sharded, "
    "opt_state) replaces the update) and find the cause (a bad batch, a learning rate too high, fp16 overflow: "
    "jit_step(loss_scale=...)), or leave on_nonfinite out (\"raise\"): it checks before updating, for one "
    "synchronisation with the device per step."
)


_UNUSABLE = (
    "[rank {rank}] {call}: these shards are unusable: a step on them failed after its point of no return, when "
    "some ranks had updated and others had not, so the ranks no longer hold one model. Nothing was changed or "
    "written now. Load the last good checkpoint into them on every rank: checkpoint.load("
    "shardfn.checkpoint.latest(directory), sharded, opt_state) replaces their values and optimizer state. What "
    "happened:\n{what}"
)


class Unusable:
    """The verdict of a step that failed after its point of no return (shardfn._no_return [Note:
    the point of no return]): the tree's values are not one model across the ranks."""

    def __init__(self, what: str) -> None:
        self.what = what

    def refuse(self, rank: int, call: str) -> None:
        raise RuntimeError(_UNUSABLE.format(rank=rank, call=call, what=self.what))


def check_usable(sharded: Any, call: str) -> None:
    """Raises ``RuntimeError`` if ``sharded`` is :class:`Unusable`; reads nothing on the device."""
    if isinstance(sharded._verdict, Unusable):
        sharded._verdict.refuse(sharded.mesh.rank, call)


@contextmanager
def unusable_on_failure(sharded: Any) -> Iterator[None]:
    """Marks ``sharded`` unusable when the block learns that a peer failed after a step's
    point of no return (a PeerError with ``updated``): the step made the ranks differ."""
    try:
        yield
    except PeerError as e:
        if e.updated is not None:
            sharded._mark_unusable(Unusable(str(e)))
        raise


class Verdict:
    """A step's global loss and gradient norm on their way to the host without a wait."""

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor) -> None:
        values = torch.stack([loss.detach().float(), norm.detach().float()])
        self.event = None
        self.read: list[float] | None = None
        if values.is_cuda:
            self.values = torch.empty(2, dtype=torch.float32, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = values

    def loss_and_norm(self) -> list[float]:
        if self.read is None:
            if self.event is not None:
                self.event.synchronize()  # done already, unless the device is a whole step behind
            self.read = self.values.tolist()
        return self.read


def check_alike(verdict: Verdict | None, other: Verdict | None, rank: int, call: str) -> None:
    """Trees mapped together whose verdicts differ: the tree made carries one, so both are read
    here; raises ``FloatingPointError`` if either step's values were not finite (see the note)."""
    if verdict is other:
        return
    for v in (verdict, other):
        if isinstance(v, Unusable):
            v.refuse(rank, call)
    for v in (verdict, other):
        loss, norm = v.loss_and_norm() if v is not None else (0.0, 0.0)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise FloatingPointError(_NOT_FINITE.format(rank=rank, call=call, loss=loss, norm=norm))


def check_verdict(sharded: Any, call: str) -> None:
    """Raises ``FloatingPointError`` if the step that made ``sharded`` had a non-finite loss
    or gradient norm (see the note); a verdict reads the device once, then keeps its values."""
    verdict = sharded._verdict
    if verdict is None:
        return
    check_usable(sharded, call)
    loss, norm = verdict.loss_and_norm()
    if math.isfinite(loss) and math.isfinite(norm):
        return
    raise FloatingPointError(_NOT_FINITE.format(rank=sharded.mesh.rank, call=call, loss=loss, norm=norm))
