"""The pieces of ``torch.cuda`` that shardfn._program.capture uses, faked on the CPU as strictly as CUDA.

A capture (:meth:`FakeCuda.capture`) runs the body once under a dispatch mode that records
every aten op with its arguments and results (tensors by object), then undoes what the run
did: the memory that existed before capture is restored, the generator's state too, and
what the capture allocated (its pool) is filled with garbage (NaN), so nothing of a capture
can pass for a step. A replay (:meth:`FakeGraph.replay`) runs the recorded ops again, on the
same tensors, never the Python that made them: an op whose result was allocated at capture
writes its new value into that tensor, an in-place op runs on its tensors, a view is the
view made at capture. So a replay reads and writes the memory the capture saw, whatever the
caller passes later; its outputs are the capture's tensors, overwritten by each replay; a
random op draws fresh values from the generator at each replay (the registered generator
of ``torch.cuda.graph``).

While capturing it raises as CUDA does: on a host read (``.item()``, ``bool()``,
``torch.equal``, an op whose output shape depends on values, ``.tolist()``, ``.numpy()``),
on a read or a reset of the random state (``torch.get_rng_state``, ``torch.set_rng_state``,
``torch.cuda.get_rng_state``), on a non-functional c10d collective, and on an allocation
outside the pool: an op that reads a tensor whose memory neither existed when the capture
began nor was made by a recorded op (``torch.tensor(...)``: on CUDA, a copy from pageable
host memory). A functional collective is recorded but not run (its result is zeros while
capturing): a capture on one rank issues nothing its peers must match, as on CUDA.

What it does not model: the memory of tensors the caller dropped (the fake holds every
tensor the graph reads, so a stale replay shows as wrong values, which the tests compare bit
for bit, not as a write into reused memory); memory reuse inside the pool; ops run outside
the dispatch mode (with modes disabled) or through ``Generator.get_state`` on a generator
object (a C method it cannot patch); host-device copies and streams' real ordering (there is
one device, the CPU; the streams only log what waits on what); the time a replay takes.
"""

import contextlib
import gc
import itertools

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_READS = {torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}
_RNG = [(torch, "get_rng_state"), (torch, "set_rng_state"), (torch.random, "get_rng_state"),
        (torch.random, "set_rng_state"), (torch.cuda, "get_rng_state"), (torch.cuda, "set_rng_state")]


class CaptureError(RuntimeError):
    """What CUDA raises for an operation that is not permitted while a stream is capturing."""


class FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        FakeCuda.log.append(("wait", self.name, other.name))


def _storage(t):
    return t.untyped_storage().data_ptr()


def _tensors(tree):
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _live_storages():
    """The memory of every tensor alive now (what existed before a capture began)."""
    live = set()
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and not issubclass(type(o), FakeTensor):
            for t in (o, o._base):
                if t is not None and t.device.type != "meta" and t.numel():
                    live.add(_storage(t))
    return live


class _Op:
    """One recorded op: run again at replay unless it only makes views."""

    __slots__ = ("func", "args", "kwargs", "fresh", "rerun", "collective")

    def __init__(self, func, args, kwargs, fresh, rerun, collective):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.fresh = fresh  # (index among its flat outputs, the tensor it allocated at capture)
        self.rerun, self.collective = rerun, collective


class _Recorder(TorchDispatchMode):
    def __init__(self, graph, fail_at):
        super().__init__()
        self.graph = graph
        self.before = _live_storages()
        self.saved = {}  # storage ptr -> (storage, its bytes before capture)
        self.fail_at = fail_at

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func._overloadpacket.__name__}"
        tags = func.tags
        if (func in _HOST_READS or torch.Tag.data_dependent_output in tags
                or torch.Tag.dynamic_output_shape in tags):
            raise CaptureError(f"fake CUDA: {name} reads a tensor's value on the host while capturing "
                               "(operation not permitted when stream is capturing)")
        namespace = getattr(func, "namespace", "")
        if namespace == "c10d":
            raise CaptureError(f"fake CUDA: c10d.{name} is not modelled while capturing")
        if self.fail_at is not None and len(self.graph.ops) == self.fail_at:
            raise torch.OutOfMemoryError(f"fake CUDA: out of memory while capturing (op #{self.fail_at}, {name})")
        inputs = _tensors((args, kwargs))
        for t in inputs:
            if t.numel() and _storage(t) not in self.before and _storage(t) not in self.graph.pool:
                raise CaptureError(f"fake CUDA: {name} reads a {tuple(t.shape)} tensor allocated while capturing "
                                   "outside the graph's pool (a tensor made from host data)")
        schema = func._schema.arguments
        flat_args = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        written = [t for a, v in zip(schema, flat_args) if a.alias_info is not None and a.alias_info.is_write
                   for t in _tensors(v)]
        for t in written:  # capture does not run: what existed before is put back after it
            ptr = _storage(t)
            if t.numel() and ptr not in self.graph.pool and ptr not in self.saved:
                self.saved[ptr] = (t.untyped_storage(), t.untyped_storage().clone())
        collective = namespace == "_c10d_functional" and name != "wait_tensor"
        if collective:  # recorded, not issued: the peers' captures issue nothing either
            out = _unissued(func, args, kwargs, written)
        else:
            out = func(*args, **kwargs)
        seen = {_storage(t) for t in inputs if t.numel()}
        fresh = [(i, t) for i, t in enumerate(pytree.tree_leaves(out))
                 if isinstance(t, torch.Tensor) and (not t.numel() or _storage(t) not in seen)]
        for _, t in fresh:
            if t.numel():
                self.graph.pool.add(_storage(t))
        self.graph.ops.append(_Op(func, args, kwargs, fresh, bool(fresh or written), collective))
        return out


