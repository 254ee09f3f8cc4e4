"""autoplan: the plans that fit a memory budget, found with explain's fake-tensor step.

[Note: how autoplan searches]
``autoplan(model, mesh, budget, batch)`` tries every combination of strategy (FULL_SHARD,
SHARD_GRAD_OP, SHARD_OPTIMIZER, NO_SHARD; on a ``(replicate, shard)`` mesh the hybrid
ones), remat (none, full), CPU offload (off, on) and micro-batches (1, 2, 4 where the
batch splits), on the units and precision of the ``base`` plan. Each candidate's figures
(device memory between steps and at its peak, host memory, bytes moved by collectives
and by host <-> device copies per step) come from :func:`shardfn.explain`: one real step
of the same code on fake tensors, no weights allocated.

A deep model is not simulated at its full depth. Every figure of a model made of L equal
blocks is affine in L once the blocks' pattern is established (the peak comes at the same
point of the step, one block more adds the same bytes), so autoplan runs explain on copies
of the model cut to 3 and to 4 blocks and extends the line to L: a 7B GPT (32 blocks) is
planned from two small simulations per candidate. Checked exactly: the extended figures
of a 32-block 7B GPT at 64 ranks equal explain's at full depth, to the byte
(tests/test_autoplan.py). Models whose units are not the elements of one list of blocks
are simulated at full depth.

The result keeps the candidates that fit the budget (predicted device peak at most the
budget) and are not dominated: no other fitting candidate is at most as large in device
peak, bytes moved and recomputation, and smaller in one. The recommended plan is the
first of them in this order: no offload, no recomputation, fewest micro-batches, fewest
bytes moved, smallest peak (a plan that fits without giving up speed before one that
gives up more). Explanations are kept per model structure, mesh, batch and candidate, so
asking again with another budget simulates nothing.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .._run.batch import rows
from .._deprecated import as_loss, deprecated, old_loss, renamed
from .explain import Explanation, explain
from .._memory import parse_size
from .._state.offload import Offload
from .._state.plan import Plan, Remat, Strategy

__all__ = ["AutoPlan", "Candidate", "autoplan"]

_GIB = 2**30


class _Recent(collections.OrderedDict):
    """The ``size`` most recently used entries (an LRU)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make: Any) -> Any:
        if key in self:
            self.move_to_end(key)
            return self[key]
        self[key] = value = make()
        while len(self) > self.size:
            self.popitem(last=False)
        return value


# (model structure, mesh, batch, loss, optimizer, candidate) -> figures. The loss and the
# optimizer are keys by identity, held by the entry: an id() alone would be recycled once
# the function is freed and answer for another one.
_CACHE: _Recent = _Recent(256)


class _Same:
    """A key part equal only to the very same object, which it keeps alive."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan autoplan tried: the plan, the step options, and its figures per rank."""

    plan: Plan
    micro_batches: int
    peak_bytes: int  # on the compute device, during a step
    persistent_bytes: int  # on the compute device, between steps
    host_bytes: int  # in host memory between steps (offload)
    comm_bytes: int  # sent through collectives per step (the textbook volume of each)
    transfer_bytes: int  # host <-> device copies per step (offload)

    @property
    def remat(self) -> bool:
        return self.plan.remat is not None

    @property
    def offload(self) -> bool:
        return self.plan.offload.enabled

    @property
    def step_options(self) -> dict[str, Any]:
        """What to pass to :func:`shardfn.jit_step` besides the plan."""
        return {"micro_batches": self.micro_batches}

    def moved(self) -> int:
        return self.comm_bytes + self.transfer_bytes

    def label(self) -> str:
        parts = [self.plan.strategy.value, "remat" if self.remat else "", "offload" if self.offload else "",
                 f"micro_batches={self.micro_batches}" if self.micro_batches > 1 else ""]
        return " + ".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """What :func:`autoplan` found; ``print()`` it for the table."""

    mesh: int | tuple[int, int]
    budget: int
    frontier: tuple[Candidate, ...]  # fitting and not dominated; the recommended one first
    tried: int
    seconds: float
    tensor: int = 1  # ranks of the mesh's "tensor" axis (autoplan(tensor=...)), part of ``mesh``'s world


    @property
    def world(self) -> int | tuple[int, int]:
        """Deprecated: :attr:`mesh`."""
        deprecated("AutoPlan.world", "AutoPlan.mesh")
        return self.mesh

    @property
    def chosen(self) -> Candidate | None:
        """The recommended plan, or None when nothing fits."""
        return self.frontier[0] if self.frontier else None

    def __str__(self) -> str:
        big = max([self.budget, *(c.peak_bytes for c in self.frontier)]) >= _GIB
        scale, unit = (_GIB, "GiB") if big else (2**20, "MiB")

        def size(b: int) -> str:
            return f"{b / scale:,.2f}"

        where = f"mesh {self.mesh}" + (f" with a tensor axis of {self.tensor}" if self.tensor > 1 else "")
        head = (f"shardfn.autoplan: {where}, budget {size(self.budget)} {unit} per rank; {self.tried} plans "
                f"simulated in {self.seconds:.1f} s; {len(self.frontier)} fit and are not dominated")
        rows = [head, f"  {'plan':<52} {'peak':>9} {'persist':>9} {'host':>9} {'comm/step':>10} {'host<->dev':>10}"
                      f"  ({unit} per rank)"]
        for i, c in enumerate(self.frontier):
            mark = "* " if i == 0 else "  "
            rows.append(f"{mark}{c.label():<52} {size(c.peak_bytes):>9} {size(c.persistent_bytes):>9} "
                        f"{size(c.host_bytes):>9} {size(c.comm_bytes):>10} {size(c.transfer_bytes):>10}")
        if not self.frontier:
            rows.append("  nothing fits: a larger mesh, bf16 parameters (base=Plan(precision=...)), or a smaller batch")
        else:
            rows.append("  * recommended: no offload or recomputation when a plan fits without; then the fewest "
                        "micro-batches and bytes moved")
        return "\n".join(rows)


