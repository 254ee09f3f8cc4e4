"""Mesh-aware reductions for code that runs on local shards inside a step (optimizers).

The analogue of ``jax.lax.psum`` inside ``shard_map``: an optimizer sees only this
rank's shard of each parameter and gradient, so a statistic over a whole parameter (its
norm, a trust ratio) is the sum of per-shard partial results over the ranks that hold
the other shards. :func:`psum` does that sum inside a step, or inside
:func:`on_shards` (code of your own on the shards, e.g. on the gradients of
``shardfn.jit_grad``). When parameters are not sharded (NO_SHARD, a world of one) it
returns its input, and so it does on one process, so the same optimizer code runs
unchanged on one device. With several processes and neither a step nor ``on_shards``
it cannot know which ranks hold the other shards, and raises rather than return a
partial sum.

[Note: psum with a tensor axis]
A leaf split over the mesh's ``tensor`` axis (shardfn._parallel.tensor) has its other parts on the
shard axis and on the tensor axis; any other leaf is the same on every tensor rank, its
other parts on the shard axis only. Which one a value comes from is the caller's to say
(``split=``): summed over the tensor axis too, a whole leaf's value would count once per
tensor rank, and not summed there a split leaf's would miss its other pieces.

[Note: padding]
Padding rows of a shard are zero in parameters and gradients (packing zeroes them and the
built-in optimizers keep them zero), so sums of squares over padded shards equal those
over the real parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from .._comm import collectives as C
from .._comm import guard as G
from .._comm.events import Purpose
from .._comm.guard import guarded
from .._comm.scope import here

__all__ = ["on_shards", "psum", "sum_of_squares"]

_NO_SCOPE = (
    "[rank {rank}] shardfn.optim.psum(t): outside a step, on {world} processes (so are global_norm and "
    "clip_by_global_norm): "
    "it cannot tell which ranks hold the other shards of these tensors, and a sum over this rank's shard alone "
    "would be silently wrong. Run it inside `with shardfn.on_shards(sharded):` (sharded: the ShardedParams "
    "the tensors are shards of), or inside a step."
)

@contextmanager
def on_shards(sharded: Any) -> Iterator[None]:
    """Code in the block works on this rank's shards of ``sharded``: :func:`psum` (and
    ``global_norm``, ``clip_by_global_norm``) sums over the ranks holding the other shards.

    A step sets this up for its optimizer by itself; use it for your own code on shards
    outside a step, e.g. on the gradients of ``shardfn.jit_grad``. Every rank must run the
    same psums in the same order: ranks whose psums differ all raise DivergenceError, at
    the latest at the end of the block, which every rank agrees on.

    Example:
        >>> loss, grads, metrics = grad_fn(sharded, batch)
        >>> with shardfn.on_shards(sharded):
        ...     norms = {n: psum(g.float().square().sum()).sqrt() for n, g in grads.items()}
        ...     updates, opt_state = opt.update(grads, opt_state, sharded)
    """
    layout = getattr(sharded, "layout", None)
    if layout is None:
        raise TypeError(f"on_shards(sharded): expected the ShardedParams from shardfn.shard(), got "
                        f"{type(sharded).__name__}.")
    # an error on one rank reaches the others at their next psum
    with guarded(sharded.mesh, shards=(sharded.mesh, layout.sharded, layout)) as scope:
        yield
    if layout.sharded:  # the ranks made the same psums, or all of them raise here
        G.agree_exit(sharded.mesh.channel("shard"), "shardfn.on_shards(...)", scope)
    if sharded.mesh.axis_size("tensor") > 1:  # and so on the tensor axis (psum(..., split=True))
        G.agree_exit(sharded.mesh.channel("tensor"), "shardfn.on_shards(...)", scope)


def psum(t: torch.Tensor, *, split: bool | None = None) -> torch.Tensor:
    """Sum of ``t`` over the ranks that hold the other shards of the parameters.

    Every rank must call it (it is a collective inside a step or :func:`on_shards`). When
    parameters are replicated, or on one process, it returns ``t`` unchanged; elsewhere
    it raises (see the module docstring). On a mesh with a ``tensor`` axis the caller says
    where the other parts of its value live ([Note: psum with a tensor axis]):
    ``split=True`` for a value computed from leaves split over that axis (the names in
    ``sharded.layout.splits``), ``split=False`` for one computed from the other leaves;
    without a tensor axis ``split`` changes nothing.

    Example:
        >>> with shardfn.on_shards(sharded):  # as inside an optimizer's update: local shards
        ...     norms = {n: psum(p.square().sum()).sqrt() for n, p in sharded.items()}  # whole parameters' norms
    """
    scope = _in_progress()  # a public call: the scope it begins in, read once ([Note: the scope])
    if scope.shards is not None:  # (a step's, or on_shards')
        mesh, sharded, _ = scope.shards
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(_NO_SCOPE.format(rank=dist.get_rank(), world=dist.get_world_size()))
    else:
        return t
    if split is not None and not isinstance(split, bool):
        raise TypeError(f"psum(t, split={split!r}): True or False (whether t comes from leaves split over the mesh's "
                        "'tensor' axis), or leave it out on a mesh without one.")
    tensor = mesh.axis_size("tensor") > 1
    if tensor and split is None:
        raise ValueError("psum(t): on a mesh with a 'tensor' axis the ranks that hold the other parts of a parameter "
                         "depend on the parameter, and psum cannot tell from t: pass split=True for a value computed "
                         "from leaves split over the tensor axis (sharded.layout.splits names them), split=False for "
                         "one from the other leaves (psum those separately). The step's metrics['grad_norm'] needs "
                         "neither; see docs/tensor-parallel.md.")
    over = (["shard"] if sharded and mesh.axis_size("shard") > 1 else []) + (["tensor"] if tensor and split else [])
    if not over:
        return t
    out = t.detach().clone()
    for axis in over:
        C.all_reduce(out, mesh.channel(axis), Purpose.PSUM, op=C.SUM, scope=scope)
    return out


def sum_of_squares(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's partial sum of squares of a tree of shards, in fp32: one foreach norm
    for all of them (a kernel per op, not per leaf), as ``clip_grad_norm_`` computes it.
    An ignored parameter, whole on every rank, counts on the ranks that hold the first
    shards only, so that a :func:`psum` counts it once ([Note: ignored parameters])."""
    shards = _in_progress().shards  # (mesh, sharded, layout) of a step or on_shards
    layout = shards[2] if shards is not None else None
    if layout is not None and layout.ignored and layout.shard_rank(shards[0]) != 0:
        tree = {n: t for n, t in tree.items() if n not in layout.ignored}
    leaves = [t.detach() if t.requires_grad else t for t in tree.values() if t is not None]
    if not leaves:
        return torch.zeros(())
    return torch.stack(torch._foreach_norm(leaves, 2, dtype=torch.float32)).square().sum()


def _in_progress() -> Any:
    """The scope of the step or ``on_shards`` block in progress, which says whose shards
    these are: psum's and sum_of_squares' one read of it ([Note: the scope])."""
    return here()
