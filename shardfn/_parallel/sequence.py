"""Sequence parallelism: the activations between split layers split on the sequence.

[Note: the sequence region]
Between a ``"sequence_start"`` module (its first argument split on dim 1 over the tensor
axis) and a ``"sequence_end"`` one (gathered whole), activations are split on the sequence:
``"sequence"`` modules (norms) run on the rank's part, so their parameters' gradients (and
rowwise biases') are partial sums, added over the tensor axis in one all-reduce a step,
after the data axes' reduction; a module holding colwise layers all-gathers its input for
them and reduce-scatters its gradient; rowwise layers reduce-scatter their output. The rule:
a split activation reaches planned modules only, since anything else would read a part of
the sequence without an error. So each call checks what it can see: the region opens and
closes in order and is closed at return, no module with parameters outside the plan runs in
it, and a block's gathered input (:class:`_Gathered`) refuses any use but its colwise
layers'. A parameter-free function that mixes positions is what it cannot see. The start is
a layer's input, not the embeddings, which transformers read the sequence length from.
Details and figures: docs/tensor-parallel.md, "Sequence parallelism".
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from .._comm import collectives as C
from .._comm.events import Purpose
from .call import REPLICATED, SEQUENCE_STYLES, Pass, TensorCall, blocks_of
from .ops import full_leaf, function

__all__ = ["SEQUENCE_STYLES", "blocks_of", "check_closed", "container_forward", "from_torch_style", "gathered_input",
           "outside_region", "partial_leaves", "reduce_scatter_output", "region_check_hook", "sequence_forward",
           "sequence_parallel", "sum_partial_grads"]

_DIM = 1  # the sequence dim of every activation in the region (batch first)


def _part(x: torch.Tensor, t: int, r: int, path: str) -> torch.Tensor:
    """Tensor rank ``r``'s part of ``x`` along the sequence."""
    _check_divides(x, t, path)
    n = x.shape[_DIM] // t
    return x.narrow(_DIM, r * n, n)


def _check_divides(x: torch.Tensor, t: int, path: str) -> None:
    if x.dim() < 2 or x.shape[_DIM] % t:
        raise ValueError(f"shardfn: sequence parallelism splits the input of {path!r} (shape {list(x.shape)}) on dim "
                         f"{_DIM}, the sequence, over the mesh's 'tensor' axis's {t} ranks, which do not divide it. "
                         f"Pad the sequence to a multiple of {t}, or leave the sequence styles out of the plan.")


