"""jit_grad: a step's gradients as a tree of shards, for loops that do more than one update.

[Note: gradients as a tree]
``jit_grad(loss_fn, mesh)`` is everything a step does before its optimizer: the
forward and backward of every micro-batch with just-in-time gathers, one reduction per
unit, the metrics all-reduce (loss, gradient norm, ``Mean``'s count, buffer flags, aux)
and the buffer averaging. :class:`shardfn.Step` runs the same :class:`Grad` and then its
optimizer, inside the same runtime (so ``shardfn.optim.psum`` works in the optimizer), so
the two cannot drift apart.

The gradients are those of the global mean loss (of ``sum(total) / sum(count)`` for a
:class:`shardfn.Mean`), laid out like the trainable parameters: name -> this rank's
dim-0 shard, padding rows zero. They come as :class:`shardfn.optim.Gradients`, carrying
their global norm, so ``clip_by_global_norm`` on them needs no collective. Buffers
(running statistics) are updated in the tree you pass, and averaged over the ranks, as a
step would.

[Note: tokens over the ranks]
``metrics["tokens"]`` is the sum over the ranks of each rank's tokens (``count_tokens``),
never one rank's count times the ranks. A plain mean loss needs as many rows and tokens on
every rank, and the metrics all-reduce's header carries them ([Note: the schedule guard]),
so ranks that pass it agree: the product is the sum, a host int. With a :class:`Mean` loss
ranks may differ, so the count rides on that same all-reduce, split into two words (the
low 12 bits and the rest: every partial sum is an integer below 2**24, exact in fp32 up
to 2**36 tokens and 4096 ranks); the step reads it with the loss and norm (an int), or,
reading nothing (``on_nonfinite="raise_next"``, a recorded step), hands out the 0-d
int64 device tensor. A recorded step's program holds that sum; with a plain loss it was
recorded while the headers agreed, and a replay assumes what the plain loss itself does
(the ranks replay programs recorded together). A world of one counts on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from .._comm import collectives as C
from .batch import MicroBatches, agree_on_micro_batches, count_tokens, objective, rows, split, uneven_error
from .buffers import StepBuffers
from .._comm.events import Purpose
from .._comm.guard import Where, guarded
from .._state.layout import Layout
from .._mesh import Mesh
from .._compile import backend_of
from .._deprecated import as_loss, old_options
from .functionalize import apply_of
from ..optim._gradients import Gradients
from .options import Accumulate, Aux, StepOptions, check_options
from .._comm.pipelined import Deviated, Run, Schedule
from ..optim._psum import sum_of_squares
from .._comm.recording import device_values
from .._comm.scope import Scope
from .runtime import Runtime, active
from .._state.sharded import ShardedParams
from .._parallel.sequence import sum_partial_grads
from .._parallel.tensor import split_sum_of_squares
from .._parallel.agree import batch_digests, other_batches
from .._state.verdict import agreed_error

__all__ = ["Grad", "GradOut", "jit_grad"]

_OTHER_LAYOUT = (
    "{what}(sharded, ...): these shards have a different layout than the ones it was first called with.\n"
    "  first call: {first!r}\n  this call:  {got!r}\n"
    "A step or grad function (and the optimizer state) belongs to one layout: build a new one with "
    "shardfn.jit_step(...) / shardfn.jit_grad(...) (and a new opt_state, opt.init(sharded)) for these shards, or "
    "pass the shards it returned."
)
_NO_ELEMENTS = (
    "[rank {rank}] {what}: the Mean losses of this step count 0 elements on every rank (every label padding?): "
    "there is nothing to average. Nothing was updated; skip such batches."
)
_USED_DIRECTLY = (
    "loss_fn(apply, params, batch): used the shards of {names} directly, not through apply(params, ...): a shard is this rank's dim-0 "
    "chunk of the parameter, not the parameter. Call apply(params, ...) (or compute the term from "
    "shardfn.gather(...) outside the step)."
)


class GradOut(NamedTuple):
    """What :meth:`Grad.run` yields: the global mean loss (0-d fp32), the gradient shards
    and the metrics so far (``tokens`` and ``comm_bytes`` are added when the run ends)."""

    loss: torch.Tensor
    grads: Gradients
    metrics: dict[str, Any]
    # with a tensor axis: the tensor ranks, over the mesh, whose group got two batches (0-d;
    # [Note: one batch per tensor group]); what a raise_next step's verdict carries
    batches_differ: torch.Tensor | None
    # what the step's update is handed from the run, still active: a call that ends the
    # run's work in flight (Runtime.settle), and the observers the run reports to
    settle: Callable[[], None]
    observers: tuple[Any, ...]


class Grad:
    """``grad_fn(sharded, batch) -> (loss, grads, metrics)``; see :func:`jit_grad`."""

    def __init__(self, loss: tuple[Callable[..., Any], bool], mesh: Mesh, options: StepOptions):
        # loss_fn(apply, params, batch), and whether it reads apply ([Note: one loss convention])
        self.loss_fn, self.needs_apply = loss
        self.mesh = mesh
        self.options = options  # [Note: step options]
        self.has_aux = options.aux is not Aux.NONE
        # Not state of the model: the units' forward order (a prefetch hint, recorded on
        # each call that completes, for the next: the part of a forward that a failed call
        # ran would make this rank prefetch, so issue collectives, otherwise than its peers)
        # and the layout of the first call (to catch other shards).
        self.order: list[tuple[int, int]] = []
        self.layout: Layout | None = None
        self.schedule = Schedule()  # the collectives of the last verified call

    def __call__(self, sharded: ShardedParams, batch: Any) -> tuple[torch.Tensor, Gradients, dict[str, Any]]:
        with guarded(self.mesh, Where.STEP) as scope:  # a rank whose arguments are refused tells the others
            self.check(sharded)
        buffers = StepBuffers(sharded, list(sharded.layout.buffers), donate=True, track=self.options.sync_buffers,
                              recorded=scope.comm.recorded, fake=self.mesh.fake)
        with self.run(sharded, batch, buffers, scope) as out:
            pass
        replaced = buffers.replaced(sharded)
        if replaced:
            sharded._set_buffers(replaced)
        return out.loss, out.grads, out.metrics

    def check(self, sharded: Any) -> None:
        if self.mesh.size > 1:
            self.mesh.guard.check_alive(f"{self.options.what}(sharded, ...)")
        if not isinstance(sharded, ShardedParams):
            raise TypeError(
                f"{self.options.what}(sharded, ...): expected the ShardedParams from shardfn.shard(), got "
                f"{type(sharded).__name__}."
            )
        if sharded.mesh is not self.mesh and sharded.mesh != self.mesh:
            raise ValueError(
                f"{self.options.what}(sharded, ...): the shards live on {sharded.mesh!r} but this {self.options.what} was built for "
                f"{self.mesh!r}. Shard with the same mesh you pass to jit_step / jit_grad."
            )
        if self.needs_apply and apply_of(sharded) is None:
            raise TypeError(
                f"{self.options.what}(sharded, ...): loss_fn(apply, params, batch) needs the apply of the model these shards "
                "were made from, and they were made from a plain mapping, which names no model. Shard the params "
                "of shardfn.functionalize(model) (they carry the model)."
            )
        if self.layout is None:
            self.layout = sharded.layout
        elif sharded.layout is not self.layout and sharded.layout != self.layout:
            raise ValueError(_OTHER_LAYOUT.format(what=self.options.what, first=self.layout, got=sharded.layout))

    @contextmanager
    def run(self, sharded: ShardedParams, batch: Any, buffers: StepBuffers, scope: Scope, scale: float = 1.0,
            nonfinite: bool = False) -> Iterator[GradOut]:
        """Computes the gradients and metrics with ``buffers`` as the working buffers, and
        yields them while the runtime is still active (a step runs its optimizer there).
        ``scope``: the one the public call began in, handed down ([Note: the scope]).
        ``nonfinite``: this rank read a verdict of ``sharded`` that is not finite (shardfn._state.verdict
        [Note: reading a verdict when it is ready]); told in the opening header, and if any
        rank's is True, every rank raises there."""
        layout = sharded.layout
        run = Run(self.schedule, self.mesh) if self.mesh.size > 1 else None
        rt = Runtime(self.mesh, scope, self.options, order=self.order, owner=sharded, buffers=buffers, run=run)
        done = False
        with self.mesh.random.drawing(self.mesh, scope):  # [Note: randomness on the tensor axis]
            rng = _rng_state(self.mesh.device) if run is not None and run.pipelined else None
            try:
                with active(rt):
                    if run is not None and run.open(rt.scope, nonfinite):
                        raise run.told(agreed_error(sharded, self.options.what))
                    # [Note: one batch per tensor group] (a graph step's: on the host, before its program)
                    checked = self.mesh.axis_size("tensor") > 1 and not scope.comm.recorded
                    digests = batch_digests(batch, rt) if checked else None
                    while True:  # once, or twice when every rank's schedule changed alike
                        try:
                            loss, count, grads, auxes = self._grads(rt, sharded, batch, scale)
                            if run is not None:
                                run.end_of_backward(rt.scope)
                        except Deviated:
                            run.report(rt.scope)  # raises (the buffers are restored below), unless every rank deviated alike
                            buffers.restore()  # then the step runs again from the same state
                            rt.restart()
                            run.rerun()
                            _set_rng_state(rng)
                            continue
                        break
                    # The loss, the gradients' sum of squares, Mean's count, the buffer-change flags
                    # (and the aux to average) share one all-reduce per mesh axis.
                    # With a plain loss every rank must have as many rows (and tokens): the metrics all-reduce's
                    # header carries them (see [Note: the schedule guard]); Mean weighs them exactly.
                    # [Note: tokens over the ranks]
                    tokens = count_tokens(batch)
                    summed = self.mesh.size > 1 and count is not None
                    sq = (split_sum_of_squares(grads, layout, self.mesh, sum_of_squares)
                          if self.mesh.axis_size("tensor") > 1 else sum_of_squares(grads))
                    differ = (digests != digests[0]).any() if digests is not None else None
                    reduced = self._reduce_metrics(rt.scope, layout, loss, count, sq,
                                                   buffers.flags(self.mesh.device), auxes, len(auxes),
                                                   rows=0 if count is not None else _size(batch),
                                                   tokens=tokens if summed else None, differ=differ)
                    tokens = reduced["tokens"] if summed else tokens * self.mesh.data_size
                    if run is not None:
                        self.schedule.learn(run.recorded, run.pipelined)
                    if reduced["rescale"] is not None:  # [Note: token-weighted losses]
                        torch._foreach_mul_(list(grads.values()), reduced["rescale"])
                    norm = reduced["norm"]
                    metrics: dict[str, Any] = {"loss": reduced["loss"], "grad_norm": norm}
                    if self.options.read_metrics:
                        extra = [reduced["differ"]] if differ is not None else []
                        metrics["loss"], metrics["grad_norm"], *read = _scalars(self.mesh.fake, reduced["loss"], norm,
                                                                               *extra, *([tokens] if summed else []))
                        if extra and read.pop(0):  # (the same sum on every rank: every rank raises here)
                            raise run.told(other_batches(digests, self.mesh))
                        tokens = int(read[0]) if read and read[0] is not None else tokens
                        if not all(math.isfinite(v) for v in (metrics["loss"], metrics["grad_norm"]) if v is not None):
                            metrics["nonfinite"] = self._nonfinite_ranks(loss, grads, rt.scope)
                    if self.has_aux:
                        metrics["aux"] = reduced["aux"]
                    if self.options.sync_buffers:
                        buffers.sync(reduced["changed"], self.mesh, rt.scope)
                    done = True  # from here on the caller updates the state
                    yield GradOut(reduced["loss"], Gradients(grads, norm), metrics, reduced["differ"], rt.settle,
                                  rt.observers)
            except BaseException:
                if not done:
                    buffers.restore()  # nothing the step changed stays changed
                raise
            finally:
                order = rt.finish()
                if done:
                    self.order = order
        metrics["tokens"] = tokens
        metrics["comm_bytes"] = dict(rt.log.bytes())
        if layout.offloaded:
            metrics["transfer_bytes"] = dict(rt.log.transfer_bytes())  # host <-> device ([Note: offload])

    def _grads(self, rt: Runtime, sharded: ShardedParams, batch: Any,
               scale: float) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor], list[Any]]:
        """This rank's loss (the mean over micro-batches, or with Mean the sum of totals),
        Mean's count (or None), the reduced gradients of the trainable shards, the aux of each
        micro-batch."""
        trainable = [n for n, leaf in sharded.layout.leaves.items() if leaf.requires_grad]
        leaves = [sharded[n] for n in trainable]
        loose = [n for n, g in sharded.layout.ignored.items() if g.requires_grad]  # [Note: ignored parameters]
        if loose and rt.scope.comm.recorded:
            from .._comm.recording import Unrecordable

            raise Unrecordable(f"the gradients of the ignored parameters ({', '.join(loose[:3])}) are taken by "
                               "autograd and all-reduced outside the units", "leave shard(ignored=...) out",
                               frozen=False)
        own: dict[str, torch.Tensor] = {}
        batches = split(batch, self.options.micro_batches, "jit_grad" if self.options.what == "grad_fn" else "jit_step")
        sizes = agree_on_micro_batches(batch, self.mesh, rt.scope) if isinstance(batch, MicroBatches) else None
        k = len(batches)
        grads: dict[str, torch.Tensor] = {}
        values, counts, auxes = [], [], []
        # Gradients of the mean over micro-batches and ranks (see [Note: averaging
        # gradients]), times the fp16 loss scale, divided out below.
        factor = rt.loss_factor(k) * scale
        apply = apply_of(sharded)
        for i, mb in enumerate(batches):
            rt.start_micro_batch(last=i == k - 1)
            loss, count, aux = objective(self.loss_fn(apply, sharded, mb), self.has_aux, bool(leaves or loose),
                                           self.options.read_metrics, self.mesh.fake)
            if counts and (count is None) != (counts[0] is None):
                raise TypeError("loss_fn(apply, params, batch): returned shardfn.Mean for some micro-batches and a plain "
                                "loss for others; return one kind in a step.")
            if count is None and sizes is not None and len({s for pair in sizes for s in pair}) > 1:
                raise uneven_error(sizes)
            values.append(loss.detach())
            counts.append(count)
            auxes.append(aux)
            if not leaves and not loose:
                continue
            try:
                with torch.profiler.record_function("shardfn::backward"):
                    direct = torch.autograd.grad(loss * factor if factor != 1.0 else loss,
                                                 leaves + [sharded[n] for n in loose], allow_unused=True)
            except BaseException:
                rt.settle()  # nothing left in flight
                raise
            rt.end_backward(grads)  # every reduction done; the reduced shard gradients added into grads
            for n, g in zip(loose, direct[len(leaves):]):
                if g is not None:
                    own[n] = g if n not in own else own[n] + g
            used = [n for n, g in zip(trainable, direct[: len(leaves)]) if g is not None]
            if used:
                raise ValueError(_USED_DIRECTLY.format(names=", ".join(used[:4])))
        out = {n: grads[n] if n in grads else torch.zeros_like(sharded[n]) for n in trainable}
        if loose:
            out.update(reduce_ignored(own, loose, sharded, rt.scope))
        # partial gradients: [Note: the sequence region], [Note: a module that reads split heads]
        if sharded.layout.tensor:
            sum_partial_grads(out, sharded.layout, rt)
        if scale != 1.0:
            out = {n: g.div_(scale) for n, g in out.items()}
        if counts[0] is None:
            return torch.stack(values).mean(), None, out, auxes
        return torch.stack([v.float() for v in values]).sum(), torch.stack(counts).sum(), out, auxes

    def _nonfinite_ranks(self, loss: torch.Tensor, grads: dict[str, torch.Tensor], scope: Scope) -> dict[str, list[int]]:
        """Which ranks saw a non-finite loss, and which hold non-finite gradient shards: one
        small all-gather, only in a step whose global loss or norm is not finite (the same
        decision on every rank: both came out of the metrics all-reduce)."""
        bad = torch.tensor([not bool(torch.isfinite(loss.detach()).all()),
                            not all(bool(torch.isfinite(g).all()) for g in grads.values())], dtype=torch.float32)
        every = C.all_gather_mesh(bad.to(self.mesh.device), self.mesh, Purpose.METRICS, scope=scope).view(-1, 2).cpu()
        return {"loss": [r for r in range(len(every)) if every[r, 0]],
                "grads": [r for r in range(len(every)) if every[r, 1]]}

    def _reduce_metrics(self, scope: Scope, layout: Layout, loss: torch.Tensor, count: torch.Tensor | None, sq: torch.Tensor,
                        flags: torch.Tensor, auxes: list[Any], k: int, rows: int = 0,
                        tokens: int | None = None, differ: torch.Tensor | None = None) -> dict[str, Any]:
        """Global loss and gradient norm, which buffers changed on any rank (and Mean's global
        count, the tokens summed over the ranks, the averaged aux): one all-reduce (sum) per
        mesh axis of ``[loss, sum of squares, (count), (tokens as two words), flags..., (aux...)]``.

        A plain loss is averaged over every rank (equal-sized batches); with Mean, the loss
        is the sum of totals over the global count, and the gradients are to be multiplied
        by ``rescale`` (see [Note: token-weighted losses]). The sum of squares is summed over
        all ranks and divided by the number of replicas of each shard, which hold the same
        gradients. A buffer flag is positive where some rank changed it. ``scope``: the
        runtime's (its pipelined run, its log, whether it is recorded or a planning run).
        """
        device = self.mesh.device
        head = [loss.detach().float(), sq.float()] + ([count] if count is not None else [])
        if tokens is not None:  # exact in fp32 sums: 12 low bits, and the rest ([Note: tokens over the ranks])
            head += list(device_values([tokens >> 12, tokens & 4095], torch.float32, device, scope.comm.recorded))
        aux_flat, unflatten = _flat_aux(auxes) if self.options.aux is Aux.MEAN else (torch.zeros(0, device=device), None)
        tail = [differ.float().reshape(1)] if differ is not None else []  # [Note: one batch per tensor group]
        v = torch.cat([torch.stack([t.to(device) for t in head]), flags, aux_flat.to(device), *tail])
        if self.mesh.axis_rank("tensor") > 0:  # a tensor axis's ranks share one batch: counted once, on its rank 0
            keep = torch.zeros_like(v)
            keep[1] = 1  # (the sum of squares: shardfn._parallel.tensor.split_sum_of_squares)
            keep[len(head) : len(head) + flags.numel()] = 1
            keep[v.numel() - len(tail):] = 1
            v = v * keep
        if self.mesh.size > 1:
            C.all_reduce_mesh(v, self.mesh, Purpose.METRICS, op=C.SUM, detail=rows, scope=scope)
        n = len(head)
        norm = (v[1] / layout.replicas).sqrt()
        out: dict[str, Any] = {"changed": v[n : n + flags.numel()], "rescale": None, "tokens": None,
                               "differ": v[-1] if tail else None}
        if tokens is not None:
            out["tokens"] = (v[n - 2].double() * 4096 + v[n - 1].double()).to(torch.int64)
        if count is None:
            out["loss"] = v[0] / self.mesh.data_size
        else:
            total = v[2]
            if self.options.read_metrics and not self.mesh.fake and float(total) == 0:
                raise ValueError(_NO_ELEMENTS.format(rank=self.mesh.rank, what=self.options.what))
            rescale = self.mesh.data_size * k / total
            out["loss"], out["rescale"] = v[0] / total, rescale
            norm = norm * rescale
        out["norm"] = norm
        if self.has_aux:
            out["aux"] = unflatten(v[n + flags.numel():v.numel() - len(tail)] / self.mesh.data_size) if unflatten else (
                auxes[0] if len(auxes) == 1 else list(auxes))
        return out


