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

[Note: batch leaves]
One rule says which tensors of a batch ``micro_batches=k`` cuts, and it never guesses from a
size. A leaf wrapped in :class:`Whole` is a per-step value (an ``[S, S]`` mask, a position
table) and reaches every micro-batch whole; every other tensor leaf is a batch leaf, cut on
dim 0. The batch's rows are dim 0 of its first batch leaf, one marked :class:`Batched` before
unmarked ones (:func:`rows`; :func:`count_tokens` reads the same leaves in that order). A
batch leaf whose dim 0 is not the rows, or a 0-d one, is refused, and so is an unmarked one
with more than one dim equal to the rows (an ``[S, S]`` mask at ``S`` rows per rank, or the
rows' own leaf at that size): a size that equals the rows is no evidence that a leaf holds
rows, and a wrong cut is silent (a loss that reads ``mask.sum(0)`` gets as many weights
either way). ``Batched`` says that a leaf holds rows. The refusal lists every such leaf at
once with both fixes. It reads this rank's shapes only, before the micro-batches' first
collective: ranks with the same shapes all raise it, a rank alone tells the others (they
raise PeerError, shardfn._comm.guard), and nothing has changed. Without micro-batches nothing is
cut and nothing is checked, and ``loss_fn`` always gets the plain tensors. Both markers are
pytree nodes whose child is their tensor, so a recorded step (shardfn._program.graph) takes it as an
input of its program, and the program's key holds the markers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree


from .._comm import collectives as C
from .._comm.events import Purpose

__all__ = ["Batched", "Mean", "MicroBatches", "Whole"]

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
_CANNOT_CUT = (
    "{call}(micro_batches={k}): cuts each batch leaf on dim 0 into {k} micro-batches, and the batch's rows are {rows} "
    "(dim 0 of {first}); {count} cannot be cut as given:\n{lines}\n"
    "Say what each one is: wrap a per-step value (an [S, S] attention mask, a position table, a constant) in "
    "shardfn.Whole(...), and every micro-batch gets it whole; mark a leaf that holds one row per example (token "
    "ids, labels, also the rows' own leaf) with shardfn.Batched(...), and it is cut on dim 0, which must be the "
    "rows. E.g. batch = {{\"x\": shardfn.Batched(x), \"y\": shardfn.Batched(y), \"mask\": shardfn.Whole(mask)}}. "
    "Nothing is cut because a size happens to equal the rows (docs/training.md, \"Gradient accumulation\")."
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


class _Marker:
    """What :class:`Whole` and :class:`Batched` share: a tensor, said to be one thing or the other."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"shardfn.{type(self).__name__}(tensor): expected a tensor, got {type(tensor).__name__}.")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tensor of shape {tuple(self.tensor.shape)}, {self.tensor.dtype})"


class Whole(_Marker):
    """A batch leaf that every micro-batch gets whole: a per-step value, not one per row.

    ``jit_step(micro_batches=k)`` cuts the batch leaves on dim 0 (see [Note: batch leaves]);
    a tensor wrapped in ``Whole`` (an ``[S, S]`` attention mask, a position table) is not
    cut, counts neither as the batch's rows nor as its tokens, and reaches ``loss_fn`` as
    the plain tensor, in every micro-batch (also in :class:`MicroBatches`, and without
    micro-batches). With micro-batches, a per-step leaf must be wrapped when its dim 0 is
    not the batch's rows, or when more than one of its dims is (an ``[S, S]`` mask at ``S``
    rows); its counterpart :class:`Batched` marks a leaf that holds rows.

    Args:
        tensor: the tensor.

    Example:
        >>> mask = shardfn.Whole(torch.ones(4, 4).tril())   # one [seq, seq] mask for every row
        >>> def weighted_loss(apply, params, batch):
        ...     weights = batch["mask"].sum(0)              # the plain [4, 4] tensor, in every micro-batch
        ...     return lm_loss(apply(params, batch["input_ids"]), batch["labels"]) * weights.mean()
        >>> step = shardfn.jit_step(weighted_loss, mesh, optimizer=opt, micro_batches=2)
        >>> sharded, opt_state, metrics = step(sharded, opt_state, {**batch, "mask": mask})
    """

    __slots__ = ()


class Batched(_Marker):
    """A batch leaf that holds one row per example: cut on dim 0 into micro-batches.

    ``jit_step(micro_batches=k)`` cuts a leaf only when it is sure the leaf holds rows (see
    [Note: batch leaves]): one with more than one dim equal to the batch's rows (token ids
    ``[S, S]`` at ``S`` rows per rank, a square feature map) could as well be a per-step
    value, and the step refuses it until it is marked: ``Batched`` when it holds rows,
    :class:`Whole` when it is one value for the step. A ``Batched`` leaf is cut on dim 0,
    which must be the batch's rows; its dim 0 defines the rows (a marked leaf comes before
    unmarked ones, for the tokens too), and ``loss_fn`` gets the plain tensor (also in
    :class:`MicroBatches` and without micro-batches).

    Args:
        tensor: the tensor, with at least one dim (its rows).

    Example:
        >>> ids = torch.randint(0, 17, (4, 4))             # 4 rows of 4 tokens: dims 0 and 1 are both 4
        >>> square = {"input_ids": shardfn.Batched(ids), "labels": shardfn.Batched(ids.roll(-1, 1)),
        ...           "mask": shardfn.Whole(torch.ones(4, 4).tril())}
        >>> step = shardfn.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=2)
        >>> sharded, opt_state, metrics = step(sharded, opt_state, square)  # 2 rows each, the whole mask
        >>> shardfn.Batched(ids)
        Batched(tensor of shape (4, 4), torch.int64)
    """

    __slots__ = ()

    def __init__(self, tensor: torch.Tensor):
        super().__init__(tensor)
        if not tensor.dim():
            raise ValueError("shardfn.Batched(tensor): a 0-d tensor has no rows; wrap a per-step value in "
                             "shardfn.Whole(...) instead.")


for _cls in (Whole, Batched):
    pytree.register_pytree_node(
        _cls, lambda m: ([m.tensor], None), lambda children, _, cls=_cls: cls(children[0]),
        serialized_type_name=f"shardfn.{_cls.__name__}",
        flatten_with_keys_fn=lambda m: ([(pytree.GetAttrKey("tensor"), m.tensor)], None))


def _is_marker(x: Any) -> bool:
    return isinstance(x, _Marker)


class _Leaf(NamedTuple):
    path: str  # as keystr writes it: "['mask']"
    tensor: torch.Tensor
    marked: bool  # wrapped in Batched


def _batch_leaves(batch: Any) -> list[_Leaf]:
    """The batch leaves (see [Note: batch leaves]) in the batch's order: ``Whole`` leaves left out."""
    leaves, _ = pytree.tree_flatten_with_path(batch, is_leaf=_is_marker)
    return [_Leaf(pytree.keystr(path), x.tensor if isinstance(x, Batched) else x, isinstance(x, Batched))
            for path, x in leaves if isinstance(x, (torch.Tensor, Batched))]


