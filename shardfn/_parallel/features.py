"""A colwise layer's output, split by features over the tensor axis: what may read it.

[Note: a split layer's output]
A colwise layer gives each tensor rank a block of its output features. That is exact only
while each feature is computed on its own: elementwise operations (an activation, a gate's
product, a scale, dropout) until a rowwise layer sums the blocks. A module that reshapes
the output by a head count, normalises or sums over it, or mixes it with a whole tensor,
would read one rank's block as the whole, silently. Whether that holds is never read from
a module's name: the output is a :class:`PerFeature` tensor, and every operation on it is
checked op by op (views must keep the last dim, arithmetic must not mix a whole tensor in);
anything else raises, naming the op and the layer. Only a transformers attention module
that shardfn checked ([Note: attention split by heads] in shardfn._parallel.tensor) gets its
projections' outputs plainly. A recorded program or a compiled unit holds plain tensors:
their first call ran eagerly, with the checks. Dropout on it: [Note: randomness on the
tensor axis] in shardfn._parallel.rng.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PerFeature", "per_feature", "plain"]

_READ_ACROSS = (
    "shardfn: {op} reads the output of the colwise layer {layer!r} {how}. That output is split over the mesh's "
    "'tensor' axis by features ({parts} ranks each hold {mine} of its {whole}), so only elementwise operations may "
    "use it until a rowwise layer takes it (an MLP's shape): a module that reshapes it by heads, normalises or sums "
    "over it, or mixes it with a whole tensor would read one rank's block as the whole, without an error "
    "([Note: a split layer's output]). Attention is split only in a transformers attention module shardfn can check "
    "([Note: attention split by heads]). Fix: leave {layer!r} and the layers that read its output out of the "
    "tensor_parallel plan, or split only the MLPs (e.g. 'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': 'rowwise')."
)

_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.is_floating_point,
             torch.Tensor.element_size, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_contiguous,
             *(getattr(torch.Tensor, a).__get__ for a in ("shape", "dtype", "device", "ndim", "requires_grad",
                                                            "is_cuda", "layout", "grad_fn", "is_leaf"))}
# ops that keep a tensor's elements where they are (beyond the pointwise ones)
_SAME = {"clone", "_to_copy", "detach", "alias", "copy_", "contiguous", "zeros_like", "ones_like", "empty_like",
         "full_like", "fill_", "zero_"}


class PerFeature(torch.Tensor):
    """A colwise layer's output: the last dim is this tensor rank's block of its features
    (``parts`` blocks in all, this is block ``rank``); see [Note: a split layer's output]."""

    layer: str = ""
    parts: int = 1
    rank: int = 0
    program: str = ""  # "graph" or "compile": the call runs to be recorded or compiled after (see _dropout)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # an aten op called from Python (a dispatch mode of the caller's passing on backward's
        # ops, which read the saved output): below the functions the model calls
        if func in _METADATA or isinstance(func, torch._ops.OpOverload):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        src = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, PerFeature))
        if func is F.dropout:
            return _dropout(src, *args, **kwargs)
        check = _Check(src, getattr(func, "__name__", None) or repr(func))
        with torch._C.DisableTorchFunctionSubclass(), check:
            out = func(*args, **kwargs)
        return pytree.tree_map(lambda t: _like(t, src) if isinstance(t, torch.Tensor) and id(t) in check.split
                               else t, out)


def _like(t: torch.Tensor, src: PerFeature) -> PerFeature:
    if isinstance(t, PerFeature):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        out = t.as_subclass(PerFeature)
    out.layer, out.parts, out.rank, out.program = src.layer, src.parts, src.rank, src.program
    return out


