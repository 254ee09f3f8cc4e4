"""Buffers during a step: which ones the forward updated, and keeping them equal on all ranks.

Buffers (running statistics, masks, caches) are replicated: each rank holds the model's
buffer tensors in ``apply.buffers``. A forward that updates one in place (BatchNorm's
running mean) sees only its own slice of the batch, so ranks would drift apart. After the
backward, the step averages every floating-point buffer whose version counter moved
during the step over all ranks. For statistics linear in the batch (a running mean) that
is exactly the single-device value; for others (a running variance) it is the mean of the
ranks' values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from . import _collectives as C

__all__ = ["note", "track"]


class Tracker:
    def __init__(self) -> None:
        self.seen: dict[int, tuple[Any, dict[str, int]]] = {}  # id(apply) -> (apply, versions before)

    def note(self, apply: Any) -> None:
        if id(apply) not in self.seen:
            versions = {n: b._version for n, b in apply.buffers.items() if b.is_floating_point()}
            self.seen[id(apply)] = (apply, versions)

    def changed(self) -> list[torch.Tensor]:
        out = []
        for apply, versions in self.seen.values():
            out += [b for n, b in apply.buffers.items() if n in versions and b._version != versions[n]]
        return out

    def sync(self, mesh: Any) -> None:
        """One all-reduce (per mesh axis) of all changed buffers, flattened in fp32."""
        changed = self.changed()
        if not changed or mesh.size == 1:
            return
        flat = torch.cat([b.detach().reshape(-1).float() for b in changed])
        for axis in mesh.axis_names:
            if mesh.axis_size(axis) > 1:
                C.all_reduce(flat, mesh.group(axis), tag="buffers", op="avg")
        offset = 0
        with torch.no_grad():
            for b in changed:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()


_TRACKERS: list[Tracker] = []


@contextlib.contextmanager
def track() -> Iterator[Tracker]:
    t = Tracker()
    _TRACKERS.append(t)
    try:
        yield t
    finally:
        _TRACKERS.remove(t)


def note(apply: Any) -> None:
    """Called by a sharded call: remembers ``apply``'s buffer versions for the step."""
    if _TRACKERS:
        _TRACKERS[-1].note(apply)
