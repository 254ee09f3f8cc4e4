"""Equivalence of sharded training with plain single-process training, for any model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .._functionalize import Apply, functionalize
from .._mesh import Mesh
from .._sharded import gather, shard
from .._step import jit_step
from ..optim import GradientTransformation, apply_updates
from ._cluster import Cluster

__all__ = ["EquivalenceReport", "check_equivalence", "reference_training", "sharded_training", "split_batch"]

LossFn = Callable[[Apply, Mapping[str, torch.Tensor], Any], torch.Tensor]


def split_batch(batch: Any, rank: int, world: int) -> Any:
    """Rank ``rank``'s contiguous slice (dim 0) of every tensor in a global batch pytree."""

    def take(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        n = t.shape[0]
        if n % world:
            raise ValueError(
                f"split_batch: a global batch of {n} rows does not split evenly over {world} ranks; use a "
                f"global batch size that every tested world size divides (for 1..4: a multiple of 12)."
            )
        b = n // world
        return t[rank * b : (rank + 1) * b]

    return pytree.tree_map(take, batch)


def reference_training(model_fn, loss_fn: LossFn, batches: Sequence[Any], optimizer, *, seed: int = 0):
    """Plain single-process training on the global batches: ``(losses, final params)``.

    ``model_fn()`` is called after ``torch.manual_seed(seed)``; ``optimizer()`` builds
    the GradientTransformation; ``loss_fn(apply, params, batch)`` returns the mean loss.
    The final params include the model's floating-point buffers, as ``"buffer:<name>"``.
    """
    torch.manual_seed(seed)
    params, apply = functionalize(model_fn())
    params = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    opt: GradientTransformation = optimizer()
    state = opt.init(params)
    losses = []
    for batch in batches:
        trainable = [n for n, p in params.items() if p.requires_grad]
        loss = loss_fn(apply, params, batch)
        grads = dict(zip(trainable, torch.autograd.grad(loss, [params[n] for n in trainable])))
        updates, state = opt.update(grads, state, params)
        params = {n: t.detach().requires_grad_(t.requires_grad) for n, t in apply_updates(params, updates).items()}
        losses.append(float(loss.detach()))
    return losses, {**{n: t.detach() for n, t in params.items()}, **_float_buffers(apply)}


def _float_buffers(apply: Apply) -> dict[str, torch.Tensor]:
    return {f"buffer:{n}": b.detach().clone() for n, b in apply.buffers.items() if b.is_floating_point()}


def sharded_training(
    model_fn,
    loss_fn: LossFn,
    batches,
    optimizer,
    strategy,
    units=None,
    *,
    seed: int = 0,
    replicate: int | None = None,
    step_options: Mapping[str, Any] | None = None,
):
    """Runs on every rank of a cluster: the same training, sharded. Returns (losses, full params).

    ``replicate=R`` trains on a 2-D mesh of R replicas (the hybrid strategies);
    ``step_options`` go to :func:`shardfn.jit_step` (``micro_batches=``, ...).
    """
    mesh = Mesh.from_group(replicate=replicate)
    torch.manual_seed(seed)
    params, apply = functionalize(model_fn())
    sharded = shard(params, mesh, strategy, units=units)
    del params
    opt = optimizer()
    state = opt.init(sharded)
    step = jit_step(lambda p, b: loss_fn(apply, p, b), mesh, optimizer=opt, **(step_options or {}))
    losses = []
    for batch in batches:
        sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.rank, mesh.size))
        losses.append(metrics["loss"])
    return losses, {**gather(sharded), **_float_buffers(apply)}


@dataclasses.dataclass
class EquivalenceReport:
    """Largest differences from the single-process reference, per configuration and leaf."""

    rtol: float
    atol: float
    # (strategy, world size or (R, S)) -> leaf -> (max abs diff, max of |diff| / (atol + rtol*|ref|))
    leaves: dict[tuple[str, Any], dict[str, tuple[float, float]]] = dataclasses.field(default_factory=dict)
    losses: dict[tuple[str, Any], list[tuple[float, float]]] = dataclasses.field(default_factory=dict)

    def failures(self) -> list[str]:
        out = []
        for cfg, leaves in self.leaves.items():
            for name, (diff, ratio) in leaves.items():
                if not ratio <= 1.0:
                    out.append(f"{cfg[0]} world={cfg[1]}: {name}: max |diff| {diff:.3g} ({ratio:.2f}x the tolerance)")
        for cfg, pairs in self.losses.items():
            for i, (got, ref) in enumerate(pairs):
                if not math.isclose(got, ref, rel_tol=self.rtol, abs_tol=self.atol):
                    out.append(f"{cfg[0]} world={cfg[1]}: loss at step {i + 1}: {got!r} vs reference {ref!r}")
        return out

    def __str__(self) -> str:
        lines = [f"EquivalenceReport(rtol={self.rtol}, atol={self.atol})"]
        for cfg, leaves in self.leaves.items():
            worst = max(leaves.items(), key=lambda kv: kv[1][1]) if leaves else ("-", (0.0, 0.0))
            loss_diff = max((abs(a - b) for a, b in self.losses[cfg]), default=0.0)
            lines.append(
                f"  {cfg[0]:<14} world={cfg[1]}  max loss diff {loss_diff:.3g}  "
                f"worst leaf {worst[0]} |diff| {worst[1][0]:.3g} ({worst[1][1]:.2f}x tol)"
            )
        return "\n".join(lines)


