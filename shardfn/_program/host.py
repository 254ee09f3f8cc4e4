"""What a program recorded for a device cannot hold: host tensors (see [Note: recording a
step] in shardfn._comm.recording)."""

from __future__ import annotations

from typing import Any

import torch

from .._comm.recording import Unrecordable

__all__ = ["refuse_host_tensors"]


def _place(node: torch.fx.Node) -> str:
    """Where in the user's or shardfn's code ``node`` was recorded: the last frame of its trace."""
    lines = [line.strip() for line in node.meta.get("stack_trace", "").strip().splitlines()]
    return " ".join(lines[-2:]) if lines else "an unknown place"


def refuse_host_tensors(gm: torch.fx.GraphModule, device: torch.device, names: list[str]) -> None:
    """Raises :class:`Unrecordable` for the first input, constant or operation of ``gm`` whose
    tensor is not on ``device`` (the mesh's), when that is not the host. ``names``: the
    inputs' leaf paths, in the program's order. On a device, host work is recorded once and
    never run again by a captured program: a host step count would freeze the schedule."""
    if device.type == "cpu":
        return
    inputs = iter(names)
    for node in gm.graph.nodes:
        name = next(inputs, "an input") if node.op == "placeholder" else None
        value = getattr(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        host = [v for v in values if isinstance(v, torch.Tensor) and v.device != device]
        if not host:
            continue
        what = f"{tuple(host[0].shape)} {host[0].dtype} tensor on {host[0].device}, not on the mesh's {device}"
        if node.op == "placeholder":
            raise Unrecordable(f"the program's input {name} is a {what}", f"keep {name} on {device}",
                               "the program's inputs")
        if node.op == "get_attr":
            raise Unrecordable(f"the program holds a constant {what}",
                               f"make the value on {device} (torch.full(..., device=...)), not on the host",
                               next((_place(u) for u in node.users), "an unknown place"))
        raise Unrecordable(f"{node.target} makes a {what}", f"make every tensor of the step on {device}", _place(node))
