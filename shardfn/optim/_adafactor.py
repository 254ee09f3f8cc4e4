"""Adafactor, equal to ``torch.optim.Adafactor``, on any shards: its statistics summed with psum."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._psum import psum
from ._count import advance, incremented as _next, mirrored, new_count, remember
from ._checks import _count, _check_hyper, _check_learning_rate, _check_params, _check_state, _resolve_learning_rate, _trainable
from ._fused import zeros_like_views
from ._protocol import GradientTransformation, Params, ScalarOrSchedule, Updates
from ._whole import _piece_shape as _piece
from ._whole import full_shape, local_elements, split_of

__all__ = ["AdafactorState", "adafactor"]


def _done(count: torch.Tensor) -> int:
    """The updates done, as a number: Adafactor computes its step sizes on the host. While a
    graph step records, the mirror has forgotten the count, and the read here is refused
    ([Note: step counts])."""
    value = mirrored(count)
    if value is None:
        value = int(count)
        remember(count, value)
    return value


class AdafactorState(NamedTuple):
    """State of :func:`adafactor`. ``row_var`` / ``col_var``: for each parameter of two or
    more dimensions, in sorted name order, its factored second moment over the last two
    dimensions, ``[..., rows, 1]`` and ``[..., 1, cols]``, whole on every rank (small: the
    parameter is never gathered); ``variance``: name -> shard-shaped second moment of each
    1-D (or 0-d) parameter."""

    count: torch.Tensor
    row_var: tuple[torch.Tensor, ...]
    col_var: tuple[torch.Tensor, ...]
    variance: dict[str, torch.Tensor]


def _places(params: Params, name: str, first: int, count: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(batch, row, column)`` in the whole parameter ``name`` (its last two dims) of this
    rank's ``count`` elements from ``first`` in its piece's row-major order: a piece split over
    the tensor axis is moved by its tensor rank's offset along the split dim."""
    piece = _piece(params, name)
    rows, cols = piece[-2], piece[-1]
    at = torch.arange(first, first + count, device=device)
    b, r, c = at // (rows * cols), (at // cols) % rows, at % cols
    split = split_of(params, name)
    if split is not None:
        t = params.mesh.axis_rank("tensor")
        dim = split.dim % len(piece)
        if dim == len(piece) - 2:
            r = split.at(r, t, rows)
        elif dim == len(piece) - 1:
            c = split.at(c, t, cols)
        elif split.parts > 1:
            raise ValueError(f"adafactor: {name!r} is a packed weight split on a batch dim; give it another optimizer "
                             "(shardfn.optim.partition).")
        else:
            b = b + t * math.prod(piece[:-2])
    return b, r, c


