"""The schedule guard: ranks that are about to run different collectives find out together.

[Note: the schedule guard]
Collectives are matched by call order alone: when two ranks issue different ones, gloo
either aborts the process (the sizes differ) or exchanges the wrong buffers without a word
(the sizes agree), and NCCL hangs or does the same. So before shardfn issues any collective
on a process group of more than one rank, the ranks exchange a *header* (:data:`HEADER`
int64 words, the same size whatever the collective: what, unit, bytes, detail, where,
status, position) on the group's control group. Only when every rank's header is the same
does the collective run; otherwise no rank issues it and every rank raises the same
:class:`DivergenceError`, built from the same headers, naming what each rank was about to
do. Each header is waited for before its collective, so nothing a step changes has changed
when this raises.

A rank whose step raises tells the others through the same channel (:func:`fail`: a header
with ``status = FAILED``), so that they raise :class:`PeerError` at once instead of waiting,
the ranks stay matched and training can go on. Every wait on the host is bounded by the
mesh's ``step_timeout`` (on NCCL, data collectives are waited for on the stream: [Note:
waiting on NCCL]): a peer that does not come raises :class:`CommError`, and the process group,
which then holds a collective that will never finish, is unusable. The header's words, the
control groups, how an error travels on a 2-D mesh, the roll call and what a timeout leaves:
docs/ranks-that-differ.md, "How: a header before every collective" and "Timeouts, and what
a timeout leaves behind".

[Note: the guard's state] The guard keeps no module state: a :class:`Guard` belongs to its
mesh (``mesh.guard``) and holds one :class:`Channel` per axis group (and sub-group) of
the mesh: the group, the gloo group its headers travel on and its exchanges so far;
besides, the unit names it can print, the error that made the process group unusable,
and counters. Which groups already know of an error travels with the error itself
(:func:`told`). Two meshes over the same process group (``Mesh.from_env()`` called twice)
keep their own counts, which only messages read; an error that broke the process group
is known to the mesh that saw it, and another mesh finds out at its next wait. Collectives take a channel where torch
takes a process group. What a rank is doing (the header's ``where``), whether it is
inside a guarded region and the step in progress are fields of the scope
(shardfn._comm.scope), set and reset by the ``with`` blocks that own them and read on the
calling thread only; backward gets its runtime's ([Note: backward on device threads]).

Cost: one small all-reduce (112 bytes, whatever the world: [Note: a fixed-size agreement])
per collective, waited before the collective starts — except inside a step whose collectives repeat the previous steps',
where the check is pipelined (see [Note: the pipelined guard] in shardfn._comm.pipelined).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from .._compat import all_gather_single
from .._errors import CommError, DivergenceError, PeerError
from .compiling import compiling
from .failures import (Told, describe, failed_at, lost, name_the_others, peer_error, raised_here, read_failure,
    unplayable, unplayed)
from .header import (_CONTEXTS, _DTYPES, _KINDS, _PURPOSES, DETAIL, DIVERGED, FAILED, HEADER, NBYTES, OK, POSITION,
    STATUS, UNIT, WHAT, WHERE, Failure, Where, describe_header, fix, label, unit_id)
from .events import Collective, Purpose
from .._memory import on_host
from .recording import untraced
from .scope import Scope, Where, within

__all__ = [
    "Channel", "CommError", "DivergenceError", "Failure", "Guard", "PeerError", "Scope", "Where", "agree",
    "agree_exit", "agree_words", "exchange", "exchange_details", "fail", "guarded", "wait", "words",
]

DEFAULT_STEP_TIMEOUT = 60.0
_POLL_S = 0.0005  # between looks at the collectives of exchanges run side by side



# [Note: backward on device threads]
# On CUDA, autograd runs backward on its own device threads. torch copies its thread-local
# state into them (grad mode, the dispatch modes ``make_fx`` records through), but not
# Python's context: a ContextVar set by the caller reads its default there. So nothing
# that backward runs (a unit's regather, its reduction, a bucket's collective, a
# saved-tensor hook, a remat recompute) reads one: what it needs is a value carried by
# the objects backward reaches, the runtime's :class:`Scope` (``Runtime.scope``) and
# observers, passed to the collectives as arguments. tests/test_backward_threads.py runs
# every backward under an empty context to hold this on the CPU.


class Guard:
    """The schedule guard of one mesh (``mesh.guard``): see [Note: the guard's state]."""

    __slots__ = ("timeout", "channels", "subgroups", "names", "broken", "incidents", "headers", "header_bytes", "fake")

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.channels: dict[str, Channel] = {}  # mesh axis -> its channel
        self.subgroups: dict[int, tuple[Channel, int]] = {}  # see Mesh.subgroup
        self.names = {unit_id(n): n for n in _CONTEXTS}  # unit hash -> name, for messages
        self.broken: str | None = None  # the CommError that made the process group unusable
        self.incidents = 0  # this rank's failures so far
        self.fake = False  # over torch's fake process group: a planning run (Mesh.fake)
        self.headers = 0  # header exchanges so far (tests count them)
        self.header_bytes = 0  # the bytes of the exchanges' results so far: what reached this rank

    def channel(self, group: Any, axis: str, control: Any = None) -> "Channel":
        """A channel over ``group`` whose headers travel on ``control`` (default: the group)."""
        return Channel(self, group, control if control is not None else group, axis)

    def learn(self, names: dict[int, str]) -> None:
        """Unit names this rank may have to print for a peer (``Layout.names_by_id``), so
        that a divergence names units this rank did not run."""
        if not names.keys() <= self.names.keys():
            self.names.update(names)

    def check_alive(self, what: str) -> None:
        """Raises a clear error when the process group is gone or unusable."""
        check_alive(what)
        if self.broken is not None:
            raise CommError(f"[rank {dist.get_rank()}] shardfn: the process group is unusable since an earlier error; "
                            f"restart the job and resume from the last checkpoint. The error was:\n{self.broken}")


class Channel:
    """A process group as the guard sees it: the group collectives run on, the group its
    headers go over, and how many exchanges it has seen."""

    __slots__ = ("guard", "group", "control", "axis", "ranks", "position", "off", "on_stream")

    def __init__(self, guard: Guard, group: Any, control: Any, axis: str):
        self.guard, self.group, self.control, self.axis = guard, group, control, axis
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.position = 0  # header exchanges so far
        backend = str(dist.get_backend(group))
        # A world of one, or the fake process group of a planning run (no values to compare).
        self.off = len(self.ranks) == 1 or backend == "fake"
        # Data collectives are waited for on the device's stream: see [Note: waiting on NCCL].
        self.on_stream = backend == "nccl" and not self.off

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def timeout(self) -> float:
        return self.guard.timeout


def words(kind: Collective, purpose: Purpose, unit: str, nbytes: int, detail: int, dtype: torch.dtype | None,
          where: int) -> list[int]:
    """The first five words of a header (what, unit, bytes, detail, where); ``where``: what
    the caller's region is (its scope's ``where``)."""
    code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    return [code * 4096 + _KINDS.index(kind) * 64 + _PURPOSES.index(purpose), unit_id(unit), nbytes, detail, where]


def check_alive(what: str) -> None:
    """Raises a clear error when the process group was destroyed or never started."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"shardfn: {what} needs the process group, but it was destroyed (torch.distributed."
            "destroy_process_group()) or never started. Shards are this rank's pieces of the model and can only be "
            "used together with the other ranks: gather what you need (shardfn.gather, checkpoint.save) before "
            "destroying the process group."
        )


def agree(ch: Channel, kind: Collective, purpose: Purpose, unit: str, nbytes: int, detail: int,
          dtype: torch.dtype | None, scope: Scope) -> None:
    """Exchanges this collective's header on ``ch``; raises unless every rank's is the same.
    ``scope``: the caller's, handed down from where its public call began."""
    ch.guard.check_alive(f"{kind.value} ({purpose.value})")
    if ch.off:
        return
    mine = words(kind, purpose, unit, nbytes, detail, dtype, scope.where)
    if unit:
        ch.guard.names.setdefault(mine[UNIT], unit)
    agree_words(ch, mine, f"{kind.value} ({label(purpose, unit)})", 0, scope)


def agree_exit(ch: Channel, context: str, scope: Scope) -> None:
    """The end of a ``with`` block that issues collectives: every rank of ``ch`` ends
    it here, or the ranks' calls inside it differed and all of them raise
    DivergenceError, naming what each was doing. ``scope``: the block's caller's."""
    agree(ch, Collective.BARRIER, Purpose.EXIT, context, 0, 0, None, scope)


def agree_words(ch: Channel, mine: list[int], what: str, position: int, scope: Scope,
                free: int | None = None) -> list[list[int]]:
    """Exchanges the header ``mine`` (five words) on ``ch``; raises DivergenceError
    unless every rank's is the same (but for word ``free``, a flag the caller reads);
    returns them all. ``scope``: the caller's."""
    headers = exchange(ch, [*mine, OK, position], what, scope)
    same = (lambda h: h[:STATUS]) if free is None else (lambda h: h[:free] + h[free + 1:STATUS])
    if any(same(h) != same(headers[0]) or h[STATUS] != OK for h in headers):
        run = scope.run
        if run is not None and any(h[STATUS] == DIVERGED for h in headers):
            raise told(DivergenceError(run.explain(ch, headers)), ch)
        raise told(DivergenceError(_diverged(ch, headers)), ch)
    return headers


def exchange(ch: Channel, mine: list[int], what: str, scope: Scope) -> list[list[int]]:
    """All ranks' headers; raises PeerError when a peer's header says it failed.
    ``scope``: the caller's (whether it is recorded, its pipelined run).

    A recorded step's headers are this call's host work, not its program's ([Note:
    recording a step]).

    [Note: a fixed-size agreement] The ranks first agree on a value whose size does not
    grow with the world: one all-reduce (MAX) of the header and its negation gives every
    word's largest and smallest value over the ranks. Equal, every rank sent this header,
    and that is the answer. Otherwise (a divergence, a failure, a deviation: every rank sees
    it, so every rank goes on alike) an all-gather brings each rank's header for the message.
    """
    with untraced(scope.comm.recorded):
        return _exchange(ch, mine, what, scope.run)


def exchange_details(ch: Channel, detail: int, what: str, scope: Scope) -> list[int]:
    """Every rank's ``detail`` (a digest, a seed, a fingerprint) on ``ch``, in rank order,
    from one step header; the caller decides what a difference means."""
    mine = words(Collective.BARRIER, Purpose.STEP, "", 0, detail, None, scope.where)
    return [h[DETAIL] for h in exchange(ch, [*mine, OK, 0], what, scope)]


def _exchange_all(channels: list[Channel], mine: list[int], what: str, recorded: bool) -> list[list[list[int]]]:
    """All ranks' headers on each of ``channels``, the exchanges run side by side (see
    :func:`fail`); no check of what they hold. ``recorded``: whether the caller's step is."""
    with untraced(recorded):
        return _side_by_side([(ch, _rounds(ch, mine)) for ch in channels], what)


def _rounds(ch: Channel, mine: list[int]) -> Generator[Any, None, list[list[int]]]:
    """One exchange ([Note: a fixed-size agreement]) as its collectives: yields the work
    handle of each one to wait for, and returns every rank's header."""
    with on_host():  # host memory on any device (the control group is gloo's)
        extremes = torch.tensor([*mine, *(-w for w in mine)], dtype=torch.int64)
        ch.guard.headers += 1
        ch.guard.header_bytes += extremes.numel() * extremes.element_size()
        work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=ch.control, async_op=True)
    yield work  # outside on_host(): a generator suspended inside a context would leave it entered
    top = extremes.tolist()
    if top[:HEADER] == [-w for w in top[HEADER:]]:
        headers = [list(mine) for _ in ch.ranks]
    else:
        with on_host():
            out = torch.empty(ch.size * HEADER, dtype=torch.int64)
            ch.guard.header_bytes += out.numel() * out.element_size()
            work = all_gather_single(out, torch.tensor(mine, dtype=torch.int64), group=ch.control, async_op=True)
        yield work
        headers = out.view(-1, HEADER).tolist()
    ch.position += 1
    return headers


