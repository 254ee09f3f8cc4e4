"""``jit_step(graph=True)``: the whole step recorded once, then replayed as one program.

[Note: a graph step]
The first call runs the eager step under the rules of a recording: what a program cannot
hold is refused there, and the step learns its units' forward order, so that the
recorded step prefetches as eager steps do. The second call records: the eager step runs
once under ``make_fx`` ([Note: recording a step] in shardfn._comm.recording), every
collective checked header by header, so the step's operations (all-gathers, forward,
backward with its regathers, reductions and buckets, clipping, the update, the metrics)
become one graph whose collectives the ranks agreed on one by one. Its inputs are the
state's flat buffers, not the leaves that are views of them (inputs that alias one
another would be copied back after every run). Before the program is used the ranks
agree on its fingerprint (its collectives in order); then each call only runs it,
compiled: no Python per unit or leaf, no host read, one header exchange (the ranks agree
on which program: [Note: agreeing on the key] in shardfn._program.key). The state is
updated in place (donation), so the same tensors are its inputs on every call. A key
([Note: a program's key]) without a program is recorded again, by every rank together.

It reports as ``on_nonfinite="raise_next"`` does: the loss and gradient norm travel with
the shards, and the next call (or a save) raises on every rank if they were not finite.
On a mesh with a tensor axis each call first checks, on the host and outside the program,
that the tensor group's ranks got the same batch (shardfn._parallel.agree.agree_on_batch, one more
header): a program cannot raise before its own update, and another batch would be silent.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import traceback
import zlib
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _get_current_dispatch_mode_stack

from . import capture as _capture
from .._comm import guard as G
from .._comm.failures import describe
from .._run.batch import count_tokens
from .._errors import CommError, DivergenceError
from .._comm.events import CollectiveCall, CollectiveLog, emit, observe
from .._comm.scope import here
from .._run.functionalize import apply_of
from .host import refuse_host_tensors
from .key import ModelAttributes, agree_on_key, group_values, refuse_moved, what_changed
from .._comm.recording import Unrecordable, record
from .restore import put_back
from .._parallel.agree import agree_on_batch
from .replay import _COMPILE_FAILED, _HALF_RUN, _LOST, bounded, compile_error, note_failure, peer_failures
from .._state.verdict import Verdict, agreed_error, check_verdict, read_ready
from .workspace import workspace
from ..optim import hyperparams
from ..optim._count import forget

__all__ = ["GraphStep"]

_TORCH = os.path.dirname(torch.__file__)
_PACKAGE = os.path.dirname(__file__)

_REFUSED = (
    "[rank {rank}] jit_step(graph=True): this step cannot be recorded as one program: {why}, at {where}.{frozen} "
    "Fix: {fix}, or build the step with graph=False."
)

_FROZEN = " A recorded program would replay that value as a constant (a silently different step)."

_DIFFERENT = (
    "[rank {rank}] shardfn: the ranks on {ranks} recorded different programs for {what}: the fingerprints of their "
    "collectives (kind, group, size and dtype, in order) are {prints}. Each rank ran its step, checked collective by "
    "collective, but their programs differ elsewhere, so none is replayed. Every rank must record the same step: the "
    "same batch shapes and dtypes, plan, optimizer and loss_fn; or build the step with graph=False."
)


def _where(tb: Any) -> str:
    """The innermost frame of ``tb`` outside torch and this module: the code that asked."""
    for frame in reversed(traceback.extract_tb(tb)):
        if not frame.filename.startswith(_TORCH) and frame.filename != __file__ and frame.name != "__torch_dispatch__":
            name = frame.filename
            if name.startswith(_PACKAGE):
                name = os.path.relpath(name, os.path.dirname(_PACKAGE))
            elif name.startswith(os.getcwd() + os.sep):
                name = os.path.relpath(name)
            return f"{name}:{frame.lineno} ({frame.name}: {frame.line})"
    return "an unknown place"


class _NoHostReads(TorchDispatchMode):
    """Refuses, while recording, every operation whose result depends on a tensor's value
    on the host (a read) or whose shape depends on values (``nonzero``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        tags = func.tags
        if torch.Tag.data_dependent_output in tags:
            raise Unrecordable(f"{func._overloadpacket.__name__} reads a tensor's value on the host",
                               "keep the value on the device (a tensor operation instead of .item(), bool() or "
                               "torch.equal; metrics can be read after the step)")
        if torch.Tag.dynamic_output_shape in tags:
            raise Unrecordable(f"{func._overloadpacket.__name__} makes a tensor whose shape depends on values",
                               "give every tensor a static shape (a mask instead of indexing by values)")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_host_copies() -> Any:
    """``.tolist()`` and ``.numpy()`` of a CPU tensor read its values without dispatching
    (so :class:`_NoHostReads` cannot see them): refused where :class:`_NoHostReads` is on
    the dispatch-mode stack, as the rest. That stack is torch's thread-local state, which
    autograd carries into backward's device threads, and the guard's headers set it aside
    (shardfn._comm.recording.untraced): no context variable is read ([Note: backward on device
    threads] in shardfn._comm.guard)."""
    saved = {how: getattr(torch.Tensor, how) for how in ("tolist", "numpy")}

    def refuse(how: str) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(mode, _NoHostReads) for mode in _get_current_dispatch_mode_stack()):
                raise Unrecordable(f"Tensor.{how}() reads a tensor's values on the host",
                                   "keep the value on the device (metrics can be read after the step)")
            return saved[how](tensor, *args, **kwargs)

        return read

    try:
        for how in saved:
            setattr(torch.Tensor, how, refuse(how))
        yield
    finally:
        for how, method in saved.items():
            setattr(torch.Tensor, how, method)


