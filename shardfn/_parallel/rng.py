"""The random stream of a tensor group: dropout under tensor parallelism.

[Note: randomness on the tensor axis]
The rule: a replicated activation draws the same mask on every rank of a tensor group, a
split one a different mask on each. So each tensor group has one random stream, owned by
the mesh. While shardfn runs the model on a mesh with a tensor axis (a step, a call of
``apply``, a ``bind`` block, a graph step's program), torch's default generators (the CPU's,
and the mesh device's) hold the stream's state: every random op draws alike on every tensor
rank, whatever seed a rank set for other reasons, and the rank's own state is back after.
A split activation's dropout draws the whole activation's mask and keeps its rank's block
([Note: a split layer's output]): each rank its own mask, and the one one process would
draw. The stream starts at the first such call from tensor rank 0's ``torch.initial_seed()``,
sent in one header: one process seeded with it before its first step draws the same masks.
remat's recompute draws what its forward drew (torch's checkpoint restores the state it
saved). A random op on activations split by heads or on the sequence would draw one mask
for every rank's part: attention dropout on split heads is refused at ``shard``, and the
sequence region's random ops are the region's blind spot (docs/tensor-parallel.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._comm import guard as G

__all__ = ["TensorRandom"]


def _states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set(states: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


class TensorRandom:
    """A mesh's tensor group's random stream; see [Note: randomness on the tensor axis]."""

    __slots__ = ("states", "seed", "active")

    def __init__(self) -> None:
        self.states: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.seed: int | None = None  # the seed the stream started from, once it has
        self.active = False  # whether the default generators hold the stream now

    @contextmanager
    def drawing(self, mesh: Any, scope: Any) -> Iterator[None]:
        """For the block, torch's default generators draw from the stream (nothing on a mesh
        without a tensor axis; nothing more inside a block that already does). ``scope``:
        the caller's (shardfn._comm.scope.Scope), for the header that starts the stream."""
        if self.active or mesh.axis_size("tensor") == 1:
            yield
            return
        if self.states is None:
            self.states = self._start(mesh, scope)
        own = _states(mesh.device)
        _set(self.states, mesh.device)
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.states = _states(mesh.device)
            _set(own, mesh.device)

    def _start(self, mesh: Any, scope: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stream's first state, from tensor rank 0's seed (one header on the tensor axis)."""
        ch = mesh.channel("tensor")
        seed = torch.initial_seed() & (2**62 - 1)
        if not ch.off:
            seed = G.exchange_details(ch, seed, "the tensor axis's random stream", scope)[0]
        self.seed = seed
        cpu = torch.Generator().manual_seed(seed).get_state()
        device = None
        if mesh.device.type == "cuda":
            device = torch.Generator(device=mesh.device).manual_seed(seed).get_state()
        return cpu, device
