"""A recorded step replayed as one CUDA graph (``jit_step(graph=True)`` on a CUDA mesh).

[Note: capturing a step]
A recorded program ``fn(state, inputs)`` ([Note: a graph step] in shardfn._program.graph) becomes one
CUDA graph in three uses. First: ``fn`` runs eagerly on a side stream, fenced both ways,
a real step of the call that also starts every process group and kernel it uses (a
capture must not be the first use of an NCCL communicator). Second: the batch is copied
into static buffers, ``fn(state, static)`` is captured on that stream into a memory pool of
its own (capture only records), and the graph is replayed for this call's step. Later:
copy the batch in, replay. The outputs (a few 0-d tensors) are static, rewritten by the
next replay, so the caller gets clones. A graph reads and writes the memory it was
captured on, whatever tensors a call passes, so a replay reads only the state it is given:
a call whose state tensors differ in address, shape, stride or dtype from the captured
ones (a reset optimizer state, a checkpoint loaded into a fresh tree) destroys the graph and
captures again on them. Recapturing is exact and costs one capture per change of tree
(rare); copying each call's state in and out would cost twice the state's bytes a step.
The graph holds the captured tensors, so their memory is never reused under it. Where
segments expand, ``NCCL_GRAPH_REGISTER=0`` is set (NCCL's registration assumes one
allocation per buffer). Graphs are destroyed before the process group (``close()``, an
``atexit`` hook). ``torch.cuda.graph`` registers the default generator, so random ops draw
fresh values at each replay; nothing reads a generator's state while capturing (remat's
reads are Python of the eager and recording calls: [Note: random ops in a program] in
shardfn._run.remat).

[Note: a capture that fails on one rank]
A capture issues nothing, but the peers of a rank whose capture raised (out of memory, a
capture error) would replay, and their collectives wait inside the graph for a rank that
never comes (on NCCL, until the watchdog). So after capturing, before the first replay, the
ranks exchange one header per mesh axis (:func:`agree_on_capture`): a rank whose capture
raised sends a failed one instead (the guard's failure path), and every other rank raises
PeerError naming it, within the step timeout. No rank replayed, so every state is as it
was; each rank drops its graph, and the next call captures again, on every rank.
"""

from __future__ import annotations

import atexit
import os
import re
import weakref
from typing import Any

import torch

from .._comm import guard as G
from .._comm.events import Collective, Purpose

__all__ = ["Captured", "agree_on_capture", "check_capturable", "close_all"]


_NOT_CAPTURED = (
    "[rank {rank}] jit_step(graph=True): capturing the recorded program as a CUDA graph failed on this rank. No rank "
    "replayed it, so every rank's shards and optimizer state are as before this call, and the next call captures "
    "again on every rank. If it fails again, the graph does not fit (it holds a memory pool of its own beside "
    "the eager step's memory): use smaller batches, or build the step with graph=False."
)

_EXPANDABLE = re.compile(r"expandable_segments\s*:\s*true", re.I)

_GLOO = (
    "[rank {rank}] jit_step(graph=True) on {device}: the mesh axis {axis!r} runs its collectives on gloo, which "
    "copies CUDA tensors through the host and waits there: a CUDA graph cannot hold that. Fix: start the process "
    "group with NCCL (Mesh.from_env() on a GPU does), or build the step with graph=False."
)


class _Cuda:
    """The pieces of ``torch.cuda`` a capture uses (a test hands a graph step fakes instead)."""

    def side_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def on_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def new_pool(self, device: torch.device) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, body: Any, stream: Any, pool: Any) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = body()
        return graph, outputs


def graphs_for(device: torch.device) -> _Cuda | None:
    """What captures a graph step's programs on ``device``: CUDA's graphs on a CUDA mesh;
    None elsewhere, where a program is replayed uncaptured."""
    return _Cuda() if device.type == "cuda" else None


_LIVE: weakref.WeakSet[Captured] = weakref.WeakSet()


