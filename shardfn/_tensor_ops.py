"""The two autograd Functions of tensor parallelism ([Note: hand-written tensor collectives]
in shardfn._tensor), shared with sequence parallelism (shardfn._sequence)."""

from __future__ import annotations

from typing import Any

import torch

from . import _collectives as C
from ._events import Purpose

__all__ = ["CopyToTensor", "GatherOutput", "ReduceFromTensor"]


class CopyToTensor(torch.autograd.Function):
    """A colwise layer's input: the same forward, its gradient all-reduced over the tensor axis."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
        ctx.rt, ctx.path = rt, path
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g = grad.contiguous().clone()
        C.all_reduce(g, ctx.rt.mesh.channel("tensor"), Purpose.TENSOR, ctx.path, op=C.SUM, to=ctx.rt.observers,
                     scope=ctx.rt.scope)
        return g, None, None


class ReduceFromTensor(torch.autograd.Function):
    """A rowwise layer's output: the partial sums all-reduced over the tensor axis; the same backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
        out = y.contiguous().clone()
        C.all_reduce(out, rt.mesh.channel("tensor"), Purpose.TENSOR, path, op=C.SUM, to=rt.observers, scope=rt.scope)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


class GatherOutput(torch.autograd.Function):
    """A ``"colwise_gather_output"`` layer's output (a head's): every tensor rank's features
    all-gathered into the whole output; every rank computes the same gradient of it after,
    so backward keeps the rank's features."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
        ctx.rt = rt
        ch = rt.mesh.channel("tensor")
        got = torch.empty((ch.size, *y.shape), dtype=y.dtype, device=y.device)
        C.all_gather(got.view(-1), y.contiguous().view(-1), ch, Purpose.TENSOR, path, to=rt.observers, scope=rt.scope)
        return torch.cat(got.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        t, r = ctx.rt.mesh.axis_size("tensor"), ctx.rt.mesh.axis_rank("tensor")
        n = grad.shape[-1] // t
        return grad.narrow(-1, r * n, n).contiguous(), None, None