def _what(x: Any) -> Any:
    """What a program is recorded for: a tensor's shape, dtype and device; any other value
    itself (an unhashable one: the object)."""
    if isinstance(x, torch.Tensor):
        return x.shape, x.dtype, x.device
    try:
        hash(x)
    except TypeError:
        return type(x), id(x)
    return x


def _torch_optimizers(leaves: list[Any]) -> list[torch.optim.Optimizer]:
    """The torch optimizers of ``from_torch`` states among ``leaves``."""
    from ..optim._torch import TorchOptimizerState

    return [leaf.optimizer for leaf in leaves if isinstance(leaf, TorchOptimizerState) and leaf.optimizer is not None]


def _hidden(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors of a state that is not a pytree (``from_torch``'s: its optimizer's private
    parameters and per-parameter state), which the program must take as inputs too. The
    first call, eager, has made that state (a parameter it made none for keeps none)."""
    hidden: list[torch.Tensor] = []
    for optimizer in optimizers:
        params = optimizer.param_groups[0]["params"]
        hidden += params
        hidden += [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return hidden


def _bases(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a program takes as its inputs for the state: each tensor's base (for a sharded
    tree's leaves and an optimizer's state, the unit's flat buffer), once. Leaves that
    share a buffer would be inputs that alias one another, which the compiler handles by
    copying every updated input back after the program."""
    bases: dict[int, torch.Tensor] = {}
    for t in tensors:
        base = t._base if t._base is not None else t
        bases.setdefault(id(base), base)
    return list(bases.values())


def _input_names(sharded: Any, opt_state: Any, state: list[torch.Tensor], inputs: list[Any]) -> list[str]:
    """The program's inputs named: each state buffer by the first leaf it holds, then the batch's leaves."""
    named: dict[int, str] = {}
    leaves = [(f"params[{n!r}]", t) for n, t in sharded.items()]
    leaves += [(f"opt_state{pytree.keystr(p)}", t) for p, t in pytree.tree_flatten_with_path(opt_state)[0]]
    for name, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            named.setdefault(id(leaf._base if leaf._base is not None else leaf), name)
    return [named.get(id(t), "a hidden optimizer tensor") for t in state] + [f"batch leaf {i}" for i in range(len(inputs))]


def _view_of_base(leaf: Any) -> Any:
    """``leaf`` made again, while recording, as a view of its base (an input of the program)."""
    if not isinstance(leaf, torch.Tensor) or leaf._base is None:
        return leaf
    view = leaf._base.as_strided(leaf.size(), leaf.stride(), leaf.storage_offset())
    return view.requires_grad_() if leaf.requires_grad else view  # (the base is no trainable leaf)


class _Program:
    """One recorded step: its graph, what it is run by, and what a replay reports."""

    def __init__(self, gm: torch.fx.GraphModule, calls: list[CollectiveCall], comm_bytes: dict[str, int],
                 aux_spec: Any, axes: dict[str, str], tokens: bool, hyper: dict[str, Any]) -> None:
        self.gm = gm
        # the optimizer's hyperparams: a value its recording computed from the state (None) is
        # the program's output, in order after the others; any other value is a constant of it
        self.hyper = hyper
        self.hyper_outputs = sum(v is None for v in hyper.values())
        self.tokens = tokens  # whether the tokens summed over the ranks are an output (after loss and norm)
        self.fn: Any = gm
        self.calls = calls
        self.comm_bytes = comm_bytes
        self.aux_spec = aux_spec
        self.replays = 0
        self.compiled = False  # whether its compiled function has run once (and so compiled)
        self.number = 0  # its place among the programs the ranks recorded together ([Note: agreeing on the key])
        self.collectives = [n for n in gm.graph.nodes if n.op == "call_function"
                            and getattr(n.target, "namespace", "") == "_c10d_functional" and "wait" not in n.name]
        self.fingerprint = _fingerprint(self.collectives, axes)
        self.workspace = workspace(gm)


def _fingerprint(nodes: list[Any], axes: dict[str, str]) -> int:
    """The program's collectives in order (op, group, input shape and dtype): what every rank
    must have recorded alike. Local ops may differ by rank (a shard's offset), and so do the
    names of the groups: a group is named by its mesh axis (``axes``: group name -> axis)."""
    text = repr([(str(n.target), [axes.get(a, "?") if isinstance(a, str) and a in axes else a
                                  for a in n.args if isinstance(a, (str, int))],
                  tuple(n.args[0].meta["val"].shape) if "val" in n.args[0].meta else None,
                  str(n.args[0].meta["val"].dtype) if "val" in n.args[0].meta else None) for n in nodes])
    return zlib.crc32(text.encode()) & 0x7FFFFFFF or 1


class GraphStep:
    """``step(sharded, opt_state, batch)`` built by ``jit_step(graph=True)``; see [Note: a graph step]."""

    def __init__(self, step: Any, backend: str | None) -> None:
        self.step = step
        self.mesh = step.mesh
        self.backend = backend  # "inductor", or None: the recorded graph runs op by op
        self.graphs = _capture.graphs_for(self.mesh.device)  # what captures its programs (None: nothing)
        self.programs: dict[Any, _Program] = {}
        self.warm = False  # whether the first call ran (eagerly, see _warm_up)
        self.recordings = 0
        # (sharded, opt_state, the state's inputs, its key, their step counts, the from_torch optimizers)
        self._last: tuple[Any, Any, list[torch.Tensor], Any, list[torch.Tensor], list[Any]] | None = None
        self._program: _Program | None = None  # the last one run
        self._key: Any = None  # the key of the last call ([Note: a program's key])
        self._attributes: ModelAttributes | None = None

    def __getattr__(self, name: str) -> Any:  # init, grad, optimizer, ...: the eager step's
        if name == "step":
            raise AttributeError(name)
        return getattr(self.step, name)

    @property
    def workspace_bytes(self) -> int | None:
        """The most bytes the last program run holds beyond the state and the batch (its
        activations, gathered units and gradients), in its recorded order; None before the
        first recording. Inductor plans the compiled program's buffers itself."""
        return self._program.workspace if self._program is not None else None

    def __call__(self, sharded: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        scope = here()  # a public call: the scope it begins in, read once ([Note: the scope])
        nonfinite = read_ready(sharded, "step")  # [Note: reading a verdict when it is ready]
        if self.mesh.axis_size("tensor") > 1:  # [Note: a graph step]: on the host, outside the program
            with G.guarded(self.mesh, G.Where.STEP) as guarded:
                agree_on_batch(batch, self.mesh, guarded)
        last = self._last
        if last is not None and last[0] is sharded and last[1] is opt_state:  # the trees the last call returned
            state, shape, counts, optimizers = last[2:]
        else:
            with G.guarded(self.mesh, G.Where.STEP):
                self.step._check(sharded, opt_state)
            leaves, spec = pytree.tree_flatten((sharded, opt_state))
            optimizers = _torch_optimizers(leaves)
            if not self.warm:  # (the eager step it runs leaves the verdicts to this call: read them all)
                check_verdict(sharded, "step")
                self._key = (None, *self._batch_key(batch), self._model_key(sharded), group_values(optimizers))
                with put_back(_bases([t for t in leaves if isinstance(t, torch.Tensor)] + _hidden(optimizers)),
                              optimizers):  # [Note: a recording that raises]
                    out = self._warm_up(sharded, opt_state, batch)
                self.warm = True
                return out
            hidden = _hidden(optimizers)
            state = _bases([t for t in leaves if isinstance(t, torch.Tensor)] + hidden)
            shape = (spec, tuple(_what(t) for t in leaves), tuple(_what(t) for t in hidden))
            counts = [t for t in state if t.dim() == 0]  # ([Note: step counts] in shardfn.optim._count)
        inputs, bspec = pytree.tree_flatten(batch)
        key = (shape, bspec, tuple(_what(t) for t in inputs), self._model_key(sharded), group_values(optimizers))
        program = self.programs.get(key)
        if self.mesh.size > 1:  # [Note: agreeing on the key]
            last, recorded = self._key, self._program is not None
            with G.guarded(self.mesh, G.Where.STEP) as guarded:
                agree_on_key(self.mesh, guarded, program.number if program else len(self.programs) + 1, program is not None,
                             lambda: what_changed(self.mesh.rank, key, last, recorded, self._attributes), nonfinite,
                             lambda: agreed_error(sharded, "step"))
        self._key = key
        if program is None:
            forget(counts)  # a read while recording reaches the tensor ([Note: step counts])
            with put_back(state, optimizers):
                program, aux = self._record(sharded, opt_state, batch, state, inputs, scope)
            program.number = len(self.programs) + 1
            self.programs[key] = program
        else:
            aux = self._replay(program, state, inputs, scope)
        forget(counts)  # written by the program, perhaps without a trace ([Note: step counts])
        sharded = sharded._with_verdict(Verdict(aux[0], aux[1], sharded._verdict))  # the same tensors, updated in place
        self._last = (sharded, opt_state, state, shape, counts, optimizers)
        self._program = program
        # the learning rate: computed by the program from the count, or a constant of it
        computed = iter(aux[len(aux) - program.hyper_outputs:])
        metrics = {k: next(computed) if v is None else v for k, v in program.hyper.items()}
        aux = aux[:len(aux) - program.hyper_outputs]
        # [Note: tokens over the ranks]: summed in the program (Mean), or agreed when recorded
        tokens = aux[2] if program.tokens else count_tokens(batch) * self.mesh.data_size
        metrics.update(loss=aux[0], grad_norm=aux[1], tokens=tokens, comm_bytes=dict(program.comm_bytes))
        if program.aux_spec is not None:
            metrics["aux"] = pytree.tree_unflatten(list(aux[2 + program.tokens:]), program.aux_spec)
        return sharded, opt_state, metrics

    def close(self) -> None:
        """Destroys the step's CUDA graphs ([Note: capturing a step]): call it (or let the
        process exit) before ``dist.destroy_process_group()``. A later call captures again."""
        for program in self.programs.values():
            if isinstance(program.fn, _capture.Captured):
                program.fn.close()

    @staticmethod
    def _batch_key(batch: Any) -> tuple[Any, Any]:
        inputs, bspec = pytree.tree_flatten(batch)
        return bspec, tuple(_what(t) for t in inputs)

    def _model_key(self, sharded: Any) -> tuple[Any, ...]:
        """The plain attributes of the model's modules, ``training`` among them ([Note: a
        program's key]); () for trees without a model."""
        apply = apply_of(sharded)
        if apply is None:
            return ()
        if self._attributes is None or self._attributes.root is not apply.module:
            self._attributes = ModelAttributes(apply.module)
        return self._attributes.values()

    def _replay(self, program: _Program, state: list[torch.Tensor], inputs: list[Any],
                scope: G.Scope) -> list[torch.Tensor]:
        if program.fn is program.gm and self.backend is not None:  # [Note: random ops in a program] in _remat
            options = {"fallback_random": True} if self.backend == "inductor" else None
            program.fn = torch.compile(program.gm, backend=self.backend, fullgraph=True, dynamic=False, options=options)
        if self.graphs is not None and not isinstance(program.fn, _capture.Captured):
            _capture.check_capturable(self.mesh)  # [Note: capturing a step]
            program.fn = _capture.Captured(program.fn, self.mesh.device, cuda=self.graphs,
                                           agree=functools.partial(_capture.agree_on_capture, self.mesh))
        # Under a dispatch mode of the caller's (an op counter, a memory tracker) dynamo runs
        # nothing compiled: the recorded graph runs op by op, so the mode sees each op.
        fn = program.gm if _get_current_dispatch_mode() is not None else program.fn
        self.mesh.guard.check_alive("jit_step(graph=True)")
        if isinstance(fn, _capture.Captured):  # captured on this state, or every rank raises: nothing ran
            fn.prepare(state, inputs)
        first = fn is not program.gm and not program.compiled  # it compiles first ([Note: a replay that raises ...])
        try:
            with torch.no_grad(), bounded(self.mesh, not first), self.mesh.random.drawing(self.mesh, scope):
                out = fn(state, inputs)
        except Exception as e:
            lost = isinstance(e, RuntimeError) and any(
                w in str(e).lower() for w in ("timed out", "timeout", "closed", "reset", "connection"))
            if self.mesh.size == 1:
                raise
            if not lost and not compile_error(e):  # a program half run: the peers time out, and name this
                note_failure(e)
                self.mesh.guard.broken = _HALF_RUN.format(rank=self.mesh.rank, error=describe(e))
                raise
            if lost:  # the program's collectives: a timeout ends a replay nobody matches
                peers = peer_failures(range(self.mesh.size))
                self.mesh.guard.broken = _LOST.format(rank=self.mesh.rank, error=f"{type(e).__name__}: {str(e)[:200]}")
                if peers:
                    self.mesh.guard.broken += f" What the other ranks said: {peers}."
                raise CommError(self.mesh.guard.broken) from None
            with torch.no_grad(), bounded(self.mesh, False), self.mesh.random.drawing(self.mesh, scope):
                program.gm(state, inputs)  # nothing ran: the program, op by op, for the peers
            e.add_note(_COMPILE_FAILED.format(rank=self.mesh.rank))
            with G.guarded(self.mesh, G.Where.STEP):
                raise
        program.replays += 1
        program.compiled = program.compiled or fn is not program.gm
        to = scope.observers
        if to:
            for call in program.calls:
                emit(call, to)
        return out

    def _warm_up(self, sharded: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        """The first call: one eager step, under the rules of a recording. What a program
        cannot hold is refused now, and the step learns its units' forward order, so that
        the recorded step prefetches as eager steps do (a first step has no order to follow)
        and an optimizer that makes its state in its first step (``from_torch``) has made it."""
        metrics = hyperparams(self.step.optimizer, opt_state)
        # a read while recording reaches the tensor, which the recording refuses ([Note: step counts])
        forget(t for t in pytree.tree_leaves((sharded, opt_state)) if isinstance(t, torch.Tensor) and t.dim() == 0)
        with self._refusing(sharded), record(), _NoHostReads():
            sharded, opt_state, out = self.step(sharded, opt_state, batch)
        return sharded, opt_state, {**metrics, **out}

    @contextlib.contextmanager
    def _refusing(self, sharded: Any) -> Any:
        """What a program cannot hold raises ``ValueError`` in the block, naming the cause,
        where it is and the fix."""
        if sharded.layout.offloaded:
            raise ValueError(_REFUSED.format(
                rank=self.mesh.rank, why="offloaded shards are copied between host and device by the step's Python",
                where=f"{sharded.layout!r}", frozen="", fix="shard without offload"))
        attributes = self._attributes if apply_of(sharded) is not None else None
        before = attributes.values() if attributes is not None else ()
        try:
            with _no_host_copies():
                yield
            refuse_moved(self.mesh.rank, attributes, before)
        except Unrecordable as e:
            raise ValueError(_REFUSED.format(rank=self.mesh.rank, why=e.why, where=e.where or _where(e.__traceback__),
                                             frozen=_FROZEN if e.frozen else "",
                                             fix=e.fix)) from None

    def _record(self, sharded: Any, opt_state: Any, batch: Any, state: list[torch.Tensor],
                inputs: list[Any], scope: G.Scope) -> tuple[_Program, Any]:
        from torch.fx.experimental.proxy_tensor import make_fx

        out: dict[str, Any] = {}
        seen = CollectiveLog()
        # ZeRO-1's kept full parameters are a cache outside the inputs: the program gathers
        # them from the shards in its forward instead ([Note: replicated parameters])
        sharded._donate_replicas()

        def program(state_in: list[torch.Tensor], batch_in: list[Any]) -> list[torch.Tensor]:
            # The inputs are the state's own buffers (make_fx in real mode traces the objects
            # it is given); the step runs on trees whose leaves are views of them made here.
            leaves, spec = pytree.tree_flatten((sharded, opt_state))
            before = [_view_of_base(t) for t in leaves]
            trees = pytree.tree_unflatten(before, spec)
            with record(), _NoHostReads(), observe(seen):
                # what the update will use, from the state before it (a schedule: from the count)
                hyper = hyperparams(self.step.optimizer, trees[1])
                new, new_state, metrics = self.step(*trees, batch)
            after = pytree.tree_leaves((new, new_state))
            with torch.no_grad():
                for old, now in zip(before, after):
                    if now is not old:  # a leaf the step replaced: written back, so the inputs stay the state
                        old.copy_(now)
            out["metrics"] = metrics
            aux = metrics.get("aux")
            leaves, out["aux_spec"] = pytree.tree_flatten(aux) if "aux" in metrics else ([], None)
            tokens = [metrics["tokens"]] if isinstance(metrics["tokens"], torch.Tensor) else []
            out["hyper"] = {k: None if isinstance(v, torch.Tensor) else v for k, v in hyper.items()}
            computed = [v.detach() for v in hyper.values() if isinstance(v, torch.Tensor)]
            out["outputs"] = [metrics["loss"].detach(), metrics["grad_norm"].detach(), *tokens,
                              *[a.detach() for a in leaves], *computed]
            return out["outputs"]

        self.recordings += 1
        with self._refusing(sharded):
            gm = make_fx(program, record_module_stack=False, record_stack_traces=True)(state, inputs)
        with G.guarded(self.mesh, G.Where.STEP), self._refusing(sharded):  # every rank learns it
            refuse_host_tensors(gm, self.mesh.device, _input_names(sharded, opt_state, state, inputs))
        _strip(gm)
        _check_constants(gm, state, inputs)
        metrics = out["metrics"]
        axes = {self.mesh.channel(a).group.group_name: a for a in self.mesh.axis_names}
        prog = _Program(gm, seen.calls, metrics["comm_bytes"], out["aux_spec"], axes,
                        isinstance(metrics["tokens"], torch.Tensor), out["hyper"])
        for axis in self.mesh.axis_names:  # every rank recorded the same collectives, or every rank raises
            ch = self.mesh.channel(axis)
            if ch.off:
                continue
            what = "the recorded program of jit_step(graph=True)"
            prints = G.exchange_details(ch, prog.fingerprint, what, scope)
            if len(set(prints)) > 1:
                raise G.told(DivergenceError(_DIFFERENT.format(rank=self.mesh.rank, ranks=list(ch.ranks), prints=prints,
                                                               what=what)), ch)
        outputs = out["outputs"]
        gc.collect()  # the recording's tracer and proxies form cycles that hold the step's intermediates
        return prog, outputs


def _check_constants(gm: torch.fx.GraphModule, *trees: list[Any]) -> None:
    """No tensor the program holds as a constant may share memory with its inputs: the
    program must reach the state only through its inputs, or a replay on other tensors of
    the same shapes would read and write the recorded ones."""
    inputs = {t.untyped_storage().data_ptr() for tree in trees for t in tree if isinstance(t, torch.Tensor) and t.numel()}
    for node in gm.graph.nodes:
        value = getattr(gm, node.target) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor) and value.numel() and value.untyped_storage().data_ptr() in inputs:
            used = [u.meta.get("stack_trace", "").strip().splitlines()[-2:] for u in node.users]
            raise AssertionError(f"shardfn internal error: jit_step(graph=True) recorded a tensor of the step's state "
                                 f"as a constant of the program ({tuple(value.shape)}), used at {used}")


def _strip(gm: torch.fx.GraphModule) -> None:
    """Drops the profiler's range markers (they hold no tensors, and a compiled graph cannot)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "profiler":
            gm.graph.erase_node(node)
    gm.recompile()
