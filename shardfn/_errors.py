"""The errors every rank raises alike when ranks differ or fail (see [Note: the schedule guard]
in shardfn._comm.guard), exported as ``shardfn.DivergenceError``, ``PeerError`` and ``CommError``."""

from __future__ import annotations

from typing import Any

__all__ = ["CommError", "DivergenceError", "PeerError"]


# The public errors carry the name users import them by (``shardfn.PeerError`` in a
# traceback, not ``shardfn._comm.guard.PeerError``); pickle finds them there too. They pickle
# without the process groups shardfn._comm.guard.told marks them with: those mean nothing elsewhere.


def _state(exc: BaseException) -> dict[str, Any]:
    return {k: v for k, v in exc.__dict__.items() if k != "_shardfn_told"}


class DivergenceError(RuntimeError):
    """The ranks were about to issue different collectives; none was issued."""

    __module__ = "shardfn"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), self.args, _state(self)


class PeerError(RuntimeError):
    """Another rank raised inside shardfn; ``rank`` and ``original`` say which and what.

    ``updated`` is ``None`` when nothing was updated (the usual case: the failure came before
    the step's point of no return). A failure after it (a rank whose optimizer update raised
    once every rank had agreed to update) leaves the ranks' states different: ``updated`` is
    then the ranks known to have updated, and the shards are unusable until a checkpoint is
    loaded (docs/ranks-that-differ.md)."""

    __module__ = "shardfn"
    updated: tuple[int, ...] | None = None
    others: tuple[int, ...] = ()  # the other ranks known to have raised at the same time

    def __init__(self, message: str, rank: int, original: str):
        super().__init__(message)
        self.rank = rank
        self.original = original

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (*self.args, self.rank, self.original), _state(self)


class CommError(RuntimeError):
    """A peer did not answer within the step timeout, or its connection closed; the
    process group is unusable from then on."""

    __module__ = "shardfn"

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), self.args, _state(self)
