"""A failure as the ranks tell it: what a rank that raised leaves in the store for its peers,
how they read it, and what each rank's error then says (the guard, shardfn._comm.guard, carries
the failed headers; this module words what they mean).

A failed header's ``status`` says that its rank raised (``FAILED`` plus its incident
number), its ``detail`` where (a :class:`Failure`: before the step's point of no return, or
after it). The error's text is in the store under the rank and incident, with the rank where
it began, so that a rank that passes an error on names its origin.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, NamedTuple

import torch.distributed as dist

from .._errors import CommError, PeerError
from .header import DETAIL, FAILED, STATUS, Failure

_ROLL_CALL_S = 3.0
_UNPLAYED = "shardfn/unplayed/{}"  # the store's key for a rank's failed play-out
_RESTART = "restart the job (torchrun --max-restarts) and resume from shardfn.checkpoint.latest(...)"

__all__ = ["Told", "describe", "failed_at", "lost", "name_the_others", "peer_error", "raised_here", "read_failure",
           "unplayable", "unplayed"]


def peer_error(ranks: tuple[int, ...], headers: list[list[int]], run: Any) -> PeerError:
    """The PeerError of a rank whose exchange on ``ranks`` met failed headers (``run``: the
    pipelined step in progress, if any): the ranks that raised, what, and whether anything
    was updated."""
    if any(h[DETAIL] != Failure.BEFORE for h in headers if h[STATUS] >= FAILED):
        return _failed_late(ranks, headers, run)
    failed = [(r, h[STATUS]) for r, h in zip(ranks, headers) if h[STATUS] >= FAILED]
    origin, original = read_failure(*failed[0])
    others = tuple(sorted({read_failure(r, status)[0] for r, status in failed[1:]} - {origin}))
    error = PeerError(f"[rank {dist.get_rank()}] shardfn: {_raised_by(origin, others)}, so this rank stops too "
                      f"(nothing was updated):\n  {original}\nSee rank {origin}'s traceback for where.", origin, original)
    error.others = others
    return error


def _raised_by(origin: int, others: tuple[int, ...]) -> str:
    """How a PeerError names the ranks that raised: the origin, and the others it knows of."""
    return f"rank {origin} raised" + (f" (and ranks {list(others)})" if others else "")


def failed_at(exc: BaseException, failure: int | None = None) -> int:
    """Where ``exc`` was raised (a :class:`Failure`), which its failed header tells the peers;
    with ``failure``, first records it (the step does, for an error after its point of no
    return: [Note: the point of no return] in shardfn._run.no_return). The first record stands."""
    if failure is not None:
        exc.__dict__.setdefault("_shardfn_failure", failure)
    return exc.__dict__.get("_shardfn_failure", Failure.BEFORE)


_STATE_OF = {Failure.KEPT: "did not (its shards and optimizer state are as before the step)",
             Failure.PARTLY: "did not finish (its shards and optimizer state may be partly updated)"}
_WAY_BACK = ("These shards are unusable now: every rank refuses to step, save, export or gather them. Load the last "
             "good checkpoint into them on every rank: checkpoint.load(shardfn.checkpoint.latest(directory), sharded, "
             "opt_state).")


def _failed_late(ranks: tuple[int, ...], headers: list[list[int]], run: Any) -> PeerError:
    """The PeerError for peers of which at least one failed after the step's point of no
    return: which ranks updated and which did not, never "nothing was updated"."""
    me = dist.get_rank()
    mid = run is not None and not run.opening and not run.phase1  # this rank is in that same update
    late = {r: h[DETAIL] for r, h in zip(ranks, headers) if h[STATUS] >= FAILED}
    texts = {r: read_failure(r, h[STATUS]) for r, h in zip(ranks, headers) if h[STATUS] >= FAILED}
    rest = [r for r in ranks if r not in late]
    updated = () if mid else tuple(rest)
    did = (f"ranks {rest} were updating too, and stop here (their state may be partly updated)" if mid else
           f"ranks {rest} updated their shards and optimizer state in that step")
    fates = [f"rank {r} {_STATE_OF.get(f, 'raised before it: ' + texts[r][1])}" for r, f in late.items()]
    origin, original = texts[min(late, key=lambda r: (late[r] == Failure.BEFORE, r))]
    error = PeerError(
        f"[rank {me}] shardfn: rank {origin} raised after the step's metrics all-reduce, the point after which every "
        f"rank updates its state, so the ranks' states differ now: {did}; {'; '.join(fates)}:\n  {original}\n"
        f"{_WAY_BACK} See rank {origin}'s traceback for where.", origin, original)
    error.updated = updated
    failed_at(error, max(late.values()))  # a rank that passes it on tells the same
    return error


def read_failure(rank: int, status: int) -> tuple[int, str]:
    """(the rank where the error began, its text) for a failed header of ``rank``; a rank
    that passes on an error it learned names the rank it learned it from."""
    try:
        store = dist.distributed_c10d._get_default_store()
        origin, _, text = store.get(f"shardfn/failure/{rank}/{status - FAILED}").decode(errors="replace").partition("|")
        return int(origin), text
    except Exception as e:  # noqa: BLE001 - the store is gone with its host
        return rank, f"(its error could not be read from the store: {e})"


def describe(exc: BaseException) -> str:
    """One line for an exception: its type, message and innermost frame."""
    if isinstance(exc, PeerError):
        return exc.original
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}{where}"


class Told(NamedTuple):
    """What :func:`fail` learned while telling the peers: the ranks of the groups it told,
    and the peers whose failed headers met its own (each raised an error of its own at the
    same point, or passed one on), as ``{the rank where that error began: its text}``."""

    ranks: frozenset[int]
    raised: dict[int, str]


def unplayable(mesh: Any, exc: BaseException, error: BaseException) -> None:
    """This rank's pipelined step raised ``exc``, and playing out the rest of its schedule for
    the peers failed with ``error`` ([Note: the pipelined guard]): they wait in collectives this
    rank will never issue. The mesh's process group is unusable from now on: this rank refuses
    every later call, and the store says why, for the peers' :func:`lost` and :func:`unplayed`."""
    me = dist.get_rank()
    did = (f"raised in a pipelined step ({describe(exc)}) and could not play out" if error is not exc else
           "left its pipelined step's schedule and could not play out")
    story = f"rank {me} {did} the rest of the step's collectives for the other ranks ({describe(error)})"
    exc.__dict__["_shardfn_unplayed"] = describe(error)
    if mesh.guard.broken is None:
        mesh.guard.broken = (f"[rank {me}] shardfn: {story}, so they wait in collectives it never issues; the "
                             f"process group is unusable (nothing was updated): {_RESTART}.")
    try:
        dist.distributed_c10d._get_default_store().set(_UNPLAYED.format(me), story)
    except Exception:  # noqa: BLE001 - the store is gone with its host: the peers' timeouts name this rank
        pass


