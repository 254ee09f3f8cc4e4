"""The autograd Functions of tensor parallelism ([Note: hand-written tensor collectives] in
shardfn._parallel.tensor) and what they are made of, shared with sequence parallelism
(shardfn._parallel.sequence): each is a forward and a backward over the tensor axis, both taking the
runtime the forward had ([Note: backward on device threads])."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._comm import collectives as C
from .._comm.events import Purpose

__all__ = ["CopyToTensor", "GatherOutput", "ReduceFromTensor", "Split", "SplitInput", "full_leaf", "function",
           "shared_copy"]


def full_leaf(local: torch.Tensor, dim: int, mesh: Any, purpose: Purpose, name: str, to: Any = None,
              scope: Any = None) -> torch.Tensor:
    """The whole of a tensor split on ``dim`` over the tensor axis, from every tensor rank's
    piece (every tensor rank calls it); ``to``, ``scope``: as shardfn._comm.collectives takes them."""
    return torch.cat(_gathered(local, mesh, purpose, name, to, scope).unbind(0), dim=dim)


class Split(NamedTuple):
    """A leaf split over the tensor axis: its name, the dim, its whole shape, and ``parts``.

    [Note: packed splits]
    A packed weight (an expert's gate and up projections in one ``gate_up_proj``) holds
    ``parts`` equal blocks along ``dim``, and the forward cuts it into them (``chunk(2)``).
    Each tensor rank holds the same block of every part, side by side: its rows of the gate
    and then its rows of the up projection, so that its chunks are its gate's and its up's
    (transformers' ``packed_colwise``: a strided shard). ``parts=1`` is a plain split: one
    contiguous block per rank. Every reader and writer of a split leaf (checkpoints, exports,
    resharding, loading, the optimizers) goes through :meth:`piece`, :meth:`whole` and
    :meth:`at`, so the two kinds never differ elsewhere.
    """

    leaf: str
    dim: int
    shape: tuple[int, ...]
    parts: int = 1

    def piece(self, t: torch.Tensor, tensor: int, rank: int) -> torch.Tensor:
        """Tensor rank ``rank``'s piece of the whole tensor ``t``."""
        part = self.shape[self.dim] // self.parts
        n = part // tensor
        if self.parts == 1:
            return t.narrow(self.dim, rank * n, n)
        return torch.cat([t.narrow(self.dim, p * part + rank * n, n) for p in range(self.parts)], dim=self.dim)

    def whole(self, local: torch.Tensor, mesh: Any, purpose: Purpose, name: str, to: Any = None,
              scope: Any = None) -> torch.Tensor:
        """The whole tensor from every tensor rank's piece (every tensor rank calls it)."""
        if self.parts == 1:
            return full_leaf(local, self.dim, mesh, purpose, name, to, scope)
        got = _gathered(local, mesh, purpose, name, to, scope)
        cut = [g.chunk(self.parts, dim=self.dim) for g in got.unbind(0)]
        return torch.cat([c[p] for p in range(self.parts) for c in cut], dim=self.dim)

    def at(self, index: Any, rank: int, block: int) -> Any:
        """Where index ``index`` (an int or a tensor of them) along ``dim`` of tensor rank
        ``rank``'s piece, whose size along ``dim`` is ``block``, lies in the whole tensor."""
        n = block // self.parts
        return (index // n) * (self.shape[self.dim] // self.parts) + rank * n + index % n

    def runs(self, lo: int, hi: int, rank: int, block: int) -> list[tuple[int, int, int]]:
        """The piece's indices ``lo:hi`` along ``dim`` as runs ``(piece start, whole start, length)``
        contiguous in both."""
        n = block // self.parts
        out = []
        while lo < hi:
            end = min(hi, (lo // n + 1) * n)
            out.append((lo, int(self.at(lo, rank, block)), end - lo))
            lo = end
        return out


def _gathered(local: torch.Tensor, mesh: Any, purpose: Purpose, name: str, to: Any, scope: Any) -> torch.Tensor:
    """Every tensor rank's ``local``, stacked on a new dim 0 (every tensor rank calls it)."""
    t = mesh.axis_size("tensor")
    got = torch.empty((t, *local.shape), dtype=local.dtype, device=local.device)
    C.all_gather(got.view(-1), local.contiguous().view(-1), mesh.channel("tensor"), purpose, name, to=to, scope=scope)
    return got


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


def shared_copy(copies: dict[int, tuple], x: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """``x`` as a colwise layer's input: one :class:`CopyToTensor` per input tensor and call.

    [Note: one all-reduce per shared input]
    Colwise layers that read the same tensor (q, k and v; gate and up) share one copy of it,
    so autograd sums their partial input gradients on the rank first and the tensor axis
    all-reduces that sum once (Megatron's ``f``), named by the first layer that read it. The
    copies live in the sharded call's own dict (``copies``), made afresh for each call, so no
    copy outlives its forward (a micro-batch, a step); one is reused only while its input is
    the same tensor at the same version (an input changed in place gets a new copy). An
    input without a gradient (``bind``'s block runs under no_grad) is used as it is.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward: nothing to reduce, nothing to keep
        return x
    hit = copies.get(id(x))
    if hit is None or hit[0] is not x or hit[1] != x._version:
        hit = copies[id(x)] = (x, x._version, CopyToTensor.apply(x, rt, path))
    return hit[2]
