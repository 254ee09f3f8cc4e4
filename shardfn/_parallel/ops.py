"""The autograd Functions of tensor parallelism ([Note: hand-written tensor collectives] in
shardfn._parallel.tensor) and what they are made of, shared with sequence parallelism
(shardfn._parallel.sequence): each is a forward and a backward over the tensor axis, both taking the
runtime the forward had ([Note: backward on device threads])."""

from __future__ import annotations

from typing import Any

import torch

from .._comm import collectives as C
from .._comm.events import Purpose

__all__ = ["CopyToTensor", "GatherOutput", "ReduceFromTensor", "SplitInput", "full_leaf", "function"]


def full_leaf(local: torch.Tensor, dim: int, mesh: Any, purpose: Purpose, name: str, to: Any = None,
              scope: Any = None) -> torch.Tensor:
    """The whole of a tensor split on ``dim`` over the tensor axis, from every tensor rank's
    piece (every tensor rank calls it); ``to``, ``scope``: as shardfn._comm.collectives takes them."""
    t = mesh.axis_size("tensor")
    got = torch.empty((t, *local.shape), dtype=local.dtype, device=local.device)
    C.all_gather(got.view(-1), local.contiguous().view(-1), mesh.channel("tensor"), purpose, name, to=to, scope=scope)
    return torch.cat(got.unbind(0), dim=dim)


def function(name: str, forward: Any, backward: Any, doc: str) -> type:
    """An autograd Function whose forward is ``forward(x, rt, path)`` and whose backward is
    ``backward(grad, rt, path)``, with the forward's runtime ``rt``."""

    def fwd(ctx: Any, x: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
        ctx.rt, ctx.path = rt, path
        return forward(x, rt, path)

    def bwd(ctx: Any, grad: torch.Tensor) -> tuple:
        return backward(grad, ctx.rt, ctx.path), None, None

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "forward": staticmethod(fwd),
                                                     "backward": staticmethod(bwd)})


def _summed(t: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """``t`` summed over the tensor axis, in a new tensor."""
    out = t.contiguous().clone()
    C.all_reduce(out, rt.mesh.channel("tensor"), Purpose.TENSOR, path, op=C.SUM, to=rt.observers, scope=rt.scope)
    return out


def _features(t: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """This tensor rank's block of ``t``'s last dim."""
    n = t.shape[-1] // rt.mesh.axis_size("tensor")
    return t.narrow(-1, rt.mesh.axis_rank("tensor") * n, n).contiguous()


CopyToTensor = function("CopyToTensor", lambda x, rt, path: x.view_as(x), _summed,
                        "A colwise layer's input: the same forward, its gradient all-reduced over the tensor axis.")
ReduceFromTensor = function("ReduceFromTensor", _summed, lambda grad, rt, path: grad,
                            "A rowwise layer's output: the partial sums all-reduced over the tensor axis; the same "
                            "backward.")
GatherOutput = function(
    "GatherOutput",
    lambda y, rt, path: full_leaf(y, -1, rt.mesh, Purpose.TENSOR, path, rt.observers, rt.scope), _features,
    "A ``\"colwise_gather_output\"`` layer's output (a head's): every tensor rank's features all-gathered into the "
    "whole output; every rank computes the same gradient of it after, so backward keeps the rank's features.")
SplitInput = function(
    "SplitInput", lambda x, rt, path: _features(x, rt, path),
    lambda grad, rt, path: full_leaf(grad, -1, rt.mesh, Purpose.TENSOR, path, rt.observers, rt.scope),
    "A ``\"rowwise_split_input\"`` layer's whole input: the rank's features of it; its gradient, whose other "
    "features the other ranks computed, all-gathered into the whole input's.")
