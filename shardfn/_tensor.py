"""Tensor parallelism: ``nn.Linear`` layers split over the mesh's ``"tensor"`` axis.

[Note: hand-written tensor collectives]
A split layer's collectives are written here, as two autograd Functions over shardfn's own
collectives, not taken from DTensor (``torch.distributed.tensor.parallel``): DTensor's
collectives bypass shardfn._collectives (no schedule guard, no timeout, no count in the
step's log), and the DTensors autograd saves have no storage that FULL_SHARD's saved
handles can recognise, so a unit's gathered parameters would silently stay alive. A
colwise layer holds rows of the weight (and of the bias): its input is the same on every
tensor rank, its input's gradient is a partial sum, all-reduced in backward. A rowwise
layer holds columns of the weight: its output is a partial sum, all-reduced in forward,
and its bias is added once, after the reduction. Backward takes the runtime's scope and
observers, never a context variable ([Note: backward on device threads]). The ranks of a
tensor group split the layers of one batch, so each step opens with their batches' digest
in a header on the tensor axis (:func:`agree_on_batch`): other batches would train without
a word, each rank's partial sums of another input added together.
"""

from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from . import _collectives as C
from . import _guard as G
from ._errors import DivergenceError
from ._events import Collective, Purpose

__all__ = ["STYLES", "agree_on_batch", "full_leaf", "local_state", "resolve_tensor_parallel", "split_sum_of_squares",
           "tp_forward"]

STYLES = ("colwise", "rowwise")

_NOT_YET = (
    "shard(tensor_parallel=...): {what} is not supported yet (stage 1 of tensor parallelism: a mapping from "
    "module-path patterns to 'colwise' or 'rowwise', on nn.Linear layers). Pass such a mapping; see "
    "docs/tensor-parallel.md."
)
_ATTENTION = (
    "shard(tensor_parallel=...): {path!r} is inside an attention module: its output is reshaped by the number of "
    "heads, and a rank's slice of it would be read with the wrong head size without any error. Splitting attention "
    "is not supported yet; split the MLP's layers only (e.g. 'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': "
    "'rowwise')."
)


def resolve_tensor_parallel(spec: Any, module: nn.Module | None, state: Mapping[str, torch.Tensor],
                            tensor: int) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, int, tuple], ...]]:
    """``(module path, style)`` of each layer ``spec`` splits and ``(leaf, dim, global shape)``
    of each leaf it splits over ``tensor`` ranks; every mistake raises naming the fix."""
    if spec is None:
        return (), ()
    if tensor == 1:
        raise ValueError("shard(tensor_parallel=...): the mesh has no 'tensor' axis (or it has one rank). Build "
                         "the mesh with Mesh.from_env(tensor=T), or drop tensor_parallel=.")
    if isinstance(spec, str):
        raise ValueError(_NOT_YET.format(what=f"tensor_parallel={spec!r}"))
    if not isinstance(spec, Mapping):
        raise TypeError(f"shard(tensor_parallel=...): expected a mapping from module-path patterns to 'colwise' or "
                        f"'rowwise', got {type(spec).__name__}.")
    if module is None:
        raise ValueError("shard(tensor_parallel=...): the module tree is unknown; pass the params returned by "
                         "functionalize(model).")
    styles: dict[str, str] = {}
    for pattern, style in spec.items():
        if not isinstance(style, str) or style not in STYLES:
            name = repr(style) if isinstance(style, str) else f"a {type(style).__name__} object"
            raise ValueError(_NOT_YET.format(what=f"the style {name} (for {pattern!r})"))
        paths = [p for p, _ in module.named_modules() if p and fnmatch.fnmatchcase(p, pattern)]
        if not paths:
            raise ValueError(f"shard(tensor_parallel=...): the pattern {pattern!r} matches no module of "
                             f"{type(module).__name__}; patterns are module paths with fnmatch wildcards, "
                             f"e.g. 'blocks.*.mlp.0'.")
        for path in paths:
            m = module.get_submodule(path)
            if any("attn" in part or "attention" in part for part in path.split(".")):
                raise ValueError(_ATTENTION.format(path=path))
            if type(m) is not nn.Linear:
                raise ValueError(f"shard(tensor_parallel=...): {path!r} (matched by {pattern!r}) is a "
                                 f"{type(m).__name__}; only nn.Linear layers can be split yet. Narrow the pattern.")
            if path in styles and styles[path] != style:
                raise ValueError(f"shard(tensor_parallel=...): {path!r} is matched as {styles[path]!r} and as "
                                 f"{style!r}; give each layer one style.")
            styles[path] = style
    splits = []
    for path, style in sorted(styles.items()):
        for name, dim in (("weight", 0 if style == "colwise" else 1), ("bias", 0 if style == "colwise" else None)):
            leaf = f"{path}.{name}"
            if dim is None or getattr(module.get_submodule(path), name) is None:
                continue
            if leaf not in state:
                raise ValueError(f"shard(tensor_parallel=...): {leaf!r} is tied to another parameter (it is not "
                                 "a leaf of the state); a tied weight cannot be split yet. Leave its layer out.")
            shape = tuple(state[leaf].shape)
            if shape[dim] % tensor:
                raise ValueError(f"shard(tensor_parallel=...): {leaf!r} of shape {list(shape)} is split {style} "
                                 f"on dim {dim} ({shape[dim]}), which the tensor axis's {tensor} ranks do not "
                                 f"divide ({shape[dim]} % {tensor} = {shape[dim] % tensor}). Choose a tensor size "
                                 "that divides it, or leave the layer out.")
            splits.append((leaf, dim, shape))
    return tuple(sorted(styles.items())), tuple(splits)


