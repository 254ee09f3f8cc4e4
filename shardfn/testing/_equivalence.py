"""Equivalence of sharded training with plain single-process training, for any model."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from .._run.batch import Mean, unwrap
from .._deprecated import renamed
from .._run.functionalize import Apply, functionalize
from .._mesh import Mesh
from .._state.plan import Plan, Strategy
from .._shard import shard
from .._state.sharded import ShardedParams, gather
from .._jit import jit_step
from ..optim import GradientTransformation, apply_updates
from ._cluster import Cluster
from ._pieces import local_shards, split_batch

__all__ = ["EquivalenceReport", "check_equivalence", "full_state", "reference_training", "sharded_training", "split_batch"]

LossFn = Callable[[Apply, Mapping[str, torch.Tensor], Any], torch.Tensor]

# check_equivalence logs each check's margin here at INFO (the test suite prints the closest
# ones at its end, so a bound that a passing run nearly reached shows before another CPU fails it).
_log = logging.getLogger("shardfn.testing")


def reference_training(model_fn, loss_fn: LossFn, batches: Sequence[Any], optimizer, *, seed: int = 0):
    """Plain single-process training on the global batches: ``(losses, final state)``.

    ``model_fn()`` is called after ``torch.manual_seed(seed)``; ``optimizer()`` builds
    the GradientTransformation; ``loss_fn(apply, params, batch)`` returns the mean loss.
    The final state holds every parameter and buffer, by name (see [Note: the state tree]).
    """
    torch.manual_seed(seed)
    params, apply = functionalize(model_fn())
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    opt: GradientTransformation = optimizer()
    opt_state = opt.init(state)
    losses = []
    for batch in batches:
        trainable = [n for n, p in state.items() if p.requires_grad]
        loss = _plain_loss(loss_fn(apply, state, unwrap(batch)))  # buffers change in place (or are replaced) in ``state``
        # A parameter the loss did not use (an expert no token chose) has a zero gradient.
        raw = torch.autograd.grad(loss, [state[n] for n in trainable], allow_unused=True)
        grads = {n: torch.zeros_like(state[n]) if g is None else g for n, g in zip(trainable, raw)}
        updates, opt_state = opt.update(grads, opt_state, state)
        state = {n: t.detach().requires_grad_(t.requires_grad) for n, t in apply_updates(state, updates).items()}
        losses.append(float(loss.detach()))
    return losses, {n: t.detach() for n, t in state.items()}


def _plain_loss(out: Any) -> torch.Tensor:
    """A loss_fn's result as the scalar to differentiate: ``(loss, aux)`` -> loss,
    ``Mean(total, count)`` -> total / count (the mean over the global batch)."""
    if isinstance(out, tuple) and not isinstance(out, Mean):
        out = out[0]
    return out.total / out.count if isinstance(out, Mean) else out


def full_state(sharded: ShardedParams) -> dict[str, torch.Tensor]:
    """Every parameter (gathered, under its canonical name) and every buffer of a sharded tree."""
    gathered = gather(sharded)
    out: dict[str, torch.Tensor] = {}
    for key, name in sharded.layout.state_dict_keys:
        out.setdefault(name, gathered[key])
    out.update({n: sharded[n].detach().clone() for n in sharded.layout.buffers})
    return out


@renamed(strategy="plan")
def sharded_training(
    model_fn,
    loss_fn: LossFn,
    batches,
    optimizer,
    plan: Plan | Strategy | str,
    units=None,
    *,
    seed: int = 0,
    replicate: int | None = None,
    step_options: Mapping[str, Any] | None = None,
    tensor: int | None = None,
    tensor_parallel: Any = None,
):
    """Runs on every rank of a cluster: the same training, sharded, with
    ``loss_fn(apply, params, batch)`` as :func:`check_equivalence` takes it.

    Returns ``{"losses", "state", "shards", "buffers"}``: the loss of every step, the final
    full state (:func:`full_state`), this rank's local shard of every parameter as
    ``(shard, first row, real rows)`` (a flat shard: ``(shard, first element, -1)``) and the
    names of the buffers. ``replicate=R`` trains
    on a 2-D mesh of R replicas (the hybrid strategies); ``step_options`` go to
    :func:`shardfn.jit_step` (``micro_batches=``, ...). ``tensor=T`` adds a ``"tensor"`` axis
    of T ranks (each tensor group gets the same slice of the batch) and ``tensor_parallel``
    goes to :func:`shardfn.shard`; a split leaf's shard is then a piece of this tensor rank's
    part of it, its ``(Split, tensor rank, tensor size)`` in ``"splits"`` (shardfn._parallel.ops).
    """
    mesh = Mesh.from_group(replicate=replicate, tensor=tensor)
    torch.manual_seed(seed)
    params, _ = functionalize(model_fn())  # the shards carry the model's apply
    sharded = shard(params, mesh, plan, units=units, tensor_parallel=tensor_parallel)
    del params
    opt = optimizer()
    state = opt.init(sharded)
    step = jit_step(loss_fn, mesh, optimizer=opt, **(step_options or {}))
    losses = []
    for batch in batches:
        sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(metrics["loss"])
    layout = sharded.layout
    splits = {s.leaf: (s, mesh.axis_rank("tensor"), mesh.axis_size("tensor")) for s in layout.splits}
    return {"losses": losses, "state": full_state(sharded), "shards": local_shards(sharded),
            "buffers": list(layout.buffers), "splits": splits}


@dataclasses.dataclass
class EquivalenceReport:
    """Largest differences from the single-process reference, per configuration and leaf."""

    rtol: float
    atol: float
    # (strategy, world size or (R, S)) -> leaf -> (max abs diff, max of |diff| / (atol + rtol*|ref|))
    leaves: dict[tuple[str, Any], dict[str, tuple[float, float]]] = dataclasses.field(default_factory=dict)
    losses: dict[tuple[str, Any], list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    # (strategy, world) -> (rank, leaf) -> (max abs diff of the real rows, ratio as above, padding rows all zero)
    shards: dict[tuple[str, Any], dict[tuple[int, str], tuple[float, float, bool]]] = dataclasses.field(
        default_factory=dict)

    def failures(self) -> list[str]:
        out = []
        for cfg, leaves in self.leaves.items():
            for name, (diff, ratio) in leaves.items():
                if not ratio <= 1.0:
                    out.append(f"{cfg[0]} world={cfg[1]}: {name}: max |diff| {diff:.3g} ({ratio:.2f}x the tolerance)")
        for cfg, shards in self.shards.items():
            for (rank, name), (diff, ratio, zero_padding) in shards.items():
                if not ratio <= 1.0:
                    out.append(f"{cfg[0]} world={cfg[1]}: rank {rank}'s shard of {name}: max |diff| {diff:.3g} from "
                               f"the reference's rows ({ratio:.2f}x the tolerance)")
                if not zero_padding:
                    out.append(f"{cfg[0]} world={cfg[1]}: rank {rank}'s shard of {name}: padding rows are not zero")
        for cfg, pairs in self.losses.items():
            for i, (got, ref) in enumerate(pairs):
                if not math.isclose(got, ref, rel_tol=self.rtol, abs_tol=self.atol):
                    out.append(f"{cfg[0]} world={cfg[1]}: loss at step {i + 1}: {got!r} vs reference {ref!r}")
        return out

    def margin(self) -> tuple[float, str]:
        """The largest ``|diff| / (atol + rtol * |ref|)`` over every leaf, shard and loss,
        and where it is: how close the run came to its tolerance (1.0 is the bound)."""
        worst = (0.0, "-")
        for cfg, leaves in self.leaves.items():
            for name, (_, ratio) in leaves.items():
                worst = max(worst, (ratio, f"{cfg[0]} world={cfg[1]} {name}"))
        for cfg, shards in self.shards.items():
            for (rank, name), (_, ratio, _) in shards.items():
                worst = max(worst, (ratio, f"{cfg[0]} world={cfg[1]} rank {rank}'s shard of {name}"))
        for cfg, pairs in self.losses.items():
            for i, (got, ref) in enumerate(pairs):
                worst = max(worst, (abs(got - ref) / (self.atol + self.rtol * abs(ref)),
                                    f"{cfg[0]} world={cfg[1]} loss at step {i + 1}"))
        return worst

    def __str__(self) -> str:
        ratio, where = self.margin()
        lines = [f"EquivalenceReport(rtol={self.rtol}, atol={self.atol}): worst {ratio:.2f}x the tolerance ({where})"]
        for cfg, leaves in self.leaves.items():
            worst = max(leaves.items(), key=lambda kv: kv[1][1]) if leaves else ("-", (0.0, 0.0))
            loss_diff = max((abs(a - b) for a, b in self.losses[cfg]), default=0.0)
            lines.append(
                f"  {cfg[0]:<14} world={cfg[1]}  max loss diff {loss_diff:.3g}  "
                f"worst leaf {worst[0]} |diff| {worst[1][0]:.3g} ({worst[1][1]:.2f}x tol)"
            )
        return "\n".join(lines)


def _difference(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> tuple[float, float]:
    """(max |diff|, max |diff| / (atol + rtol * |ref|)); exact for non-floating tensors."""
    if not got.numel():
        return 0.0, 0.0
    if not ref.is_floating_point():
        wrong = float((got.to(ref.dtype) != ref).sum())
        return wrong, float("inf") if wrong else 0.0
    diff = (got.to(ref.dtype) - ref).abs()
    return float(diff.max()), float((diff / (atol + rtol * ref.abs())).max())


def compare(report: EquivalenceReport, cfg: tuple[str, Any], results: Sequence[Mapping[str, Any]], ref_losses,
            ref_state) -> None:
    """Rank 0's losses and full state, and every rank's local shards, against the reference."""
    report.losses[cfg] = list(zip(results[0]["losses"], ref_losses))
    state = results[0]["state"]
    report.leaves[cfg] = {name: _difference(state[name], ref, report.rtol, report.atol) for name, ref in ref_state.items()}
    shards = {}
    for rank, result in enumerate(results):
        for name, (local, start, rows) in result["shards"].items():
            ref = ref_state[name] if ref_state[name].dim() else ref_state[name].reshape(1)  # a 0-d parameter: one row
            if name in result.get("splits", {}):  # split over the tensor axis: this tensor rank's part of it
                split, t, size = result["splits"][name]
                ref = split.piece(ref, size, t).contiguous()
            if rows < 0:  # a flat shard: a run of the flattened parameter, no padding
                diff, ratio = _difference(local, ref.reshape(-1)[start : start + local.numel()], report.rtol, report.atol)
                shards[(rank, name)] = (diff, ratio, True)
                continue
            diff, ratio = _difference(local[:rows], ref[start : start + rows], report.rtol, report.atol)
            shards[(rank, name)] = (diff, ratio, bool((local[rows:] == 0).all()))
    report.shards[cfg] = shards


def _mesh_of(world: Any, tensor_parallel: Any) -> tuple[int | None, int | None, int, Any]:
    """``(replicate, tensor, ranks, name in the report)`` of one of check_equivalence's world sizes."""
    if isinstance(world, Mapping):
        bad = sorted(set(world) - {"replicate", "shard", "tensor"})
        if bad or not all(isinstance(n, int) and n >= 1 for n in world.values()):
            raise ValueError(f"check_equivalence: world size {dict(world)!r}: a mapping names mesh axes "
                             "('replicate', 'shard', 'tensor') with positive sizes, e.g. {'shard': 2, 'tensor': 2}.")
        r, t = world.get("replicate"), world.get("tensor")
        size = (r or 1) * world.get("shard", 1) * (t or 1)
        name = "(" + ", ".join(f"{a}={world[a]}" for a in ("replicate", "shard", "tensor") if a in world) + ")"
        replicate, tensor = r, t
    else:
        replicate, tensor = (world[0], None) if isinstance(world, tuple) else (None, None)
        size, name = (world[0] * world[1] if isinstance(world, tuple) else world), world
    if tensor_parallel is not None and (tensor or 1) < 2:
        raise ValueError(f"check_equivalence(tensor_parallel=...): world size {name} has no 'tensor' axis; name one "
                         "as a mapping of mesh axes, e.g. world_sizes=({'tensor': 2}, {'shard': 2, 'tensor': 2}).")
    return replicate, tensor, size, name


