"""Muon: momentum orthogonalised by Newton-Schulz, equal to ``torch.optim.Muon`` on whole matrices."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._count import advance, incremented as _next, new_count
from ._checks import _count, _check_grads, _check_hyper, _check_learning_rate, _check_params, _check_state, _resolve_learning_rate, _trainable
from ._fused import zeros_like_views
from ._protocol import GradientTransformation, Params, ScalarOrSchedule, Updates
from .._comm.events import Purpose
from .._comm.recording import Unrecordable
from .._comm.scope import here
from ._whole import full_shape, require_whole, split_of, whole_tensor

__all__ = ["MuonState", "muon"]

_NOT_MATRIX = (
    "muon: {n} parameter(s) are not matrices ({rows}). Muon orthogonalises 2-D parameters (3-D: a batch of matrices "
    "along dim 0, stacked experts); give the others (embeddings' biases, norms, ...) another optimizer: "
    "shardfn.optim.partition({{'muon': muon(...), 'adamw': adamw(...)}}, lambda name, shape: 'muon' if "
    "len(shape) >= 2 else 'adamw')."
)


class MuonState(NamedTuple):
    """State of :func:`muon`: ``count`` (0-d int64, updates done) and ``momentum_buffer``
    (name -> buffer shaped like the shard)."""

    count: torch.Tensor
    momentum_buffer: dict[str, torch.Tensor]


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """``torch.optim.Muon``'s Newton-Schulz orthogonalisation of a matrix, op for op, in
    ``dtype`` (torch computes in bfloat16); a 3-D tensor is a batch of matrices, each
    normalised and orthogonalised on its own."""
    a, b, c = coefficients
    x = g.to(dtype, copy=True)  # (torch's .bfloat16() does not copy a bf16 input, and then divides it in place)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, update, x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, update, x, beta=a)
    return x.mT if tall else x


def _adjusted(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for a matrix of ``shape`` (the last two dims)."""
    rows, cols = shape[-2:]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def muon(
    learning_rate: ScalarOrSchedule,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> GradientTransformation:
    """Muon, equal to ``torch.optim.Muon`` (its arguments and defaults) on whole matrices.

    Each step: ``buf = lerp(buf, g, 1 - momentum)``; the update ``lerp(g, buf, momentum)``
    (``buf`` without Nesterov), orthogonalised by ``ns_steps`` Newton-Schulz iterations in
    ``ns_dtype`` (torch's is bfloat16); ``p *= 1 - lr * weight_decay``; ``p -= lr' * update``
    with ``lr'`` adjusted to the matrix's shape by ``adjust_lr_fn`` (``None``/"original":
    ``sqrt(max(1, rows / cols))``; "match_rms_adamw": ``0.2 * sqrt(max(rows, cols))``).

    On shards, every parameter must be whole on the rank that holds it (see [Note:
    whole-parameter optimizers]): shard with ``placement=shardfn.whole(...)``, which puts
    each matrix whole on one rank and spreads them over the ranks, so each matrix's
    Newton-Schulz runs exactly once in the world, on its rank, with no communication.
    A matrix split over the mesh's ``tensor`` axis (``shard(tensor_parallel=...)``), whole on
    one shard rank as above, is orthogonalised whole: its tensor group all-gathers the
    update's pieces (one all-gather per matrix and step, counted under ``"tensor"``), each
    rank runs Newton-Schulz on the whole matrix and keeps its own piece (eager steps only:
    a ``graph=True`` step refuses it, the tensor groups' programs would differ).
    Cut parameters, and parameters that are not 2-D or 3-D (a batch of matrices along dim
    0), are an error at ``init`` naming them. Pair it with AdamW for the rest through
    :func:`shardfn.optim.partition`.

    Example:
        >>> is_matrix = lambda name, shape: len(shape) == 2 and name.startswith("blocks.")
        >>> sharded = shard(params, mesh, "FULL_SHARD", placement=shardfn.whole(is_matrix))
        >>> opt = partition({"muon": muon(0.02), "adamw": adamw(3e-4)},
        ...                 lambda name, shape: "muon" if is_matrix(name, shape) else "adamw")
    """
    _check_learning_rate(learning_rate, "muon")
    _check_hyper("weight_decay", weight_decay, "muon", lo=0.0)
    _check_hyper("momentum", momentum, "muon", lo=0.0)
    _check_hyper("eps", eps, "muon", lo=0.0)
    if not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"muon: ns_steps={ns_steps!r}; an int in [0, 100).")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"muon: ns_coefficients={ns_coefficients!r}; three floats (a, b, c).")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"muon: adjust_lr_fn={adjust_lr_fn!r}; None, 'original' or 'match_rms_adamw'.")
    if not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
        raise TypeError(f"muon: ns_dtype={ns_dtype!r}; a floating-point torch.dtype (torch.bfloat16, torch.float32).")
    coefficients = tuple(float(x) for x in ns_coefficients)

    def init(params: Params) -> MuonState:
        trainable = _trainable(params)
        bad = [n for n in trainable if len(full_shape(params, n)) not in (2, 3)]
        if bad:
            rows = ", ".join(f"{n} {list(full_shape(params, n))}" for n in bad[:8]) + (" ..." if len(bad) > 8 else "")
            raise ValueError(_NOT_MATRIX.format(n=len(bad), rows=rows))
        require_whole(params, trainable, "muon", "Newton-Schulz orthogonalises the whole matrix", tensor_ok=True)
        return MuonState(new_count(params), zeros_like_views(trainable))

    def step(grads: Params, state: MuonState, params: Params, lr: float) -> dict[str, torch.Tensor]:
        """The new momentum in place, and each whole matrix's orthogonalised update (not yet scaled)."""
        split = [k for k in grads if split_of(params, k) is not None]
        if split and here().comm.recorded:  # every rank: the layout is the same on all of them
            raise Unrecordable(f"muon gathers the pieces of a matrix split over the 'tensor' axis ({split[0]}) on "
                               "the tensor group that holds it, and not on the others, so the ranks' programs would "
                               "differ", "give the split matrices an elementwise optimizer (sf.optim.partition)",
                               frozen=False)
        out = {}
        for k, g in grads.items():
            buf = state.momentum_buffer[k]
            buf.lerp_(g.to(buf.dtype), 1 - momentum)
            whole = whole_tensor(g, params, k)
            if whole is None:  # the matrix lives on another rank
                continue
            update = whole.lerp(buf.view(whole.shape), momentum) if nesterov else buf.view(whole.shape)
            split = split_of(params, k)
            if split is None:
                out[k] = newton_schulz(update, coefficients, ns_steps, eps, ns_dtype)
                continue
            mesh = params.mesh  # the tensor group's pieces, orthogonalised whole; this rank's piece
            o = newton_schulz(split.whole(update, mesh, Purpose.TENSOR, k), coefficients, ns_steps, eps, ns_dtype)
            out[k] = split.piece(o, mesh.axis_size("tensor"), mesh.axis_rank("tensor"))
        return out

    def update(grads: Params, state: MuonState, params: Params | None = None) -> tuple[Updates, MuonState]:
        _check_state(state, MuonState, "muon")
        _check_grads(grads, state.momentum_buffer, "muon")
        params = _check_params(grads, params, "muon")
        done = _count(state.count)
        lr = _resolve_learning_rate(learning_rate, done, tensor_ok=False)
        new = MuonState(_next(state.count, done), {k: b.clone() for k, b in state.momentum_buffer.items()})
        updates: Updates = {}
        with torch.no_grad():
            orthogonal = step(grads, new, params, lr)
            for k in grads:
                p = params[k]
                if k not in orthogonal:
                    updates[k] = torch.zeros_like(p)
                    continue
                adjusted = _adjusted(lr, adjust_lr_fn, full_shape(params, k))
                decayed = p * (1 - lr * weight_decay)
                updates[k] = (decayed.add(orthogonal[k].reshape(p.shape), alpha=-adjusted) - p).to(p.dtype)
        return updates, new

    def update_(grads: Params, state: MuonState, params: Params | None = None) -> MuonState:
        _check_state(state, MuonState, "muon")
        _check_grads(grads, state.momentum_buffer, "muon")
        params = _check_params(grads, params, "muon")
        done = _count(state.count)
        lr = _resolve_learning_rate(learning_rate, done, tensor_ok=False)
        with torch.no_grad():
            orthogonal = step(grads, state, params, lr)
            for k, o in orthogonal.items():  # torch's order: decay, then the scaled update
                p = params[k]
                p.mul_(1 - lr * weight_decay)
                p.add_(o.reshape(p.shape), alpha=-_adjusted(lr, adjust_lr_fn, full_shape(params, k)))
            state.count.add_(1)  # last: an update that raised leaves the count as it was
            advance(state.count, done)
        return state

    def muon_hyperparams(state: MuonState) -> dict[str, float]:
        _check_state(state, MuonState, "muon")
        return {"learning_rate": _resolve_learning_rate(learning_rate, _count(state.count))}

    return GradientTransformation(init, update, muon_hyperparams, update_)
