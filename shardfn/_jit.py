"""jit_step: a training step on local shards, eager or recorded as one program.

The entry point chooses: an eager :class:`shardfn._run.step.Step`, or, with ``graph=``, a
:class:`shardfn._program.graph.GraphStep` that records that step once and replays it. It sits
above both, so that neither the eager step nor the program imports the other's maker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._deprecated import as_loss, old_options
from ._mesh import Mesh
from ._program.graph import GraphStep
from ._compile import backend_of
from ._run.grad import Grad
from ._run.options import Accumulate, Aux, OnNonfinite, StepOptions, check_options
from ._run.step import Step
from ._state.precision import DynamicLossScale

__all__ = ["jit_step"]


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
