"""jit_step: one training step on local shards, as a function."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

from . import _buffers
from . import _collectives as C
from . import _psum
from ._call import accumulate_locally
from ._layout import Layout
from ._mesh import Mesh
from ._precision import DynamicLossScale, LossScaleState
from ._sharded import ShardedParams
from .optim import GradientTransformation, apply_updates, apply_updates_, hyperparams

__all__ = ["Step", "jit_step"]

_OTHER_LAYOUT = (
    "step(sharded, ...): these shards have a different layout than the ones this step was first called with.\n"
    "  first call: {first!r}\n  this call:  {got!r}\n"
    "A step (and its optimizer state) belongs to one layout: build a new step with shardfn.jit_step(...) and a "
    "new opt_state with opt.init(sharded) for these shards, or pass the shards this step returned."
)


class Step:
    """``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``; see :func:`jit_step`."""

    def __init__(
        self,
        loss_fn: Callable[..., torch.Tensor],
        mesh: Mesh,
        optimizer: GradientTransformation,
        donate: bool,
        micro_batches: int,
        accumulate: str,
        sync_buffers: bool,
        loss_scale: DynamicLossScale | None,
        overlap: bool,
        prefetch: bool,
    ):
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.optimizer = optimizer
        self.donate = donate
        self.micro_batches = micro_batches
        self.accumulate = accumulate
        self.sync_buffers = sync_buffers
        self.loss_scale = loss_scale
        self.overlap = overlap
        self.prefetch = prefetch
        self.order: list[str] = []  # units' forward order, recorded on each step for the next
        self.scaler = LossScaleState(loss_scale.init_scale) if loss_scale is not None else None
        self.layout: Layout | None = None  # recorded on the first call

    def __call__(self, sharded: ShardedParams, opt_state: Any, batch: Any) -> tuple[ShardedParams, Any, dict[str, Any]]:
        self._check(sharded, opt_state)
        ctx = _psum.StepContext(
            self.mesh, sharded.layout.strategy.sharded, predivided=True, overlap=self.overlap,
            prefetch=self.prefetch, order=self.order,
        )
        with C.record_collectives() as log, _psum.step_context(ctx), _buffers.track() as buffers:
            loss, grads = self._grads(sharded, batch)
            # The loss metric and the gradients' sum of squares share one all-reduce per axis.
            loss, norm = self._reduce_metrics(loss, _psum.sum_of_squares(grads))
            ctx.norms[id(grads)] = norm
            metrics: dict[str, Any] = {"loss": loss, "grad_norm": _scalar(norm)}
            metrics.update(hyperparams(self.optimizer, opt_state))
            skip = False
            if self.scaler is not None:
                # The same value on every rank: the norm came out of an all-reduce.
                skip = not is_fake(norm) and not bool(torch.isfinite(norm))
                metrics.update(loss_scale=self.scaler.scale, skipped=skip)
                self.scaler.update(self.loss_scale, not skip)
            # Donation with an in-place optimizer (optim [Note: donation]): params and state
            # are updated in place and the gradients serve as scratch; else update + apply.
            in_place = self.donate and getattr(self.optimizer, "update_", None) is not None
            if not skip:
                with torch.profiler.record_function("shardfn::optimizer"):
                    if in_place:
                        self._finish_prefetch(ctx)  # no all-gather may still be reading the shards
                        opt_state = self.optimizer.update_(grads, opt_state, sharded)
                    else:
                        updates, opt_state = self.optimizer.update(grads, opt_state, sharded)
            if self.sync_buffers:
                buffers.sync(self.mesh)
        self._finish_prefetch(ctx)
        if skip or in_place:
            new = sharded
        elif self.donate:
            apply_updates_(sharded, updates)
            new = sharded
        else:
            new = sharded.replace(apply_updates(sharded, updates))
        metrics["tokens"] = _count_tokens(batch) * self.mesh.size
        metrics["comm_bytes"] = dict(log.bytes())
        return new, opt_state, metrics

    def _finish_prefetch(self, ctx: _psum.StepContext) -> None:
        # The order seen this step is the next step's prefetch order. A prefetch that was
        # never used (the order changed) is waited for, so no collective stays in flight.
        if ctx.seen:
            self.order = list(dict.fromkeys(ctx.seen))
        for unit in ctx.units.values():
            if unit.inflight is not None:
                unit.inflight[0].wait()
                unit.inflight = None

    def _grads(self, sharded: ShardedParams, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over the micro-batches, and the averaged gradients of the trainable shards."""
        trainable = [n for n, t in sharded.items() if t.requires_grad]
        leaves = [sharded[n] for n in trainable]
        k = self.micro_batches
        total: list[torch.Tensor | None] = [None] * len(leaves)
        losses = []
        local = contextlib.nullcontext(None) if self.accumulate == "reduce_each" or k == 1 else accumulate_locally()
        with local as acc:
            for i in range(k):
                mb = batch if k == 1 else _micro_batch(batch, i, k)
                loss = self._loss(sharded, mb, trainable)
                losses.append(loss.detach())
                if acc is not None:
                    acc.last = i == k - 1
                if not leaves:
                    continue
                # Gradients of the mean over micro-batches: each backward carries 1/k (and
                # the loss scale, divided out below).
                # Also 1/N: each rank's loss is a mean over its slice, and the reduce sums.
                scale = (self.scaler.scale if self.scaler is not None else 1.0) / (k * self.mesh.size)
                ctx = _psum.current()
                try:
                    with torch.profiler.record_function("shardfn::backward"):
                        grads = torch.autograd.grad(loss * scale if scale != 1.0 else loss, leaves, allow_unused=True)
                finally:
                    ctx.wait_pending()  # overlapped reductions: the gradients are complete after this
                for j, g in enumerate(grads):
                    if g is not None:
                        total[j] = g if total[j] is None else total[j].add_(g)
        out = {n: g if g is not None else torch.zeros_like(sharded[n]) for n, g in zip(trainable, total)}
        if self.scaler is not None:
            out = {n: g.div_(self.scaler.scale) for n, g in out.items()}
        return torch.stack(losses).mean(), out

    def _loss(self, sharded: ShardedParams, batch: Any, trainable: list[str]) -> torch.Tensor:
        loss = self.loss_fn(sharded, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} {getattr(loss, 'shape', '')}")
        if trainable and not loss.requires_grad:
            raise ValueError(
                "loss_fn returned a tensor that does not depend on the parameters: call apply(params, ...) on the "
                "params loss_fn receives (the sharded tree), not on a captured copy."
            )
        return loss.reshape(())

    def _reduce_metrics(self, loss: torch.Tensor, sq: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Global mean loss and global gradient norm: one 2-element all-reduce per mesh axis.

        The loss is averaged over every axis (equal-sized batches). The sum of squares is
        summed over the axis whose ranks hold different shards and averaged over axes
        whose ranks hold the same values (replicas), which leaves it unchanged there.
        """
        v = torch.stack([loss.float(), sq.float()]).to(self.mesh.device)
        for axis in self.mesh.axis_names:
            n = self.mesh.axis_size(axis)
            if n == 1:
                continue
            differs = axis == "shard" and self.layout is not None and self.layout.strategy.sharded
            v = v * torch.tensor([1.0 / n, 1.0 if differs else 1.0 / n], device=v.device)
            C.all_reduce(v, self.mesh.group(axis), tag="metrics", op="sum")
        return _scalar(v[0]), v[1].sqrt()

    def _check(self, sharded: Any, opt_state: Any) -> None:
        if not isinstance(sharded, ShardedParams):
            raise TypeError(
                f"step(sharded, ...): expected the ShardedParams from shardfn.shard(), got {type(sharded).__name__}."
            )
        if sharded.mesh != self.mesh:
            raise ValueError(
                f"step(sharded, ...): the shards live on {sharded.mesh!r} but this step was built for "
                f"{self.mesh!r}. Shard with the same mesh you pass to jit_step."
            )
        if self.layout is None:
            self.layout = sharded.layout
        elif sharded.layout is not self.layout and sharded.layout != self.layout:
            raise ValueError(_OTHER_LAYOUT.format(first=self.layout, got=sharded.layout))
        check_opt_state(opt_state, sharded)


def check_opt_state(opt_state: Any, sharded: ShardedParams) -> None:
    """Every optimizer-state tensor under a parameter's key must be shaped like its shard."""
    leaves = sharded.layout.leaves
    problems = []
    for path, leaf in pytree.tree_flatten_with_path(opt_state)[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        keys = [k.key for k in path if isinstance(k, pytree.MappingKey)]
        if not keys:
            continue
        name = keys[-1]
        where = f"opt_state{pytree.keystr(path)}"
        if name not in leaves:
            problems.append(f"  {where}: there is no parameter {name!r} in these shards")
        elif tuple(leaf.shape) != leaves[name].shard_shape:
            problems.append(
                f"  {where}: shape {tuple(leaf.shape)}, but the shard of {name!r} has shape "
                f"{leaves[name].shard_shape} on {sharded.mesh!r}"
            )
    if problems:
        raise ValueError(
            "step(sharded, opt_state, ...): the optimizer state does not match these shards:\n"
            + "\n".join(problems[:10])
            + ("\n  ..." if len(problems) > 10 else "")
            + "\nInitialise it from these shards: opt_state = opt.init(sharded)."
        )


def _scalar(t: torch.Tensor) -> float | None:
    """A metric as a Python float; ``None`` for a fake tensor (a planning run has no values)."""
    return None if is_fake(t) else float(t)


def _micro_batch(batch: Any, i: int, k: int) -> Any:
    def take(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.shape[0] % k:
            raise ValueError(
                f"jit_step(micro_batches={k}): a local batch of {t.shape[0]} rows does not split into {k} equal "
                f"micro-batches; use a per-rank batch size divisible by {k}."
            )
        b = t.shape[0] // k
        return t[i * b : (i + 1) * b]

    return pytree.tree_map(take, batch)


def _count_tokens(batch: Any) -> int:
    """Elements of the batch's first integer tensor (token ids), else its rows."""
    leaves = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    for t in leaves:
        if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            return t.numel()
    return leaves[0].shape[0] if leaves and leaves[0].dim() else 0


def jit_step(
    loss_fn: Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor],
    mesh: Mesh,
    *,
    optimizer: GradientTransformation,
    donate: bool = True,
    micro_batches: int = 1,
    accumulate: str = "reduce_each",
    sync_buffers: bool = True,
    loss_scale: DynamicLossScale | None = None,
    overlap: bool = True,
    prefetch: bool = True,
) -> Step:
    """Builds ``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``.

    ``loss_fn(params, batch)`` is written as for one device: it calls ``apply(params, ...)``
    and returns the mean loss over its batch. Each rank passes its own slice of the
    global batch (equal sizes); gradients are averaged over ranks, so a step equals one
    single-device step on the global batch. ``metrics["loss"]`` is the global mean loss.

    Args:
        loss_fn: ``(params, batch) -> scalar tensor``.
        mesh: the mesh the shards live on.
        optimizer: a :class:`shardfn.optim.GradientTransformation`, run on local shards.
        donate: update the shards and the optimizer state in place (as JAX's
            ``donate_argnums``): the returned ``sharded`` and ``opt_state`` are the same
            tensors (when the optimizer has an in-place ``update_``, as shardfn.optim's
            do, no parameter-sized temporaries are allocated), and the trees you passed
            in must not be used for anything but this call. ``False`` returns new tensors
            and leaves its arguments untouched.
        micro_batches: gradient accumulation: split each rank's batch into this many
            equal micro-batches (dim 0), one forward and backward each, one optimizer
            update on the mean. Equals one step on the whole batch.
        accumulate: with ``micro_batches > 1``: ``"reduce_each"`` reduce-scatters every
            micro-batch's gradients and sums the shards (memory stays sharded; one
            reduce-scatter per unit and micro-batch), ``"local"`` sums unreduced unit
            gradients locally and reduce-scatters once on the last micro-batch (one per
            unit and step; a full gradient buffer per unit meanwhile).
        sync_buffers: average the floating-point buffers that the forward updated in
            place (running statistics) over all ranks after the backward, so every rank
            holds the same values (one all-reduce per mesh axis, only when some changed).

        loss_scale: a :class:`shardfn.DynamicLossScale` for fp16 training: skips steps
            whose gradients overflow on any rank; ``metrics`` then has ``loss_scale`` (the
            scale this step used) and ``skipped``.

        overlap: issue each unit's gradient reduction asynchronously, overlapping the
            rest of the backward (``False``: each reduction blocks, for comparison).
        prefetch: start each unit's all-gather while the unit before it computes (forward
            order recorded on the previous step; reversed for backward's regathers), at
            most one in flight; costs about one more unit of memory under FULL_SHARD.
            ``False`` gathers each unit only when it runs, for comparison.

    ``metrics`` holds ``loss`` (global mean), ``grad_norm`` (global L2 norm of the
    gradients, before any clipping), ``learning_rate`` (when the optimizer reports it),
    ``tokens`` (global count: elements of the batch's first integer tensor, else rows)
    and ``comm_bytes`` (bytes per collective kind issued by this rank in the step).

    Example:
        >>> step = jit_step(loss_fn, mesh, optimizer=shardfn.optim.adamw(3e-4))
        >>> sharded, opt_state, metrics = step(sharded, opt_state, batch)
    """
    if not callable(loss_fn):
        raise TypeError(f"jit_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"jit_step: mesh must be a shardfn.Mesh, got {type(mesh).__name__}")
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(
            f"jit_step: optimizer must have init and update functions (a GradientTransformation such as "
            f"shardfn.optim.adamw(3e-4)), got {type(optimizer).__name__}."
        )
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"jit_step: micro_batches must be a positive int, got {micro_batches!r}")
    if accumulate not in ("reduce_each", "local"):
        raise ValueError(f"jit_step: accumulate must be 'reduce_each' or 'local', got {accumulate!r}")
    if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(f"jit_step: loss_scale must be a shardfn.DynamicLossScale, got {loss_scale!r}")
    return Step(loss_fn, mesh, optimizer, donate, micro_batches, accumulate, sync_buffers, loss_scale, overlap, prefetch)