def _size(batch: Any) -> int:
    """What must agree across ranks for a plain mean loss: the batch's rows, and in the high
    32 bits the elements of its first integer tensor (tokens) when they are not the rows."""
    n, tokens = _rows(batch), count_tokens(batch)
    return n + (tokens << 32) if tokens != n else n


def _rows(batch: Any) -> int:
    """Rows of the batch (MicroBatches: all of them), 0 when it has no batched tensor."""
    try:
        return sum(rows(b) for b in batch) if isinstance(batch, MicroBatches) else rows(batch)
    except (TypeError, ValueError):
        return 0


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's generators, for a step that may run twice (see [Note: the pipelined guard])."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None] | None) -> None:
    if state is not None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])


def _scalars(fake: bool, *ts: torch.Tensor) -> list[float | None]:
    """Metrics as Python floats, read from the device in one copy: the step's one
    synchronisation with the device, which its check that the step is finite needs before
    the state changes (``None`` in a planning run, ``fake``: it has no values)."""
    if fake:
        return [None] * len(ts)
    # fp64 only for a count of tokens (exact to 2**53); fp32 metrics are read as they are
    dtype = torch.float32 if all(t.is_floating_point() for t in ts) else torch.float64
    return torch.stack([t.detach().to(dtype) for t in ts]).tolist()


