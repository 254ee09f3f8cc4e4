"""Tensor parallelism: ``nn.Linear`` layers split over the mesh's ``"tensor"`` axis.

[Note: hand-written tensor collectives]
A split layer's collectives are written here, as two autograd Functions over shardfn's own
collectives, not taken from DTensor (``torch.distributed.tensor.parallel``): DTensor's
collectives bypass shardfn._comm.collectives (no schedule guard, no timeout, no count in the
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
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from .._comm import collectives as C
from .._comm import guard as G
from .features import per_feature, plain
from .sequence import (SEQUENCE_STYLES, blocks_of, from_torch_style, gathered_input, outside_region,
    reduce_scatter_output)
from .call import REPLICATED  # [Note: a module that reads split heads]
from .experts import MOE, PARAM_STYLES, experts_splits, parameter_paths
from .ops import GatherOutput, ReduceFromTensor, Split, SplitInput, full_leaf, shared_copy

__all__ = ["AUTO_STYLES", "REPLICATED", "STYLES", "auto_plan", "full_leaf", "heads_of", "local_state",
           "resolve_tensor_parallel", "split_sum_of_squares", "tp_forward"]

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise", REPLICATED,
          MOE, "packed_colwise", "packed_rowwise", *SEQUENCE_STYLES)
# an attention's layers styled so that every rank runs all of its heads: its output (q, k, v)
# gathered whole, and the layer after it (o) splitting its whole input itself
WHOLE_HEADS = ("colwise_gather_output", "rowwise_split_input")

_NOT_YET = (
    "shard(tensor_parallel=...): {what} is not supported yet. Tensor parallelism takes 'auto' or a mapping from "
    "module-path patterns to a style: 'colwise', 'rowwise', 'colwise_gather_output' or 'rowwise_split_input' "
    "(nn.Linear layers), 'embedding_rowwise' (an nn.Embedding), 'replicated_with_grad_allreduce' (a per-head norm "
    "inside a split attention), 'moe_tp_experts' (a transformers experts module) with 'packed_colwise', "
    "'packed_rowwise', 'colwise' or 'rowwise' naming its parameters, 'sequence', 'sequence_start' or 'sequence_end' "
    "(sequence parallelism), "
    "or one of torch's ParallelStyle objects of those kinds. Pass such a mapping; see docs/tensor-parallel.md."
)
_ATTENTION = (
    "shard(tensor_parallel=...): {path!r} is inside {attention!r}, a module with a head_dim that shardfn cannot "
    "prove splits exactly by heads: its output may be reshaped by a head count of its own, and a rank's slice of "
    "it would be read with the wrong head size without any error. Only a transformers attention module that "
    "reshapes by head_dim can be split ([Note: attention split by heads]); split the MLP's layers only (e.g. "
    "'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.2': 'rowwise')."
)


def resolve_tensor_parallel(spec: Any, module: nn.Module | None, state: Mapping[str, torch.Tensor],
                            tensor: int) -> tuple[tuple[tuple[str, str], ...], tuple[Split, ...]]:
    """``(module path, style)`` of each layer ``spec`` splits and ``(leaf, dim, global shape)``
    of each leaf it splits over ``tensor`` ranks; every mistake raises naming the fix."""
    if spec is None:
        return (), ()
    if tensor == 1:
        raise ValueError("shard(tensor_parallel=...): the mesh has no 'tensor' axis (or it has one rank). Build "
                         "the mesh with Mesh.from_env(tensor=T), or drop tensor_parallel=.")
    if isinstance(spec, str) and spec != "auto":
        raise ValueError(_NOT_YET.format(what=f"tensor_parallel={spec!r}"))
    if not isinstance(spec, (Mapping, str)):
        raise TypeError(f"shard(tensor_parallel=...): expected a mapping from module-path patterns to 'colwise' or "
                        f"'rowwise', got {type(spec).__name__}.")
    if module is None:
        raise ValueError("shard(tensor_parallel=...): the module tree is unknown; pass the params returned by "
                         "functionalize(model).")
    if spec == "auto":
        spec = auto_plan(module)
    styles: dict[str, str] = {}
    attentions: set[str] = set()
    replicated: dict[str, str | None] = {}  # REPLICATED module path -> the attention it sits in
    whole: dict[str, str] = {}  # an attention -> a layer of it styled to leave its heads whole (WHOLE_HEADS)
    needs: dict[str, tuple[str, bool | None]] = {}  # torch objects: what their layouts need of the plan
    from_torch: set[str] = set()
    params: dict[str, str] = {}  # a parameter of an experts module -> its style
    for pattern, style in spec.items():
        given = style
        if not isinstance(style, str):
            if not _is_torch_style(style):
                raise ValueError(_NOT_YET.format(what=f"the style a {type(style).__name__} object (for {pattern!r})"))
            style, sequence = from_torch_style(style, pattern)
            needs[pattern] = (style, sequence)
        if style not in STYLES:
            raise ValueError(_NOT_YET.format(what=f"the style {style!r} (for {pattern!r})"))
        paths = [p for p, _ in module.named_modules() if p and fnmatch.fnmatchcase(p, pattern)]
        named = parameter_paths(module, pattern) if not paths and style in PARAM_STYLES else []
        for name in named:  # a parameter ([Note: experts split by features])
            if params.setdefault(name, style) != style:
                raise ValueError(f"shard(tensor_parallel=...): {name!r} is matched as {params[name]!r} and as "
                                 f"{style!r}; give each parameter one style.")
        if named:
            continue
        if not paths:
            raise ValueError(f"shard(tensor_parallel=...): the pattern {pattern!r} matches no module of "
                             f"{type(module).__name__}; patterns are module paths with fnmatch wildcards, "
                             f"e.g. 'blocks.*.mlp.0'.")
        for path in paths:
            m = module.get_submodule(path)
            if not isinstance(given, str):
                from_torch.add(path)
            if path in styles and styles[path] != style:
                raise ValueError(f"shard(tensor_parallel=...): {path!r} is matched as {styles[path]!r} and as "
                                 f"{style!r}; give each module one style.")
            if style in SEQUENCE_STYLES:
                styles[path] = style
                continue
            attention = heads_of(module, path)
            if style == REPLICATED:
                styles[path], replicated[path] = style, attention
                continue
            if style == MOE:
                styles[path] = style
                continue
            if style in PARAM_STYLES and style.startswith("packed"):
                raise ValueError(f"shard(tensor_parallel=...): {path!r} (matched by {pattern!r}) is a module, styled "
                                 f"{style!r}; shardfn splits packed weights of an experts module's parameters only. "
                                 "Narrow the pattern to a parameter, or leave it out of the plan.")
            if attention is not None and style in WHOLE_HEADS:
                whole.setdefault(attention, path)
            elif attention is not None:
                attentions.add(attention)
            if style == "embedding_rowwise":
                _check_embedding(m, path, pattern)
            elif type(m) is not nn.Linear:
                raise ValueError(f"shard(tensor_parallel=...): {path!r} (matched by {pattern!r}) is a "
                                 f"{type(m).__name__}; only nn.Linear layers can be split {style}, and nn.Embedding "
                                 "layers 'embedding_rowwise'. Narrow the pattern.")
            styles[path] = style
    for attention, layer in sorted(whole.items()):
        if attention in attentions:
            raise ValueError(f"shard(tensor_parallel=...): {layer!r} is inside the attention module {attention!r} and "
                             f"styled {styles[layer]!r}, which leaves its heads whole, while other layers of it split "
                             "them. Give the attention's layers 'colwise' and 'rowwise' (heads split), or "
                             "'colwise_gather_output' and 'rowwise_split_input' (heads whole on every rank).")
    for path, attention in sorted(replicated.items()):
        if attention not in attentions or not any(True for _ in module.get_submodule(path).parameters(recurse=False)):
            raise ValueError(f"shard(tensor_parallel=...): {path!r} is styled {REPLICATED!r}, which sums its "
                             "parameters' gradients over the tensor ranks; that is exact only for a module with "
                             "parameters of its own that reads the split heads of an attention whose layers are split "
                             "(a per-head query or key norm), and "
                             + (f"{path!r} has none of its own." if attention in attentions else
                                f"{path!r} is not inside such an attention.")
                             + " Leave it out of the plan.")
    for attention in sorted(attentions):
        _check_attention(module, attention, styles, tensor)
    _check_sequence(styles, needs, from_torch)
    tied = _tied_groups(module)
    splits = experts_splits(module, state, styles, params, tensor, tied)
    for path, style in sorted(styles.items()):
        if style in SEQUENCE_STYLES or style in (REPLICATED, MOE):  # (whole on every rank; experts: their parameters)
            continue
        rows = not style.startswith("rowwise")  # colwise ones: output features; an embedding: its rows
        for name, dim in (("weight", 0 if rows else 1), ("bias", 0 if rows else None)):
            leaf = f"{path}.{name}"
            if dim is None or getattr(module.get_submodule(path), name, None) is None:
                continue
            if leaf in tied or leaf not in state:  # a tie's other names would read the piece as the whole
                others = [n for n in tied.get(leaf, ()) if n != leaf] or ["another parameter"]
                raise ValueError(f"shard(tensor_parallel=...): {leaf!r} is tied to {', '.join(map(repr, others))} "
                                 f"(one tensor under several names), and {path!r} splits it {style}: every other "
                                 "name would read this rank's piece as the whole tensor. A tied weight cannot be "
                                 f"split: untie it (e.g. tie_word_embeddings=False), or leave {path!r} out of the "
                                 "plan.")
            shape = tuple(state[leaf].shape)
            if shape[dim] % tensor:
                raise ValueError(f"shard(tensor_parallel=...): {leaf!r} of shape {list(shape)} is split {style} "
                                 f"on dim {dim} ({shape[dim]}), which the tensor axis's {tensor} ranks do not "
                                 f"divide ({shape[dim]} % {tensor} = {shape[dim] % tensor}). Choose a tensor size "
                                 "that divides it, or leave the layer out.")
            splits.append(Split(leaf, dim, shape))
    return tuple(sorted({**styles, **params}.items())), tuple(sorted(splits))


def _check_embedding(m: nn.Module, path: str, pattern: str) -> None:
    """An ``"embedding_rowwise"`` layer is a plain ``nn.Embedding``: what renormalises or
    rescales by whole rows (``max_norm``, ``scale_grad_by_freq``) or makes sparse
    gradients would see a rank's rows only."""
    if type(m) is not nn.Embedding:
        raise ValueError(f"shard(tensor_parallel=...): {path!r} (matched by {pattern!r}) is a {type(m).__name__}; "
                         "'embedding_rowwise' splits an nn.Embedding's rows. Narrow the pattern.")
    odd = [a for a in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(m, a)]
    if odd:
        raise ValueError(f"shard(tensor_parallel=...): the embedding {path!r} has {', '.join(odd)} set, which would "
                         "act on this rank's rows of the vocabulary only; leave it out of the plan.")


