"""What a step takes and what its ``loss_fn`` returns: micro-batches, ``Mean`` losses, aux.

[Note: token-weighted losses]
A language-model batch with padding (labels -100) has a different number of real tokens on
every rank and in every micro-batch, so the mean of per-rank (or per-micro-batch) means is
not the mean over the global batch. ``loss_fn`` may return :class:`Mean` ``(total, count)``:
the sum of per-element losses and their number. The step back-propagates each micro-batch's
``total`` times the same factor a plain loss gets, ``1 / (ranks x micro-batches)`` (one
factor for every rank, so gradient magnitudes stay those of a mean, which matters in fp16),
and reductions sum (see [Note: averaging gradients]). The global count ``C`` (all ranks,
all micro-batches) rides on the metrics all-reduce that follows the backward anyway, as one
more float: no extra collective. The step then multiplies the gradient shards by
``ranks x micro-batches / C`` — the gradient of ``sum(total) / C``, the single-device mean
over the global batch — and reports ``metrics["loss"] = sum(total) / C``; the gradient norm
is rescaled by the same factor. Counts travel in fp32: exact up to 2**24 elements per step.

[Note: micro-batches of any size]
``step(sharded, opt_state, MicroBatches([mb0, mb1, ...]))`` runs one forward and backward
per micro-batch and one update, whatever their sizes (variable-length packing). Every rank
must run the same number of them (each issues the same collectives per micro-batch), so
the step first gathers each rank's count and row sizes (one small all-gather per mesh axis,
the only collective this path adds) and raises the same error on every rank if the counts
differ; with a plain scalar loss and micro-batches of different sizes (on any rank) it
raises too, since each micro-batch would weigh the same whatever its size: return
:class:`Mean` to weigh every element alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from torch._subclasses.fake_tensor import is_fake

from . import _collectives as C
from ._events import Purpose

__all__ = ["Mean", "MicroBatches"]

_NOT_A_LOSS = (
    "loss_fn(apply, params, batch): must return a scalar tensor or shardfn.Mean(total, count){aux}, got {got}."
)
_DETACHED = (
    "loss_fn(apply, params, batch): returned a loss that does not depend on the parameters: call apply(params, ...) "
    "on the params "
    "loss_fn receives (the sharded tree), not on a captured copy."
)
_UNEVEN = (
    "step(..., MicroBatches(...)): micro-batches of different sizes ({sizes} rows, over all ranks: {per_rank}) "
    "with a plain scalar loss would each weigh the same, whatever their size. Return shardfn.Mean(total, count) "
    "from loss_fn "
    "(e.g. the sum of per-token losses and the number of tokens) to weigh every element alike, or give "
    "micro-batches of one size."
)
_COUNTS_DIFFER = (
    "[rank {rank}] step(..., MicroBatches(...)): ranks give different numbers of micro-batches ({counts} by "
    "rank); every rank must run the same number (each micro-batch's forward and backward are collectives). Pad "
    "with empty micro-batches (0 rows; a Mean loss of count 0 adds nothing) or split the data evenly."
)


class Mean(NamedTuple):
    """A loss given as a sum and a count (see [Note: token-weighted losses]).

    The step optimises ``sum(total) / sum(count)`` over every rank and micro-batch: the
    single-device mean over the global batch, however the elements are spread.

    Attributes:
        total: a scalar tensor, the sum of the per-element losses (it carries the gradient).
        count: the number of elements summed (an int or a scalar tensor).

    Example:
        >>> def loss_fn(apply, params, batch):
        ...     logits = apply(params, batch["input_ids"])
        ...     labels = batch["labels"]                    # -100 where padded
        ...     total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        ...     return shardfn.Mean(total, (labels != -100).sum())
    """

    total: torch.Tensor
    count: Any


class MicroBatches:
    """A step's batch as micro-batches of any sizes: one forward and backward each, one update.

    See [Note: micro-batches of any size]. With :class:`Mean` losses the step equals one
    step on their concatenation.

    Example:
        >>> sharded, opt_state, m = step(sharded, opt_state, shardfn.MicroBatches(batches))  # packed, any lengths
    """

    __slots__ = ("batches",)

    def __init__(self, batches: Iterable[Any]):
        self.batches = tuple(batches)
        if not self.batches:
            raise ValueError("MicroBatches(...): give at least one micro-batch.")

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __repr__(self) -> str:
        return f"MicroBatches({len(self)} micro-batches, rows {[rows(b) for b in self.batches]})"


def rows(batch: Any) -> int:
    """Dim 0 of the batch's first tensor (0 when it has none)."""
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    return leaves[0].shape[0] if leaves and leaves[0].dim() else 0


