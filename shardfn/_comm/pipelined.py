"""The pipelined guard: a step whose collectives repeat the previous steps' checks them once.

[Note: the pipelined guard]
The schedule guard (shardfn._comm.guard) waits for a header exchange before every collective:
a round trip per unit and direction. Inside a step that is mostly wasted, because a step
usually issues exactly the collectives of the step before. So each step function keeps
the *schedule* of its last verified step (for every collective until the metrics
all-reduce: its group, header and size), and once two consecutive steps, both checked
header by header, had the same schedule, the next steps run *pipelined*: one header
exchange opens the step with a hash of the schedule, and then a collective that equals the
next one of the schedule runs at once, without a header. Every rank compares against the
same schedule, so ranks that all match it issue matching collectives.

A rank that leaves the schedule, or whose step raises, issues none of its own collectives:
it plays out the rest of the schedule with scratch buffers, so the other ranks'
collectives complete, and reports in the header of the metrics all-reduce, which is always
exchanged and waited for before anything is updated. There every rank sees every report
and raises the same error. A rank whose play-out fails leaves the others in collectives it
never issues: the process group is unusable, and every rank says so (_failures.unplayable).
If every rank left the schedule alike (a layer skipped on all ranks), nothing is wrong but
the data after that point was scratch: the step runs again, checked, from the same state,
and pipelining waits longer after each re-run, so a schedule that keeps changing stays checked.

Collectives after the metrics all-reduce stay checked: they are few and their inputs are
already the same on every rank. So a pipelined step costs two waited header exchanges per
mesh axis, whatever the number of units ([Note: a fixed-size agreement] in shardfn._comm.guard).
Case by case: docs/ranks-that-differ.md, "Steady steps: one check per step, not per collective".
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import guard as G
from .communicator import EAGER
from .events import Collective, Purpose

__all__ = ["Deviated", "Run", "Schedule"]

_REPLAYABLE = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE)
_MAX_NEED = 64


class Deviated(BaseException):
    """Raised on a rank whose pipelined step left the schedule (a BaseException, so that a
    loss_fn's ``except Exception`` does not swallow it); the step reports it."""


class Entry(NamedTuple):
    channel: G.Channel
    axis: str  # the mesh axis of the channel, the same name on every rank
    header: tuple[int, ...]  # the five words of shardfn._comm.guard.words
    kind: Collective
    dtype: torch.dtype
    device: torch.device
    numel: int  # of the tensor the header counts: an all-gather's output, a reduce-scatter's input
    op: Any


class Schedule:
    """What one step function knows of its collectives, the same on every rank."""

    def __init__(self) -> None:
        self.verified: list[Entry] | None = None
        self.repeats = 0  # steps since, checked or pipelined, with the same schedule
        self.need = 1  # repeats before steps run pipelined
        self.reruns = 0
        self._hash = 0  # of ``verified``, computed when it is learned

    @property
    def pipelined(self) -> bool:
        return (self.verified is not None and self.repeats >= self.need
                and all(e.kind in _REPLAYABLE for e in self.verified))

    def fingerprint(self) -> int:
        return self._hash if self.pipelined else 0

    def learn(self, recorded: list[Entry], pipelined: bool) -> None:
        """After a step whose metrics header every rank agreed on."""
        if pipelined or recorded == self.verified:
            self.repeats += 1
        else:
            self.verified, self.repeats = recorded, 0
            text = repr([(e.axis, e.header, e.numel, str(e.dtype)) for e in recorded])
            self._hash = zlib.crc32(text.encode()) & 0x7FFFFFFF or 1

    def forget(self) -> None:
        """After a re-run: learn again, and wait longer before pipelining."""
        self.verified, self.repeats = None, 0
        self.need = min(2 * self.need, _MAX_NEED)
        self.reruns += 1


def _bytes(e: Entry) -> int:
    """The scratch bytes that playing out ``e`` takes: its whole tensor and one rank's part."""
    return (e.numel + e.numel // e.channel.size) * e.dtype.itemsize


class Run:
    """One step's walk through its collectives; see [Note: the pipelined guard]."""

    def __init__(self, schedule: Schedule, mesh: Any):
        self.schedule = schedule
        self.mesh = mesh
        self.pipelined = schedule.pipelined
        self.opening = True  # before the collectives of the forward and backward
        self.phase1 = True  # until the metrics all-reduce
        self.position = 0
        self.recorded: list[Entry] = []
        self.deviation: tuple[int, list[int]] | None = None
        self.played = False
        self.unplayed: Exception | None = None  # what made the play-out fail, if it did

    def _groups(self) -> list[G.Channel]:
        return [self.mesh.channel(a) for a in self.mesh.axis_names if not self.mesh.channel(a).off]

    def open(self, scope: G.Scope, nonfinite: bool = False) -> bool:
        """The step's opening header, on every axis: the schedule every rank is about to run,
        and in its detail whether this rank, or a rank it heard on an earlier axis, read a
        verdict that is not finite (shardfn._state.verdict [Note: reading a verdict when it is
        ready]). Returns whether any rank did: then every rank raises, the step still opening.
        ``scope``: the step's runtime's."""
        fp = self.schedule.fingerprint()
        n = len(self.schedule.verified) if fp else 0
        for ch in self._groups():
            what = G.words(Collective.BARRIER, Purpose.STEP, "", n, 0, None, G.Where.STEP)[0]
            headers = G.agree_words(ch, [what, fp, n, int(nonfinite), G.Where.STEP], "the start of a step", 0, scope,
                                    free=G.DETAIL)
            nonfinite = nonfinite or any(h[G.DETAIL] for h in headers)
        self.opening = nonfinite
        return nonfinite

    def told(self, exc: BaseException) -> BaseException:
        """``exc``, raised on every rank after the opening header said so: no peer needs telling."""
        for ch in self._groups():
            G.told(exc, ch)
        return exc

    def rerun(self) -> None:
        """Every rank deviated alike: the step runs again, checked."""
        self.schedule.forget()
        self.pipelined, self.phase1, self.position = False, True, 0
        self.recorded, self.deviation, self.played = [], None, False

    # -- collectives ---------------------------------------------------------------------

    def collective(self, ch: G.Channel, kind: Collective, purpose: Purpose, unit: str, t: torch.Tensor, op: Any,
                   detail: int, scope: G.Scope) -> None:
        """Called before each collective of the step (shardfn._comm.collectives), with the
        caller's scope (in backward, its runtime's: [Note: backward on device threads])."""
        if ch.off:
            return
        words = G.words(kind, purpose, unit, t.numel() * t.element_size(), detail, t.dtype, scope.where)
        entry = Entry(ch, ch.axis, tuple(words), kind, t.dtype, t.device, t.numel(), op)
        if not (self.phase1 and self.pipelined):  # checked: a waited header (recorded until the metrics)
            G.agree_words(ch, words, f"{kind.value} ({G.label(purpose, unit)})", self.position, scope)
            if self.phase1:
                self.recorded.append(entry)
                self.position += 1
            return
        if self.deviation is not None:
            raise Deviated()
        expected = self.schedule.verified
        if self.position < len(expected) and expected[self.position] == entry:
            self.position += 1
            return
        self._deviate(words)

    def end_of_backward(self, scope: G.Scope) -> None:
        """Before the metrics all-reduce: the end of the pipelined part. ``scope``: the step's runtime's."""
        if self.pipelined and self.phase1 and self.deviation is None and self.position != len(self.schedule.verified):
            self._deviate(G.words(Collective.ALL_REDUCE, Purpose.METRICS, "", -1, 0, None, scope.where))
        self.phase1 = False

    def _deviate(self, words: list[int]) -> None:
        self.deviation = (self.position, words)
        self.play_out()
        raise Deviated()

    def play_out(self) -> None:
        """Issues the rest of the schedule with scratch buffers, as the other ranks run it.
        Its scratch is allocated before the first of them: one buffer per device, for the
        largest, whatever the dtypes. What makes it fail is kept in ``unplayed`` (see
        :meth:`before_fail`)."""
        if self.played or not self.pipelined or not self.phase1 or self.opening:
            return
        self.played = True
        try:
            rest = self.schedule.verified[self.position:]
            scratch = {d: torch.zeros(max(_bytes(e) for e in rest if e.device == d), dtype=torch.uint8, device=d)
                       for d in {e.device for e in rest}}
            for e in rest:
                size = e.numel * e.dtype.itemsize
                full = scratch[e.device][:size].view(e.dtype)
                part = scratch[e.device][size:_bytes(e)].view(e.dtype)
                if e.kind is Collective.ALL_GATHER:
                    work = EAGER.all_gather(full, part, e.channel)
                elif e.kind is Collective.REDUCE_SCATTER:
                    work, _ = EAGER.reduce_scatter(part, full, e.channel, e.op)
                else:
                    work = EAGER.all_reduce(full, e.channel, e.op)
                G.wait(work, e.channel, f"{e.kind.value} (playing out the schedule after a deviation)")
        except Exception as error:
            self.unplayed = error
            raise

    def before_fail(self) -> Exception | None:
        """A rank whose step raises: play out the schedule, so that its failed header meets
        the others' metrics header. Returns what made the play-out fail, if it did (then the
        peers wait in collectives this rank never issues: shardfn._comm.guard.fail)."""
        if self.unplayed is None:
            try:
                self.play_out()
            except Exception:  # noqa: BLE001 - kept in self.unplayed
                pass
        self.phase1 = False
        return self.unplayed

    # -- the verdict -----------------------------------------------------------------------

    def report(self, scope: G.Scope) -> None:
        """On a rank that deviated: its report in the metrics header of every axis. Returns
        when every rank deviated alike (the step is to run again), else raises. ``scope``:
        the step's runtime's."""
        position, words = self.deviation
        for state in self._groups():
            headers = G.exchange(state, [*words, G.DIVERGED, position], "the metrics all-reduce (a deviation)", scope)
            if any(h[G.STATUS] != G.DIVERGED or h[G.POSITION] != position or h[:G.STATUS] != words for h in headers):
                raise G.told(G.DivergenceError(self.explain(state, headers)), state)

    def explain(self, state: Any, headers: list[list[int]]) -> str:
        """The same message on every rank, from the headers and the shared schedule."""
        reports = [h[G.POSITION] for h in headers if h[G.STATUS] == G.DIVERGED]
        first = min(reports)
        expected = self.schedule.verified or []
        did = [h if h[G.POSITION] == first else list(expected[first].header) for h in headers]
        lines = [f"  rank {r}: {G.describe_header(h, state.guard.names)}" for r, h in zip(state.ranks, did)]
        return (f"[rank {dist.get_rank()}] shardfn: the ranks diverged at collective #{first} of the step on ranks "
                f"{list(state.ranks)}: until then every rank ran the collectives of the previous steps (checked at "
                f"the metrics all-reduce, before anything was updated). There:\n" + "\n".join(lines) + "\n"
                + G.fix(did, state.guard.names))