def _unissued(func, args, kwargs, written):
    """What a functional collective returns while capturing, without issuing it: zeros, in the
    tensors it writes (an ``out=`` or in-place variant) or in new ones of its results' shapes."""
    if written:
        for t in written:
            t.zero_()
        return written[0] if len(func._schema.returns) == 1 and len(written) == 1 else list(written)
    with FakeTensorMode() as fake:
        shapes = func(*pytree.tree_map_only(torch.Tensor, fake.from_tensor, args), **kwargs)
    return pytree.tree_map_only(torch.Tensor, lambda m: torch.zeros(m.shape, dtype=m.dtype), shapes)


class FakeGraph:
    def __init__(self):
        self.ops = []
        self.pool = set()  # the storages the capture allocated
        self.outputs = []
        self.replays = 0
        self.destroyed = False

    def capture(self, body, fail_at=None):
        rng = torch.get_rng_state()
        recorder = _Recorder(self, fail_at)
        try:
            with _refusing_host_state(), recorder:
                outputs = body()
        finally:
            for storage, before in recorder.saved.values():
                storage.copy_(before)
            torch.set_rng_state(rng)
        for op in self.ops:  # what the capture computed is garbage until a replay writes it
            for _, t in op.fresh:
                if t.is_floating_point():
                    t.fill_(float("nan"))
        self.outputs = outputs
        return outputs

    def replay(self):
        assert not self.destroyed, "replay of a destroyed graph"
        FakeCuda.log.append(("replay", FakeCuda.on[-1].name))
        with torch.no_grad():
            for op in self.ops:
                if not op.rerun:
                    continue
                new = op.func(*op.args, **op.kwargs)
                flat = pytree.tree_leaves(new)
                if op.collective:
                    for t in _tensors(flat):
                        torch.ops._c10d_functional.wait_tensor(t)
                for i, t in op.fresh:
                    t.copy_(flat[i])
        self.replays += 1

    def reset(self):
        self.destroyed = True
        self.ops = []


@contextlib.contextmanager
def _refusing_host_state():
    """``.tolist()``, ``.numpy()`` and the random state's reads raise in the block."""
    def refuse(what):
        def method(*args, **kwargs):
            raise CaptureError(f"fake CUDA: {what} while capturing (operation not permitted when stream is capturing)")
        return method

    saved = [(torch.Tensor, how, getattr(torch.Tensor, how)) for how in ("tolist", "numpy")]
    saved += [(owner, how, getattr(owner, how)) for owner, how in _RNG]
    try:
        for owner, how, _ in saved:
            setattr(owner, how, refuse(f"{owner.__name__}.{how}()"))
        yield
    finally:
        for owner, how, method in saved:
            setattr(owner, how, method)


class FakeCuda:
    """The pieces of torch.cuda that shardfn._program.capture uses, on the CPU. ``fail``: the captures
    (counted from 0) that raise, each at its op given there (out of memory)."""

    log: list = []
    on: list = []

    def __init__(self, fail=None):
        FakeCuda.log = []
        FakeCuda.on = [FakeStream("current")]
        self.graphs = []
        self.pools = []
        self.fail = dict(fail or {})
        self._captures = itertools.count()

    def side_stream(self, device):
        return FakeStream(f"side{len(self.pools)}")

    def current_stream(self, device):
        return FakeCuda.on[-1]

    @contextlib.contextmanager
    def on_stream(self, stream):
        FakeCuda.on.append(stream)
        FakeCuda.log.append(("on", stream.name))
        try:
            yield
        finally:
            FakeCuda.on.pop()

    def new_pool(self, device):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, body, stream, pool):
        assert pool in self.pools and FakeCuda.on[-1] is not stream
        FakeCuda.log.append(("capture", stream.name))
        graph = FakeGraph()
        number = next(self._captures)
        with self.on_stream(stream):  # torch.cuda.graph captures on its stream
            outputs = graph.capture(body, self.fail.get(number))
        self.graphs.append(graph)
        return graph, outputs