def _embedding(module: nn.Embedding, ids: torch.Tensor, rt: Any, path: str) -> torch.Tensor:
    """An ``"embedding_rowwise"`` lookup: each tensor rank holds a block of the vocabulary's
    rows, looks up the ids in it (zeros for the others), and the all-reduce sums the blocks'
    results: each id's row comes from the one rank that holds it."""
    n = module.weight.shape[0]
    start = rt.mesh.axis_rank("tensor") * n
    # in another rank's block; an id outside the vocabulary stays out of range on every rank,
    # so that the lookup raises there as the whole embedding's does (never a silent zero row)
    elsewhere = ((ids < start) | (ids >= start + n)) & (ids >= 0) & (ids < n * rt.mesh.axis_size("tensor"))
    pad = module.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + n else None
    y = F.embedding((ids - start).masked_fill(elsewhere, 0), module.weight, pad)
    return ReduceFromTensor.apply(y.masked_fill(elsewhere.unsqueeze(-1), 0), rt, path)


def _is_torch_style(style: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(style, ParallelStyle)


def _check_sequence(styles: dict[str, str], needs: Mapping[str, tuple[str, bool | None]],
                    from_torch: set[str]) -> None:
    """A plan's sequence styles agree with its layers': every colwise layer has an enclosing
    module to gather its input, and torch objects' layouts say what the plan says."""
    blocks = blocks_of(styles)
    for path in sorted(p for p, s in styles.items() if s == "sequence_end" and p in blocks):
        if path not in from_torch:
            raise ValueError(f"shard(tensor_parallel=...): {path!r} holds colwise layers and is styled 'sequence_end'; "
                             "in a plan with sequence parallelism such a module gathers its input for them by itself. "
                             "Style 'sequence_end' the module that reads the region's last activations (the head).")
        del styles[path]  # torchtitan's PrepareModuleInput on an attention or MLP: the block gathers anyway
    sequence = any(s in SEQUENCE_STYLES for s in styles.values())
    for pattern, (style, needed) in needs.items():
        if needed is not None and needed != sequence:
            raise ValueError(f"shard(tensor_parallel=...): the {style} style given for {pattern!r} has torch layouts "
                             f"that {'need' if needed else 'refuse'} sequence parallelism, and the plan "
                             f"{'has no' if needed else 'has'} sequence styles. With them, rowwise layers "
                             "reduce-scatter their output (RowwiseParallel(output_layouts=Shard(1))); without them, they "
                             "all-reduce it (RowwiseParallel()).")
    if sequence and "" in blocks:
        raise ValueError("shard(tensor_parallel=...): a colwise layer of the model's root module is in a plan with "
                         "sequence parallelism, where a colwise layer's enclosing module gathers its input, and the "
                         "root has none. Leave it out, or wrap it in a module of its own.")


# the styles of a transformers base_model_tp_plan that "auto" takes, with transformers' meaning
AUTO_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise", REPLICATED,
               MOE, "packed_colwise", "packed_rowwise")