def unplayed(ch: Any, what: str, ranks: Any = None) -> CommError | None:
    """The CommError of a wait on ``ch`` that cannot complete because a peer (of ``ranks``,
    default: any of the group) could not play out its step (:func:`unplayable`), or None when
    none did. Makes the process group unusable here too."""
    me = dist.get_rank()
    stories = []
    try:
        store = dist.distributed_c10d._get_default_store()
        for r in (ch.ranks if ranks is None else ranks):
            if r != me and (ranks is not None or store.check([_UNPLAYED.format(r)])):
                stories.append(store.get(_UNPLAYED.format(r)).decode(errors="replace"))
    except Exception as e:  # noqa: BLE001 - the store is gone with its host
        stories += [f"rank {r} could not play out its step (its report could not be read: {e})" for r in ranks or ()]
    if not stories:
        return None
    message = (f"[rank {me}] shardfn: {what} on ranks {list(ch.ranks)} cannot complete: {'; '.join(stories)}. So "
               f"collectives of this step wait for ranks that will never issue them: the process group is unusable "
               f"now (nothing was updated); {_RESTART}.")
    if ch.guard.broken is None:
        ch.guard.broken = message
    return CommError(message)


def raised_here(mesh: Any, exc: BaseException, seen: Told | None) -> str:
    """The note on an error this rank raised itself: its rank and mesh, and what the other
    ranks raise, as far as this rank's exchanges in :func:`fail` tell (``seen``).

    A peer whose failed header met this rank's raised an error of its own at the same point
    (or passed one on) and raises that; the peers that raised nothing raise
    :class:`PeerError` naming the ranks that did. So when every rank raised, none raises
    PeerError. On a 2-D mesh this rank exchanges with its own row and column only, so what
    the ranks beyond them raise is said with that reservation."""
    head = f"[rank {mesh.rank}] shardfn: raised on rank {mesh.rank} of {mesh!r}"
    if "_shardfn_unplayed" in exc.__dict__:  # the peers wait in collectives this rank never issues
        return (f"{head} in a pipelined step, and it could not play out the rest of the step's collectives for the "
                f"other ranks ({exc.__dict__['_shardfn_unplayed']}): they wait in collectives it never issues, and "
                f"raise CommError naming it (at their next header, or when their step timeout ends). The process "
                f"group is unusable now (nothing was updated): every later shardfn call refuses it; {_RESTART}.")
    if failed_at(exc) != Failure.BEFORE:  # after the step's point of no return: say who updated
        raised = sorted({dist.get_rank(), *(seen.raised if seen is not None else ())})
        updated = sorted(seen.ranks - set(raised)) if seen is not None else "that did not raise"
        return (f"{head} after the step's metrics all-reduce, the point after which every rank updates its state: "
                f"ranks {updated} updated their shards and optimizer state in that step; rank {mesh.rank} "
                f"{_STATE_OF[failed_at(exc)]}" + (f"; ranks {raised} raised here. " if len(raised) > 1 else ". ")
                + "The other ranks raise PeerError saying so at their next call. " + _WAY_BACK)
    if seen is None:  # no peer heard of it from this rank
        return head + "."
    raised = sorted({dist.get_rank(), *seen.raised})  # ranks of the mesh, as seen.ranks: counts compare them
    if len(raised) >= mesh.size:
        if all(text == describe(exc) for text in seen.raised.values()):
            return head + "; every rank raised this same error itself, so no rank raises PeerError."
        return head + ("; every rank raised an error of its own here (see each one's traceback), so no rank "
                       "raises PeerError.")
    beyond = "" if len(seen.ranks) >= mesh.size else ", or an error of their own raised at the same time"
    if len(raised) == 1:
        return head + f"; the other ranks raise PeerError naming it{beyond}."
    return head + (f"; ranks {raised} each raised an error here, and the other ranks raise PeerError naming "
                   f"them{beyond}.")


