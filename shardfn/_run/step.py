"""jit_step: one training step on local shards, as a function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .buffers import StepBuffers
from .grad import Grad
from .._errors import PeerError
from .._comm.failures import describe, failed_at
from .._comm.guard import Failure, Where, guarded
from .no_return import after_agreement, check_outputs, quick as _quick, signature as _signature
from .options import OnNonfinite
from .._state.offload import mark_host_trees, place_on_host, wait_for_device
from .._state.replica import refresh
from .._state.precision import DynamicLossScale, LossScaleState
from .._state.sharded import ShardedParams, unit_views
from .._state.verdict import Unusable, Verdict, check_usable, read_ready, unusable_on_failure
from ..optim import GradientTransformation, apply_updates, apply_updates_, hyperparams
from ..optim._protocol import param_leaves

__all__ = ["Step", "jit_step"]

_NOT_LOSS_SCALED = (
    "step(sharded, opt_state, ...): this step scales the loss (jit_step(loss_scale=...)), so its optimizer state "
    "carries the scale: a shardfn.LossScaleState, got {got}. Build it with opt_state = step.init(sharded)."
)


_NONFINITE = (
    "[rank {rank}] step: the global loss ({loss}) or gradient norm ({norm}) is not finite; nothing was updated. "
    "Ranks whose own loss was not finite: {loss_ranks}; ranks holding non-finite gradient shards: {grads}. Find the "
    "cause (a bad batch on those ranks, a learning rate too high, fp16 overflow: jit_step(loss_scale=...)), or "
    "pass jit_step(..., on_nonfinite=\"skip\") to skip such steps on every rank (metrics['skipped'] says so)."
)


class Step:
    """``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``; see :func:`jit_step`.

    Its :class:`shardfn._run.grad.Grad` (``step.grad``) computes the gradients and metrics
    (see [Note: gradients as a tree]); the step adds the optimizer update, run inside the
    same runtime."""

    def __init__(self, grad: Grad, optimizer: GradientTransformation, loss_scale: DynamicLossScale | None):
        self.grad = grad
        self.options = grad.options  # [Note: step options]
        self.mesh = grad.mesh
        self.optimizer = optimizer
        self.loss_scale = loss_scale
        donate = self.options.donate
        # The update path, chosen once (see the three methods below); the function, not a
        # bound method, which would hold the step in a reference cycle.
        in_place = donate and getattr(optimizer, "update_", None) is not None
        self._update = Step._in_place if in_place else Step._donated if donate else Step._fresh
        self._expected: tuple[Any, Any] | None = None  # (layout, what init builds: see _check_structure)
        self._accepted: Any = None  # a state structure found equal to it in another order
        self._verified: tuple[Any, Any] | None = None  # (layout, _quick of the state) last checked

    def init(self, sharded: ShardedParams) -> Any:
        """The optimizer state this step takes: ``optimizer.init(sharded)``, and with
        ``loss_scale`` the :class:`shardfn.LossScaleState` around it."""
        state = self.optimizer.init(sharded)
        return self.loss_scale.init(state) if self.loss_scale is not None else state

    def __call__(self, sharded: ShardedParams, opt_state: Any, batch: Any) -> tuple[ShardedParams, Any, dict[str, Any]]:
        if isinstance(sharded, ShardedParams):  # the same on every rank ([Note: the point of no return])
            check_usable(sharded, "step")
        try:
            with unusable_on_failure(sharded):  # a peer failed after the previous step's point of no return
                return self._step(sharded, opt_state, batch)
        except Exception as e:
            if failed_at(e) != Failure.BEFORE and not isinstance(e, PeerError):  # this rank did
                notes = "".join(f"\n{n}" for n in getattr(e, "__notes__", []))
                sharded._mark_unusable(Unusable(f"{describe(e)}{notes}"))
            raise

    def _step(self, sharded: ShardedParams, opt_state: Any, batch: Any) -> tuple[ShardedParams, Any, dict[str, Any]]:
        with guarded(self.mesh, Where.STEP) as scope:  # a rank whose arguments are refused tells the others
            self._check(sharded, opt_state)
        inner = opt_state.opt_state if self.loss_scale is not None else opt_state
        scale = float(opt_state.scale) if self.loss_scale is not None else 1.0
        # [Note: reading a verdict when it is ready]: at world 1 this raises; else the opening header tells
        # (a graph step reads its verdicts itself, before it runs or records this step)
        recorded, fake = scope.comm.recorded, self.mesh.fake  # the mode, where the step begins ([Note: the scope])
        nonfinite = (self.options.on_nonfinite is OnNonfinite.RAISE_NEXT and not recorded
                     and read_ready(sharded, "step"))
        buffers = StepBuffers(sharded, list(sharded.layout.buffers), donate=self.options.donate,
                               track=self.options.sync_buffers, recorded=recorded, fake=fake)
        with self.grad.run(sharded, batch, buffers, scope, scale, nonfinite) as out:
            grads, metrics = out.grads, out.metrics
            if not recorded:  # a graph step's program computes them itself (shardfn._program.graph)
                metrics.update(hyperparams(self.optimizer, inner))
            skip = False
            if self.loss_scale is not None:
                # The same value on every rank: the norm came out of an all-reduce.
                norm = grads.global_norm
                skip = not fake and not bool(torch.isfinite(norm))
                metrics.update(loss_scale=scale, skipped=skip)
                opt_state = LossScaleState(inner, *self.loss_scale.next(opt_state, not skip))
            elif "nonfinite" in metrics:  # (raise_next: the verdicts were read when the step began)  # the same on every rank (see Grad._nonfinite_ranks)
                if self.options.on_nonfinite is OnNonfinite.RAISE:
                    buffers.restore()
                    bad = metrics["nonfinite"]
                    raise FloatingPointError(_NONFINITE.format(
                        rank=self.mesh.rank, loss=metrics["loss"], norm=metrics["grad_norm"], loss_ranks=bad["loss"],
                        grads=bad["grads"]))
                skip = True
            if self.options.on_nonfinite is OnNonfinite.SKIP:
                metrics["skipped"] = skip
            if skip:
                new = _with_buffers(sharded, buffers)
            else:
                with torch.profiler.record_function("shardfn::optimizer"), \
                        after_agreement(None, buffers, inner):
                    new, inner = self._update(self, out.settle, sharded, grads, inner, buffers)
            # [Note: replicated parameters]; a recorded program keeps no replica between
            # replays (it gathers each unit in its forward), so it does not make one here
            if sharded.layout.keeps_replica and not recorded:
                new = refresh(new, out.observers, donated=self.options.donate)
            if not self.options.read_metrics and not fake:
                new = new._with_verdict(Verdict(metrics["loss"], metrics["grad_norm"], sharded._verdict,
                                                out.batches_differ))
        opt_state = opt_state._replace(opt_state=inner) if self.loss_scale is not None else inner
        return new, opt_state, metrics

    # -- the update: one of three paths, chosen when the step is built -----------------------

    def _quiet(self, settle: Callable[[], None], sharded: ShardedParams) -> None:
        """Before the shards are written in place, or read on the host: no all-gather of the
        step still reads them (``settle``, the run's), and (offload) no copy to the device
        ([Note: offload])."""
        settle()
        if sharded.layout.offloaded:  # the optimizer runs on the host
            wait_for_device(self.mesh.device)

    def _in_place(self, settle: Callable[[], None], sharded: ShardedParams, grads: Any, inner: Any,
                  buffers: StepBuffers) -> tuple[ShardedParams, Any]:
        """Donation with an in-place optimizer (optim [Note: donation]): parameters and state
        are updated in place, the gradients serve as scratch."""
        self._quiet(settle, sharded)
        with after_agreement(Failure.PARTLY):
            inner = self.optimizer.update_(grads, inner, sharded)
        return _with_buffers(sharded, buffers), inner

    def _donated(self, settle: Callable[[], None], sharded: ShardedParams, grads: Any, inner: Any,
                 buffers: StepBuffers) -> tuple[ShardedParams, Any]:
        """Donation with an optimizer without ``update_``: its updates added into the shards."""
        self._quiet(settle, sharded)
        new = self.optimizer.update(grads, inner, sharded)
        updates, new_inner = check_outputs(new, inner, sharded)  # before anything is written
        with after_agreement(Failure.PARTLY):
            apply_updates_(sharded, updates)
        return _with_buffers(sharded, buffers), new_inner

    def _fresh(self, settle: Callable[[], None], sharded: ShardedParams, grads: Any, inner: Any,
               buffers: StepBuffers) -> tuple[ShardedParams, Any]:
        """``donate=False``: new shards and buffers; the arguments stay untouched."""
        if sharded.layout.offloaded:
            self._quiet(settle, sharded)
        updates, inner = check_outputs(self.optimizer.update(grads, inner, sharded), inner, sharded)
        params = apply_updates(sharded.params(), updates)
        if sharded.layout.offloaded:  # new shards, in host memory like the old ones ([Note: offload])
            params = {n: place_on_host(t.detach(), self.mesh.device).requires_grad_(t.requires_grad)
                      for n, t in params.items()}
        else:  # a flat unit's new shards as views of one buffer again ([Note: placements])
            params = unit_views(params, sharded.layout, sharded.layout.shard_rank(self.mesh))
            layout = sharded.layout
            for n, t in params.items():
                t.requires_grad_((layout.leaves[n] if n in layout.leaves else layout.ignored[n]).requires_grad)
        return sharded.replace({**params, **buffers.work}), inner

    def _check(self, sharded: Any, opt_state: Any) -> None:
        self.grad.check(sharded)
        full = opt_state
        if self.loss_scale is not None:
            if not isinstance(opt_state, LossScaleState):
                raise TypeError(_NOT_LOSS_SCALED.format(got=type(opt_state).__name__))
            opt_state = opt_state.opt_state
        quick = _quick(full)
        if self._verified is None or self._verified[0] is not sharded.layout or self._verified[1] != quick:
            check_opt_state(opt_state, sharded)  # (names and shapes only: once per state structure)
            self._check_structure(full, sharded, quick)
            self._verified = (sharded.layout, quick)
        if sharded.layout.offloaded:  # built from host shards, so in host memory: say so ([Note: live bytes])
            mark_host_trees([opt_state])

    def _check_structure(self, opt_state: Any, sharded: ShardedParams, quick: Any) -> None:
        """The optimizer state must be what ``step.init`` builds for these shards (keys,
        tensor shapes and dtypes), checked before the step: a state the optimizer would
        refuse only in its update, after the step's collectives, would fail on one rank
        while the others update."""
        if self._expected is None or self._expected[0] is not sharded.layout:
            try:  # the same optimizer on meta tensors of the shards' shapes: no memory, no values
                meta = sharded.replace({n: torch.empty_like(t, device="meta").requires_grad_(t.requires_grad)
                                        for n, t in sharded.items()})
                built = self.init(meta)
                expected = (_quick(built), built)
            except Exception:  # noqa: BLE001 - an optimizer that cannot build on meta tensors: unchecked
                expected = None
            self._expected = (sharded.layout, expected)
        if self._expected[1] is None or quick == self._expected[1][0] or quick == self._accepted:
            return
        expected, got = _signature(self._expected[1][1]), _signature(opt_state)
        problems = [f"  opt_state{p}: missing" for p in expected if p not in got]
        problems += [f"  opt_state{p}: not in the state {type(self.optimizer).__name__} builds" for p in got
                     if p not in expected]
        problems += [f"  opt_state{p}: {got[p]}, expected {expected[p]}" for p in expected
                     if p in got and got[p] != expected[p]]
        built = self._expected[1][1]
        if not problems and type(opt_state) is not type(built):  # the same paths in another state class
            problems = [f"  opt_state: a {type(opt_state).__name__}, where the optimizer builds a "
                        f"{type(built).__name__}"]
        if not problems:  # the same state, its dicts in another order (a resharded state): fine
            self._accepted = quick
            return
        raise ValueError(
            "step(sharded, opt_state, ...): the optimizer state is not the one this step's optimizer builds for "
            "these shards:\n" + "\n".join(problems[:10]) + ("\n  ..." if len(problems) > 10 else "")
            + "\nInitialise it from these shards with this step's optimizer: opt_state = step.init(sharded) "
            "(or load it from a checkpoint into step.init(sharded)).")


def _with_buffers(sharded: ShardedParams, buffers: StepBuffers) -> ShardedParams:
    """``sharded`` with the buffers the forward replaced (rather than updated in place)."""
    replaced = buffers.replaced(sharded)
    return sharded.replace(replaced) if replaced else sharded


def check_opt_state(opt_state: Any, sharded: ShardedParams) -> None:
    """Every optimizer-state tensor under a parameter's key must be shaped like its shard."""
    layout = sharded.layout
    rank = layout.shard_rank(sharded.mesh)
    problems = []
    for path, name, leaf in param_leaves(opt_state):
        if not isinstance(leaf, torch.Tensor) or name is None:
            continue
        where = f"opt_state{path}"
        if name not in layout.leaves and name not in layout.ignored:
            problems.append(f"  {where}: there is no parameter {name!r} in these shards")
        elif tuple(leaf.shape) != layout.shard_shape(name, rank):
            problems.append(
                f"  {where}: shape {tuple(leaf.shape)}, but the shard of {name!r} has shape "
                f"{layout.shard_shape(name, rank)} on {sharded.mesh!r}"
            )
    if problems:
        raise ValueError(
            "step(sharded, opt_state, ...): the optimizer state does not match these shards:\n"
            + "\n".join(problems[:10])
            + ("\n  ..." if len(problems) > 10 else "")
            + "\nInitialise it from these shards: opt_state = opt.init(sharded) (step.init(sharded) with loss_scale)."
        )
