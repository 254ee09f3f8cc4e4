"""Cross-entropy over a head split by vocabulary: no rank holds the whole logits.

[Note: the vocabulary-parallel loss]
A head styled ``"colwise"`` gives each tensor rank a block of the vocabulary's logits, in
rank order. The loss needs three things across the blocks, for each token: the largest
logit (for a stable exponent), the sum of the exponentials, and the target's logit, which
one rank holds. So the forward makes one all-reduce of the maxima (MAX) and one of the sums
and the picked logits together (SUM), of a few numbers per token each, instead of the
``[rows, seq, vocab]`` all-gather of ``"colwise_gather_output"``. The backward needs no
collective: a rank's gradient of its logits is its block of ``softmax - one_hot``, scaled as
the mean over the tokens; the head's own backward all-reduces its input's gradient, as
every colwise layer's does. A target outside the vocabulary gives a NaN loss on every rank,
which the step reports as it reports any non-finite loss (no rank can tell the others
otherwise without a host read).
"""

from __future__ import annotations

from typing import Any

import torch

from .._comm import collectives as C
from .._comm.events import Purpose
from .features import plain

__all__ = ["vocab_parallel_cross_entropy"]

_UNIT = "vocab_parallel_cross_entropy"


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, mesh: Any,
                ignore_index: int) -> torch.Tensor:  # type: ignore[override]
        ch, n = mesh.channel("tensor"), logits.shape[-1]
        start = mesh.axis_rank("tensor") * n
        z = logits.float()
        top = z.max(-1).values
        C.all_reduce(top, ch, Purpose.TENSOR, _UNIT, op=C.MAX)
        z = z - top.unsqueeze(-1)
        e = z.exp()
        local = targets - start
        own = (local >= 0) & (local < n)
        both = torch.stack([e.sum(-1), z.gather(-1, local.clamp(0, n - 1).unsqueeze(-1)).squeeze(-1) * own])
        C.all_reduce(both, ch, Purpose.TENSOR, _UNIT, op=C.SUM)
        total, picked = both[0], both[1]
        counted = targets != ignore_index
        vocab = n * mesh.axis_size("tensor")
        inside = (targets >= 0) & (targets < vocab)
        per_token = torch.where(counted & ~inside, torch.nan, total.log() - picked)  # (a target outside: NaN)
        count = counted.sum()
        ctx.save_for_backward(e, total, local, own & counted, counted, count)
        ctx.dtype = logits.dtype
        return ((per_token * counted).sum() / count).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        e, total, local, picked, counted, count = ctx.saved_tensors
        g = e / total.unsqueeze(-1)  # this rank's block of the softmax, less the one-hot of the targets it holds
        g.scatter_add_(-1, local.clamp(0, g.shape[-1] - 1).unsqueeze(-1), -picked.to(g.dtype).unsqueeze(-1))
        g *= (counted.to(g.dtype) * (grad.float() / count)).unsqueeze(-1)
        return g.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, mesh: Any, *,
                                 ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(whole_logits.flatten(0, -2), targets.flatten(), ignore_index=...)``
    (the mean over the targets not ignored) from this tensor rank's block of the logits, of
    a head styled ``"colwise"``: see [Note: the vocabulary-parallel loss]. ``logits``:
    ``[..., vocab / T]``, tensor rank ``r``'s columns ``r * vocab / T`` on; ``targets``:
    ``[...]``, ids in the whole vocabulary; ``mesh``: the step's. Call it in ``loss_fn``, the
    same on every rank of a tensor group. With ``tensor_parallel="auto"``, which gathers a
    transformers head's logits (``"colwise_gather_output"``), pass the plan as a mapping with
    the head ``"colwise"`` instead (docs/tensor-parallel.md).

    Example:
        >>> def loss_fn(apply, params, batch):  # the head styled "colwise": its logits stay split
        ...     logits = apply(params, batch["x"]).logits
        ...     return shardfn.vocab_parallel_cross_entropy(logits, batch["y"], mesh)
    """
    if mesh.axis_size("tensor") == 1:
        raise ValueError("vocab_parallel_cross_entropy(logits, targets, mesh): the mesh has no 'tensor' axis (or it "
                         "has one rank), so the logits are whole: use torch.nn.functional.cross_entropy.")
    local = plain(logits)
    if local.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy(logits, targets, mesh): logits of shape {list(local.shape)} "
                         f"(this rank's block of the vocabulary last) need targets of shape {list(local.shape[:-1])}, "
                         f"got {list(targets.shape)}.")
    return _VocabParallelCE.apply(local.reshape(-1, local.shape[-1]), targets.reshape(-1), mesh, ignore_index)