def adafactor(
    learning_rate: ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    maximize: bool = False,
) -> GradientTransformation:
    """Adafactor, equal to ``torch.optim.Adafactor`` (its arguments and defaults), on any shards.

    Its update reads whole-parameter statistics: the mean of ``g**2`` over each row and each
    column (the factored second moment of a parameter of two or more dimensions, over its
    last two), the parameter's norm and the update's norm. On shards each rank sums its own
    elements' contributions and :func:`shardfn.optim.psum` adds them up over the ranks: two
    all-reduces per step in all (the row and column sums and the parameters' sums of
    squares of every parameter at once, then the updates' sums of squares), ``rows + cols + 1``
    floats per matrix and one per vector, and no parameter is ever gathered. Any placement
    works: flat pieces, row shards (their padding rows untouched) or whole parameters. A
    parameter split over the mesh's ``tensor`` axis adds its piece's sums at their places in
    the whole parameter, summed over the tensor axis too (``psum(split=True)``: two
    all-reduces more per step); the others are the same on every tensor rank and summed over
    the shard axis only.

    Example:
        >>> opt = adafactor(1e-2, weight_decay=0.01)
    """
    _check_learning_rate(learning_rate, "adafactor")
    _check_hyper("d", d, "adafactor", lo=0.0)
    _check_hyper("weight_decay", weight_decay, "adafactor", lo=0.0)
    if beta2_decay > 0:
        raise ValueError(f"adafactor: beta2_decay={beta2_decay!r}; it must be <= 0.")
    eps1, eps2 = eps
    if (eps1 is not None and eps1 < 0) or eps2 < 0:
        raise ValueError(f"adafactor: eps={eps!r}; (eps1 or None, eps2), both >= 0.")

    def split(params: Params, names) -> tuple[list[str], list[str]]:
        factored = sorted(n for n in names if len(full_shape(params, n)) >= 2)
        return factored, [n for n in names if n not in factored]

    def init(params: Params) -> AdafactorState:
        trainable = _trainable(params)
        factored, plain = split(params, trainable)
        rows = tuple(torch.zeros((*full_shape(params, n)[:-1], 1), dtype=trainable[n].dtype,
                                 device=trainable[n].device) for n in factored)
        cols = tuple(torch.zeros((*full_shape(params, n)[:-2], 1, full_shape(params, n)[-1]), dtype=trainable[n].dtype,
                                 device=trainable[n].device) for n in factored)
        return AdafactorState(new_count(params), rows, cols, zeros_like_views({n: trainable[n] for n in plain}))

    def compute(grads: Params, state: AdafactorState, params: Params, done: int) -> tuple[dict, float]:
        """Each parameter's (real elements, update, step size) for the update after ``done``
        ones, with the moments in ``state`` advanced in place; and the learning rate."""
        count = done + 1
        lr = _resolve_learning_rate(learning_rate, count - 1)
        one_minus_beta2 = count ** beta2_decay
        rho = min(lr, 1 / count ** 0.5)
        factored, plain = split(params, list(grads))
        names = factored + plain
        # where each factored parameter's moments are in the state: sorted, over every trainable one
        index = {n: i for i, n in enumerate(split(params, _trainable(params))[0]) if n in grads}
        # round 1: each factored parameter's row and column sums of g**2, and every parameter's
        # sum of squares; summed over the ranks where each parameter's other parts are (a
        # parameter split over the tensor axis: over it too, each rank's elements at their
        # places in the whole parameter)
        parts: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        local = {}
        for n in names:
            g = grads[n] if not maximize else -grads[n]
            g_elems, first = local_elements(g, params, n)
            p_elems, _ = local_elements(params[n], params, n)
            cut = split_of(params, n) is not None
            local[n] = (g_elems, p_elems, first, cut)
            shape = full_shape(params, n)
            if n in index:
                rows, cols = shape[-2], shape[-1]
                batch = math.prod(shape[:-2])
                b, r, c = _places(params, n, first, g_elems.numel(), g.device)
                sq = g_elems * g_elems
                parts[cut].append(torch.zeros(batch * rows, dtype=g.dtype, device=g.device).index_add_(0, b * rows + r, sq))
                parts[cut].append(torch.zeros(batch * cols, dtype=g.dtype, device=g.device).index_add_(0, b * cols + c, sq))
            parts[cut].append(p_elems.float().square().sum().reshape(1).to(g.dtype))
        summed = {cut: psum(torch.cat(ts), split=cut) for cut, ts in parts.items() if ts}
        out, at = {}, {True: 0, False: 0}
        for n in names:
            g_elems, p_elems, first, cut = local[n]
            shape = full_shape(params, n)
            e1 = eps1 if eps1 is not None else torch.finfo(params[n].dtype).eps
            if n in index:
                i = index[n]
                rows, cols = shape[-2], shape[-1]
                batch = math.prod(shape[:-2])
                row_sum = summed[cut][at[cut] : at[cut] + batch * rows]
                col_sum = summed[cut][at[cut] + batch * rows : at[cut] + batch * (rows + cols)]
                at[cut] += batch * (rows + cols)
                row_var, col_var = state.row_var[i], state.col_var[i]
                row_var.lerp_(row_sum.view(row_var.shape) / cols, one_minus_beta2)
                col_var.lerp_(col_sum.view(col_var.shape) / rows, one_minus_beta2)
                b, r, c = _places(params, n, first, g_elems.numel(), g_elems.device)
                scale = row_var.mean(dim=-2, keepdim=True).clamp(min=e1).reshape(-1)[b]
                estimate = row_var.reshape(-1)[b * rows + r] * col_var.reshape(-1)[b * cols + c] / scale
            else:
                variance, _ = local_elements(state.variance[n], params, n)
                variance.lerp_(g_elems * g_elems, one_minus_beta2)
                estimate = variance.clone()
            p_norm = float(summed[cut][at[cut]]) ** 0.5
            at[cut] += 1
            update = estimate.clamp_(min=e1 * e1).rsqrt_().mul_(g_elems)
            alpha = max(eps2, p_norm / math.prod(shape) ** 0.5) * rho
            out[n] = (p_elems, update, alpha, math.prod(shape), cut)
        # round 2: the updates' sums of squares
        norms = {}
        for cut in (True, False):
            mine = [n for n, v in out.items() if v[4] == cut]
            if mine:
                sums = psum(torch.stack([out[n][1].float().square().sum() for n in mine]), split=cut)
                norms.update(zip(mine, sums))
        for n, (p_elems, update, alpha, numel, _) in out.items():
            denom = max(1.0, float(norms[n]) ** 0.5 / (numel ** 0.5 * d))
            out[n] = (p_elems, update, -alpha / denom)
        return out, lr

    def update(grads: Params, state: AdafactorState, params: Params | None = None) -> tuple[Updates, AdafactorState]:
        _check_state(state, AdafactorState, "adafactor")
        params = _check_params(grads, params, "adafactor")
        done = _done(state.count)
        new = AdafactorState(_next(state.count, done), tuple(t.clone() for t in state.row_var),
                             tuple(t.clone() for t in state.col_var), {k: t.clone() for k, t in state.variance.items()})
        updates: Updates = {}
        with torch.no_grad():
            steps, lr = compute(grads, new, params, done)
            for n, (p_elems, update, step_size) in steps.items():
                u = torch.zeros_like(params[n])
                new_p = p_elems * (1 - lr * weight_decay) if weight_decay else p_elems.clone()
                new_p.add_(update, alpha=step_size)
                u.reshape(-1)[: p_elems.numel()] = new_p - p_elems
                updates[n] = u
        return updates, new

    def update_(grads: Params, state: AdafactorState, params: Params | None = None) -> AdafactorState:
        _check_state(state, AdafactorState, "adafactor")
        params = _check_params(grads, params, "adafactor")
        with torch.no_grad():
            done = _done(state.count)
            steps, lr = compute(grads, state, params, done)
            state.count.add_(1)
            advance(state.count, done)
            for n, (p_elems, update, step_size) in steps.items():  # torch's order: decay, then the step
                if weight_decay:
                    p_elems.mul_(1 - lr * weight_decay)
                p_elems.add_(update, alpha=step_size)
        return state

    def adafactor_hyperparams(state: AdafactorState) -> dict[str, float]:
        _check_state(state, AdafactorState, "adafactor")
        return {"learning_rate": _resolve_learning_rate(learning_rate, _count(state.count))}

    return GradientTransformation(init, update, adafactor_hyperparams, update_)