def check_equivalence(
    model_fn: Callable[[], nn.Module],
    loss_fn: LossFn | None = None,
    batches: Sequence[Any] | None = None,
    *,
    optimizer: Callable[[], GradientTransformation] | None = None,
    strategies: Sequence[str] = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"),
    world_sizes: Sequence[int | tuple[int, int] | Mapping[str, int]] = (1, 2, 3, 4),
    units: Any = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    seed: int = 0,
    clusters: Mapping[int, Cluster] | None = None,
    raise_on_failure: bool = True,
    step_options: Mapping[str, Any] | None = None,
    tensor_parallel: Any = None,
) -> EquivalenceReport:
    """Checks that sharded training of your model equals single-process training.

    For each world size (a spawned CPU/gloo cluster) and strategy, trains
    ``len(batches)`` steps with each rank on its slice of every global batch, and
    compares the loss of every step and the final full parameters with plain
    training on the global batches in this process.

    A LightningModule (``model_fn`` builds one; ``loss_fn`` and ``optimizer`` are not given:
    its ``training_step`` and ``configure_optimizers`` are) is trained by a Trainer under
    :class:`shardfn.lightning.TrainerStrategy` with each strategy at each world size, against a
    Trainer on one device on the global batches (``pip install -e ".[lightning]"``).

    Args:
        model_fn: builds the model; called after ``torch.manual_seed(seed)`` in every process.
        loss_fn: ``loss_fn(apply, params, batch) -> mean loss`` of the batch (not for a LightningModule).
        batches: global batches (pytrees of tensors, dim 0 divisible by every world size).
        optimizer: builds the optimizer, e.g. ``functools.partial(shardfn.optim.adamw, 1e-3)``
            (not for a LightningModule).
        strategies, world_sizes, units: the grid to check. A world size may be a pair
            ``(R, S)``: a 2-D mesh of R replicas of S shards, for the hybrid strategies;
            or a mapping of mesh axes to sizes, ``{"tensor": 2}`` or ``{"shard": 2, "tensor": 2}``
            (keys ``"replicate"``, ``"shard"``, ``"tensor"``; a missing one is 1): a mesh with a
            tensor axis, as ``Mesh.from_env(tensor=T)`` builds, for ``tensor_parallel``.
        rtol, atol: the tolerance per element (``|diff| <= atol + rtol * |ref|``).
        clusters: reuse running clusters, by world size (the test suite does).
        raise_on_failure: raise ``AssertionError`` listing every failure (default).
        step_options: keyword arguments for :func:`shardfn.jit_step` in the sharded runs
            (``micro_batches=4``, ``accumulate="local"``, ...); the reference always
            takes one plain step per global batch. For a LightningModule: keyword arguments
            of both Trainers (``gradient_clip_val=1.0``, ``precision="bf16-true"``, ...).
        tensor_parallel: passed to :func:`shardfn.shard` (``{"blocks.*.mlp.0": "colwise",
            ...}`` or ``"auto"``); then every world size must name a ``"tensor"`` axis of
            more than one rank. Each tensor group trains on one slice of the batch; a split
            leaf's local shards are compared with the matching part of the reference.

    Every buffer is compared too (by name; integer buffers exactly) and must be equal on
    every rank, and so is each rank's local shard of every parameter with the matching
    rows of the reference, its padding rows exactly zero (so replicas that drift apart,
    or a rank whose shard differs, fail even when rank 0's gathered values are right).
    Models with batch statistics (BatchNorm in train mode) are not equivalent to one
    device on the global batch: each rank normalises its own slice, as under DDP.

    ``model_fn``, ``loss_fn`` and ``optimizer`` travel to the ranks by pickle: use
    module-level functions or ``functools.partial`` of them, not lambdas.

    Returns:
        An :class:`EquivalenceReport` with the largest difference per leaf.

    Example:
        >>> report = check_equivalence(make_model, my_loss, batches,
        ...                            optimizer=functools.partial(shardfn.optim.sgd, 0.1))
        >>> print(report)
    """
    if batches is None:
        raise TypeError("check_equivalence(model_fn, loss_fn, batches, ...): batches= is missing: the global batches "
                        "to train on.")
    torch.manual_seed(seed)
    lightning = _lightning(model_fn(), loss_fn, optimizer, tensor_parallel)
    if lightning:
        from ._lightning import lightning_reference, lightning_training, mean_losses

        ref_losses, ref_state = lightning_reference(model_fn, batches, step_options, seed)
    else:
        ref_losses, ref_state = reference_training(model_fn, loss_fn, batches, optimizer, seed=seed)
    report = EquivalenceReport(rtol, atol)
    for world in world_sizes:
        # An int is a 1-D mesh; a pair (R, S) a 2-D mesh of R replicas of S shards.
        replicate, tensor, size, world = _mesh_of(world, tensor_parallel)
        own = clusters is None or size not in clusters
        cluster = Cluster(size) if own else clusters[size]
        try:
            for strategy in strategies:
                if lightning:
                    results = cluster.run(lightning_training, model_fn, batches, strategy, units, replicate,
                                          step_options, seed)
                    mean_losses(results)
                else:
                    results = cluster.run(
                        sharded_training, model_fn, loss_fn, batches, optimizer, strategy, units,
                        seed=seed, replicate=replicate, step_options=step_options, tensor=tensor,
                        tensor_parallel=tensor_parallel,
                    )
                first = results[0]
                for r, other in enumerate(results[1:], 1):
                    if list(other["losses"]) != list(first["losses"]):
                        raise AssertionError(
                            f"{strategy} world={world}: rank {r} reports losses {other['losses']}, rank 0 {first['losses']}")
                    for name in first["buffers"]:
                        if not torch.equal(other["state"][name], first["state"][name]):
                            raise AssertionError(f"{strategy} world={world}: buffer {name} differs between rank 0 and rank {r}")
                compare(report, (str(strategy), world), results, ref_losses, ref_state)
        finally:
            if own:
                cluster.close()
    ratio, where = report.margin()
    failures = report.failures()
    _log.info("check_equivalence: worst %.3gx the tolerance (rtol=%g, atol=%g) at %s%s", ratio, rtol, atol, where,
              f"; {len(failures)} failures" if failures else "")
    if raise_on_failure and failures:
        raise AssertionError("check_equivalence: sharded training differs from single-process training:\n  " + "\n  ".join(report.failures()) + f"\n{report}")
    return report


def _lightning(model: nn.Module, loss_fn: Any, optimizer: Any, tensor_parallel: Any) -> bool:
    """Whether ``model`` is a LightningModule (trained by Trainers); the arguments checked."""
    try:
        from lightning.pytorch import LightningModule
    except ImportError:  # (without the extra nothing is a LightningModule)
        LightningModule = ()
    if not isinstance(model, LightningModule):
        missing = [k for k, v in (("loss_fn", loss_fn), ("optimizer", optimizer)) if v is None]
        if missing:
            raise TypeError(f"check_equivalence(model_fn, loss_fn, batches, optimizer=...): {' and '.join(missing)} "
                            f"missing for {type(model).__name__}, which is not a LightningModule (whose training_step "
                            "and configure_optimizers would be used).")
        return False
    given = [k for k, v in (("loss_fn", loss_fn), ("optimizer", optimizer), ("tensor_parallel", tensor_parallel))
             if v is not None]
    if given:
        raise TypeError(f"check_equivalence({type(model).__name__}, ...): {' and '.join(given)} given for a "
                        "LightningModule, which trains by its own training_step and configure_optimizers under "
                        "TrainerStrategy (no tensor axis); leave them out.")
    return True
