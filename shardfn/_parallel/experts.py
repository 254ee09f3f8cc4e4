"""A mixture of experts split over the tensor axis: transformers' ``moe_tp_experts``.

[Note: experts split by features]
An experts module holds every expert's weights as 3-D parameters (``gate_up_proj``
``[experts, 2 * intermediate, hidden]``, ``down_proj`` ``[experts, hidden, intermediate]``).
Split as transformers' plans say (``gate_up_proj`` ``packed_colwise``: each rank's rows of
the gate and of the up projection, [Note: packed splits]; ``down_proj`` ``rowwise``: the
matching columns), each tensor rank runs every expert on its block of the intermediate
features, for every token. Its inputs (the tokens and the routing weights) are the same on
every rank; its output is a partial sum, all-reduced in forward; the inputs' gradients are
partial sums, all-reduced in backward (the tokens' shared with other colwise layers that
read them, [Note: one all-reduce per shared input]). The router stays whole, and with the
routing weights' gradient summed its gradient is whole on every rank.

[Note: experts proven by a probe]
Whether that is exact depends on the experts' forward, which differs by family and by
``config._experts_implementation`` (gate and up concatenated or interleaved, transposed
weights, biases, a clamp). So the plan's style names are not trusted: when a plan splits an
experts module, its forward runs once on the CPU with random float32 weights of its shapes
(one expert's values repeated over all of them, so the probe costs one expert's memory),
whole and as each tensor rank runs it, and the output and the gradients of the tokens, the
routing weights and every split weight are compared. Beyond float32's rounding (1e-4 of the
largest value; a wrong split differs by the values themselves), or on an error, the plan is
refused, naming the module. Once per experts class, implementation and shapes in a process;
every rank runs the same probe, on the same generated values, so all decide alike.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from .ops import ReduceFromTensor, Split, shared_copy

__all__ = ["MOE", "PARAM_STYLES", "experts_forward", "experts_splits", "parameter_paths"]

MOE = "moe_tp_experts"
# a style that names a parameter of an experts module: (the dim it splits, counted from the last, for a
# parameter of two dims or more; how many packed parts the dim holds)
PARAM_STYLES = {"colwise": (-2, 1), "rowwise": (-1, 1), "packed_colwise": (-2, 2), "packed_rowwise": (-1, 2)}
_TOLERANCE = 1e-4
_proven: dict[tuple, str | None] = {}  # (class, implementation, shapes, splits, tensor) -> why refused, or None


def parameter_paths(module: nn.Module, pattern: str) -> list[str]:
    """The names of ``module``'s parameters that ``pattern`` matches (fnmatch)."""
    return [n for n, _ in module.named_parameters() if fnmatch.fnmatchcase(n, pattern)]