def _side_by_side(exchanges: list[tuple[Channel, Generator[Any, None, list[list[int]]]]],
                  what: str) -> list[list[list[int]]]:
    """Runs :func:`_rounds` generators: each of its collectives waited for as it completes,
    whatever the others do, each bounded by its channel's step timeout. One alone waits as
    :func:`wait` does."""
    results: list[Any] = [None] * len(exchanges)
    pending: dict[int, tuple[Any, float]] = {}  # exchange -> (its collective in flight, its deadline)

    def advance(i: int) -> None:
        ch, rounds = exchanges[i]
        try:
            pending[i] = (next(rounds), time.monotonic() + ch.timeout)
        except StopIteration as done:
            results[i] = done.value

    for i in range(len(exchanges)):
        advance(i)
    while pending:
        for i, (work, deadline) in list(pending.items()):
            ch = exchanges[i][0]
            if len(pending) == 1 or work.is_completed():
                del pending[i]
                wait(work, ch, what, host=True)
                advance(i)
            elif time.monotonic() > deadline:
                if compiling(ch.ranks):  # busy, not lost: [Note: compiling is not a hang]
                    pending[i] = (work, time.monotonic() + ch.timeout)
                    continue
                raise lost(ch, what, RuntimeError(f"timed out after {ch.timeout:g} s"))
        if len(pending) > 1:
            time.sleep(_POLL_S)
    return results