def auto_plan(module: nn.Module) -> dict[str, str]:
    """``tensor_parallel="auto"``: the transformers model's ``config.base_model_tp_plan``,
    its patterns made paths of ``module`` (they are relative to the base model)."""
    plan = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"shard(tensor_parallel='auto'): {type(module).__name__} has no base_model_tp_plan (its "
                         "config's tensor-parallel plan, as a transformers model has); pass a mapping from module-path "
                         "patterns to 'colwise' or 'rowwise' instead, e.g. {'blocks.*.mlp.0': 'colwise', "
                         "'blocks.*.mlp.2': 'rowwise'}.")
    prefix = getattr(module, "base_model_prefix", "")
    base = prefix + "." if prefix and isinstance(getattr(module, prefix, None), nn.Module) else ""
    for pattern, style in plan.items():
        if style not in AUTO_STYLES:
            raise ValueError(f"shard(tensor_parallel='auto'): the model's base_model_tp_plan splits {pattern!r} as "
                             f"{style!r}, a transformers style shardfn does not have (it has "
                             f"{', '.join(map(repr, AUTO_STYLES))}). Pass a mapping instead: the plan with that layer "
                             "left out or given one of those styles.")
    # (a plan names the layers of every variant of the family: a mixture of experts' dense MLPs, where this
    # model may have none; a pattern that matches nothing in it is dropped, as transformers drops it)
    names = [n for n, _ in module.named_modules()] + [n for n, _ in module.named_parameters()]
    tied = _tied_parameters(module)
    # (an embedding tied to the head stays whole, as a tied head does: whole on every rank, exact)
    out = {base + p: style for p, style in plan.items() if any(fnmatch.fnmatchcase(n, base + p) for n in names)
           and not (style == "embedding_rowwise" and any(fnmatch.fnmatchcase(n, f"{base}{p}.weight") for n in tied))}
    # The model class's own plan (its head: {"lm_head": "colwise_gather_output"}), where shardfn
    # has the style and the head's weight is its own (a tied head stays whole, as it is exact).
    for path, style in (getattr(type(module), "_tp_plan", None) or {}).items():
        if (style == "colwise_gather_output" and isinstance(module.get_submodule(path), nn.Linear)
                and f"{path}.weight" not in tied and "*" not in path):
            out[path] = style
    return out