def _marked_first(leaves: list[_Leaf]) -> list[_Leaf]:
    """The order in which leaves define the rows and hold the tokens: a marked one first."""
    return sorted(leaves, key=lambda leaf: not leaf.marked)


def unwrap(batch: Any) -> Any:
    """The batch as ``loss_fn`` gets it: each :class:`Whole` and :class:`Batched` replaced by its tensor."""
    return pytree.tree_map(lambda x: x.tensor if isinstance(x, _Marker) else x, batch, is_leaf=_is_marker)


def rows(batch: Any) -> int:
    """Dim 0 of the batch's first batch leaf, a :class:`Batched` one first (0 when it has none)."""
    leaves = _marked_first(_batch_leaves(batch))
    return leaves[0].tensor.shape[0] if leaves and leaves[0].tensor.dim() else 0


def _cannot_cut(leaf: _Leaf, n: int) -> str | None:
    """Why ``leaf`` cannot be cut into micro-batches of a batch of ``n`` rows, or None."""
    shape = tuple(leaf.tensor.shape)
    what = f"  batch{leaf.path}" + (" (shardfn.Batched)" if leaf.marked else "")
    if not shape:
        return f"{what}: a 0-d tensor, which has no rows"
    if shape[0] != n:
        return f"{what} of shape {shape}: dim 0 is {shape[0]}, not the {n} rows"
    dims = [str(d) for d, size in enumerate(shape) if size == n]
    if len(dims) > 1 and not leaf.marked:
        return (f"{what} of shape {shape}: ambiguous, dims {', '.join(dims[:-1])} and {dims[-1]} "
                f"{'both' if len(dims) == 2 else 'all'} equal the {n} rows")
    return None