def name_the_others(exc: PeerError, seen: Told) -> None:
    """Adds to the ranks ``exc`` names the ones whose failed headers this rank met while
    passing it on (peers that raised at the same time)."""
    others = tuple(sorted((set(exc.others) | set(seen.raised)) - {exc.rank}))
    if others != exc.others:
        text = exc.args[0].replace(_raised_by(exc.rank, exc.others), _raised_by(exc.rank, others), 1)
        exc.args, exc.others = (text,), others


def lost(ch: Any, what: str, error: RuntimeError) -> CommError:
    """The CommError of a wait that timed out or whose peer's connection closed, naming the
    ranks of the group that do not answer a roll call in the store."""
    told = unplayed(ch, what)  # a peer that could not play out its step said so in the store
    if told is not None:
        return told
    me = dist.get_rank()
    closed = "closed" in str(error).lower() or "reset" in str(error).lower()
    silent = _roll_call(ch)
    told = unplayed(ch, what)  # (said while this rank called the roll)
    if told is not None:
        return told
    who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}" if silent else "a peer"
    cause = (f"{who} closed the connection (its process died or destroyed its process group)" if closed else
             f"no answer from {who} within the step timeout ({ch.timeout:g} s): stopped, dead, or busy outside "
             f"shardfn (a rank that left the training loop early, or one that runs collectives of its own)")
    message = (f"[rank {me}] shardfn: {what} on ranks {list(ch.ranks)} did not complete: {cause}. "
               f"The process group is unusable now; restart the job (torchrun --max-restarts) and resume from "
               f"shardfn.checkpoint.latest(...). Raise the timeout with Mesh.from_env(step_timeout=...) if a rank "
               f"legitimately spends longer between collectives. ({type(error).__name__}: {str(error)[:200]})")
    if ch.guard.broken is None:
        ch.guard.broken = message
    return CommError(message)


def _roll_call(ch: Any) -> list[int]:
    """The ranks of ``ch``'s group that do not write their name in the store within a
    few seconds (every rank that ends up here writes its own)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        base = f"shardfn/rollcall/{'-'.join(map(str, ch.ranks))}/{ch.position}/"
        store.set(base + str(dist.get_rank()), "1")
        deadline = time.monotonic() + _ROLL_CALL_S
        missing = [r for r in ch.ranks if r != dist.get_rank()]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([base + str(r)])]
            time.sleep(0.1)
        return missing
    except Exception:  # the store lives on rank 0's host, which may be the lost one
        return []