@renamed(world="mesh", batch_example="batch")
def autoplan(
    model: nn.Module,
    mesh: int | tuple[int, int],
    memory_budget_per_rank: int | float | str,
    batch: Any,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: Any = None,
    base: Plan | None = None,
    strategies: Sequence[Strategy | str] | None = None,
    micro_batches: Sequence[int] = (1, 2, 4),
    tensor: int | None = None,
    tensor_parallel: Mapping[str, str] | None = None,
    verbose: bool = True,
) -> AutoPlan:
    """The plans that fit ``memory_budget_per_rank`` on ``world`` ranks, on the frontier of
    memory and communication (see [Note: how autoplan searches]).

    Args:
        model: the model, usually built under ``torch.device("meta")`` (nothing is allocated).
        mesh: the ranks to plan for, as for :func:`shardfn.explain`: a world size, or a
            ``(replicate, shard)`` pair (hybrid strategies).
        memory_budget_per_rank: bytes of compute-device memory per rank (an int), or a
            string such as ``"40GiB"`` / ``"80GB"``; leave headroom for what is not a tensor.
        batch: one rank's batch, as the step receives it (only shapes and dtypes matter).
        loss_fn, optimizer: as for :func:`shardfn.explain`: ``loss_fn(apply, params, batch)``,
            the loss a step takes.
        base: a plan whose units and precision every candidate keeps (default: ``Plan()``).
        strategies: the strategies to try (default: every one the mesh takes).
        micro_batches: the numbers of micro-batches to try (those that split the batch).
        tensor, tensor_parallel: as for :func:`shardfn.explain`: a ``"tensor"`` axis of
            ``tensor`` ranks and the layers split over it.
        verbose: print the table.

    Returns:
        An :class:`AutoPlan`: ``frontier`` (each a :class:`Candidate` with ``plan`` and
        ``step_options``), ``chosen``.

    Example:
        >>> found = sf.autoplan(model, 64, "40GiB", batch, loss_fn=loss_fn)
        >>> sharded = sf.shard(params, mesh, found.chosen.plan)
        >>> step = sf.jit_step(loss_fn, mesh, optimizer=opt, **found.chosen.step_options)
    """
    budget = parse_size(memory_budget_per_rank, "autoplan(memory_budget_per_rank=...)")
    base = base or Plan()
    start = time.perf_counter()
    rows = _rows(batch)
    # A (params, batch) loss closes over the user's apply, which cannot run a cut model:
    # explained at full depth (see _figures).
    whole = loss_fn is not None and old_loss(loss_fn)
    loss_fn = as_loss(loss_fn, "autoplan", stacklevel=5)[0] if loss_fn is not None else None
    hybrid = not isinstance(mesh, int)
    if strategies is None:
        strategies = Strategy.candidates(hybrid)
    strategies = [Strategy.parse(s) for s in strategies]
    tp = _TensorPlan(tensor, tensor_parallel)
    candidates = []
    for strategy, remat, offload, k in itertools.product(strategies, (False, True), (False, True), micro_batches):
        if not (isinstance(k, int) and k >= 1) or rows % k:
            continue
        plan = Plan(strategy, units=base.units, precision=base.precision, remat=Remat() if remat else None,
                    offload=Offload(params=True, optimizer=True) if offload else None)
        candidates.append(_figures(model, mesh, plan, k, batch, loss_fn, optimizer, whole, tp))
    fitting = [c for c in candidates if c.peak_bytes <= budget]
    frontier = [c for c in fitting if not any(_dominates(o, c) for o in fitting)]
    frontier.sort(key=lambda c: (c.offload, c.remat, c.micro_batches, c.moved(), c.peak_bytes))
    found = AutoPlan(mesh, budget, tuple(frontier), len(candidates), time.perf_counter() - start, tensor or 1)
    if verbose:
        print(found)
    return found