def split(batch: Any, micro_batches: int) -> list[Any]:
    """The micro-batches of a step's batch: a :class:`MicroBatches` as given, or ``micro_batches``
    equal parts of dim 0."""
    if isinstance(batch, MicroBatches):
        if micro_batches != 1:
            raise ValueError(
                f"jit_step(micro_batches={micro_batches}): splits each batch into equal parts; this batch is already "
                "given as MicroBatches. Use one or the other."
            )
        return list(batch)
    if micro_batches == 1:
        return [batch]

    def take(t: Any, i: int) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % micro_batches:
            raise ValueError(
                f"jit_step(micro_batches={micro_batches}): a local batch of {t.shape[0]} rows does not split into "
                f"{micro_batches} equal micro-batches; use a per-rank batch size divisible by {micro_batches}, or "
                "pass shardfn.MicroBatches([...]) of any sizes."
            )
        b = t.shape[0] // micro_batches
        return t[i * b : (i + 1) * b]

    return [pytree.tree_map(lambda t: take(t, i), batch) for i in range(micro_batches)]


def agree_on_micro_batches(batches: MicroBatches, mesh: Any) -> list[tuple[int, int]]:
    """Every rank's number and sizes of micro-batches; raises on every rank if the numbers
    differ. Returns each rank's smallest and largest micro-batch (rows)."""
    sizes = [rows(b) for b in batches]
    mine = torch.tensor([len(sizes), min(sizes), max(sizes)], dtype=torch.int64, device=mesh.device)
    everyone = C.all_gather_mesh(mine, mesh, Purpose.MICRO_BATCHES).view(-1, 3) if mesh.size > 1 else mine.view(1, 3)
    counts = everyone[:, 0].tolist()
    if len(set(counts)) > 1:
        raise ValueError(_COUNTS_DIFFER.format(rank=mesh.rank, counts=counts))
    return [(int(lo), int(hi)) for lo, hi in everyone[:, 1:].tolist()]


def objective(out: Any, has_aux: bool, needs_grad: bool,
              read: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """``loss_fn``'s result as ``(what to back-propagate, Mean's count (0-d fp32) or None, aux)``.
    ``read=False``: a negative count is not read on the host but becomes NaN, which makes the
    step's values non-finite (shardfn._step [Note: a step that does not wait])."""
    aux = None
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2) or isinstance(out, Mean):
            raise TypeError(_NOT_A_LOSS.format(aux=" with aux: (loss, aux) (jit_step(aux=...))",
                                               got=type(out).__name__))
        out, aux = out
    count = None
    if isinstance(out, Mean):
        out, count = out.total, out.count
        if isinstance(count, torch.Tensor) and count.numel() != 1:
            raise TypeError(f"shardfn.Mean(total, count): count must be a number, got a tensor of shape "
                            f"{tuple(count.shape)}.")
        if not isinstance(count, (int, float, torch.Tensor)) or isinstance(count, bool):
            raise TypeError(f"shardfn.Mean(total, count): count must be a number >= 0, got {count!r}.")
        count = torch.as_tensor(count).detach().reshape(()).to(torch.float32)
        if not read:
            count = torch.where(count >= 0, count, torch.nan)
        elif not is_fake(count) and not float(count) >= 0:  # a planning run (explain) has no values
            raise TypeError(f"shardfn.Mean(total, count): count must be a number >= 0, got {float(count)!r}.")
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise TypeError(_NOT_A_LOSS.format(aux=" (with aux=...: (loss, aux))" if has_aux else "",
                                           got=f"{type(out).__name__} {getattr(out, 'shape', '')}".strip()))
    if needs_grad and not out.requires_grad:
        raise ValueError(_DETACHED)
    return out.reshape(()), count, aux


def count_tokens(batch: Any) -> int:
    """Elements of the batch's first integer tensor (token ids), else its rows."""
    if isinstance(batch, MicroBatches):
        return sum(count_tokens(b) for b in batch)
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    for t in leaves:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return rows(batch)


def uneven_error(sizes: list[tuple[int, int]]) -> ValueError:
    """The error for micro-batches of different sizes; ``sizes``: each rank's (smallest, largest)."""
    lo, hi = min(s[0] for s in sizes), max(s[1] for s in sizes)
    per_rank = ", ".join(f"rank {r} {a}" + (f" to {b}" if b != a else "") for r, (a, b) in enumerate(sizes))
    return ValueError(_UNEVEN.format(sizes=f"{lo} to {hi}", per_rank=per_rank))