def split(batch: Any, micro_batches: int, call: str = "jit_step") -> list[Any]:
    """The micro-batches of a step's batch, as ``loss_fn`` gets them: a :class:`MicroBatches`
    as given, or ``micro_batches`` equal parts of the batch leaves' dim 0 (see [Note: batch
    leaves]); markers unwrapped in each. ``call`` names the entry point in errors."""
    if isinstance(batch, MicroBatches):
        if micro_batches != 1:
            raise ValueError(
                f"{call}(micro_batches={micro_batches}): splits each batch into equal parts; this batch is already "
                "given as MicroBatches. Use one or the other."
            )
        return [unwrap(b) for b in batch]
    if micro_batches == 1:
        return [unwrap(batch)]
    leaves = _batch_leaves(batch)
    n = rows(batch)
    bad = [line for leaf in leaves if (line := _cannot_cut(leaf, n)) is not None]
    if bad:
        first = _marked_first(leaves)[0]
        raise ValueError(_CANNOT_CUT.format(
            call=call, k=micro_batches, rows=n, lines="\n".join(bad),
            first=f"batch{first.path}, " + ("marked shardfn.Batched" if first.marked else "its first batch leaf"),
            count=f"{len(bad)} leaves" if len(bad) > 1 else "this leaf"))
    if n % micro_batches:
        raise ValueError(
            f"{call}(micro_batches={micro_batches}): a local batch of {n} rows does not split into "
            f"{micro_batches} equal micro-batches; use a per-rank batch size divisible by {micro_batches}, or "
            "pass shardfn.MicroBatches([...]) of any sizes."
        )
    b = n // micro_batches

    def take(x: Any, i: int) -> Any:
        if isinstance(x, Whole):
            return x.tensor
        x = x.tensor if isinstance(x, Batched) else x
        return x[i * b : (i + 1) * b] if isinstance(x, torch.Tensor) else x

    return [pytree.tree_map(lambda x: take(x, i), batch, is_leaf=_is_marker) for i in range(micro_batches)]


def agree_on_micro_batches(batches: MicroBatches, mesh: Any, scope: Any) -> list[tuple[int, int]]:
    """Every rank's number and sizes of micro-batches; raises on every rank if the numbers
    differ. Returns each rank's smallest and largest micro-batch (rows). ``scope``: the
    step's runtime's."""
    sizes = [rows(b) for b in batches]
    mine = torch.tensor([len(sizes), min(sizes), max(sizes)], dtype=torch.int64, device=mesh.device)
    everyone = C.all_gather_mesh(mine, mesh, Purpose.MICRO_BATCHES, scope=scope).view(-1, 3) if mesh.size > 1 else mine.view(1, 3)
    counts = everyone[:, 0].tolist()
    if len(set(counts)) > 1:
        raise ValueError(_COUNTS_DIFFER.format(rank=mesh.rank, counts=counts))
    return [(int(lo), int(hi)) for lo, hi in everyone[:, 1:].tolist()]


def objective(out: Any, has_aux: bool, needs_grad: bool, read: bool,
              fake: bool) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """``loss_fn``'s result as ``(what to back-propagate, Mean's count (0-d fp32) or None, aux)``.
    ``read=False``: a negative count is not read on the host but becomes NaN, which makes the
    step's values non-finite (shardfn._run.step [Note: a step that does not wait]).
    ``fake``: a planning run (shardfn.explain), whose count has no value to read."""
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
        elif not fake and not float(count) >= 0:
            raise TypeError(f"shardfn.Mean(total, count): count must be a number >= 0, got {float(count)!r}.")
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise TypeError(_NOT_A_LOSS.format(aux=" (with aux=...: (loss, aux))" if has_aux else "",
                                           got=f"{type(out).__name__} {getattr(out, 'shape', '')}".strip()))
    if needs_grad and not out.requires_grad:
        raise ValueError(_DETACHED)
    return out.reshape(()), count, aux


def count_tokens(batch: Any) -> int:
    """Elements of the batch's first integer batch leaf (token ids), a :class:`Batched` one
    first, else its rows; :class:`Whole` leaves are not the batch's (see [Note: batch leaves])."""
    if isinstance(batch, MicroBatches):
        return sum(count_tokens(b) for b in batch)
    for leaf in _marked_first(_batch_leaves(batch)):
        t = leaf.tensor
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return rows(batch)


def uneven_error(sizes: list[tuple[int, int]]) -> ValueError:
    """The error for micro-batches of different sizes; ``sizes``: each rank's (smallest, largest)."""
    lo, hi = min(s[0] for s in sizes), max(s[1] for s in sizes)
    per_rank = ", ".join(f"rank {r} {a}" + (f" to {b}" if b != a else "") for r, (a, b) in enumerate(sizes))
    return ValueError(_UNEVEN.format(sizes=f"{lo} to {hi}", per_rank=per_rank))