def _split_of(name: str, style: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(dim, parts)`` a parameter style splits ``shape`` on, or None: whole on every rank
    (transformers keeps a rowwise bias whole)."""
    back, parts = PARAM_STYLES[style]
    if len(shape) >= 2:
        return len(shape) + back, parts
    return (0, parts) if back == -2 else None


def experts_splits(module: nn.Module, state: Mapping[str, torch.Tensor], styles: Mapping[str, str],
                   params: Mapping[str, str], tensor: int, tied: Mapping[str, tuple[str, ...]]) -> list[Split]:
    """The splits of the parameters ``params`` names (name -> style), each inside a module
    ``styles`` gives :data:`MOE`; every experts module checked and proven by the probe."""
    experts = sorted(p for p, s in styles.items() if s == MOE)
    for name in sorted(params):
        if not any(name.startswith(e + ".") or not e for e in experts):
            raise ValueError(f"shard(tensor_parallel=...): {name!r} is a parameter, styled {params[name]!r}; a style "
                             f"that names a parameter is taken inside a module styled {MOE!r} only (an experts "
                             "module's 3-D weights). Style the module that holds it, or name an nn.Linear layer.")
    if experts and any(s in ("sequence", "sequence_start", "sequence_end") for s in styles.values()):
        raise ValueError(f"shard(tensor_parallel=...): {experts[0]!r} is styled {MOE!r} in a plan with sequence "
                         "parallelism, which shardfn does not split experts under. Drop the sequence styles, or "
                         "leave the experts out of the plan.")
    splits = []
    for path in experts:
        m = module.get_submodule(path)
        own = {f"{path}.{n}" if path else n: p for n, p in m.named_parameters()}
        unstyled = sorted(n for n in own if n not in params)
        if not own or unstyled:
            raise ValueError(f"shard(tensor_parallel=...): {path!r} is styled {MOE!r}, which runs each expert on "
                             "this rank's block of its features; " + (
                                 "it has no parameters." if not own else
                                 f"its parameters {', '.join(map(repr, unstyled))} have no style, and would be whole "
                                 "on every rank inside the split experts. Give each a style ('packed_colwise', "
                                 "'rowwise', ...), as transformers' plans do.") + " Or leave it out of the plan.")
        mine = {}
        for name in sorted(own):
            shape = tuple(state[name].shape) if name in state else tuple(own[name].shape)
            cut = _split_of(name, params[name], shape)
            if cut is None:
                continue
            dim, parts = cut
            if name in tied:
                raise ValueError(f"shard(tensor_parallel=...): {name!r} is tied to another parameter; a tied weight "
                                 f"cannot be split. Leave {path!r} out of the plan.")
            if shape[dim] % (parts * tensor):
                raise ValueError(f"shard(tensor_parallel=...): {name!r} of shape {list(shape)} is split "
                                 f"{params[name]} on dim {dim} ({shape[dim]}" + (f", {parts} packed parts" if parts > 1
                                                                                 else "")
                                 + f"), which the tensor axis's {tensor} ranks do not divide"
                                 + (" in each part" if parts > 1 else "") + ". Choose a tensor size that divides it, "
                                 "or leave the experts out of the plan.")
            mine[name[len(path) + 1 if path else 0:]] = Split(name, dim, shape, parts)
        _prove(m, path, mine, tensor)
        splits += mine.values()
    return splits


def _prove(m: nn.Module, path: str, splits: Mapping[str, Split], tensor: int) -> None:
    """Refuses experts module ``m`` unless the probe finds its split exact ([Note: experts proven by a probe])."""
    shapes = tuple((n, tuple(p.shape)) for n, p in m.named_parameters())
    implementation = getattr(getattr(m, "config", None), "_experts_implementation", None)  # (which forward runs)
    key = (type(m), implementation, shapes, tuple((n, s.dim, s.parts) for n, s in sorted(splits.items())), tensor)
    if key not in _proven:
        try:  # (real values even where the caller plans on fake ones: explain, autoplan, a recorded step)
            with _disable_current_modes(), torch.device("cpu"):
                _proven[key] = _probe(m, dict(shapes), splits, tensor)
        except Exception as e:  # the forward cannot run split (or at all on the CPU): refused, never guessed
            _proven[key] = f"its forward raised {type(e).__name__}: {e}"
    why = _proven[key]
    if why is not None:
        raise ValueError(f"shard(tensor_parallel=...): {path!r} ({type(m).__name__}) is styled {MOE!r}, and its "
                         f"forward is not exact when split so: {why}. shardfn runs it once on the CPU, whole and "
                         "split, before it trusts a plan ([Note: experts proven by a probe]); its experts "
                         "implementation (config._experts_implementation) or its parameters' styles do not split "
                         "this way. Leave the experts out of the plan (their parameters whole on every rank).")


def _probe(m: nn.Module, shapes: Mapping[str, tuple[int, ...]], splits: Mapping[str, Split],
           tensor: int) -> str | None:
    """Why experts module ``m`` is not exact split as ``splits`` say, or None."""
    hidden, experts = getattr(getattr(m, "config", None), "hidden_size", None), getattr(m, "num_experts", None)
    if not all(isinstance(v, int) and v > 0 for v in (hidden, experts)):
        return ("it has no num_experts, or its config no hidden_size, which the probe needs to call it as a "
                "transformers experts module")
    k = min(2, experts)  # (experts a token is routed to: any number exercises the same split)
    g = torch.Generator().manual_seed(0)
    # one expert's values repeated over the experts dim (a parameter's first dim if it has one per expert)
    base = {n: torch.randn((1, *s[1:]) if s and s[0] == experts else s, generator=g) for n, s in shapes.items()}

    def full(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: v.expand(shapes[n][:1] + v.shape[1:]) if shapes[n] and shapes[n][0] == experts else v
                for n, v in values.items()}

    n = 3
    x = torch.randn(n, hidden, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(n)])
    weights = torch.rand(n, k, generator=g)
    r = None

    def run(values: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        nonlocal r
        leaves = [x.clone().requires_grad_(), weights.clone().requires_grad_(),
                  *(v.clone().requires_grad_() for v in values.values())]
        with torch.enable_grad():
            y = torch.func.functional_call(m, full(dict(zip(values, leaves[2:]))), (leaves[0], index, leaves[1]))
            if r is None:
                r = torch.randn(y.shape, generator=g)
            return (y.detach(), *torch.autograd.grad((y * r).sum(), leaves, allow_unused=True))

    if any(s.dim == 0 and shapes[nm][:1] == (experts,) for nm, s in splits.items()):
        return "a style splits the experts dim itself"
    whole = run(base)
    ranks = [run({nm: (splits[nm].piece(v, tensor, t) if nm in splits else v) for nm, v in base.items()})
             for t in range(tensor)]
    checks = [("the output", whole[0], sum(o[0] for o in ranks)), ("the tokens' gradient", whole[1],
              sum(o[1] for o in ranks)), ("the routing weights' gradient", whole[2], sum(o[2] for o in ranks))]
    for i, nm in enumerate(base):
        got = [o[3 + i] for o in ranks]
        if nm in splits:
            s = splits[nm]
            want = [s.piece(whole[3 + i], tensor, t) if whole[3 + i] is not None else None for t in range(tensor)]
        else:
            want, got = [whole[3 + i]], [None if any(v is None for v in got) else sum(got)]
        checks += [(f"{nm!r}'s gradient", w, gt) for w, gt in zip(want, got)]
    for what, want, got in checks:
        if (want is None) != (got is None):
            return f"{what} is {'missing' if got is None else 'extra'} when split"
        if want is None:
            continue
        scale = float(want.abs().max()) or 1.0
        err = float((want - got).abs().max()) / scale
        if err > _TOLERANCE:
            return f"{what} differs from the whole module's by {err:.2g} of its largest value"
    return None


def experts_forward(active: Any, path: str, module: nn.Module) -> Any:
    """An experts module's forward, split as [Note: experts split by features] says when the
    active call's layout styles it :data:`MOE`; its own otherwise."""
    inner = module.forward

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> Any:
        now = active()
        if now is None or now.styles.get(path) != MOE:
            return inner(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        rt = now.rt
        y = inner(shared_copy(now.copies, hidden_states, rt, path), top_k_index,
                  shared_copy(now.copies, top_k_weights, rt, path), *args, **kwargs)
        return ReduceFromTensor.apply(y, rt, path)

    return forward
