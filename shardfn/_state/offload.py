"""CPU offload: the shards, their gradients and the optimizer state live in host memory.

[Note: offload]
With ``shard(..., offload=Offload(params=True, optimizer=True))`` this rank's parameter
shards are placed in host memory (pinned, when the compute device is CUDA), and so are
their gradients and the optimizer state built from them; the buffers stay on the compute
device. A step moves what the device needs when it needs it, in copies a step makes
anyway: each gather's pack of the shards ([Note: copies]) becomes the host-to-device copy,
and the reduced gradient shard's cast back to the master dtype (copy 4, which then always
happens) the device-to-host copy. The optimizer then runs on the host, on host tensors.

On CUDA the copies run on a side stream from pinned memory, so a prefetched unit's
transfer overlaps the running unit's compute; the compute stream waits for it where the
unit is used, and the step waits for the device before anything on the host reads a
gradient or the optimizer writes a shard that a transfer may still be reading. Every copy
is reported to the observers as a :class:`shardfn._comm.events.Transfer`: counted, not assumed.
On a CPU-only machine the same code runs between two CPU tensors, and shardfn._memory
tells host tensors from device ones by marks (see [Note: live bytes]), so tests and
``explain`` see what a GPU would hold. The copies per unit with their bytes, and measured
memory: docs/memory.md, "CPU offload".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._comm.events import Transfer, emit
from .._memory import mark_host

__all__ = ["Offload", "to_device_into", "to_host", "wait_for_device"]


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where the state lives between uses: ``Offload(params=True, optimizer=True)`` keeps
    this rank's parameter shards, their gradients and the optimizer state in host memory
    (see [Note: offload]).

    Args:
        params: parameter shards (and their gradients) in host memory; each unit is copied
            to the compute device just before its all-gather.
        optimizer: the optimizer state in host memory; the update runs on the host.

    The optimizer updates the shards where they live, so the two go together: pass both
    (FSDP's ``CPUOffload(offload_params=True)``, DeepSpeed's parameter and optimizer
    offload) or neither.

    Example:
        >>> sharded = shard(params, mesh, "FULL_SHARD", offload=Offload(params=True, optimizer=True))
    """

    params: bool = False
    optimizer: bool = False

    def __post_init__(self) -> None:
        for name in ("params", "optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Offload({name}={getattr(self, name)!r}): a bool.")
        if self.params != self.optimizer:
            raise ValueError(
                f"Offload(params={self.params}, optimizer={self.optimizer}): the optimizer updates the parameter "
                "shards where they live, so both live in host memory or neither does. Pass "
                "Offload(params=True, optimizer=True) to offload, or no offload to keep everything on the device."
            )

    @property
    def enabled(self) -> bool:
        return self.params

    def __repr__(self) -> str:
        return f"Offload(params={self.params}, optimizer={self.optimizer})"


def place_on_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in host memory (pinned when ``device`` is CUDA), marked as host memory; a CPU
    tensor on a CPU mesh stays where it is (it is already in host memory)."""
    if t.device.type != "cpu":
        t = t.to("cpu", copy=True)
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    mark_host(t)
    return t


def to_device_into(out: torch.Tensor, shards: Sequence[torch.Tensor], to: Any, unit: str) -> None:
    """Copies ``shards`` (host) one after the other into the flat ``out`` (device), cast to
    ``out``'s dtype: one copy per shard (see [Note: offload])."""
    offset = 0
    for s in shards:
        n = s.numel()
        out[offset : offset + n].copy_(s.detach().reshape(-1), non_blocking=True)
        offset += n
    emit(Transfer("to_device", offset * out.element_size(), unit, len(shards)), to)


def to_host(t: torch.Tensor, dtype: torch.dtype, to: Any, unit: str) -> torch.Tensor:
    """A host copy of ``t`` (a device tensor) in ``dtype``: one copy, pinned and
    non-blocking on CUDA (see :func:`wait_for_device`)."""
    pin = t.device.type == "cuda"
    out = torch.empty(t.shape, dtype=dtype, device="cpu", pin_memory=pin)
    mark_host(out)
    out.copy_(t, non_blocking=pin)
    if pin:  # done when this event is: see wait_for_device
        done = torch.cuda.Event()
        done.record()
        _TO_HOST.append(done)
    emit(Transfer("to_host", out.numel() * out.element_size(), unit, 1), to)
    return out


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype, to: Any, unit: str) -> torch.Tensor:
    """A device copy of host tensor ``t`` in ``dtype`` (a world of one: no all-gather)."""
    out = torch.empty(t.shape, dtype=dtype, device=device)
    to_device_into(out.view(-1), [t], to, unit)
    return out


def wait_for_device(device: torch.device) -> None:
    """Host code is about to read or write what the device copies from or into: waits for
    the copies to the host (their events) and for the side stream's copies from the host
    shards (a no-op on CPU, where copies are done when they return)."""
    if device.type != "cuda":
        return
    while _TO_HOST:
        _TO_HOST.pop().synchronize()
    if device in _SIDE:
        _SIDE[device].synchronize()


_TO_HOST: list[Any] = []  # CUDA events of copies to pinned host memory not yet waited for
_SIDE: dict[torch.device, Any] = {}


def copy_stream(device: torch.device) -> Any:
    """The side stream a unit's transfer and all-gather run on (CUDA), else a no-op
    context: the compute stream waits for it where the unit is used."""
    if device.type != "cuda":
        return _NoStream()
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return torch.cuda.stream(_SIDE[device])


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def join_stream(out: torch.Tensor) -> None:
    """The compute stream waits for the side stream's copies into ``out`` and the
    allocator learns that the compute stream uses it (CUDA; nothing on CPU)."""
    if out.device.type == "cuda" and out.device in _SIDE:
        current = torch.cuda.current_stream(out.device)
        current.wait_stream(_SIDE[out.device])
        out.record_stream(current)


def mark_host_trees(trees: Iterable[Any]) -> None:
    """Marks every tensor of ``trees`` (an optimizer state built from host shards) as host memory."""
    for leaf in pytree.tree_leaves(list(trees)):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
            mark_host(leaf)
