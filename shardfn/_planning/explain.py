"""explain: what a plan will cost per rank, before any training, at any scale.

[Note: how explain predicts]
The static figures (parameters, bytes of shards, gradients and optimizer state per
rank and unit) come from the layout and from ``optimizer.init`` on the shards. The
communication per step and the peak come from *running* one real training step, the
same ``jit_step`` code a run executes, on fake tensors: ``FakeTensorMode`` gives every
tensor a shape, dtype and device but no data, and a process group on torch's ``fake``
backend accepts every collective without moving anything. So the gather, free,
regather, reduce and optimizer allocations are the ones a real step makes, and
:func:`shardfn._memory.track_live_bytes` counts them the same way it counts a real
run's. One step warms up (it records the unit order that prefetching follows); the
second is measured. The prediction is rank 0's, whose shards are the largest (padding
sits on the last ranks). What it cannot see: memory that is not a tensor (the CUDA
caching allocator's fragmentation and workspaces, NCCL buffers, the Python heap).

A 7B model at 64 ranks plans on a laptop in seconds: no parameter is ever allocated.

[Note: tensor parallelism in a plan]
With ``tensor=T`` and ``tensor_parallel=`` the fake world has the tensor axis and ``shard``
splits the layers as a real run does: each split leaf enters the layout as tensor rank 0's
piece (1/T of it, every piece the same shape), FSDP shards those pieces over ``shard``,
and the fake step runs the split layers' own forward, so the gathered units, the
activations of the split layers and the tensor axis's all-reduces are the real ones. Only
``params`` counts a split leaf whole (its global shape in ``layout.splits``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from .._deprecated import as_loss
from .._comm.events import Collective, CollectiveLog, record_collectives
from .._run.functionalize import Apply, Params, functionalize
from .._memory import track_live_bytes
from .._mesh import Mesh
from .._state.offload import mark_host_trees
from .._state.plan import Plan, Strategy
from .._shard import shard
from .._jit import jit_step
from ..optim import adamw
from ..optim._protocol import param_leaves

__all__ = ["Explanation", "UnitCost", "explain"]

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """One unit's share of a step, on one rank (bytes)."""

    name: str
    params: int  # elements of the full parameters
    param_bytes: int  # this rank's shards
    grad_bytes: int  # this rank's gradient shards (trainable parameters)
    optim_bytes: int  # this rank's optimizer state for the unit's parameters
    gather_bytes: int  # all-gather output per step
    reduce_bytes: int  # reduce-scatter input + all-reduce tensor per step
    placement: str = "flat"  # "flat", "rows" or "whole" ([Note: placements])
    padding: int = 0  # elements of padding, all ranks together: what the placement costs beyond the parameters
    bucket: str = ""  # the bucket it reduces in ([Note: buckets]); its own name when it reduces alone
    gather_bucket: str = ""  # the bucket it gathers in; its own name when it gathers alone


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What :func:`explain` found; ``print()`` it for the table."""

    strategy: str
    mesh_shape: tuple[int, ...]
    units: tuple[UnitCost, ...]
    collectives: dict[str, tuple[int, int]]  # kind -> (count, bytes) per step and rank, all of them
    persistent_bytes: int | None  # shards, buffers and optimizer state on the compute device, before a step
    peak_bytes: int | None  # the most live tensor bytes on the compute device during a step (None: no batch given)
    # With offload ([Note: offload]): what lives in host memory instead, and the copies per step
    host_bytes: int = 0  # shards and optimizer state in host memory, before a step
    host_peak_bytes: int | None = None  # ... and at most during a step (gradients, optimizer temporaries)
    transfers: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # direction -> (copies, bytes)
    tensor: int = 1  # ranks of the mesh's "tensor" axis ([Note: tensor parallelism in a plan])
    split_layers: tuple[str, ...] = ()  # the layers split over them

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)

    def total(self, field: str) -> int:
        return sum(getattr(u, field) for u in self.units)

    def __str__(self) -> str:
        def mib(b: int | None) -> str:
            return "-" if b is None else f"{b / _MIB:,.2f}"

        ranks = math.prod(self.mesh_shape)
        head = (f"shardfn.explain: {self.strategy} on mesh {self.mesh_shape} ({ranks} ranks), "
                f"{self.params:,} parameters; MiB per rank, communication per step and rank")
        if self.split_layers:
            head += (f"\n  tensor parallel: {len(self.split_layers)} layers split over the 'tensor' axis's "
                     f"{self.tensor} ranks (a split unit's figures are its pieces on this rank)")
        cols = f"  {'unit':<22} {'params':>15} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} " \
               f"{'gather MiB':>11} {'reduce MiB':>11}  {'placement':<9} {'padding':>9}"
        rows = [head, cols]
        shown = self.units if len(self.units) <= 12 else self.units[:5] + (None,) + self.units[-5:]
        for u in shown:
            if u is None:
                rows.append(f"  {'... ' + str(len(self.units) - 10) + ' more units':<22}")
                continue
            rows.append(f"  {u.name:<22} {u.params:>15,} {mib(u.param_bytes):>11} {mib(u.grad_bytes):>10} "
                        f"{mib(u.optim_bytes):>10} {mib(u.gather_bytes):>11} {mib(u.reduce_bytes):>11}  "
                        f"{u.placement:<9} {u.padding:>9,}")
        rows.append(f"  {'total':<22} {self.params:>15,} {mib(self.total('param_bytes')):>11} "
                    f"{mib(self.total('grad_bytes')):>10} {mib(self.total('optim_bytes')):>10} "
                    f"{mib(self.total('gather_bytes')):>11} {mib(self.total('reduce_bytes')):>11}")
        coll = ", ".join(f"{k} x{c} = {mib(b)} MiB" for k, (c, b) in sorted(self.collectives.items()))
        rows.append(f"  collectives per step and rank: {coll or 'none'}")
        where = " on the compute device" if self.host_bytes else ""
        rows.append(f"  persistent per rank (shards, buffers, optimizer state){where}: {mib(self.persistent_bytes)} MiB")
        if self.host_bytes:
            peak = f", at most {mib(self.host_peak_bytes)} MiB during a step" if self.host_peak_bytes is not None else ""
            rows.append(f"  offloaded to host memory per rank (shards, gradients, optimizer state): "
                        f"{mib(self.host_bytes)} MiB between steps{peak}")
        shared = sorted({u.bucket for u in self.units if u.bucket and u.bucket != u.name})
        if shared:
            rows.append(f"  buckets (units whose gradients reduce in one collective): {', '.join(shared)}")
        shared = sorted({u.gather_bucket for u in self.units if u.gather_bucket and u.gather_bucket != u.name})
        if shared:
            rows.append(f"  buckets (units whose parameters gather in one collective): {', '.join(shared)}")
        if self.transfers:
            moves = ", ".join(f"{k} x{c} copies = {mib(b)} MiB" for k, (c, b) in sorted(self.transfers.items()))
            rows.append(f"  host <-> device copies per step and rank: {moves}")
        if self.peak_bytes is None:
            rows.append("  predicted peak: pass batch= to simulate a step")
        else:
            rows.append(f"  predicted peak live tensor bytes per rank{where}: {mib(self.peak_bytes)} MiB "
                        f"({self.peak_bytes:,} B; persistent + the step's gathered units, activations, "
                        f"gradients and optimizer temporaries)")
        return "\n".join(rows)


def explain(
    model: nn.Module | Params,
    mesh: Mesh | int | tuple[int, int],
    plan: Plan | Strategy | str = "FULL_SHARD",
    batch: Any = None,
    *,
    loss_fn: Callable[[Apply, Mapping[str, torch.Tensor], Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    tensor: int | None = None,
    tensor_parallel: Mapping[str, str] | None = None,
    verbose: bool = True,
    **step_options: Any,
) -> Explanation:
    """Plans a run: per unit and in total, what each rank holds and moves, and its peak.

    Nothing is allocated: parameters, activations and collectives are simulated on fake
    tensors and torch's ``fake`` process-group backend (see [Note: how explain predicts]).

    Args:
        model: the model (build big ones under ``torch.device("meta")``), or the params
            of :func:`shardfn.functionalize`.
        mesh: the ranks to plan for: a world size (``64``), a ``(replicate, shard)``
            pair for the hybrid strategies, or a :class:`shardfn.Mesh` over the ``fake``
            backend. With a world size, this process must not have a default process
            group yet: explain starts a fake one and ends it before returning.
            With ``tensor=T`` the mesh has a ``"tensor"`` axis of ``T`` ranks, as
            ``Mesh.from_env(tensor=T)`` builds: a world size is all the ranks (``world / T``
            shards); a ``(replicate, shard)`` pair is multiplied by ``T``.
        plan: as for :func:`shardfn.shard` (a strategy name or a :class:`shardfn.Plan`).
        batch: one rank's batch, as passed to the step (real, meta or fake tensors; only
            shapes and dtypes matter). ``None`` skips the step: no peak, and collectives
            as the layout predicts them.
        loss_fn: ``loss_fn(apply, params, batch) -> scalar``; default: the mean of
            ``apply(params, batch)``.
        optimizer: a :mod:`shardfn.optim` transformation; default ``adamw(1e-3)``.
        tensor: ranks of the mesh's ``"tensor"`` axis (with a world size or a pair as ``mesh``).
        tensor_parallel: as for :func:`shardfn.shard`: the layers to split over the tensor
            axis (docs/tensor-parallel.md); each rank's pieces are planned as its state.
        verbose: print the table.
        step_options: passed to :func:`shardfn.jit_step` (``micro_batches``, ``prefetch``, ...).

    Returns:
        An :class:`Explanation` (``print`` shows the table).

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(d_model=4096, n_layers=32, n_heads=32, vocab_size=32000, seq_len=2048))
        >>> sf.explain(model, 64, "FULL_SHARD", torch.zeros(1, 2048, dtype=torch.long))
    """
    module = model if isinstance(model, nn.Module) else getattr(model, "module", None)
    if module is None:
        raise TypeError(
            "explain(model, ...): pass the nn.Module, or the params returned by functionalize(model) "
            f"(which remember the module tree); got {type(model).__name__}."
        )
    params, _ = functionalize(module)  # the fake tree below carries this model's apply
    loss = as_loss(loss_fn, "explain")[0] if loss_fn is not None else _mean_output
    optimizer = optimizer if optimizer is not None else adamw(1e-3)
    with _fake_world(mesh, tensor) as fake_mesh, FakeTensorMode(allow_non_fake_inputs=True):
        fake = Params({n: _fake_like(p).requires_grad_(p.requires_grad) for n, p in params.items()})
        fake.module = params.module
        sharded = shard(fake, fake_mesh, plan, tensor_parallel=tensor_parallel)
        opt_state = optimizer.init(sharded)
        if sharded.layout.offloaded:
            mark_host_trees([opt_state])
        persistent = peak = None
        host = (0, None)
        log = None
        if batch is not None:
            fake_batch = pytree.tree_map(lambda t: _fake_like(t) if isinstance(t, torch.Tensor) else t, batch)
            step = jit_step(loss, fake_mesh, optimizer=optimizer, **step_options)
            sharded, opt_state, _ = step(sharded, opt_state, fake_batch)  # warm-up: records the unit order
            with track_live_bytes(sharded, opt_state) as mem, record_collectives() as log:
                persistent = mem.device_current
                host = (mem.host_current, None)
                sharded, opt_state, _ = step(sharded, opt_state, fake_batch)
            peak, host = mem.device_peak, (host[0], mem.host_peak)
        else:
            with track_live_bytes(sharded, opt_state) as mem:
                persistent, host = mem.device_current, (mem.host_current, None)
        report = _report(sharded, opt_state, log, persistent, peak, host)
    if verbose:
        print(report)
    return report


def _mean_output(apply: Apply, params: Mapping[str, torch.Tensor], batch: Any) -> torch.Tensor:
    out = apply(params, batch)
    return out.float().mean()


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and layout under the active fake mode (no values)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu") if t.layout == torch.strided \
        else torch.empty(t.shape, dtype=t.dtype)


class _fake_world:
    """The mesh to plan on: a given fake-backend mesh, or a fake world started for the call."""

    def __init__(self, mesh: Mesh | int | tuple[int, int], tensor: int | None = None):
        self.spec = mesh
        self.tensor = tensor
        self.started = False

    def __enter__(self) -> Mesh:
        spec = self.spec
        if isinstance(spec, Mesh):
            if spec.backend != "fake":
                raise ValueError(
                    f"explain(): {spec!r} runs on a real backend; explain simulates on torch's 'fake' backend. "
                    f"Pass the shape instead (mesh={spec.size if spec.ndim == 1 else spec.shape}) from a process "
                    "without a process group, or a Mesh built after "
                    "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=N)."
                )
            if self.tensor is not None and self.tensor != spec.axis_size("tensor"):
                raise ValueError(f"explain(tensor={self.tensor!r}): {spec!r} has a 'tensor' axis of "
                                 f"{spec.axis_size('tensor')}; drop tensor= when passing a Mesh.")
            return spec
        shape = (spec,) if isinstance(spec, int) else tuple(spec)
        if not shape or len(shape) > 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(f"explain(): mesh must be a world size, a (replicate, shard) pair or a Mesh; got {spec!r}")
        tensor = self.tensor
        if tensor is not None and (isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1
                                   or (len(shape) == 1 and shape[0] % tensor)):
            raise ValueError(f"explain(tensor={tensor!r}): the tensor axis must be a positive int that divides "
                             f"the world size {spec!r}, as for Mesh.from_env(tensor=T).")
        if tensor is not None and len(shape) == 2:
            shape = (*shape, tensor)  # (replicate, shard) and the tensor axis: world = R x S x T
        if dist.is_initialized():
            raise ValueError(
                f"explain(mesh={spec!r}): this process already has a default process group "
                f"({dist.get_backend()}, {dist.get_world_size()} ranks), so a fake world of {math.prod(shape)} "
                "cannot be started here. Call explain before init_process_group (or in a separate process), or "
                "pass a Mesh over the 'fake' backend."
            )
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
        self.started = True
        try:
            return Mesh.from_group(replicate=shape[0] if len(shape) >= 2 else None, tensor=tensor)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        if self.started:
            dist.destroy_process_group()
            self.started = False


def _report(sharded: Any, opt_state: Any, log: CollectiveLog | None, persistent: int | None,
            peak: int | None, host: tuple[int, int | None]) -> Explanation:
    layout = sharded.layout
    optim_bytes: dict[str, int] = {}
    for _, name, leaf in param_leaves(opt_state):
        if isinstance(leaf, torch.Tensor) and name in layout.leaves:
            unit = layout.unit_of(name).name
            optim_bytes[unit] = optim_bytes.get(unit, 0) + leaf.numel() * leaf.element_size()
    moved: dict[str, dict[str, int]] = {}
    buckets = {"gather": {layout.bucket_name(b): b for b in layout.gather_buckets},
               "reduce": {layout.bucket_name(b): b for b in layout.buckets}}
    share = {"gather": lambda u: layout.world * u.numel * u.param_dtype.itemsize,
             "reduce": lambda u: layout.world * u.grad_numel * u.reduce_dtype.itemsize}
    if log is not None:
        for c in log.calls:
            kind = "gather" if c.kind is Collective.ALL_GATHER else "reduce"
            members = buckets[kind].get(c.unit, ())
            if len(members) > 1:  # a bucket's collective ([Note: buckets]): each unit its own share
                for i in members:
                    u = layout.units[i]
                    moved.setdefault(u.name, {}).setdefault(kind, 0)
                    moved[u.name][kind] += share[kind](u)
                continue
            moved.setdefault(c.unit, {}).setdefault(kind, 0)
            moved[c.unit][kind] += c.nbytes
        collectives: dict[str, tuple[int, int]] = {}
        for c in log.calls:
            n, b = collectives.get(c.kind.value, (0, 0))
            collectives[c.kind.value] = (n + 1, b + c.nbytes)
    else:
        collectives = layout.collectives_per_step()
        for u in layout.units:
            per = layout.unit_collectives(u)
            moved[u.name] = {"gather": per.get("all_gather", (0, 0))[1],
                             "reduce": per.get("reduce_scatter", (0, 0))[1] + per.get("all_reduce", (0, 0))[1]}
    gathered_in = {i: layout.bucket_name(b) for b in layout.gather_buckets for i in b}
    # a split leaf's layout is its piece ([Note: tensor parallelism in a plan]); params count it whole
    whole_shape = {s.leaf: s.shape for s in layout.splits}
    units = []
    for u in layout.units:
        leaves = [layout.leaves[n] for n in u.leaves]
        units.append(UnitCost(
            name=u.name,
            params=sum(math.prod(whole_shape.get(n, layout.leaves[n].shape)) for n in u.leaves),
            param_bytes=u.numel * u.dtype.itemsize,
            grad_bytes=u.grad_numel * u.dtype.itemsize,
            optim_bytes=optim_bytes.get(u.name, 0),
            gather_bytes=moved.get(u.name, {}).get("gather", 0),
            reduce_bytes=moved.get(u.name, {}).get("reduce", 0),
            placement="whole" if u.whole else "flat" if u.flat else "rows",
            padding=u.numel * layout.world - sum(math.prod(leaf.shape) for leaf in leaves),
            bucket=layout.bucket_name(layout.bucket_of(u)),
            gather_bucket=gathered_in[u.index],
        ))
    transfers = {d: (log.transfer_copies()[d], b) for d, b in log.transfer_bytes().items()} if log is not None else {}
    tensor = layout.mesh_shape[-1] if layout.tensor else 1
    return Explanation(layout.strategy.value, tuple(layout.mesh_shape), tuple(units), collectives, persistent, peak,
                       host[0], host[1], transfers, tensor, tuple(path for path, _ in layout.tensor))

