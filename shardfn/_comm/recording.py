"""Whether the step in progress is being recorded as one program (``jit_step(graph=True)``).

[Note: recording a step]
A graph step is recorded by running the eager step once under ``make_fx``: every tensor
operation the step dispatches (gathers, forward, backward, reductions, update, metrics)
becomes a node of one graph, and everything decided in Python (which unit gathers when,
buckets, prefetch) is decided once, at the recording. Six things differ while recording:

* collectives are the functional ones (``torch.ops._c10d_functional``), which a graph can
  hold, writing the buffer the eager code writes in place (an all-gather) or copied into
  it; on gloo a reduce-scatter is an all-to-all and a sum in rank order, as it is paired
  sends eagerly;
* the state's flat buffers are the program's inputs, and the leaves views of them made in
  the recording, so that the step's zero-copy paths (a unit's shard buffer sent as it is,
  the update over a unit's buffers) read inputs;
* the schedule guard's header exchanges run outside the recording (:func:`untraced`):
  they are host work of this call, not of the program;
* a value read on the host (``.item()``, ``bool(t)``, ``torch.equal``) would be baked
  into the program as a constant, so every such read refuses the recording
  (``shardfn._program.graph._NoHostReads``), and the built-in optimizers compute their step
  scalars (learning rate, bias corrections) from the step count as tensors;
* nothing of the program lives on the host when the mesh is on a device: every input and
  constant is on the mesh's device, and constants are made there (:func:`device_values`),
  since a captured device program runs none of its host work again. A host tensor among
  its inputs or constants refuses the recording, naming it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .communicator import EAGER, RECORDED
from .scope import within

__all__ = ["Unrecordable", "device_values", "relative_view", "untraced"]



class Unrecordable(RuntimeError):
    """Raised while recording by what cannot be part of a recorded program:
    ``Unrecordable(why, fix)``; ``jit_step(graph=True)`` reports both and where it was.
    ``frozen``: the cause is a value the program would replay as a constant (the default),
    not a step that cannot be one program for another reason."""

    def __init__(self, why: str, fix: str, where: str | None = None, frozen: bool = True) -> None:
        super().__init__(why)
        self.why, self.fix, self.where, self.frozen = why, fix, where, frozen  # where: None names the raising frame


def device_values(values: list[float], dtype: Any, device: Any, recorded: bool) -> Any:
    """``torch.tensor(values)`` on ``device``. While recording (``recorded``: the caller's
    step is, as its context says), made there by factories (``full``): a tensor built on the
    host and copied over would be a host constant of the program, which a captured device
    program cannot hold ([Note: recording a step])."""
    import torch

    if not recorded:
        return torch.tensor(values, dtype=dtype, device=device)
    if not values:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])


def record() -> contextlib.AbstractContextManager[Any]:
    """The block is recorded: its collectives are the recorded communicator's."""
    return within(comm=RECORDED)


@contextlib.contextmanager
def untraced(recorded: bool) -> Iterator[None]:
    """Tensor work that is this call's, not the recorded program's (the guard's headers):
    runs with every dispatch mode (the recorder's) set aside. ``recorded``: whether the
    caller's step is being recorded, as its scope carries it ([Note: backward on device
    threads] in shardfn._comm.guard)."""
    if not recorded:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with within(comm=EAGER), _disable_current_modes():
        yield


def relative_view(t: Any, fulls: list[Any]) -> tuple[int, int] | None:
    """How a saved tensor is made again from the regathered parameters ``fulls`` while a
    step is recorded: ``(index, 1)`` when it is parameter ``index`` itself, ``(index, 2)``
    its transpose, None when neither (it is then kept, not packed). Eager code makes it by
    ``as_strided`` at its offset in its parameter; a compiled program lays its buffers out
    anew (inductor read garbage at a storage offset): only views that are the parameter or
    its transpose are safe. A flat unit's parameters share one storage: each is tried."""
    geometry = (t.size(), t.stride(), t.storage_offset())
    for i, full in enumerate(fulls):
        if full.dtype != t.dtype:
            continue
        if geometry == (full.size(), full.stride(), full.storage_offset()):
            return i, 1
        if full.dim() == 2 and geometry == (full.t().size(), full.t().stride(), full.storage_offset()):
            return i, 2
    return None
