"""The built-in optimizers' step counts: on the params' device, read on the host through a mirror.

[Note: step counts]
A built-in optimizer counts its updates in a 0-d int64 tensor on its params' device: a
recorded step (one CUDA graph on CUDA) reads and advances it on the device, where a host
tensor or number would be frozen at capture. An eager update needs the count as a number
(schedules, bias corrections), and reading a device tensor makes the host wait. So a mirror
keeps, per count tensor, ``(its _version, its value)``: set when a count is made, when a
built-in update advances it, and when it is read once. An entry is valid only while the
tensor's ``_version`` is unchanged: any other write (``checkpoint.load``'s ``copy_``, a
user's) bumps it, and the next read reads the tensor once. A recorded program's replay may
write a count without bumping ``_version`` (a CUDA graph does), and a read while a step is
recorded must reach the tensor (which the recording refuses) rather than bake the mirror's
number into the program, so ``GraphStep`` forgets its state's entries before it records
(and before its first, eager step, which runs under a recording's rules) and after each
replay; while recording nothing is remembered (the count is then a tensor of the program,
not a number). The mirror holds its tensors weakly; a tensor without a version counter
(an inference tensor) is read every time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["advance", "forget", "host_count", "incremented", "mirrored", "new_count", "remember"]

_MIRROR = WeakIdKeyDictionary()  # count tensor -> (its _version when seen, its value)


def _version(count: torch.Tensor) -> int | None:
    try:
        return count._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def remember(count: torch.Tensor, value: int) -> None:
    """The mirror's entry: ``count`` holds ``value`` (valid until its ``_version`` moves)."""
    version = _version(count)
    if version is not None:
        _MIRROR[count] = (version, value)


def new_count(params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """A count of 0 on the device of ``params`` (the first trainable one's, else the first
    one's; the CPU for no params), named, not taken from a global default."""
    device = next((p.device for p in params.values() if p.requires_grad), None)
    device = device or next((p.device for p in params.values()), torch.device("cpu"))
    # torch.tensor (not zeros) makes it a constant under FakeTensorMode, so the simulated
    # step of shardfn.explain can read it too
    count = torch.tensor(0, dtype=torch.int64, device=device)
    remember(count, 0)
    return count


def mirrored(count: torch.Tensor) -> int | None:
    """The value of ``count`` while the mirror's entry is valid, else None (always while a
    graph step records: it forgot its counts; see [Note: step counts])."""
    seen = _MIRROR.get(count)
    return seen[1] if seen is not None and seen[0] == _version(count) else None


def host_count(count: torch.Tensor) -> int:
    """The value of ``count`` as a Python int: from the mirror while it is valid, else read
    from the tensor once (see [Note: step counts])."""
    value = mirrored(count)
    if value is None:
        value = int(count)
        remember(count, value)
    return value


def advance(count: torch.Tensor, done: int | torch.Tensor) -> None:
    """Records that ``count`` now holds ``done + 1``: after a built-in update's ``add_(1)``, or
    for the new count ``old + 1`` a pure update returns. While a step is recorded (``done`` a
    tensor) nothing is recorded: the program's writes bump ``_version`` or are forgotten."""
    if not isinstance(done, torch.Tensor):
        remember(count, done + 1)


def incremented(count: torch.Tensor, done: int | torch.Tensor) -> torch.Tensor:
    """A new count ``count + 1`` (what a pure update returns), mirrored as ``done + 1``."""
    new = count + 1
    advance(new, done)
    return new


def forget(tensors: Iterable[torch.Tensor]) -> None:
    """Drops the mirror's entries of ``tensors`` (a replay wrote them without a trace)."""
    for t in tensors:
        _MIRROR.pop(t, None)
