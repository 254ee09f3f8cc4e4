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
next (a next step, when its values are ready: [Note: reading a verdict when it is ready];
``checkpoint.save``; ``save_pretrained``) reads it, and if a value was not finite raises
``FloatingPointError`` on every rank (the values came out of an all-reduce, so every rank
holds the same verdict) before it changes or writes anything, and keeps raising for those
shards until ``checkpoint.load`` replaces them. Every tree made from them carries the
verdict on ([Note: what a tree carries] in shardfn._state.sharded).

What else reads the device in such a step follows one rule: a value computed on the device
is read only where it must become a Python number to decide what the host does next. So a
``Mean`` loss's count is checked on the device (the verdict reports a bad one), step counts
are known on the host without a read ([Note: step counts] in shardfn.optim._count), and what remains reads because a decision needs it: which floating-point
buffers the forward changed (``sync_buffers``), and an optimizer whose step sizes are
Python numbers computed from device values. Which trees and optimizers do what:
docs/training.md, "Metrics".

[Note: reading a verdict when it is ready]
A step does not wait for its verdicts either. At each call it reads the verdicts pending
on its shards whose values are on the host (the event's ``query()``), oldest first; one not
ready stays pending on the tree the step returns, in order, with the new one. At most
MAX_PENDING stay unread: for an older one the call waits, so the host runs at most that many
steps ahead of what it checked. What must not proceed on a bad state (``checkpoint.save``,
``save_pretrained``, a ``tree_map`` over trees with different verdicts) reads them all,
waiting: every rank then knows every value. Ranks do differ in what is ready: one may read
"not finite" while another waits, and if only the first raised, the second would run the
step's collectives alone. So each rank's answer travels in the header the call exchanges
anyway (an eager step's opening header, ``Run.open``; a graph step's, ``agree_on_key``),
carried on from one mesh axis to the next so that all ranks of a 2-D mesh hear it. If any
rank's answer is "not finite", every rank reads all its pending verdicts, waiting, and
raises the same error, for the same step (the values are the same on every rank), before
the step changes anything. At world 1 the step raises when it reads one. CPU values are
ready at once: there a step reads the previous step's verdict, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._errors import DivergenceError, PeerError

__all__ = ["MAX_PENDING", "Unusable", "Verdict", "agreed_error", "check_alike", "check_usable", "check_verdict",
           "read_ready", "unusable_on_failure"]

MAX_PENDING = 2  # unread verdicts a step leaves pending at most ([Note: reading a verdict when it is ready])

_NOT_FINITE = (
    "[rank {rank}] {call}: the last step on these shards had a global loss ({loss}) or gradient norm ({norm}) that is "
    "not finite, and its update is in them and in its optimizer state: with jit_step(..., "
    "on_nonfinite=\"raise_next\") a step does not wait to read its values, so what uses the shards next tells. "
    "Nothing was changed or written. Load a checkpoint from before that step (checkpoint.load(path, sharded, "
    "opt_state) replaces the update) and find the cause (a bad batch, a learning rate too high, fp16 overflow: "
    "jit_step(loss_scale=...)), or leave on_nonfinite out (\"raise\"): it checks before updating, for one "
    "synchronisation with the device per step."
)


_OTHER_BATCHES = (
    "[rank {rank}] {call}: in the last step on these shards, the ranks of a tensor group got different batches "
    "([Note: one batch per tensor group] in shardfn._parallel.agree), and its update is in "
    "them and in its optimizer state: with jit_step(..., on_nonfinite=\"raise_next\") a step does not wait to read "
    "its check, so what uses the shards next tells. Nothing was changed or written now. Load a checkpoint from before "
    "that step (checkpoint.load(path, sharded, opt_state)), and give every rank of a tensor group the same batch: "
    "split_batch(batch, mesh.data_rank, mesh.data_size)."
)


_UNUSABLE = (
    "[rank {rank}] {call}: these shards are unusable: a step on them failed after its point of no return, when "
    "some ranks had updated and others had not, so the ranks no longer hold one model. Nothing was changed or "
    "written now. Load the last good checkpoint into them on every rank: checkpoint.load("
    "shardfn.checkpoint.latest(directory), sharded, opt_state) replaces their values and optimizer state. What "
    "happened:\n{what}"
)


class Unusable:
    """The verdict of a step that failed after its point of no return (shardfn._run.no_return [Note:
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
    """A step's global loss and gradient norm on their way to the host without a wait, and
    the verdicts of the earlier steps on the same shards that no call has read yet
    ([Note: reading a verdict when it is ready])."""

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor, earlier: Any = None,
                 batches_differ: torch.Tensor | None = None) -> None:
        # batches_differ: the tensor ranks whose group got two batches ([Note: one batch per tensor group])
        extra = [batches_differ.detach().float().reshape(())] if batches_differ is not None else []
        values = torch.stack([loss.detach().float(), norm.detach().float(), *extra])
        self.event = None
        self.read: list[float] | None = None
        if values.is_cuda:
            self.values = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
            self.values.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.values = values
        # oldest first, this one last; a verdict read and finite leaves the chain
        kept = earlier.chain if isinstance(earlier, Verdict) else []
        self.chain: list[Verdict] = [v for v in kept if v.read is None or not v.finite()] + [self]

    def ready(self) -> bool:
        """Whether its values are on the host (read, or the device is done): never waits."""
        return self.read is not None or self.event is None or self.event.query()

    def loss_and_norm(self) -> list[float]:
        """Its values; waits for the device if they are not on the host yet."""
        if self.read is None:
            if self.event is not None:
                self.event.synchronize()
            self.read = self.values.tolist()
        return self.read

    def finite(self) -> bool:
        """Whether the step was good: its loss and norm finite (and its tensor groups' batches alike)."""
        values = self.loss_and_norm()
        return all(math.isfinite(v) for v in values[:2]) and not any(values[2:])


def _first_bad(verdict: Any, wait: bool) -> Verdict | None:
    """The oldest verdict in ``verdict``'s chain that is not finite, reading each one on the
    way; ``wait`` False: stops at the first whose values are not on the host yet, unless more
    than :data:`MAX_PENDING` would stay unread (then it waits for that one)."""
    if not isinstance(verdict, Verdict):
        return None
    chain = verdict.chain
    for i, v in enumerate(chain):
        if not wait and not v.ready() and len(chain) - i <= MAX_PENDING:
            return None
        if not v.finite():
            return v
    return None


def _error(bad: Verdict, rank: int, call: str) -> Exception:
    loss, norm, *differ = bad.loss_and_norm()
    if any(differ):
        return DivergenceError(_OTHER_BATCHES.format(rank=rank, call=call))
    return FloatingPointError(_NOT_FINITE.format(rank=rank, call=call, loss=loss, norm=norm))


def read_ready(sharded: Any, call: str) -> bool:
    """A step's check of the verdicts pending on ``sharded`` ([Note: reading a verdict when it
    is ready]): reads those whose values are on the host, oldest first, without waiting
    (except for the oldest beyond :data:`MAX_PENDING`); returns whether one was not finite.
    At world 1 it raises ``FloatingPointError`` then; at more ranks the caller puts the answer
    in its header and every rank raises :func:`agreed_error` if any rank's was True."""
    if sharded._verdict is None:
        return False
    check_usable(sharded, call)
    bad = _first_bad(sharded._verdict, wait=False)
    if bad is not None and sharded.mesh.size == 1:
        raise _error(bad, sharded.mesh.rank, call)
    return bad is not None


def agreed_error(sharded: Any, call: str) -> BaseException:
    """The error every rank raises when some rank's :func:`read_ready` was True: each reads
    all its pending verdicts, waiting, and names the oldest not finite, the same step on every
    rank (the values came out of an all-reduce)."""
    bad = _first_bad(sharded._verdict, wait=True)
    if bad is None:
        return AssertionError(f"[rank {sharded.mesh.rank}] shardfn internal error: {call}: a rank read a verdict "
                              "that is not finite, and none of this rank's verdicts on these shards is")
    return _error(bad, sharded.mesh.rank, call)


def check_alike(verdict: Verdict | None, other: Verdict | None, rank: int, call: str) -> None:
    """Trees mapped together whose verdicts differ: the tree made carries one, so both are read
    here, waiting; raises ``FloatingPointError`` if either had a step whose values were not
    finite (see the note)."""
    if verdict is other:
        return
    for v in (verdict, other):
        if isinstance(v, Unusable):
            v.refuse(rank, call)
    for v in (verdict, other):
        bad = _first_bad(v, wait=True)
        if bad is not None:
            raise _error(bad, rank, call)


def check_verdict(sharded: Any, call: str) -> None:
    """Raises ``FloatingPointError`` if a step that made ``sharded`` had a non-finite loss or
    gradient norm (see the note); reads every pending verdict, waiting for the device, so
    every rank decides alike (``checkpoint.save``, ``save_pretrained``)."""
    verdict = sharded._verdict
    if verdict is None:
        return
    check_usable(sharded, call)
    bad = _first_bad(verdict, wait=True)
    if bad is not None:
        raise _error(bad, sharded.mesh.rank, call)