def compare(report: EquivalenceReport, cfg: tuple[str, Any], losses, ref_losses, params, ref_params) -> None:
    report.losses[cfg] = list(zip(losses, ref_losses))
    per_leaf = {}
    for name, ref in ref_params.items():
        got = params[name].to(ref.dtype)
        diff = (got - ref).abs()
        tol = report.atol + report.rtol * ref.abs()
        per_leaf[name] = (float(diff.max()) if diff.numel() else 0.0, float((diff / tol).max()) if diff.numel() else 0.0)
    report.leaves[cfg] = per_leaf


def check_equivalence(
    model_fn: Callable[[], nn.Module],
    loss_fn: LossFn,
    batches: Sequence[Any],
    *,
    optimizer: Callable[[], GradientTransformation],
    strategies: Sequence[str] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
    world_sizes: Sequence[int | tuple[int, int]] = (1, 2, 3, 4),
    units: Any = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    clusters: Mapping[int, Cluster] | None = None,
    raise_on_failure: bool = True,
    step_options: Mapping[str, Any] | None = None,
) -> EquivalenceReport:
    """Checks that sharded training of your model equals single-process training.

    For each world size (a spawned CPU/gloo cluster) and strategy, trains
    ``len(batches)`` steps with each rank on its slice of every global batch, and
    compares the loss of every step and the final full parameters with plain
    training on the global batches in this process.

    Args:
        model_fn: builds the model; called after ``torch.manual_seed(seed)`` in every process.
        loss_fn: ``loss_fn(apply, params, batch) -> mean loss`` of the batch.
        batches: global batches (pytrees of tensors, dim 0 divisible by every world size).
        optimizer: builds the optimizer, e.g. ``functools.partial(shardfn.optim.adamw, 1e-3)``.
        strategies, world_sizes, units: the grid to check. A world size may be a pair
            ``(R, S)``: a 2-D mesh of R replicas of S shards, for the hybrid strategies.
        rtol, atol: the tolerance per element (``|diff| <= atol + rtol * |ref|``).
        clusters: reuse running clusters, by world size (the test suite does).
        raise_on_failure: raise ``AssertionError`` listing every failure (default).
        step_options: keyword arguments for :func:`shardfn.jit_step` in the sharded runs
            (``micro_batches=4``, ``accumulate="local"``, ...); the reference always
            takes one plain step per global batch.

    Floating-point buffers are compared too (as ``buffer:<name>``), and must be equal on
    every rank.

    ``model_fn``, ``loss_fn`` and ``optimizer`` travel to the ranks by pickle: use
    module-level functions or ``functools.partial`` of them, not lambdas.

    Returns:
        An :class:`EquivalenceReport` with the largest difference per leaf.

    Example:
        >>> report = check_equivalence(make_model, my_loss, batches,
        ...                            optimizer=functools.partial(shardfn.optim.sgd, 0.1))
        >>> print(report)
    """
    ref_losses, ref_params = reference_training(model_fn, loss_fn, batches, optimizer, seed=seed)
    report = EquivalenceReport(rtol, atol)
    for world in world_sizes:
        # An int is a 1-D mesh; a pair (R, S) a 2-D mesh of R replicas of S shards.
        replicate, size = (world[0], world[0] * world[1]) if isinstance(world, tuple) else (None, world)
        own = clusters is None or size not in clusters
        cluster = Cluster(size) if own else clusters[size]
        try:
            for strategy in strategies:
                results = cluster.run(
                    sharded_training, model_fn, loss_fn, batches, optimizer, strategy, units,
                    seed=seed, replicate=replicate, step_options=step_options,
                )
                losses, params = results[0]
                for r, (other_losses, other) in enumerate(results[1:], 1):
                    if list(other_losses) != list(losses):
                        raise AssertionError(f"{strategy} world={world}: rank {r} reports losses {other_losses}, rank 0 {losses}")
                    for name in (n for n in params if n.startswith("buffer:")):
                        if not torch.equal(other[name], params[name]):
                            raise AssertionError(f"{strategy} world={world}: {name} differs between rank 0 and rank {r}")
                compare(report, (str(strategy), world), losses, ref_losses, params, ref_params)
        finally:
            if own:
                cluster.close()
    if raise_on_failure and report.failures():
        raise AssertionError("sharded training differs from single-process training:\n  " + "\n  ".join(report.failures()) + f"\n{report}")
    return report