def _dominates(a: Candidate, b: Candidate) -> bool:
    ka = (a.peak_bytes, a.moved(), a.remat, a.micro_batches)
    kb = (b.peak_bytes, b.moved(), b.remat, b.micro_batches)
    return all(x <= y for x, y in zip(ka, kb)) and ka != kb


@dataclasses.dataclass(frozen=True)
class _TensorPlan:
    """explain's ``tensor=`` and ``tensor_parallel=`` for every candidate (a key of the cache)."""

    tensor: int | None = None
    tensor_parallel: Mapping[str, str] | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "tensor_parallel": self.tensor_parallel}

    def key(self) -> str:
        return repr((self.tensor, sorted(dict(self.tensor_parallel or {}).items())))


def _figures(model: nn.Module, world: Any, plan: Plan, k: int, batch: Any, loss_fn: Any, optimizer: Any,
             whole: bool = False, tp: _TensorPlan = _TensorPlan()) -> Candidate:
    """One candidate's figures: explained at full depth, or at 3 and 4 blocks and extended."""
    blocks = None if whole else _block_list(model, plan)
    depth = len(blocks[1]) if blocks is not None else 0
    if depth <= 4:
        e = _explain(model, world, plan, k, batch, loss_fn, optimizer, tp)
        return _candidate(plan, k, [_numbers(e)], [1.0])
    small = [_explain(_cut(model, blocks, n), world, plan, k, batch, loss_fn, optimizer, tp) for n in (3, 4)]
    # f(L) = f(4) + (L - 4) * (f(4) - f(3)): every figure is affine in the number of blocks
    return _candidate(plan, k, [_numbers(small[0]), _numbers(small[1])], [-(depth - 4), depth - 3])


def _numbers(e: Explanation) -> list[int]:
    return [e.peak_bytes or 0, e.persistent_bytes or 0, e.host_bytes,
            sum(b for _, b in e.collectives.values()), sum(b for _, b in e.transfers.values())]


def _candidate(plan: Plan, k: int, figures: list[list[int]], weights: list[float]) -> Candidate:
    values = [int(round(sum(w * f[i] for w, f in zip(weights, figures)))) for i in range(len(figures[0]))]
    return Candidate(plan, k, *values)


def _explain(model: nn.Module, world: Any, plan: Plan, k: int, batch: Any, loss_fn: Any, optimizer: Any,
             tp: _TensorPlan = _TensorPlan()) -> Explanation:
    shapes = pytree.tree_map(lambda t: (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t, batch)
    key = (repr(model), repr(world), repr(shapes), _Same(loss_fn), _Same(optimizer), repr(plan), k, tp.key())
    return _CACHE.get_or(key, lambda: explain(model, world, plan, batch, loss_fn=loss_fn, optimizer=optimizer,
                                              verbose=False, micro_batches=k, **tp.kwargs()))


def _block_list(model: nn.Module, plan: Plan) -> tuple[str, nn.ModuleList] | None:
    """The list of blocks the plan's units are the elements of (``("blocks", ModuleList)``)."""
    names = [n for n, _ in model.named_parameters()]
    units = plan.units.resolve(model, names)
    parents = {u.rpartition(".")[0] for u in units}
    if len(parents) != 1 or not all(u.rpartition(".")[2].isdigit() for u in units):
        return None
    parent = parents.pop()
    blocks = model.get_submodule(parent) if parent else None
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != len(units):
        return None
    return parent, blocks


def _cut(model: nn.Module, blocks: tuple[str, nn.ModuleList], n: int) -> nn.Module:
    """A copy of ``model`` (meta tensors: no memory) with only its first ``n`` blocks."""
    full = blocks[1]
    original = full._modules
    full._modules = dict(itertools.islice(original.items(), n))  # copied short, then put back
    try:
        return copy.deepcopy(model)
    finally:
        full._modules = original


def _rows(batch: Any) -> int:
    return rows(batch) or 1
