"""A replay's peers: how long a recorded program waits for them, and what they learn when
it raises on one rank.

[Note: a replay that raises on one rank]
A program issues its collectives without headers, so a rank whose replay raises cannot
tell its peers through the guard while they wait inside the program. Two rules keep them
from waiting long. Its collectives wait at most the step timeout, as a checked step's do
(gloo's timeout of the mesh's groups, set for the replay and restored after), except in a
program's first compiled run: the ranks compile before its first collective, and compile
times differ by more than a step timeout. A compile error (a dynamo or backend error)
comes before any collective: the rank then runs the same program op by op, so that its
peers' collectives complete and every rank holds the same state, and raises; its peers
raise PeerError at their next call. Any other error leaves the program half run: the rank
writes its error to the store, and the peers, whose collectives then time out, name it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._comm.failures import describe

__all__ = ["bounded", "compile_error", "note_failure", "peer_failures"]

_KEY = "shardfn/replay-failed/{rank}"

_LOST = (
    "[rank {rank}] shardfn: jit_step(graph=True): a collective of the recorded program did not complete ({error}). A "
    "replay waits for its peers as long as the step timeout (the process group's timeout in a program's first, "
    "compiling run): a peer that raised in its replay, stopped or died ends a replay this way. The process group is "
    "unusable now; restart the job (torchrun --max-restarts) and resume from shardfn.checkpoint.latest(...)."
)


_COMPILE_FAILED = (
    "[rank {rank}] jit_step(graph=True): compiling the recorded program failed on this rank, before it ran. So that "
    "the other ranks' collectives complete, this rank then ran the same program op by op: its state holds this "
    "call's step, as theirs do, and they raise PeerError at their next call. Build the step with graph=\"eager\" "
    "(the program op by op, no compiler) or graph=False."
)


_HALF_RUN = (
    "[rank {rank}] shardfn: jit_step(graph=True): this rank's replay raised ({error}) after the program may have run "
    "some of its collectives; the other ranks' replays time out. The process group is unusable now; restart the job "
    "(torchrun --max-restarts) and resume from shardfn.checkpoint.latest(...)."
)


@contextlib.contextmanager
def bounded(mesh: Any, on: bool) -> Iterator[None]:
    """The block's collectives on ``mesh``'s gloo groups wait at most the step timeout (``on``).
    An NCCL group's timeout is its watchdog's, fixed when it was made ([Note: waiting on NCCL])."""
    backends = []
    if on:
        for axis in mesh.axis_names:
            ch = mesh.channel(axis)
            if not ch.off and not ch.on_stream:  # NCCL: its watchdog, at the group's own timeout
                backend = ch.group._get_backend(torch.device("cpu"))
                backends.append((backend, backend.options._timeout))
                backend.set_timeout(datetime.timedelta(seconds=ch.timeout))
    try:
        yield
    finally:
        for backend, timeout in backends:
            backend.set_timeout(timeout)


def compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from compiling a program (before it ran anything)."""
    return isinstance(exc, torch._dynamo.exc.TorchDynamoException)


def note_failure(exc: BaseException) -> None:
    """Writes this rank's error to the store, for the peers' messages (never raises)."""
    try:
        dist.distributed_c10d._get_default_store().set(_KEY.format(rank=dist.get_rank()), describe(exc))
    except Exception:  # noqa: BLE001 - the store is gone with its host; the caller's error is the one to see
        pass


def peer_failures(ranks: Any) -> str:
    """What the peers among ``ranks`` wrote with :func:`note_failure`, in words ('' if none)."""
    said = []
    try:
        store = dist.distributed_c10d._get_default_store()
        for r in ranks:
            if r != dist.get_rank() and store.check([_KEY.format(rank=r)]):
                said.append(f"rank {r} raised in its replay: {store.get(_KEY.format(rank=r)).decode(errors='replace')}")
    except Exception:  # noqa: BLE001 - the store is gone with its host
        pass
    return "; ".join(said)