def _gather(x: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """Every tensor rank's part of the sequence, joined in rank order."""
    return full_leaf(x, _DIM, rt.mesh, Purpose.TENSOR, path, rt.observers, rt.scope)


def _reduce_scatter(y: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """This rank's part of the sequence of ``y`` summed over the tensor ranks."""
    ch = rt.mesh.channel("tensor")
    _check_divides(y, ch.size, path)
    yt = y.transpose(0, _DIM).contiguous()
    out = torch.empty((yt.shape[0] // ch.size, *yt.shape[1:]), dtype=y.dtype, device=y.device)
    C.reduce_scatter(out.view(-1), yt.view(-1), ch, Purpose.TENSOR, path, op=C.SUM, to=rt.observers, scope=rt.scope)
    return out.transpose(0, _DIM)


def _mine(x: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """This tensor rank's part of the sequence of ``x``, its own memory."""
    return _part(x, rt.mesh.axis_size("tensor"), rt.mesh.axis_rank("tensor"), path).contiguous()


_Scatter = function("_Scatter", _mine, _gather,
                     "``sequence_start``'s input: the rank's part forward; the parts' gradients all-gathered.")
_GatherWhole = function("_GatherWhole", _gather, _mine,
                         "``sequence_end``'s input: the whole sequence forward; every rank computes the same "
                         "gradient of it after, so backward keeps the rank's part.")
_GatherPartial = function("_GatherPartial", _gather, _reduce_scatter,
                           "A block's input for its colwise layers: the whole sequence forward; their gradients are "
                           "partial sums, reduce-scattered.")
_ReduceScatter = function("_ReduceScatter", _reduce_scatter, _gather,
                           "A rowwise layer's output in the region: partial sums reduce-scattered; the gradient's "
                           "parts all-gathered.")


_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.__len__, torch.Tensor.is_floating_point,
             *(getattr(torch.Tensor, a).__get__ for a in ("shape", "dtype", "device", "ndim", "requires_grad",
                                                            "is_cuda", "layout"))}


class _Gathered(torch.Tensor):
    """The whole-sequence input of a block, for its colwise layers only: any other operation
    on it raises ([Note: the sequence region]); its shape and dtype may be read."""

    block: str = ""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        block = next((a.block for a in args if isinstance(a, _Gathered)), "?")
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
        raise ValueError(f"shardfn: {name} reads the input of {block!r}, which sequence parallelism gathered whole "
                         "from the tensor ranks' parts of the sequence for the module's colwise layers: only they "
                         "may read it (their input gradients are partial sums, reduce-scattered together; any other "
                         "use would be summed once per tensor rank, silently). Give that computation a module "
                         "of its own, in the plan, or leave the sequence styles out ([Note: the sequence region]).")


_RANDOM = (
    "shardfn: a random op (dropout, noise) ran inside the sequence region between {start!r} and {end!r}, where the "
    "activations are split on the sequence over the mesh's 'tensor' axis: every tensor rank would draw one mask for "
    "its own part of the sequence, the same on each, unlike one process's mask for the whole sequence "
    "([Note: randomness on the tensor axis]). Fix: set the dropout inside the region to 0 (e.g. the config's "
    "hidden and attention dropout), or leave the sequence styles out of the plan."
)


def _draws(device: torch.device) -> tuple[bytes, ...]:
    """The default generators' states: what a random op would change (host bytes, read
    outside any dispatch mode: a recording's, a planning run's)."""
    with _disable_current_modes():
        states = (torch.get_rng_state(), *((torch.cuda.get_rng_state(device),) if device.type == "cuda" else ()))
        return tuple(bytes(s.untyped_storage()) for s in states)


def _same_draws(before: Any, device: torch.device) -> bool:
    """Whether no random op drew since the region opened (``before``: :func:`_draws` then)."""
    return before is None or before == _draws(device)


def _tracing(rt: Any) -> bool:
    """Whether make_fx is recording a graph step's program or dynamo compiling a unit (the
    first call of each ran eagerly, with the checks), or the call's runtime ``rt`` is a
    planning run's, on fake tensors (a real run checks)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None or torch.compiler.is_compiling() or rt.mesh.fake


def gathered_input(x: Any, path: str, rt: Any) -> torch.Tensor:
    """A colwise layer's input in the region: the plain tensor its block gathered (already
    plain while a program is recorded or compiled, or in a planning run: see :func:`_tracing`)."""
    if _tracing(rt):
        return x
    if not isinstance(x, _Gathered):
        raise ValueError(f"shardfn: the colwise layer {path!r} runs in a plan with sequence parallelism, and its input "
                         "is not the sequence its enclosing module gathered (the output of a 'sequence' module that "
                         "module was given): a colwise layer's input must come straight from there. Style the "
                         "module that computes it 'sequence', or leave the sequence styles out of the plan.")
    with torch._C.DisableTorchFunctionSubclass():
        return x.as_subclass(torch.Tensor)


def _checked(now: TensorCall, path: str, style: str, need_open: bool = True) -> bool:
    """Whether this call checks the region (not a recompute, not bind's block); raises
    where ``path`` runs with the region in the wrong state."""
    if not now.checks:
        return False
    opened = now.opened
    if need_open and opened is None:
        raise ValueError(f"shardfn: {path!r} ({style!r}) ran outside the sequence region: no 'sequence_start' module "
                         "ran before it in this call, so its input is not split on the sequence. Style the module "
                         "whose input starts the region (e.g. the first layer, 'model.layers.0') 'sequence_start'.")
    if not need_open and opened is not None:
        raise ValueError(f"shardfn: {path!r} ('sequence_start') ran while the sequence region opened by {opened!r} "
                         "was open; end a region ('sequence_end') before starting another.")
    return True


def sequence_forward(active: Any, path: str, module: nn.Module) -> Any:
    """``module``'s forward under its sequence style (inert in calls whose layout gives it none)."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        now = active()
        style = now.styles.get(path) if now is not None else None
        if style not in SEQUENCE_STYLES or now.mode is Pass.WHOLE:
            return inner(*args, **kwargs)
        rt = now.rt
        if style in ("sequence_start", "sequence_end"):
            if _checked(now, path, style, need_open=style == "sequence_end"):
                if style == "sequence_end" and not _same_draws(now.draws, rt.mesh.device):
                    raise ValueError(_RANDOM.format(start=now.opened, end=path))
                now.opened = path if style == "sequence_start" else None
                now.draws = _draws(rt.mesh.device)
            if not (args and isinstance(args[0], torch.Tensor)):
                raise ValueError(f"shardfn: {path!r} is styled {style!r}, which splits or gathers the module's first "
                                 "positional argument on the sequence, and it was called without a tensor there. Give "
                                 "the style to a module called with its activations first.")
            fn = _Scatter if style == "sequence_start" else _GatherWhole
            return inner(fn.apply(args[0], rt, path), *args[1:], **kwargs)
        _checked(now, path, style)
        out = inner(*args, **kwargs)  # (its parameters' gradients: summed once a step, see partial_grads)
        if isinstance(out, torch.Tensor):  # (a weak reference: the call keeps no activation alive)
            now.made[id(out)] = weakref.ref(out)
        return out

    return forward


def container_forward(active: Any, path: str, module: nn.Module) -> Any:
    """The forward of a module holding colwise layers: in the region, the one input that a
    ``"sequence"`` module made is gathered whole for them."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        now = active()
        if now is None or not now.sequence or path not in now.blocks:
            return inner(*args, **kwargs)
        rt = now.rt
        checked = _checked(now, path, "the module holding colwise layers")
        split = now.made
        found = [(k, v) for k, v in [*enumerate(args), *kwargs.items()]
                 if isinstance(v, torch.Tensor) and id(v) in split and split[id(v)]() is v]
        if not found and not checked:  # a recompute: its 'sequence' module's output is the tensor given
            found = [(k, v) for k, v in [*enumerate(args), *kwargs.items()] if isinstance(v, torch.Tensor)][:1]
        if len(found) != 1:
            raise ValueError(f"shardfn: {path!r} holds colwise layers in a plan with sequence parallelism and was given "
                             f"{len(found)} tensors made by a 'sequence' module, not one: the one it gets is gathered "
                             "whole for its colwise layers. Style the module that computes that input (its norm) "
                             "'sequence'.")
        key, x = found[0]
        whole = _GatherPartial.apply(x, rt, path)
        if not _tracing(rt):  # (make_fx would hold a subclass's tensor as a constant: the first call checked)
            whole = whole.as_subclass(_Gathered)
            whole.block = path
        if isinstance(key, int):
            args = (*args[:key], whole, *args[key + 1:])
        else:
            kwargs = {**kwargs, key: whole}
        return inner(*args, **kwargs)

    return forward


def outside_region(now: Any, path: str, style: str) -> None:
    """A layer that takes its input whole (a ``"colwise_gather_output"`` head, an
    ``"embedding_rowwise"`` embedding) must run outside the region."""
    if now.opened is not None and now.mode is not Pass.RECOMPUTE:
        raise ValueError(f"shardfn: {path!r} ({style!r}) ran inside the sequence region opened by "
                         f"{now.opened!r}, where its input is a part of the sequence. Run it outside the region: "
                         "end the region before it ('sequence_end') or start it after it ('sequence_start').")


def reduce_scatter_output(now: Any, y: torch.Tensor, path: str) -> torch.Tensor:
    """A rowwise layer's partial sums in the region, reduce-scattered on the sequence."""
    _checked(now, path, "rowwise")
    return _ReduceScatter.apply(y, now.rt, path)


def partial_leaves(layout: Any) -> list[str]:
    """The leaves whose gradients a tensor rank holds a part of: under sequence parallelism,
    from its own part of the sequence (a ``"sequence"`` module's own parameters, a rowwise
    layer's bias); a ``"replicated_with_grad_allreduce"`` module's own parameters, from its
    own heads (shardfn._parallel.tensor [Note: a module that reads split heads]).
    :func:`sum_partial_grads` sums them once a step."""
    styles = dict(layout.tensor)
    owners = {p for p, s in styles.items() if s == REPLICATED}
    if not sequence_parallel(layout):
        return [n for n in layout.leaves if n.rpartition(".")[0] in owners]
    owners |= {p for p, s in styles.items() if s == "sequence"}
    partial = [n for n in layout.leaves if n.rpartition(".")[0] in owners]
    return partial + [f"{p}.bias" for p, s in styles.items() if s == "rowwise" and f"{p}.bias" in layout.leaves]


def sum_partial_grads(grads: dict[str, torch.Tensor], layout: Any, rt: Any) -> None:
    """Sums the shard gradients of :func:`partial_leaves` over the tensor axis, in place: one
    all-reduce a step for all of them, after the data axes' reduction (a sum commutes with
    it), instead of one per parameter and call."""
    names = [n for n in partial_leaves(layout) if n in grads]
    if not names:
        return
    # each leaf's slot as long as its largest shard on any rank: one size on every rank
    sizes = [max(layout.piece(n, r)[1] for r in range(layout.world)) for n in names]
    flat = torch.zeros(sum(sizes), dtype=grads[names[0]].dtype, device=rt.mesh.device)
    slots = flat.split(sizes)
    for n, slot in zip(names, slots):
        slot[:grads[n].numel()].copy_(grads[n].reshape(-1))
    name = "sequence" if sequence_parallel(layout) else REPLICATED
    C.all_reduce(flat, rt.mesh.channel("tensor"), Purpose.TENSOR, name, op=C.SUM, to=rt.observers, scope=rt.scope)
    for n, slot in zip(names, slots):
        grads[n].copy_(slot[:grads[n].numel()].view_as(grads[n]))


def region_check_hook(active: Any, path: str) -> Any:
    """A forward pre-hook on a module with parameters outside the plan: refuses it while the
    region is open (its input may be a part of the sequence)."""

    def hook(module: nn.Module, args: Any) -> None:
        now = active()
        if now is None or not now.sequence or path in now.styles:
            return
        opened = now.opened
        if opened is not None and now.checks:
            raise ValueError(f"shardfn: {path!r} ({type(module).__name__}, with parameters, not in the plan) ran inside "
                             f"the sequence region opened by {opened!r}, where the activations are split on the "
                             "sequence: it would read a part of it silently. Give it a style ('sequence' for a "
                             "per-token module such as a norm), or end the region before it ('sequence_end').")

    return hook


def check_closed(now: Any) -> None:
    """At the end of a call: the region it opened must be closed."""
    opened = now.opened
    if opened is not None and now.checks:
        raise ValueError(f"shardfn: the sequence region opened by {opened!r} was not closed when the call returned: its "
                         "output would be a part of the sequence on each tensor rank. Style the module that reads "
                         "the region's last activations (e.g. the head) 'sequence_end'.")



def sequence_parallel(layout: Any) -> bool:
    """Whether ``layout`` (or None) has sequence styles."""
    return layout is not None and any(style in SEQUENCE_STYLES for _, style in layout.tensor)


def from_torch_style(style: Any, pattern: str) -> tuple[str, bool | None]:
    """``(shardfn style, whether it needs sequence parallelism (None: either))`` of one of
    torch's ``ParallelStyle`` objects; those shardfn has no style for are refused by name."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    seq, rep, last = (Shard(_DIM),), (Replicate(),), (Shard(-1),)
    kind, attrs = type(style), vars(style)
    if kind is ColwiseParallel and attrs.get("output_layouts") == rep and attrs.get("input_layouts") == rep:
        return "colwise_gather_output", None
    if kind is ColwiseParallel and attrs.get("output_layouts") == last:
        if attrs.get("input_layouts") == rep:
            return "colwise", None
        if attrs.get("input_layouts") == seq:
            return "colwise", True
    if kind is RowwiseParallel and attrs.get("input_layouts") == rep and attrs.get("output_layouts") == rep:
        return "embedding_rowwise", None  # (torch's rowwise style on an nn.Embedding: its rows split)
    if kind is RowwiseParallel and attrs.get("input_layouts") == last:
        if attrs.get("output_layouts") == rep:
            return "rowwise", False
        if attrs.get("output_layouts") == seq:
            return "rowwise", True
    if kind is SequenceParallel and attrs.get("sequence_sharding") == seq:
        return "sequence", True
    if kind is PrepareModuleInput and not attrs.get("with_kwargs"):
        if attrs.get("input_layouts") == rep and attrs.get("desired_input_layouts") == seq:
            return "sequence_start", True
        if attrs.get("input_layouts") == seq and attrs.get("desired_input_layouts") == rep:
            return "sequence_end", True
    raise ValueError(f"shard(tensor_parallel=...): {pattern!r} is given {kind.__name__}({attrs}), which shardfn has no "
                     "style for. It takes ColwiseParallel() (input Replicate or Shard(1); both Replicate: "
                     "'colwise_gather_output'), RowwiseParallel() (output Replicate or Shard(1); on an nn.Embedding "
                     "input Replicate: 'embedding_rowwise'), SequenceParallel(), PrepareModuleInput(input_layouts="
                     "Replicate(), desired_input_layouts=Shard(1)) (the region's start) and PrepareModuleInput("
                     "input_layouts=Shard(1), desired_input_layouts=Replicate()) (its end), or the strings "
                     "'colwise', 'rowwise', 'colwise_gather_output', 'embedding_rowwise', 'sequence', "
                     "'sequence_start', 'sequence_end': see docs/tensor-parallel.md.")