def local_state(state: Mapping[str, torch.Tensor], splits: tuple[tuple[str, int, tuple], ...], tensor: int,
                rank: int) -> dict[str, torch.Tensor]:
    """``state`` with each split leaf replaced by tensor rank ``rank``'s piece of it."""
    out = dict(state)
    for leaf, dim, shape in splits:
        if leaf in state:  # (a unit's values hold its own leaves only)
            n = shape[dim] // tensor
            out[leaf] = state[leaf].narrow(dim, rank * n, n)
    return out


def full_leaf(local: torch.Tensor, dim: int, mesh: Any, purpose: Purpose, name: str) -> torch.Tensor:
    """The whole of a split leaf from every tensor rank's piece (every tensor rank calls it)."""
    t = mesh.axis_size("tensor")
    got = torch.empty((t, *local.shape), dtype=local.dtype, device=local.device)
    C.all_gather(got.view(-1), local.contiguous().view(-1), mesh.channel("tensor"), purpose, name)
    return torch.cat(got.unbind(0), dim=dim)


def split_sum_of_squares(grads: Mapping[str, torch.Tensor], layout: Any, mesh: Any, sum_of_squares: Any) -> torch.Tensor:
    """This rank's share of the gradients' sum of squares when summed over the whole mesh:
    split leaves on every tensor rank (each holds its own piece), the others on tensor rank 0
    only (every tensor rank holds the same values)."""
    split = {leaf for leaf, _, _ in layout.splits}
    mine = sum_of_squares({n: g for n, g in grads.items() if n in split})
    rest = sum_of_squares({n: g for n, g in grads.items() if n not in split})
    return mine + rest if mesh.axis_rank("tensor") == 0 else mine + 0 * rest


class _CopyToTensor(torch.autograd.Function):
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


class _ReduceFromTensor(torch.autograd.Function):
    """A rowwise layer's output: the partial sums all-reduced over the tensor axis; the same backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
        out = y.contiguous().clone()
        C.all_reduce(out, rt.mesh.channel("tensor"), Purpose.TENSOR, path, op=C.SUM, to=rt.observers, scope=rt.scope)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


def tp_forward(active: Any, path: str, module: nn.Linear) -> Any:
    """``module``'s forward, split as the active call's layout says (``active()``: its
    ``(layout, runtime)``, or None outside a sharded call); the module's own otherwise."""
    inner = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        now = active()
        style = dict(now[0].tensor).get(path) if now is not None else None
        if style is None:
            return inner(x)
        rt = now[1]
        if style == "colwise":
            return F.linear(_CopyToTensor.apply(x, rt, path), module.weight, module.bias)
        y = _ReduceFromTensor.apply(F.linear(x, module.weight), rt, path)
        return y if module.bias is None else y + module.bias

    return forward


_OTHER_BATCHES = (
    "[rank {rank}] shardfn: the ranks of tensor group {ranks} got different batches (digests {digests}): they split "
    "each layer of one batch between them, and each rank's partial sums of another input would be added together. "
    "Give every rank of a tensor group the same batch: split_batch(batch, mesh.data_rank, mesh.data_size)."
)


def agree_on_batch(batch: Any, mesh: Any) -> None:
    """Raises DivergenceError on every rank of this rank's tensor group unless all of them
    got the same batch (a CRC-32 of each tensor leaf's bytes, read on the host, in one
    header on the tensor axis: [Note: hand-written tensor collectives])."""
    ch = mesh.channel("tensor")
    if ch.off:  # a planning run's fake group: no values to compare, nothing to exchange (as every guard header)
        return
    digest = 0
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().reshape(-1).cpu().contiguous().view(torch.uint8)
            digest = zlib.crc32(data.numpy().tobytes(), zlib.crc32(repr((leaf.shape, leaf.dtype)).encode(), digest))
    headers = G.exchange(ch, [*G.words(Collective.BARRIER, Purpose.STEP, "", 0, digest), G.OK, 0],
                         "the batch of a tensor group")
    digests = [h[G.DETAIL] for h in headers]
    if len(set(digests)) > 1:
        raise G.told(DivergenceError(_OTHER_BATCHES.format(rank=mesh.rank, ranks=list(ch.ranks), digests=digests)), ch)
