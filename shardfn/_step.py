"""jit_step: one training step on local shards, as a function."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

from . import _collectives as C
from ._batch import MicroBatches, agree_on_micro_batches, count_tokens, objective, split, uneven_error
from ._buffers import StepBuffers
from ._events import Purpose
from ._layout import Layout
from ._mesh import Mesh
from ._precision import DynamicLossScale, LossScaleState
from ._psum import Gradients, sum_of_squares
from ._runtime import Accumulate, Runtime, active
from ._sharded import ShardedParams
from .optim import GradientTransformation, apply_updates, apply_updates_, hyperparams
from .optim._protocol import param_leaves

__all__ = ["Step", "jit_step"]

_OTHER_LAYOUT = (
    "step(sharded, ...): these shards have a different layout than the ones this step was first called with.\n"
    "  first call: {first!r}\n  this call:  {got!r}\n"
    "A step (and its optimizer state) belongs to one layout: build a new step with shardfn.jit_step(...) and a "
    "new opt_state with opt.init(sharded) (step.init(sharded) with loss_scale) for these shards, or pass the "
    "shards this step returned."
)
_NOT_LOSS_SCALED = (
    "step(sharded, opt_state, ...): this step scales the loss (jit_step(loss_scale=...)), so its optimizer state "
    "carries the scale: a shardfn.LossScaleState, got {got}. Build it with opt_state = step.init(sharded)."
)
_NO_ELEMENTS = (
    "[rank {rank}] step: the Mean losses of this step count 0 elements on every rank (every label padding?): "
    "there is nothing to average. Nothing was updated; skip such batches."
)
_USED_DIRECTLY = (
    "loss_fn used the shards of {names} directly, not through apply(params, ...): a shard is this rank's dim-0 "
    "chunk of the parameter, not the parameter. Call apply(params, ...) (or compute the term from "
    "shardfn.gather(...) outside the step)."
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
        accumulate: Accumulate,
        sync_buffers: bool,
        loss_scale: DynamicLossScale | None,
        overlap: bool,
        prefetch: bool,
        has_aux: bool,
        mean_aux: bool,
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
        self.has_aux = has_aux
        self.mean_aux = mean_aux
        # Not state of the model: the units' forward order (a prefetch hint, recorded on
        # each step for the next) and the layout of the first call (to catch other shards).
        self.order: list[tuple[int, str]] = []
        self.layout: Layout | None = None

    def init(self, sharded: ShardedParams) -> Any:
        """The optimizer state this step takes: ``optimizer.init(sharded)``, and with
        ``loss_scale`` the :class:`shardfn.LossScaleState` around it."""
        state = self.optimizer.init(sharded)
        return self.loss_scale.init(state) if self.loss_scale is not None else state

    def __call__(self, sharded: ShardedParams, opt_state: Any, batch: Any) -> tuple[ShardedParams, Any, dict[str, Any]]:
        self._check(sharded, opt_state)
        inner = opt_state.opt_state if self.loss_scale is not None else opt_state
        scale = float(opt_state.scale) if self.loss_scale is not None else 1.0
        layout = sharded.layout
        buffers = StepBuffers(sharded, list(layout.buffers), donate=self.donate, track=self.sync_buffers)
        rt = Runtime(
            self.mesh, in_step=True, overlap=self.overlap, prefetch=self.prefetch, order=self.order,
            accumulate=self.accumulate, owner=sharded, buffers=buffers,
        )
        try:
            with active(rt):
                loss, count, grads, auxes = self._grads(rt, sharded, batch, scale)
                # The loss, the gradients' sum of squares, Mean's count, the buffer-change flags
                # (and the aux to average) share one all-reduce per mesh axis.
                reduced = self._reduce_metrics(layout, loss, count, sum_of_squares(grads),
                                               buffers.flags(self.mesh.device), auxes, len(auxes))
                loss, norm, changed, rescale = reduced["loss"], reduced["norm"], reduced["changed"], reduced["rescale"]
                if rescale is not None:  # [Note: token-weighted losses]
                    torch._foreach_mul_(list(grads.values()), rescale)
                metrics: dict[str, Any] = {"loss": loss, "grad_norm": _scalar(norm)}
                if self.has_aux:
                    metrics["aux"] = reduced["aux"]
                metrics.update(hyperparams(self.optimizer, inner))
                skip = False
                if self.loss_scale is not None:
                    # The same value on every rank: the norm came out of an all-reduce.
                    skip = not is_fake(norm) and not bool(torch.isfinite(norm))
                    metrics.update(loss_scale=scale, skipped=skip)
                    opt_state = LossScaleState(inner, *self.loss_scale.next(opt_state, not skip))
                grads = Gradients(grads, norm)
                # Donation with an in-place optimizer (optim [Note: donation]): params and state
                # are updated in place and the gradients serve as scratch; else update + apply.
                in_place = self.donate and getattr(self.optimizer, "update_", None) is not None
                updates = None
                if not skip:
                    with torch.profiler.record_function("shardfn::optimizer"):
                        if in_place:
                            rt.settle()  # no all-gather may still be reading the shards
                            inner = self.optimizer.update_(grads, inner, sharded)
                        else:
                            updates, inner = self.optimizer.update(grads, inner, sharded)
                if self.sync_buffers:
                    buffers.sync(changed, self.mesh)
        finally:
            self.order = rt.finish()
        opt_state = opt_state._replace(opt_state=inner) if self.loss_scale is not None else inner
        replaced = {n: b for n, b in buffers.work.items() if b is not sharded[n]}
        if updates is None or self.donate:
            if updates is not None:
                apply_updates_(sharded, updates)
            new = sharded.replace(replaced) if replaced else sharded
        else:
            new = sharded.replace({**apply_updates(sharded.params(), updates), **buffers.work})
        metrics["tokens"] = count_tokens(batch) * self.mesh.size
        metrics["comm_bytes"] = dict(rt.log.bytes())
        return new, opt_state, metrics

    def _grads(self, rt: Runtime, sharded: ShardedParams, batch: Any,
               scale: float) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor], list[Any]]:
        """This rank's loss (the mean over micro-batches, or with Mean the sum of totals),
        Mean's count (or None), the reduced gradients of the trainable shards, the aux of each
        micro-batch."""
        trainable = [n for n, leaf in sharded.layout.leaves.items() if leaf.requires_grad]
        leaves = [sharded[n] for n in trainable]
        batches = split(batch, self.micro_batches)
        sizes = agree_on_micro_batches(batch, self.mesh) if isinstance(batch, MicroBatches) else None
        k = len(batches)
        grads: dict[str, torch.Tensor] = {}
        values, counts, auxes = [], [], []
        # Gradients of the mean over micro-batches and ranks (see [Note: averaging
        # gradients]), times the fp16 loss scale, divided out below.
        factor = rt.loss_factor(k) * scale
        for i, mb in enumerate(batches):
            rt.start_micro_batch(last=i == k - 1)
            loss, count, aux = objective(self.loss_fn(sharded, mb), self.has_aux, bool(leaves))
            if counts and (count is None) != (counts[0] is None):
                raise TypeError("loss_fn returned shardfn.Mean for some micro-batches and a plain loss for others; "
                                "return one kind in a step.")
            if count is None and sizes is not None and sizes[0] != sizes[1]:
                raise uneven_error(sizes)
            values.append(loss.detach())
            counts.append(count)
            auxes.append(aux)
            if not leaves:
                continue
            try:
                with torch.profiler.record_function("shardfn::backward"):
                    direct = torch.autograd.grad(loss * factor if factor != 1.0 else loss, leaves, allow_unused=True)
            except BaseException:
                rt.wait_pending()
                raise
            rt.end_backward(grads)  # every reduction done; the reduced shard gradients added into grads
            used = [n for n, g in zip(trainable, direct) if g is not None]
            if used:
                raise ValueError(_USED_DIRECTLY.format(names=", ".join(used[:4])))
        out = {n: grads[n] if n in grads else torch.zeros_like(sharded[n]) for n in trainable}
        if scale != 1.0:
            out = {n: g.div_(scale) for n, g in out.items()}
        if counts[0] is None:
            return torch.stack(values).mean(), None, out, auxes
        return torch.stack([v.float() for v in values]).sum(), torch.stack(counts).sum(), out, auxes

    def _reduce_metrics(self, layout: Layout, loss: torch.Tensor, count: torch.Tensor | None, sq: torch.Tensor,
                        flags: torch.Tensor, auxes: list[Any], k: int) -> dict[str, Any]:
        """Global loss and gradient norm, which buffers changed on any rank (and Mean's global
        count, the averaged aux): one all-reduce (sum) per mesh axis of
        ``[loss, sum of squares, (count), flags..., (aux...)]``.

        A plain loss is averaged over every rank (equal-sized batches); with Mean, the loss
        is the sum of totals over the global count, and the gradients are to be multiplied
        by ``rescale`` (see [Note: token-weighted losses]). The sum of squares is summed over
        all ranks and divided by the number of replicas of each shard, which hold the same
        gradients. A buffer flag is positive where some rank changed it.
        """
        device = self.mesh.device
        head = [loss.detach().float(), sq.float()] + ([count] if count is not None else [])
        aux_flat, unflatten = _flat_aux(auxes) if self.has_aux and self.mean_aux else (torch.zeros(0), None)
        v = torch.cat([torch.stack([t.to(device) for t in head]), flags, aux_flat.to(device)])
        if self.mesh.size > 1:
            C.all_reduce_mesh(v, self.mesh, Purpose.METRICS, op=C.SUM)
        n = len(head)
        norm = (v[1] / layout.replicas).sqrt()
        out: dict[str, Any] = {"changed": v[n : n + flags.numel()], "rescale": None}
        if count is None:
            out["loss"] = _scalar(v[0] / self.mesh.size)
        else:
            total = v[2]
            if not is_fake(total) and float(total) == 0:
                raise ValueError(_NO_ELEMENTS.format(rank=self.mesh.rank))
            rescale = self.mesh.size * k / total
            out["loss"], out["rescale"] = _scalar(v[0] / total), rescale
            norm = norm * rescale
        out["norm"] = norm
        if self.has_aux:
            out["aux"] = unflatten(v[n + flags.numel():] / self.mesh.size) if unflatten is not None else (
                auxes[0] if len(auxes) == 1 else list(auxes))
        return out

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
        if self.loss_scale is not None:
            if not isinstance(opt_state, LossScaleState):
                raise TypeError(_NOT_LOSS_SCALED.format(got=type(opt_state).__name__))
            opt_state = opt_state.opt_state
        check_opt_state(opt_state, sharded)


def check_opt_state(opt_state: Any, sharded: ShardedParams) -> None:
    """Every optimizer-state tensor under a parameter's key must be shaped like its shard."""
    leaves = sharded.layout.leaves
    problems = []
    for path, name, leaf in param_leaves(opt_state):
        if not isinstance(leaf, torch.Tensor) or name is None:
            continue
        where = f"opt_state{path}"
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
            + "\nInitialise it from these shards: opt_state = opt.init(sharded) (step.init(sharded) with loss_scale)."
        )