def _exchange(ch: Channel, mine: list[int], what: str, run: Any) -> list[list[int]]:
    headers = _side_by_side([(ch, _rounds(ch, mine))], what)[0]
    failed = [(r, h[STATUS]) for r, h in zip(ch.ranks, headers) if h[STATUS] >= FAILED]
    if failed and mine[STATUS] < FAILED:
        stuck = [r for r, h in zip(ch.ranks, headers) if h[STATUS] >= FAILED and h[DETAIL] == Failure.UNPLAYED]
        raise told(unplayed(ch, what, stuck) if stuck else peer_error(ch.ranks, headers, run), ch)
    return headers


def told(exc: BaseException, ch: Channel) -> BaseException:
    """``exc``, marked as known to every rank of ``ch``'s group: it was raised from an
    exchange there (a failure or a divergence every rank saw), so :func:`fail` sends no
    failed header on that group (every group sees exactly one failed exchange per incident)."""
    exc.__dict__.setdefault("_shardfn_told", []).append(ch.group)
    return exc


def _known(exc: BaseException) -> list[Any]:
    """The process groups every rank of which already knows of ``exc`` (or of an exception
    it was raised from)."""
    groups: list[Any] = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        groups += exc.__dict__.get("_shardfn_told", [])
        exc = exc.__cause__ or exc.__context__
    return groups


