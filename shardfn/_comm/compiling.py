"""A rank that compiles is busy, not lost.

[Note: compiling is not a hang]
The step timeout bounds a wait for a peer that stopped; it must never race a peer's work.
``torch.compile``'s first call, and a recompile, can take minutes, and ranks finish at
different times: the first done would wait at its next collective past the step timeout
and raise, on a loaded machine and not on a quiet one. So while dynamo compiles in a
process (torch's compile start and end callbacks, installed when a step is built to
compile), the rank says so in the store; a wait that reaches the step timeout asks the
store before it calls its peers lost, and waits another step timeout while one of them is
compiling. The process group's own timeout still bounds the whole wait.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["compiling", "watch_compiles"]

_KEY = "shardfn/compiling/{}"
_WATCHING: list[bool] = []  # whether this process's callbacks are installed (once)


def _store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _mark(busy: bool) -> None:
    try:
        if dist.is_initialized():
            _store().set(_KEY.format(dist.get_rank()), "1" if busy else "0")
    except Exception:  # noqa: BLE001 - no store (it went with its host): the peers' timeouts hold as before
        pass


def watch_compiles() -> None:
    """From now on this process marks itself compiling in the store while dynamo compiles."""
    if _WATCHING:
        return
    from torch._dynamo.callback import callback_handler

    callback_handler.register_start_callback(lambda args: _mark(True))
    callback_handler.register_end_callback(lambda args: _mark(False))
    _WATCHING.append(True)


def compiling(ranks: Any) -> list[int]:
    """The ranks among ``ranks`` (this one left out) that are compiling now."""
    try:
        me, store = dist.get_rank(), _store()
        keys = {r: _KEY.format(r) for r in ranks if r != me}
        return [r for r, k in keys.items() if store.check([k]) and store.get(k) == b"1"]
    except Exception:  # noqa: BLE001 - no store: nobody is known to be busy
        return []
