"""jit_step: one training step on local shards, as a function."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from .buffers import StepBuffers
from .compile import backend_of
from .._deprecated import as_loss, old_options
from .grad import Grad
from .._errors import PeerError
from .._comm.failures import describe, failed_at
from .._comm.guard import Failure, Where, guarded
from .._mesh import Mesh
from .no_return import after_agreement, check_outputs, quick as _quick, signature as _signature
from .options import Accumulate, Aux, OnNonfinite, StepOptions, check_options
from .._state.offload import mark_host_trees, place_on_host, wait_for_device
from .._comm.recording import recording
from .._state.replica import refresh
from .._state.precision import DynamicLossScale, LossScaleState
from .runtime import current
from .._state.sharded import ShardedParams, unit_views
from .verdict import Unusable, Verdict, check_usable, read_ready, unusable_on_failure
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
        with guarded(self.mesh, Where.STEP):  # a rank whose arguments are refused tells the others
            self._check(sharded, opt_state)
        inner = opt_state.opt_state if self.loss_scale is not None else opt_state
        scale = float(opt_state.scale) if self.loss_scale is not None else 1.0
        # [Note: reading a verdict when it is ready]: at world 1 this raises; else the opening header tells
        # (a graph step reads its verdicts itself, before it runs or records this step)
        nonfinite = (self.options.on_nonfinite is OnNonfinite.RAISE_NEXT and not recording()
                     and read_ready(sharded, "step"))
        buffers = StepBuffers(sharded, list(sharded.layout.buffers), donate=self.options.donate,
                               track=self.options.sync_buffers)
        with self.grad.run(sharded, batch, buffers, scale, nonfinite) as out:
            grads, metrics = out.grads, out.metrics
            if not recording():  # a graph step's program computes them itself (shardfn._program.graph)
                metrics.update(hyperparams(self.optimizer, inner))
            skip = False
            if self.loss_scale is not None:
                # The same value on every rank: the norm came out of an all-reduce.
                norm = grads.global_norm
                skip = not is_fake(norm) and not bool(torch.isfinite(norm))
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
                    new, inner = self._update(self, sharded, grads, inner, buffers)
            # [Note: replicated parameters]; a recorded program keeps no replica between
            # replays (it gathers each unit in its forward), so it does not make one here
            if sharded.layout.keeps_replica and not recording():
                new = refresh(new, current().observers, donated=self.options.donate)
            if not self.options.read_metrics and not is_fake(metrics["loss"]):
                new = new._with_verdict(Verdict(metrics["loss"], metrics["grad_norm"], sharded._verdict,
                                                out.batches_differ))
        opt_state = opt_state._replace(opt_state=inner) if self.loss_scale is not None else inner
        return new, opt_state, metrics

    # -- the update: one of three paths, chosen when the step is built -----------------------

    def _quiet(self, sharded: ShardedParams) -> None:
        """Before the shards are written in place, or read on the host: no all-gather still
        reads them, and (offload) no copy to the device ([Note: offload])."""
        current().settle()
        if sharded.layout.offloaded:  # the optimizer runs on the host
            wait_for_device(self.mesh.device)

    def _in_place(self, sharded: ShardedParams, grads: Any, inner: Any, buffers: StepBuffers) -> tuple[ShardedParams, Any]:
        """Donation with an in-place optimizer (optim [Note: donation]): parameters and state
        are updated in place, the gradients serve as scratch."""
        self._quiet(sharded)
        with after_agreement(Failure.PARTLY):
            inner = self.optimizer.update_(grads, inner, sharded)
        return _with_buffers(sharded, buffers), inner

    def _donated(self, sharded: ShardedParams, grads: Any, inner: Any, buffers: StepBuffers) -> tuple[ShardedParams, Any]:
        """Donation with an optimizer without ``update_``: its updates added into the shards."""
        self._quiet(sharded)
        new = self.optimizer.update(grads, inner, sharded)
        updates, new_inner = check_outputs(new, inner, sharded)  # before anything is written
        with after_agreement(Failure.PARTLY):
            apply_updates_(sharded, updates)
        return _with_buffers(sharded, buffers), new_inner

    def _fresh(self, sharded: ShardedParams, grads: Any, inner: Any, buffers: StepBuffers) -> tuple[ShardedParams, Any]:
        """``donate=False``: new shards and buffers; the arguments stay untouched."""
        if sharded.layout.offloaded:
            self._quiet(sharded)
        updates, inner = check_outputs(self.optimizer.update(grads, inner, sharded), inner, sharded)
        params = apply_updates(sharded.params(), updates)
        if sharded.layout.offloaded:  # new shards, in host memory like the old ones ([Note: offload])
            params = {n: place_on_host(t.detach(), self.mesh.device).requires_grad_(t.requires_grad)
                      for n, t in params.items()}
        else:  # a flat unit's new shards as views of one buffer again ([Note: placements])
            params = unit_views(params, sharded.layout, sharded.layout.shard_rank(self.mesh))
            for n, t in params.items():
                t.requires_grad_(sharded.layout.leaves[n].requires_grad)
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
        if name not in layout.leaves:
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


@old_options
def jit_step(
    loss_fn: Callable[..., Any],
    mesh: Mesh,
    *,
    optimizer: GradientTransformation,
    donate: bool = True,
    micro_batches: int = 1,
    accumulate: Accumulate | str = Accumulate.REDUCE_EACH,
    sync_buffers: bool = True,
    loss_scale: DynamicLossScale | None = None,
    overlap: bool = True,
    prefetch: bool | int = True,
    keep_gathered: bool = False,
    aux: Aux | str | None = None,
    on_nonfinite: OnNonfinite | str | None = None,
    compile: bool | str = False,
    graph: bool | str = False,
) -> Step:
    """Builds ``step(sharded, opt_state, batch) -> (sharded, opt_state, metrics)``.

    ``loss_fn(apply, params, batch)`` is written as for one device: it calls ``apply(params,
    ...)`` (as many times as it likes; ``apply`` is the model function of the shards, from
    :func:`shardfn.functionalize`, and every entry point that takes a loss passes it: [Note:
    one loss convention]) and returns the mean loss over its batch, or a
    :class:`shardfn.Mean` ``(total, count)`` (a sum and the number of elements summed, for
    losses over padded tokens: the step then optimises the mean over every element of the
    global batch, see [Note: token-weighted losses]). Each rank passes its own slice of the
    global batch (equal sizes, for a plain loss); gradients are averaged over ranks, so a
    step equals one single-device step on the global batch. ``metrics["loss"]`` is the
    global mean loss. The step returns the whole state updated: parameter shards, buffers
    (running statistics, averaged over ranks) and optimizer state. The batch may be a
    :class:`shardfn.MicroBatches` of micro-batches of any sizes.

    Args:
        loss_fn: ``(apply, params, batch) -> scalar tensor``. The former ``(params, batch)``
            still works for one release, with a ``DeprecationWarning``.
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
            update on the mean. Equals one step on the whole batch. Every tensor of the
            batch is cut except those wrapped in :class:`shardfn.Whole` (which every
            micro-batch gets whole); a tensor whose dim 0 is not the batch's rows is refused,
            and so is one with more than one dim equal to the rows (an ``[S, S]`` mask at
            ``S`` rows) unless it is marked: ``Whole``, or :class:`shardfn.Batched` for rows.
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
            whose gradients overflow on any rank (``on_nonfinite`` is then ``"skip"``) and
            lowers the scale; the scale lives in the optimizer state
            (build it with ``step.init(sharded)``); ``metrics`` then has ``loss_scale``
            (the scale this step used) and ``skipped``.
        overlap: issue each unit's gradient reduction asynchronously, overlapping the
            rest of the backward (``False``: each reduction blocks, for comparison).
        prefetch: how many units to gather ahead: each unit's all-gather starts while the
            ``prefetch`` units before it compute (forward order recorded on the previous
            step; reversed for backward's regathers). ``True`` is 1; each unit ahead costs
            one more unit of memory under FULL_SHARD (at most ``prefetch + 1`` gathered).
            ``0`` / ``False`` gathers each unit only when it runs.
        keep_gathered: keep every unit gathered from its first all-gather to the end of the
            step, across its micro-batches (FSDP's ``no_sync`` trade-off, for parameters):
            one all-gather per unit and step instead of one or two per micro-batch, for the
            memory of all gathered units at once. With ``accumulate="local"`` also one
            reduction per unit and step.
        aux: ``None``: ``loss_fn`` returns the loss. ``"rank"``: it returns ``(loss, aux)``,
            ``aux`` a pytree of tensors (accuracy, router statistics), as JAX's
            ``has_aux``, and ``metrics["aux"]`` is this rank's aux (a list, one per
            micro-batch, when there are several). ``"mean"``: the same, but
            ``metrics["aux"]`` is the aux averaged over micro-batches and ranks (fp32
            tensors of the same tree), riding on the metrics all-reduce (4 bytes per
            element more, no extra collective). Replaces ``has_aux`` / ``mean_aux``. A
            :class:`shardfn.Aux` member is the same (``Aux.RANK``, ``Aux.MEAN``).
        on_nonfinite: what a step whose global loss or gradient norm is not finite (on any
            rank) does (a string or a :class:`shardfn.OnNonfinite` member). ``"raise"`` (the default without ``loss_scale``): raise
            ``FloatingPointError`` on every rank, naming the ranks whose loss was not
            finite, before anything changes. ``"skip"`` (the default, and the only choice,
            with ``loss_scale``): skip the update on every rank, leaving parameters and
            optimizer state as they were, and report ``metrics["skipped"] = True``
            (``False`` otherwise). The decision rides on the metrics all-reduce; both read
            the loss and norm from the device before updating: one synchronisation per
            step. ``"raise_next"``: read nothing, update whatever the values, and raise
            ``FloatingPointError`` on every rank at the next step on the shards it returns
            (or their ``checkpoint.save``), before that changes or writes anything, if
            they were not finite: the step never waits for the device, and
            ``metrics["loss"]`` and ``["grad_norm"]`` are 0-d tensors on the mesh's device,
            read when you read them (a bad step's update is then in the state: load a
            checkpoint; see [Note: a step that does not wait]). Replaces
            ``skip_nonfinite``.
        compile: ``True`` compiles with ``torch.compile`` (inductor) each unit module's own
            forward (regional compilation: blocks of one class share one graph) and the
            built-in optimizers' in-place update; the gathers, reductions, prefetch and
            saved-tensor handles stay outside the compiled regions, as in eager. A string
            names another ``torch.compile`` backend (``"aot_eager"``: trace without
            generating code). The first step compiles; later steps do not recompile (check
            with :func:`shardfn.compile_stats`). Results equal eager's to float
            reassociation (docs/compile.md). ``apply`` outside the step runs eagerly.
        graph: ``True`` records the whole step once, on the first call, and from then on
            runs it as one program: every gather, the forward, the backward, the
            reductions, the update and the metrics, with no Python per unit or leaf and
            one header exchange per step ([Note: a graph step]). On the CPU its ops run
            one by one, on CUDA compiled by inductor ([Note: which kernels a program
            runs]); ``"eager"`` (ops one by one) or a ``torch.compile`` backend name
            (``"inductor"``) chooses. The step then reports as
            ``on_nonfinite="raise_next"`` does and updates in place (``donate``).
            Refused, with the reason, where a step cannot be one program: see
            docs/compile.md.

    ``metrics`` holds ``loss`` (global mean), ``grad_norm`` (global L2 norm of the
    gradients, before any clipping), ``learning_rate`` (when the optimizer reports it),
    ``tokens`` (summed over the ranks: elements of each rank's first integer batch tensor,
    else its rows; an int, a 0-d device tensor where the step reads nothing: docs/training.md)
    and ``comm_bytes`` (bytes per collective kind issued by this rank in the step).

    Example:
        >>> step = jit_step(loss_fn, mesh, optimizer=shardfn.optim.adamw(3e-4))
        >>> opt_state = step.init(sharded)         # = opt.init(sharded) without loss_scale
        >>> sharded, opt_state, metrics = step(sharded, opt_state, batch)
    """
    accumulate = check_options(loss_fn, mesh, micro_batches, accumulate, aux, "jit_step", prefetch)
    if on_nonfinite not in (None, "raise", "skip", "raise_next", *OnNonfinite):
        raise ValueError(f"jit_step(on_nonfinite={on_nonfinite!r}): \"raise\", \"skip\" or \"raise_next\".")
    on_nonfinite = OnNonfinite.parse(on_nonfinite) if on_nonfinite is not None else None
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(
            f"jit_step: optimizer must have init and update functions (a GradientTransformation such as "
            f"shardfn.optim.adamw(3e-4)), got {type(optimizer).__name__}."
        )
    if loss_scale is not None and not isinstance(loss_scale, DynamicLossScale):
        raise TypeError(f"jit_step: loss_scale must be a shardfn.DynamicLossScale, got {loss_scale!r}")
    if loss_scale is not None and on_nonfinite in (OnNonfinite.RAISE, OnNonfinite.RAISE_NEXT):
        raise ValueError(f"jit_step(loss_scale=..., on_nonfinite={on_nonfinite.value!r}): a loss-scaled step skips the steps "
                         "whose gradients overflow and lowers the scale; leave on_nonfinite out (it is \"skip\").")
    if graph:
        _check_graph(graph, mesh, donate, loss_scale, on_nonfinite, compile)
        on_nonfinite = OnNonfinite.RAISE_NEXT
    options = StepOptions(
        "step", micro_batches, accumulate, bool(sync_buffers), bool(overlap), int(prefetch), Aux.parse(aux),
        bool(keep_gathered), backend_of(compile, "jit_step"),
        on_nonfinite or (OnNonfinite.SKIP if loss_scale is not None else OnNonfinite.RAISE), bool(donate))
    step = Step(Grad(as_loss(loss_fn, "jit_step", stacklevel=5), mesh, options), optimizer, loss_scale)
    if graph:
        from .._program.graph import GraphStep

        return GraphStep(step, _program_backend(graph, mesh))
    return step


def _program_backend(graph: Any, mesh: Mesh) -> str | None:
    """What runs a recorded program: None, its ops one by one; else a ``torch.compile`` backend.

    [Note: which kernels a program runs]
    ``graph=True`` picks by the mesh's device, from measured step times: on the CPU the
    recorded ops one by one (as fast as inductor's program on big units, faster on small
    ones, where inductor packs buckets slowly, and nothing to compile), on CUDA inductor's
    (fused kernels inside the captured graph; unverified). A string names the backend:
    ``"eager"`` the ops one by one, ``"inductor"`` inductor everywhere. docs/compile.md has
    the figures."""
    if graph == "eager" or (graph is True and mesh.device.type == "cpu"):
        return None
    return backend_of(graph, "jit_step(graph=...)")


def _check_graph(graph: Any, mesh: Mesh, donate: bool, loss_scale: Any, on_nonfinite: Any, compile: Any) -> None:
    """What a graph step cannot be, refused when it is built ([Note: a graph step])."""
    why = None
    if mesh.axis_size("tensor") > 1 and mesh.device.type != "cpu":
        why = (f"a mesh with a 'tensor' axis on {mesh.device.type}: each call checks that a tensor group's ranks got the "
               "same batch by reading the batch on the host before the program, which on a device waits for it every "
               "call (unverified there): use a CPU mesh, or leave graph out")
    elif compile:
        why = "compile=... compiles parts of an eager step; graph=True compiles the whole step: leave compile out"
    elif not donate:
        why = "donate=False returns new tensors; a recorded program updates the state in place: leave donate on"
    elif loss_scale is not None:
        why = "a loss scale decides on the host whether to skip each step"
    elif on_nonfinite in (OnNonfinite.RAISE, OnNonfinite.SKIP):
        why = (f"on_nonfinite={on_nonfinite.value!r} reads the loss on the host before the update; a graph step reads "
               "nothing and reports as on_nonfinite=\"raise_next\" does: leave on_nonfinite out")
    elif mesh.device.type == "cuda" and mesh.backend != "nccl":
        why = (f"the mesh runs {mesh.backend} over CUDA tensors: its collectives go through the host, which a CUDA "
               "graph cannot capture; use NCCL (Mesh.from_env(device=\"cuda\")), or a CPU mesh")
    elif mesh.device.type != "cpu" and os.environ.get("SHARDFN_CUDA_GRAPH") != "1":
        why = (f"the mesh is on {mesh.device.type}: a recorded step on a device is unverified (it has never run on a "
               "GPU, see docs/compile.md \"The CUDA path\"); set SHARDFN_CUDA_GRAPH=1 to run it anyway, and check it with "
               "`python3 benchmarks/gpu_check.py --graph`; or use compile=True")
    if why is not None:
        raise ValueError(f"jit_step(graph={graph!r}): {why}. Or build the step with graph=False.")