def wait(work: Any, ch: Channel, what: str, host: bool = False) -> None:
    """Waits for a collective's work handle: on the host, bounded by the step timeout; a data
    collective (not ``host``) of a channel on NCCL, on the current stream.

    [Note: waiting on NCCL]
    NCCL's ``work.wait(timeout)`` blocks the host until the collective has finished, so the
    host could never run ahead of the device; ``work.wait()`` only makes the current stream
    wait. So on a channel whose group runs NCCL (``Channel.on_stream``) a data collective
    (all-gather, reduce-scatter, all-reduce, broadcast, scatter) is waited for on the stream;
    what reads its result on the host synchronises anyway. Header exchanges (on the gloo
    control group) and barriers, which exist to meet on the host, pass ``host=True`` and keep
    the bounded wait; gloo's wait blocks in any case, so on the CPU every wait is bounded.
    The step timeout still holds without it: a peer that does not come is met at the next
    header exchange, on the host, and a collective that started but never ends is NCCL's
    watchdog's (the process group's timeout). What that means in a pipelined step:
    docs/ranks-that-differ.md, "Timeouts, and what a timeout leaves behind".
    """
    if ch.off:
        work.wait()
        return
    if ch.guard.broken is not None and not host:
        return  # an unusable process group's collectives may never complete: a step raising anyway waits for none
    while True:
        try:
            if ch.on_stream and not host:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=ch.timeout))
            return
        except RuntimeError as e:
            # a peer that is compiling is busy, not lost: [Note: compiling is not a hang]
            if "timed out" not in str(e).lower() or not compiling(ch.ranks):
                raise lost(ch, what, e) from None


class Pending:
    """An asynchronous data collective's handle, waited for as :func:`wait` does (on the
    host within the step timeout; on NCCL, on the stream)."""

    __slots__ = ("work", "ch", "what", "then")

    def __init__(self, work: Any, ch: Channel, what: str, then: Any = None):
        self.work, self.ch, self.what, self.then = work, ch, what, then

    def wait(self) -> None:
        """Waits (once), then runs ``then()``, the local part that completes the collective."""
        if self.work is not None:
            work, self.work = self.work, None
            wait(work, self.ch, self.what)
            if self.then is not None:
                self.then()
                self.then = None


def _live(channels: Iterable[Channel]) -> list[Channel]:
    return [ch for ch in channels if not ch.off]