def _flat_aux(auxes: list[Any]) -> tuple[torch.Tensor, Any]:
    """The aux of every micro-batch, averaged over them and flattened (fp32), and a function
    that rebuilds the aux tree from such a flat tensor."""
    flat = [pytree.tree_flatten(a) for a in auxes]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise TypeError("loss_fn(apply, params, batch): its aux must have the same structure in every micro-batch "
                        "to be averaged.")
    leaves = [[torch.as_tensor(x).detach().float() for x in leaves] for leaves, _ in flat]
    means = [torch.stack(per).mean(0) for per in zip(*leaves)]
    shapes = [m.shape for m in means]
    flat_tensor = torch.cat([m.reshape(-1) for m in means]) if means else torch.zeros(0)

    def unflatten(v: torch.Tensor) -> Any:
        parts = v.split([s.numel() for s in shapes]) if shapes else []
        return pytree.tree_unflatten([p.reshape(s) for p, s in zip(parts, shapes)], spec)

    return flat_tensor, unflatten


@old_options
def jit_grad(
    loss_fn: Callable[..., Any],
    mesh: Mesh,
    *,
    micro_batches: int = 1,
    accumulate: Accumulate | str = Accumulate.REDUCE_EACH,
    sync_buffers: bool = True,
    overlap: bool = True,
    prefetch: bool | int = True,
    aux: Aux | str | None = None,
    keep_gathered: bool = False,
    compile: bool | str = False,
) -> Grad:
    """Builds ``grad_fn(sharded, batch) -> (loss, grads, metrics)``: a step without its update.

    For loops that do something other than one optimizer update per batch: DiLoCo's outer
    step, per-unit gradient statistics, the gradient noise scale, an update of your own.
    ``loss_fn(apply, params, batch)``, the batch and every option mean what they mean for
    :func:`shardfn.jit_step`,
    which runs this same code and then its optimizer (see [Note: gradients as a tree]);
    ``compile`` too: each unit module's forward compiled by ``torch.compile``.

    Returns, on every rank:
        loss: the global mean loss, a 0-d fp32 tensor (the same on every rank).
        grads: :class:`shardfn.optim.Gradients`, name -> this rank's shard of the gradient of
            that loss, for every trainable parameter (shaped like its shard in ``sharded``;
            padding rows zero), with ``grads.global_norm``. Feed them to
            ``optimizer.update(grads, state, sharded)``; for statistics over whole
            parameters sum over the shards with ``shardfn.optim.psum`` inside
            ``shardfn.on_shards(sharded)``.
        metrics: ``loss``, ``grad_norm``, ``tokens``, ``comm_bytes`` (and ``aux``), as a step's.

    Buffers: the forward's updates of the buffers (running statistics) land in ``sharded``,
    averaged over the ranks, as ``apply`` outside a step does.

    Example:
        >>> grad_fn = shardfn.jit_grad(loss_fn, mesh)
        >>> loss, grads, metrics = grad_fn(sharded, batch)
        >>> updates, opt_state = opt.update(grads, opt_state, sharded)
        >>> shardfn.optim.apply_updates_(sharded, updates)
    """
    accumulate = check_options(loss_fn, mesh, micro_batches, accumulate, aux, "jit_grad", prefetch)
    options = StepOptions("grad_fn", micro_batches, accumulate, bool(sync_buffers), bool(overlap), int(prefetch),
                          Aux.parse(aux), bool(keep_gathered), backend_of(compile, "jit_grad"))
    return Grad(as_loss(loss_fn, "jit_grad", stacklevel=5), mesh, options)


def reduce_ignored(own: dict[str, torch.Tensor], names: list[str], sharded: ShardedParams,
                   scope: Scope) -> dict[str, torch.Tensor]:
    """The ignored parameters' gradients summed over the data ranks (each micro-batch's loss
    already divided as [Note: averaging gradients] says): one all-reduce per dtype of them
    all laid end to end ([Note: ignored parameters])."""
    out = {n: own[n] if n in own else torch.zeros_like(sharded[n]) for n in names}
    mesh = sharded.mesh
    if mesh.size == 1:
        return out
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n in names:
        by_dtype.setdefault(out[n].dtype, []).append(n)
    for dtype, group in by_dtype.items():
        flat = torch.cat([out[n].reshape(-1) for n in group])
        C.all_reduce_mesh(flat, mesh, Purpose.REDUCE, op=C.SUM, scope=scope)
        for n, piece in zip(group, flat.split([out[n].numel() for n in group])):
            out[n] = piece.view_as(out[n])
    return out