def _scalar(t: torch.Tensor) -> float | None:
    """A metric as a Python float; ``None`` for a fake tensor (a planning run has no values)."""
    return None if is_fake(t) else float(t)


def _flat_aux(auxes: list[Any]) -> tuple[torch.Tensor, Any]:
    """The aux of every micro-batch, averaged over them and flattened (fp32), and a function
    that rebuilds the aux tree from such a flat tensor."""
    flat = [pytree.tree_flatten(a) for a in auxes]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise TypeError("loss_fn's aux must have the same structure in every micro-batch to be averaged.")
    leaves = [[torch.as_tensor(x).detach().float() for x in leaves] for leaves, _ in flat]
    means = [torch.stack(per).mean(0) for per in zip(*leaves)]
    shapes = [m.shape for m in means]
    flat_tensor = torch.cat([m.reshape(-1) for m in means]) if means else torch.zeros(0)

    def unflatten(v: torch.Tensor) -> Any:
        parts = v.split([s.numel() for s in shapes]) if shapes else []
        return pytree.tree_unflatten([p.reshape(s) for p, s in zip(parts, shapes)], spec)

    return flat_tensor, unflatten


def jit_step(
    loss_fn: Callable[[Mapping[str, torch.Tensor], Any], torch.Tensor],
    mesh: Mesh,
    *,
    optimizer: GradientTransformation,
    donate: bool = True,
    micro_batches: int = 1,
    accumulate: Accumulate | str = Accumulate.REDUCE_EACH,
    sync_buffers: bool = True,
    loss_scale: DynamicLossScale | None = None,
    overlap: bool = True,
    prefetch: bool = True,
    has_aux: bool = False,
    mean_aux: bool = False,
) -> Step:
    """Builds ``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``.

    ``loss_fn(params, batch)`` is written as for one device: it calls ``apply(params, ...)``
    (as many times as it likes) and returns the mean loss over its batch, or a
    :class:`shardfn.Mean` ``(total, count)`` (a sum and the number of elements summed, for
    losses over padded tokens: the step then optimises the mean over every element of the
    global batch, see [Note: token-weighted losses]). Each rank passes its own slice of the
    global batch (equal sizes, for a plain loss); gradients are averaged over ranks, so a
    step equals one single-device step on the global batch. ``metrics["loss"]`` is the
    global mean loss. The step returns the whole state updated: parameter shards, buffers
    (running statistics, averaged over ranks) and optimizer state. The batch may be a
    :class:`shardfn.MicroBatches` of micro-batches of any sizes.

    Args:
        loss_fn: ``(params, batch) -> scalar tensor``.
        mesh: the mesh the shards live on.
        optimizer: a :class:`shardfn.optim.GradientTransformation`, run on local shards.
        donate: update the shards, buffers and optimizer state in place (as JAX's
            ``donate_argnums``): the returned ``sharded`` and ``opt_state`` hold the same
            tensors (when the optimizer has an in-place ``update_``, as shardfn.optim's
            do, no parameter-sized temporaries are allocated), and the trees you passed
            in must not be used for anything but this call. ``False`` returns new tensors
            and leaves its arguments untouched.
        micro_batches: gradient accumulation: split each rank's batch into this many
            equal micro-batches (dim 0), one forward and backward each, one optimizer
            update on the mean. Equals one step on the whole batch.
        accumulate: with ``micro_batches > 1``: :attr:`Accumulate.REDUCE_EACH`
            (``"reduce_each"``) reduce-scatters every micro-batch's gradients and sums the
            shards (memory stays sharded; one reduce-scatter per unit and micro-batch),
            :attr:`Accumulate.LOCAL` (``"local"``) sums unreduced unit gradients locally and
            reduce-scatters once on the last micro-batch (one per unit and step; a full
            gradient buffer per unit meanwhile).
        sync_buffers: average the floating-point buffers that the forward changed on any
            rank (running statistics) over all ranks after the backward, so every rank
            holds the same values (see [Note: buffers in a step]).
        loss_scale: a :class:`shardfn.DynamicLossScale` for fp16 training: skips steps
            whose gradients overflow on any rank; the scale lives in the optimizer state
            (build it with ``step.init(sharded)``); ``metrics`` then has ``loss_scale``
            (the scale this step used) and ``skipped``.
        overlap: issue each unit's gradient reduction asynchronously, overlapping the
            rest of the backward (``False``: each reduction blocks, for comparison).
        prefetch: start each unit's all-gather while the unit before it computes (forward
            order recorded on the previous step; reversed for backward's regathers), at
            most one in flight; costs about one more unit of memory under FULL_SHARD.
            ``False`` gathers each unit only when it runs, for comparison.
        has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` a pytree of tensors (accuracy,
            router statistics), as JAX's ``has_aux``. ``metrics["aux"]`` is this rank's aux
            (a list, one per micro-batch, when there are several).
        mean_aux: with ``has_aux``: ``metrics["aux"]`` is the aux averaged over micro-batches
            and ranks instead (fp32 tensors of the same tree), riding on the metrics
            all-reduce (4 bytes per element more, no extra collective).

    ``metrics`` holds ``loss`` (global mean), ``grad_norm`` (global L2 norm of the
    gradients, before any clipping), ``learning_rate`` (when the optimizer reports it),
    ``tokens`` (global count: elements of the batch's first integer tensor, else rows)
    and ``comm_bytes`` (bytes per collective kind issued by this rank in the step).

    Example:
        >>> step = jit_step(loss_fn, mesh, optimizer=shardfn.optim.adamw(3e-4))
        >>> opt_state = step.init(sharded)         # = opt.init(sharded) without loss_scale
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
    accumulate = Accumulate.parse(accumulate)
    if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(f"jit_step: loss_scale must be a shardfn.DynamicLossScale, got {loss_scale!r}")
    if mean_aux and not has_aux:
        raise ValueError("jit_step(mean_aux=True) averages loss_fn's aux: pass has_aux=True too.")
    return Step(loss_fn, mesh, optimizer, donate, micro_batches, accumulate, sync_buffers, loss_scale, overlap, prefetch,
                has_aux, mean_aux)
