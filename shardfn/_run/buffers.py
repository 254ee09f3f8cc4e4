"""Buffers in a step: working copies, which ones the step changed, and keeping ranks equal.

[Note: buffers in a step]
Buffers (running statistics, masks, rotary tables) are replicated state in the tree (see
[Note: the state tree]). A step runs its forward on working copies of the tree's buffers
(the tree's own tensors with ``donate=True``, clones otherwise) and returns the tree with
them. A forward may update a buffer in place (BatchNorm's running statistics) or replace
it, and each rank's forward saw only its own slice of the batch, so ranks would drift
apart. After the backward each rank compares every floating-point buffer with its value
before the step, *by value*: CPU ``batch_norm`` updates running statistics without bumping
the tensor's version counter, so versions miss them. One flag per buffer rides on the
step's metrics all-reduce, so every rank learns which buffers changed on *any* rank, and
exactly those are averaged over all ranks (one all-reduce per mesh axis, in fp32). For a
statistic linear in the batch (a running mean) the average is the single-device value on
the global batch; for others (a running variance) it is the mean of the ranks' values.
Integer and boolean buffers (``num_batches_tracked``) are never averaged: every rank
updates them alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from typing import Any

import torch

from .._comm import collectives as C
from .._comm.events import Purpose
from .._comm.recording import device_values

__all__ = ["StepBuffers"]


class StepBuffers:
    """The working copies of one tree's buffers during a step. ``recorded``: the step is
    being recorded; ``fake``: a planning run, whose tensors hold no values (Mesh.fake)."""

    def __init__(self, tree: Mapping[str, torch.Tensor], names: Sequence[str], *, donate: bool, track: bool,
                 recorded: bool, fake: bool):
        own = {n: tree[n] for n in names}
        self.recorded, self.fake = recorded, fake
        self.own, self.donate = dict(own), donate
        self.work: dict[str, torch.Tensor] = own if donate else {n: b.clone() for n, b in own.items()}
        # Floating-point buffers are compared with their value before the step; with
        # donation every buffer is kept, so that a step that fails (or runs again) can put
        # them back (a forward updates running statistics in place).
        self.floating = [n for n in names if own[n].is_floating_point()] if track else []
        self.before = {n: b.clone() for n, b in own.items()} if donate else {n: own[n] for n in self.floating}

    def replaced(self, tree: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The working buffers that are not ``tree``'s own tensors (copies, or buffers the
        forward replaced): what the tree must take after the step."""
        return {n: b for n, b in self.work.items() if b is not tree[n]}

    def restore(self) -> None:
        """Every buffer back to its value before the step (a step that raised, or runs again)."""
        with torch.no_grad():
            for n, t in self.own.items():
                if self.donate:
                    if not self.fake:
                        t.copy_(self.before[n])
                    self.work[n] = t
                else:
                    self.work[n] = t.clone()

    def flags(self, device: torch.device) -> torch.Tensor:
        """1.0 for each floating-point buffer this rank's forward changed, else 0.0."""
        if self.recorded and self.floating:  # compared on the device: a recorded step reads nothing
            return torch.stack([_changed(self.work[n], self.before[n]) for n in self.floating]).to(device)
        # a planning run (shardfn.explain) has no values: it changed nothing
        out = [0.0 if self.fake or _same(self.work[n], self.before[n]) else 1.0 for n in self.floating]
        return device_values(out, torch.float32, device, self.recorded)

    def sync(self, changed_anywhere: torch.Tensor, mesh: Any, scope: Any) -> list[str]:
        """Averages the buffers some rank changed over the whole mesh; returns their names.
        ``scope``: the step's runtime's (its pipelined run, its collective log).

        A planning run (shardfn.explain, fake tensors) has no values, so it cannot know
        which buffers change: it averages none.
        """
        if self.fake or not self.floating:  # (nothing to read from the device)
            return []
        if self.recorded:
            return self._sync_all(changed_anywhere, mesh, scope)
        names = [n for n, f in zip(self.floating, changed_anywhere.tolist()) if f > 0]
        if not names or mesh.size == 1:
            return names
        flat = torch.cat([self.work[n].detach().reshape(-1).float() for n in names])
        C.all_reduce_mesh(flat, mesh, Purpose.BUFFERS, op=C.AVG, scope=scope)
        offset = 0
        with torch.no_grad():
            for n in names:
                b = self.work[n]
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
        return names

    def _sync_all(self, changed_anywhere: torch.Tensor, mesh: Any, scope: Any) -> list[str]:
        """A recorded step cannot choose on the host which buffers to average: it averages
        every floating-point buffer (one all-reduce per mesh axis, whether or not one
        changed) and keeps the average only where some rank changed the buffer."""
        names = list(self.floating)
        if mesh.size == 1:
            return names
        flat = torch.cat([self.work[n].detach().reshape(-1).float() for n in names])
        C.all_reduce_mesh(flat, mesh, Purpose.BUFFERS, op=C.AVG, scope=scope)
        offset = 0
        with torch.no_grad():
            for n, flag in zip(names, changed_anywhere.unbind(0)):
                b = self.work[n]
                mean = flat[offset : offset + b.numel()].view_as(b).to(b.dtype)
                b.copy_(torch.where(flag > 0, mean, b))
                offset += b.numel()
        return names


def _changed(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    if now.shape != before.shape or now.dtype != before.dtype:
        return torch.ones((), dtype=torch.float32, device=now.device)
    return (now != before).any().float()


def _same(now: torch.Tensor, before: torch.Tensor) -> bool:
    return now.shape == before.shape and now.dtype == before.dtype and bool(torch.equal(now, before))