def per_feature(y: torch.Tensor, layer: str, rt: Any, program: str = "") -> torch.Tensor:
    """``y``, a colwise layer's output in the call of runtime ``rt``, as a :class:`PerFeature`
    (plain while make_fx records or dynamo compiles, and in a planning run: see
    shardfn._parallel.sequence._tracing). ``program``: "graph" or "compile" where this call's
    forward is to be a program after."""
    from .sequence import _tracing

    if _tracing(rt):
        return y
    parts, rank = rt.mesh.axis_size("tensor"), rt.mesh.axis_rank("tensor")
    with torch._C.DisableTorchFunctionSubclass():
        out = y.as_subclass(PerFeature)
    out.layer, out.parts, out.rank, out.program = layer, parts, rank, program
    return out


def plain(x: Any) -> Any:
    """``x`` as a plain tensor, where a rowwise layer takes a :class:`PerFeature`."""
    if not isinstance(x, PerFeature):
        return x
    with torch._C.DisableTorchFunctionSubclass():
        return x.as_subclass(torch.Tensor)


def _dropout(src: PerFeature, input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` of a split output: the mask of the whole output, drawn from the stream
    every tensor rank shares, and this rank's block of it: each rank its own mask, and the
    very mask one process would draw ([Note: randomness on the tensor axis])."""
    x = plain(input)
    if not training or p == 0:
        return input
    if src.program:  # a program would hold plain tensors, and draw the block's mask alone
        why = (f"dropout of the output of the colwise layer {src.layer!r}, split over the tensor axis by features, "
               "draws the whole output's mask and keeps the rank's block, which a recorded or compiled program "
               "cannot do: it would draw the block's mask alone, the same on every tensor rank")
        fix = "move the dropout after the rowwise layer, or leave dropout out between split layers"
        if src.program == "graph":
            from .._comm.recording import Unrecordable

            raise Unrecordable(why, fix, frozen=False)
        raise ValueError(f"shardfn: jit_step(compile=True): {why}. Fix: {fix}, or build the step without compile=.")
    n = x.shape[-1]
    with torch._C.DisableTorchFunctionSubclass():
        whole = torch.ones((*x.shape[:-1], n * src.parts), dtype=x.dtype, device=x.device)
        scale = F.dropout(whole, p, True).narrow(-1, src.rank * n, n)
        out = x.mul_(scale) if inplace else x * scale
    return input if inplace else _like(out, src)


def _last(t: torch.Tensor) -> tuple[int, int]:
    return (t.shape[-1], t.stride(-1)) if t.dim() else (-1, -1)


class _Check(TorchDispatchMode):
    """Refuses, inside one torch function of a :class:`PerFeature`, every aten op that reads
    it across its features; ``split``: the ids of the tensors split by features."""

    def __init__(self, src: PerFeature, call: str) -> None:
        super().__init__()
        self.src, self.call = src, call
        self.split: dict[int, torch.Tensor] = {}  # (the tensors, so that no id is reused meanwhile)

    def _is_split(self, t: Any) -> bool:
        return isinstance(t, PerFeature) or (isinstance(t, torch.Tensor) and id(t) in self.split)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        split = [t for t in tensors if self._is_split(t)]
        out = func(*args, **kwargs)
        if not split:
            return out
        name = func._overloadpacket.__name__
        how = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            how = "with a random op (dropout of it through torch.nn.functional.dropout or nn.Dropout is supported)"
        elif torch.Tag.pointwise in func.tags or name in _SAME:
            whole = [t for t in tensors if not self._is_split(t) and t.dim() and t.shape[-1] != 1]
            if whole:
                how = f"together with a whole tensor of shape {list(whole[0].shape)}"
        elif func.is_view:
            kept = all(_last(o) == _last(split[0]) for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor))
            if not kept:
                how = "through a view that moves or cuts its last dim (its features)"
        else:
            how = "across its features"
        if how is not None:
            src = self.src
            raise ValueError(_READ_ACROSS.format(op=f"{self.call} ({func})", layer=src.layer, how=how, parts=src.parts,
                                                 mine=split[0].shape[-1] if split[0].dim() else "?",
                                                 whole=split[0].shape[-1] * src.parts if split[0].dim() else "?"))
        for o in pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.split[id(o)] = o
        return out