def _tied_parameters(module: nn.Module) -> set[str]:
    """The names of parameters that share their tensor with another name."""
    return set(_tied_groups(module))


def _tied_groups(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a parameter that shares its tensor with other names: all its names."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n: tuple(group) for group in names.values() if len(group) > 1 for n in group}


def heads_of(module: nn.Module, path: str) -> str | None:
    """The module that splits layer ``path``'s output by heads: its innermost parent with an
    integer ``head_dim`` (checked by :func:`_check_attention`), or None: then the output is
    split by features, and checked as it is used ([Note: a split layer's output]). A
    module's name says nothing ([Note: attention split by heads])."""
    parts = path.split(".")
    for i in range(len(parts) - 1, -1, -1):
        parent = ".".join(parts[:i])
        if isinstance(getattr(module.get_submodule(parent), "head_dim", None), int):
            return parent
    return None


def _check_attention(module: nn.Module, path: str, styles: Mapping[str, str], tensor: int) -> None:
    """Refuses the split of attention module ``path`` unless it is exact.

    [Note: attention split by heads]
    Splitting q/k/v colwise and o rowwise gives each tensor rank whole heads, and is exact
    only if the attention reads its head count from the tensors it gets. A transformers
    attention (Llama and its kind) reshapes with ``view(..., -1, head_dim)`` and pairs query
    heads with key/value heads by ``num_key_value_groups``, a ratio that splitting keeps;
    the test GPT's packed qkv is reshaped by its head count, and a rank's half would be
    read with the wrong head size, silently. So an attention module is split only if it is
    a transformers module with ``head_dim``, ``num_key_value_groups`` equal to the config's
    ``num_attention_heads // num_key_value_heads``, and no head count or width of its own
    (``num_heads``, ``hidden_size``, ...) that its forward could reshape by; every
    ``nn.Linear`` in it is split (a query split and a key left whole would be paired
    wrongly by grouped attention); and the tensor size divides both head counts.
    """
    att = module.get_submodule(path)
    cfg = getattr(att, "config", None)
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    own = [a for a in ("num_heads", "num_attention_heads", "num_key_value_heads", "hidden_size", "embed_dim")
           if hasattr(att, a)]
    if not (type(att).__module__.startswith("transformers.") and isinstance(getattr(att, "head_dim", None), int)
            and isinstance(heads, int) and isinstance(kv, int) and kv > 0 and not own
            and getattr(att, "num_key_value_groups", None) == heads // kv):
        layer = min(p for p in styles if p.startswith(path + ".") or not path)
        raise ValueError(_ATTENTION.format(path=layer, attention=path))
    linears = [f"{path}.{p}" for p, m in att.named_modules() if isinstance(m, nn.Linear)]
    left = [p for p in linears if p not in styles]
    if left:
        raise ValueError(f"shard(tensor_parallel=...): the attention module {path!r} has some of its layers split "
                         f"and not {', '.join(map(repr, left))}: its heads would be split in some projections and "
                         "not in others, and grouped attention would pair them wrongly without an error. Give "
                         "its layers styles so as to split all of them (query, key, value 'colwise', output "
                         "'rowwise'), or none.")
    # [Note: a module that reads split heads]
    # Inside an attention split by heads, every activation after q/k/v holds this rank's heads
    # only. A module with parameters there (Qwen3's and Gemma 3's per-head q_norm and k_norm)
    # runs exactly on them, but its parameters' gradients come from this rank's heads alone:
    # partial sums. Styled REPLICATED, it stays whole on every rank and its gradients are
    # summed over the tensor axis once a step (shardfn._parallel.sequence.sum_partial_grads);
    # left unstyled, training would be silently wrong, so it is refused here.
    held = {".".join(filter(None, (path, p))) for p, m in att.named_modules()
            if any(True for _ in m.parameters(recurse=False)) and not isinstance(m, nn.Linear)}
    unstyled = sorted(p for p in held if styles.get(p) != REPLICATED)
    if unstyled:
        one = len(unstyled) == 1
        raise ValueError(f"shard(tensor_parallel=...): the attention module {path!r} is split by heads, and "
                         f"{', '.join(map(repr, unstyled))} inside it {'has' if one else 'have'} parameters of "
                         f"{'its' if one else 'their'} own that read this rank's heads only: their gradients would be "
                         "this rank's part, and training silently wrong. A module that acts on each head alone (a "
                         f"per-head query or key norm) can be styled {REPLICATED!r}: whole on every rank, its "
                         "gradients summed over the tensor ranks. Otherwise leave the attention's layers out of the "
                         "plan.")
    drop = max(float(getattr(att, "attention_dropout", 0) or 0), float(getattr(cfg, "attention_dropout", 0) or 0))
    if drop > 0:  # [Note: randomness on the tensor axis]
        raise ValueError(f"shard(tensor_parallel=...): the attention module {path!r} drops attention weights "
                         f"(attention_dropout={drop}), and its heads are split over the mesh's 'tensor' axis: one "
                         "mask drawn for a rank's heads would be the same on every tensor rank, unlike one process's "
                         "mask for all the heads. Set the config's attention_dropout to 0.0, or leave the attention's "
                         "layers out of the plan.")
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n % tensor:
            raise ValueError(f"shard(tensor_parallel=...): the attention module {path!r} splits its heads over the "
                             f"mesh's 'tensor' axis's {tensor} ranks, which do not divide its config's "
                             f"{name}={n} (num_attention_heads={heads}, num_key_value_heads={kv}; {n} % {tensor} = "
                             f"{n % tensor}). Choose a tensor size that divides both head counts, or leave the "
                             "attention's layers out of the plan.")


def local_state(state: Mapping[str, torch.Tensor], splits: tuple[Split, ...], tensor: int,
                rank: int) -> dict[str, torch.Tensor]:
    """``state`` with each split leaf replaced by tensor rank ``rank``'s piece of it."""
    out = dict(state)
    for split in splits:
        if split.leaf in state:  # (a unit's values hold its own leaves only)
            out[split.leaf] = split.piece(state[split.leaf], tensor, rank)
    return out


def split_sum_of_squares(grads: Mapping[str, torch.Tensor], layout: Any, mesh: Any, sum_of_squares: Any) -> torch.Tensor:
    """This rank's share of the gradients' sum of squares when summed over the whole mesh:
    split leaves on every tensor rank (each holds its own piece), the others on tensor rank 0
    only (every tensor rank holds the same values)."""
    split = {s.leaf for s in layout.splits}
    mine = sum_of_squares({n: g for n, g in grads.items() if n in split})
    rest = sum_of_squares({n: g for n, g in grads.items() if n not in split})
    return mine + rest if mesh.axis_rank("tensor") == 0 else mine + 0 * rest


def tp_forward(active: Any, path: str, module: nn.Module, by_heads: bool) -> Any:
    """``module``'s forward, split as the active call's layout says (``active()``: its
    shardfn._parallel.call.TensorCall, or None outside a sharded call); the module's own
    otherwise. ``by_heads``: a colwise layer's output is read by a checked
    attention module (:func:`heads_of`), else it is checked as it is used."""
    inner = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        now = active()
        style = now.styles.get(path) if now is not None else None
        if style not in ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise"):
            return inner(x)  # (sequence styles: shardfn._parallel.sequence's; REPLICATED runs as it is)
        rt = now.rt
        sequence = now.sequence  # (a bound block runs the region whole)
        if style == "embedding_rowwise":
            if sequence:
                outside_region(now, path, style)
            return _embedding(module, x, rt, path)
        if style == "colwise_gather_output":  # a head: every rank gets the whole output
            if sequence:
                outside_region(now, path, style)
            y = F.linear(shared_copy(now.copies, x, rt, path), module.weight, module.bias)
            return GatherOutput.apply(y, rt, path)
        if style == "colwise":
            x = gathered_input(x, path, rt) if sequence else shared_copy(now.copies, x, rt, path)
            y = F.linear(x, module.weight, module.bias)
            if by_heads:
                return y
            program = "graph" if rt.ctx.recorded else "compile" if getattr(rt.options, "compile", None) else ""
            return per_feature(y, path, rt, program)
        if style == "rowwise_split_input":  # a whole input: this rank's features of it, the gradient gathered
            if sequence:
                outside_region(now, path, style)
            y = ReduceFromTensor.apply(F.linear(SplitInput.apply(x, rt, path), module.weight), rt, path)
            return y if module.bias is None else y + module.bias
        x = plain(x)
        if sequence:
            y = reduce_scatter_output(now, F.linear(x, module.weight), path)
            # (the bias's gradient, from the rank's tokens: summed once a step, _sequence.partial_leaves)
            return y if module.bias is None else y + module.bias
        y = ReduceFromTensor.apply(F.linear(x, module.weight), rt, path)
        return y if module.bias is None else y + module.bias

    return forward