class Captured:
    """``fn(state, inputs)`` replayed as one CUDA graph; see [Note: capturing a step].

    Args:
        fn: a recorded program (the op-by-op graph module, or inductor's compiled one).
        device: the mesh's device.
        cuda: the pieces of ``torch.cuda`` to use (default: the real ones).
        agree: ``agree(error)`` after each capture, ``error`` None where it succeeded: raises
            on every rank if a capture failed on any ([Note: a capture that fails on one rank]).
    """

    def __init__(self, fn: Any, device: torch.device, cuda: Any = None, agree: Any = None) -> None:
        self.fn = fn
        self.device = device
        self.cuda = cuda if cuda is not None else _Cuda()
        self.agree = agree
        self.stream: Any = None
        self.graph: Any = None
        self.pool: Any = None
        self.static_inputs: list[Any] | None = None
        self.static_outputs: list[torch.Tensor] | None = None
        self.state: list[torch.Tensor] | None = None  # the tensors the graph reads and writes, held
        self.layout: list[Any] | None = None  # their addresses, shapes, strides, dtypes at capture
        self.ready: list[torch.Tensor] | None = None  # the state prepare() last found captured
        self.warm = False  # whether fn ran eagerly on the side stream
        self.captures = 0
        self.clone_bytes = 0  # what a replayed call copies out for its caller
        _LIVE.add(self)

    def __call__(self, state: list[torch.Tensor], inputs: list[Any]) -> list[torch.Tensor]:
        if self.stream is None:
            self.stream = self.cuda.side_stream(self.device)
        if not self.warm:
            out = self._on_side_stream(lambda: self.fn(state, inputs))
            self.warm = True  # (a first use that raised, a compile error, is run eagerly again)
            return out
        if self.ready is not state:
            self.prepare(state, inputs)
        self.ready = None
        for static, t in zip(self.static_inputs, inputs):
            if isinstance(static, torch.Tensor):
                static.copy_(t)
        self.graph.replay()
        out = [t.clone() for t in self.static_outputs]
        self.clone_bytes = sum(t.nbytes for t in out)
        return out

    def prepare(self, state: list[torch.Tensor], inputs: list[Any]) -> None:
        """Makes the graph read ``state``: captures ``fn`` on it, unless the graph was
        captured on these very tensors (their addresses, shapes, strides and dtypes). A
        capture runs nothing; one that fails on any rank raises on every rank."""
        if not self.warm or (self.graph is not None and _layout(state) == self.layout):
            self.ready = state if self.warm else None
            return
        self._capture(state, inputs)
        self.ready = state

    def _on_side_stream(self, run: Any) -> Any:
        current = self.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with self.cuda.on_stream(self.stream):
            out = run()
        current.wait_stream(self.stream)
        return out

    def _capture(self, state: list[torch.Tensor], inputs: list[Any]) -> None:
        if self.stream is None:
            self.stream = self.cuda.side_stream(self.device)
        self._drop()  # the graph of another state, destroyed before its successor takes memory
        if _EXPANDABLE.search(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")):
            os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")
        static = [torch.empty_like(t).copy_(t) if isinstance(t, torch.Tensor) else t for t in inputs]
        graph = error = None
        try:
            pool = self.cuda.new_pool(self.device)
            graph, outputs = self.cuda.capture(lambda: self.fn(state, static), self.stream, pool)
        except Exception as e:  # noqa: BLE001 - raised below, on every rank
            error = e
        try:
            if self.agree is not None:
                self.agree(error)
            elif error is not None:
                raise error
        except BaseException:
            if graph is not None:
                graph.reset()
            raise
        self.graph, self.pool, self.static_inputs, self.static_outputs = graph, pool, static, outputs
        self.state, self.layout = list(state), _layout(state)
        self.captures += 1

    def _drop(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.pool = self.static_inputs = self.static_outputs = self.state = self.layout = None
        self.ready = None

    def close(self) -> None:
        """Destroys the graph and its buffers (before the process group); a later call
        runs eagerly and captures again."""
        self._drop()
        self.stream = None
        self.warm = False


def _layout(state: list[torch.Tensor]) -> list[Any]:
    """What a graph reads of its state: each tensor's address, shape, strides and dtype."""
    return [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in state]


def close_all() -> None:
    """Destroys every live graph: at exit, before torch tears the process groups down."""
    for captured in list(_LIVE):
        captured.close()


atexit.register(close_all)


def check_capturable(mesh: Any) -> None:
    """Raises ``ValueError`` for collectives over gloo, which a CUDA graph cannot capture (a
    host tensor in the program was refused when it was recorded: shardfn._program.host)."""
    device = mesh.device
    for axis in mesh.axis_names:
        ch = mesh.channel(axis)
        if not ch.off and not ch.on_stream:
            raise ValueError(_GLOO.format(rank=mesh.rank, device=device, axis=axis))


def agree_on_capture(mesh: Any, error: BaseException | None) -> None:
    """Every rank of ``mesh`` learns whether each rank's capture succeeded (``error``: this
    rank's, or None) before any replays: raises ``error`` here, and PeerError naming this
    rank on the others, within the step timeout ([Note: a capture that fails on one rank])."""
    if error is not None:
        error.add_note(_NOT_CAPTURED.format(rank=mesh.rank))
    with G.guarded(mesh, G.Where.STEP) as scope:
        if error is not None:
            raise error
        for axis in mesh.axis_names:
            ch = mesh.channel(axis)
            if not ch.off:
                G.agree_words(ch, G.words(Collective.BARRIER, Purpose.STEP, "", 0, 1, None, scope.where),
                              "the capture of a CUDA graph", 0, scope)