def fail(mesh: Any, exc: BaseException, scope: Scope) -> Told | None:
    """Tells every peer of ``mesh`` that this rank's guarded call raised ``exc``: one failed
    header on each of its axis groups that did not raise ``exc`` (see :func:`told`).
    Returns what it saw doing so, or None when it told no one (the groups knew already, or a
    peer is gone). Never raises: the caller re-raises ``exc``.

    [Note: telling every axis at once] The failed headers go out on all those groups at once,
    and each exchange completes when its own group's ranks come. One group after the other,
    ranks 0 and 3 of a 2x2 mesh that raise together waited in a cycle: rank 0 on its replicate
    group for rank 2, rank 2 on its shard group for rank 3, rank 3 on its replicate group for
    rank 1, rank 1 on its shard group for rank 0. Side by side, each group's exchange meets the
    next header of every rank in it: a failing rank's, or a peer's, which raises PeerError
    there and passes the error on along its other axes, side by side again.
    ``scope``: the failed region's (its pipelined run, whether it is recorded)."""
    guard = mesh.guard
    if guard.broken is not None or not dist.is_initialized() or isinstance(exc, CommError):
        return None
    run = scope.run  # a pipelined step first plays its collectives out, as the peers run them
    error = run.before_fail() if run is not None else None
    if isinstance(error, CommError):  # a peer that is gone; the caller's error is the one to see
        return None
    if error is not None:  # the peers wait in collectives this rank never issues: the mesh is unusable
        unplayable(mesh, exc, error)
    known = _known(exc)
    # ... and they learn it from the store when their wait ends, or from a header where headers
    # do not travel on the data group they wait on (NCCL's: see shardfn._mesh._add_channels)
    todo = [ch for ch in _live(guard.channels.values()) if not any(ch.group is g for g in known)
            and (error is None or ch.control is not ch.group)]
    if not todo:
        return None
    incident = guard.incidents
    guard.incidents += 1
    me = dist.get_rank()
    seen = Told(frozenset(r for ch in todo for r in ch.ranks), {})
    try:
        store = dist.distributed_c10d._get_default_store()
        origin = exc.rank if isinstance(exc, PeerError) else me
        store.set(f"shardfn/failure/{me}/{incident}", f"{origin}|{describe(exc)}")
        failed = [0, 0, 0, failed_at(exc) if error is None else Failure.UNPLAYED, 0, FAILED + incident, 0]
        for ch, headers in zip(todo, _exchange_all(todo, failed, "telling the other ranks of an error", scope.comm.recorded)):
            for r, h in zip(ch.ranks, headers):
                if r != me and h[STATUS] >= FAILED:
                    began, text = read_failure(r, h[STATUS])
                    if began != origin:
                        seen.raised[began] = text
    except Exception:  # a peer that is gone; the caller's error is the one to see
        return None
    return seen


@contextmanager
def guarded(mesh: Any, where: int | None = None, alone: str | None = None, **changes: Any) -> Iterator[Scope]:
    """A region whose errors every peer learns (see :func:`fail`); ``where`` marks its
    collectives' headers, ``changes`` the rest of its scope (shardfn._comm.scope.within).
    Yields the region's scope, which its code hands down. Nested regions leave it to the
    outermost; a region that must be outermost raises ``alone`` (a RuntimeError) inside another."""
    if where is not None:
        changes["where"] = where
    with within(guarded=True, **changes) as (outer, scope):
        try:
            if alone is not None and outer.guarded:
                raise RuntimeError(alone)
            yield scope
        except Exception as e:
            if not outer.guarded and mesh is not None and mesh.size > 1:
                seen = fail(mesh, e, scope)
                if isinstance(e, PeerError) and seen is not None:
                    name_the_others(e, seen)
                if not isinstance(e, (PeerError, DivergenceError, CommError)) and not str(e).startswith("[rank "):
                    e.add_note(raised_here(mesh, e, seen))
            raise


# -- the divergence message ------------------------------------------------------------


def _diverged(ch: Channel, headers: list[list[int]]) -> str:
    lines = [f"  rank {r}: {describe_header(h, ch.guard.names)}" for r, h in zip(ch.ranks, headers)]
    return (f"[rank {dist.get_rank()}] shardfn: the ranks diverged at their collective #{ch.position} on ranks "
            f"{list(ch.ranks)}; none of them issued it, and nothing was updated:\n" + "\n".join(lines)
            + "\n" + fix(headers, ch.guard.names))
