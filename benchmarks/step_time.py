"""Side-by-side GPT training step: shardfn against a single process, DDP and FSDP2.

Every configuration trains the same ``shardfn.testing.models.GPT`` (same seed, so the same
initial weights) on the same global batches with AdamW, on CPU with gloo. Ranks train on
contiguous equal slices of the global batch; the world-size-1 configurations take the
whole global batch (world x per-rank batch) in a 1-rank process.

Plain torch (``torch.optim.AdamW(foreach=True)``, the multi-tensor kernels shardfn's adamw
also uses; torch's CPU default is its slower per-parameter loop; ``zero_grad(set_to_none=True)``
after every step):

* ``single``: plain ``nn.Module`` at world size 1;
* ``ddp``: ``DistributedDataParallel``;
* ``fsdp2`` / ``fsdp2_noreshard``: ``fully_shard`` on each Block, with
  ``reshard_after_forward`` True / False, and on the root with FSDP2's default (the root's
  parameters stay gathered from forward to backward, as shardfn's root unit does);
* ``fsdp2_bf16``: ``fsdp2`` with ``MixedPrecisionPolicy(param_dtype=bfloat16,
  reduce_dtype=float32)``.

shardfn (``shardfn.shard`` with default units: one per Block, plus the root;
``shardfn.optim.adamw``; ``shardfn.jit_step``, which prefetches by default):

* ``shardfn_full`` / ``shardfn_grad_op`` / ``shardfn_no_shard``: FULL_SHARD /
  SHARD_GRAD_OP / NO_SHARD; peers ``fsdp2`` (and ``ddp``) / ``fsdp2_noreshard`` / ``ddp``;
* ``shardfn_full_noprefetch``: ``shardfn_full`` with ``jit_step(prefetch=False)``
  (peer ``shardfn_full``; shows what prefetching buys);
* ``shardfn_bf16``: FULL_SHARD with ``shardfn.Precision(param=bfloat16, reduce=float32)``;
  peer ``fsdp2_bf16``;
* ``shardfn_w1``: FULL_SHARD at world size 1 (nothing to shard) on the global batch;
  peer ``single``;
* ``shardfn_full_compiled``: ``shardfn_full`` with ``jit_step(compile=True)`` (each
  block's forward and the AdamW update compiled by inductor); peers ``shardfn_full`` and
  ``fsdp2_compiled`` (``fsdp2`` with each block's forward compiled the same way,
  ``torch.compile(block.forward)``, as torchtitan compiles per block);
* ``shardfn_full_rows``: ``shardfn_full`` with ``placement="rows"`` (each parameter cut on
  dim 0: a copy into and out of every all-gather) where the others use shardfn's default
  flat placement; ``shardfn_full`` is compared with it;
* ``shardfn_no_shard_nobuckets``: ``shardfn_no_shard`` with ``Plan(bucket_bytes=0)``, one
  all-reduce per unit (``shardfn_no_shard`` is compared with it: what buckets buy);
* ``shardfn_full_graph`` / ``shardfn_no_shard_graph`` / ``shardfn_w1_graph``:
  ``jit_step(graph="inductor")``, the whole step recorded once and replayed compiled;
  ``shardfn_full_graph_ops``: ``graph="eager"``, the recorded ops replayed one by one (no
  compile). Peer: ``shardfn_full`` (and ``fsdp2``, ``ddp``);
* ``shardfn_tensor``: FULL_SHARD on a mesh with a tensor axis of 2 (``Mesh.from_group(tensor=2)``),
  every Block's MLP split (``tensor_parallel={"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2":
  "rowwise"}``, docs/tensor-parallel.md): at world 4, shard 2 x tensor 2. It trains the same
  global batch; the two ranks of a tensor group take the same slice of it (twice ``--batch``
  rows each). Not in the default pairs; peer ``shardfn_full`` at the same world:
  ``--world 4 --pairs shardfn_tensor:shardfn_full``.

``--preset small`` trains the latency-bound regime instead (d_model 64, 24 layers, seq 16,
batch 1 per rank, vocab 64: 25 units of ~50k parameters), with its own pairs and targets.

Method: a ratio is only as good as the pair's isolation. With every configuration built in
the same processes, each ran slower (FSDP2 at 1,907 ms/step instead of 1,371) and some more
than others, so that FULL_SHARD/FSDP2 read 0.81 where the pair alone read 0.93. So every
compared pair (``--pairs``, configuration:peer) is measured two ways, ``--repeats`` times:

* interleaved: the pair alone in one fresh set of processes (a new
  ``shardfn.testing.Cluster``, one torch thread per rank: two threads per rank
  oversubscribe 2 cores, DDP ran 2.4x slower); after 2 warm-up steps each, the ``--steps``
  timed steps alternate between the two (which goes first alternates with the repeat),
  each step between two barriers: wall time on rank 0, ``time.process_time()`` on every
  rank. The ratio within each repeat: both ran in the same processes at the same moment.
* separate: each configuration alone in its own fresh set of processes, timed the same
  way; the ratio of the runs of the same repeat (run one after the other), and the ratio
  of the medians over repeats.

Both are reported with their spread (min and max over repeats); a target counts as met
when the interleaved median and the ratio of medians both meet it. At world sizes above
the core count the ranks are time-sliced: ratios are then of CPU time per rank (mean over
ranks), not wall time. The first (untimed) step of every run is timed too: for a compiled
configuration it holds the compile (cold in the first run of a process-free cache; later
runs find inductor's on-disk cache).

In the interleaved runs, after the timed steps, one configuration at a time, three
untimed steps, so that no counter perturbs the timing:

1. Communication: a ``TorchDispatchMode`` over the ``c10d`` and ``_c10d_functional`` ops,
   which sees collectives issued from Python and from C++ (DDP's reducer included), counts
   textbook bytes per rank: all-gather output, reduce-scatter input, all-reduce tensor,
   broadcast tensor (on gloo shardfn's reduce-scatter is sends and receives: its bytes are
   the bytes sent x world / (world - 1)). For shardfn it is cross-checked against
   ``shardfn.record_collectives`` (and includes the small all-reduce ``jit_step`` does for
   its metrics; the schedule guard's header all-gather, under 1 KiB, is not data).
2. Memory: ``shardfn._memory.track_live_bytes`` (bytes of live tensor storages), over two
   steps. It starts from the state: parameters (FSDP2: the local shards of its DTensors) +
   optimizer state (+ DDP's gradient buckets, the tensors its reducer all-reduces, captured
   in step 1); shardfn: the sharded parameters + optimizer state. The first step allocates
   inside the block whatever a step leaves for the next (FSDP2 keeps its last reduce-scatter
   buffer until the next step), so *persistent* bytes, counted between the two steps, are
   all that lives between steps, and *peak* is the most live at any moment of the second
   step, persistent included (garbage in reference cycles is collected before each
   reading). After it, live bytes must be back to the persistent bytes; if
   not (the counter missed a free, or something was left out), the figures are shown as
   ``?`` with a warning, and the raw numbers are kept in the JSON.

Two tables. Per configuration: ms/step (rank 0 wall time) of its separate runs, median and
min-max; cpu ms/step (mean over ranks); the slowest first step (the compile, for a compiled
one); peak and persistent MiB per rank (the largest rank) and comm MiB/step (rank 0), from
its interleaved runs. Per pair: the interleaved ratio and the separate ratio (median,
min-max over repeats), the ratio of the separate medians, the issue's target and whether
both methods meet it, and peak live bytes against the peer's.

Sanity checks: the loss after the timed steps must be finite; first-step losses (global
means, before any update) of the fp32 configurations must agree within 1e-4; the bf16
configurations compute in bfloat16 (8 significant bits), so theirs must lie within 0.02 of
the fp32 median (at d_model 64 they differed from it by 0.0016).

Output: the table, JSON (``--out``) and a PNG plot next to it (same name, ``.png``), which
needs matplotlib (``pip install -e ".[bench]"``).

Run::

    pip install -e ".[bench]"
    python benchmarks/step_time.py    # the issue's measurement: world 2, d_model 512, 8 layers, seq 128
    python benchmarks/step_time.py --world 4 --pairs shardfn_full:fsdp2 --out benchmarks/results/step_time_w4.json
    python benchmarks/step_time.py --d-model 64 --layers 2 --seq 32 --repeats 1 --steps 2 --out /tmp/smoke.json
    python benchmarks/step_time.py --world 4 --pairs shardfn_tensor:shardfn_full --out benchmarks/results/step_time_tp.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from shardfn._memory import track_live_bytes
from shardfn.testing import Cluster
from shardfn.testing.models import GPT, GPTConfig, lm_loss


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration: who trains (``torch`` or ``shardfn``) and how."""

    kind: str  # "torch" (wrap: "none", "ddp" or "fsdp2") or "shardfn"
    wrap: str = "none"
    world1: bool = False  # a 1-rank process on the global batch
    strategy: str = "FULL_SHARD"  # shardfn
    prefetch: bool = True  # shardfn
    reshard: bool = True  # fsdp2
    bf16: bool = False  # parameters gathered and computed in bfloat16, gradients reduced in fp32
    compiled: bool = False  # shardfn: jit_step(compile=True); fsdp2: each Block's forward compiled (regional)
    placement: str = "flat"  # shardfn: Plan(placement=...); "flat" is shardfn's default
    buckets: bool = True  # shardfn: Plan(bucket_bytes=0) when False (each unit reduces alone)
    graph: bool | str = False  # shardfn: jit_step(graph=...): "inductor" compiled, "eager" op by op
    tensor: int = 1  # shardfn: a "tensor" mesh axis of this size, the MLPs split over it (TENSOR_PLAN)

    def data(self, rank: int, world: int) -> tuple[int, int]:
        """This rank's slice of the global batch and the number of slices (a tensor group shares one)."""
        return rank // self.tensor, world // self.tensor


SPECS = {
    "single": Spec("torch", world1=True),
    "ddp": Spec("torch", "ddp"),
    "fsdp2": Spec("torch", "fsdp2"),
    "fsdp2_noreshard": Spec("torch", "fsdp2", reshard=False),
    "fsdp2_bf16": Spec("torch", "fsdp2", bf16=True),
    "fsdp2_compiled": Spec("torch", "fsdp2", compiled=True),
    "shardfn_full": Spec("shardfn"),
    "shardfn_full_noprefetch": Spec("shardfn", prefetch=False),
    "shardfn_grad_op": Spec("shardfn", strategy="SHARD_GRAD_OP"),
    "shardfn_bf16": Spec("shardfn", bf16=True),
    "shardfn_no_shard": Spec("shardfn", strategy="NO_SHARD"),
    "shardfn_w1": Spec("shardfn", world1=True),
    "shardfn_full_compiled": Spec("shardfn", compiled=True),
    "shardfn_full_rows": Spec("shardfn", placement="rows"),
    "shardfn_no_shard_nobuckets": Spec("shardfn", strategy="NO_SHARD", buckets=False),
    "shardfn_full_graph": Spec("shardfn", graph="inductor"),
    "shardfn_no_shard_graph": Spec("shardfn", strategy="NO_SHARD", graph="inductor"),
    "shardfn_w1_graph": Spec("shardfn", world1=True, graph="inductor"),
    "shardfn_full_graph_ops": Spec("shardfn", graph="eager"),
    "shardfn_tensor": Spec("shardfn", tensor=2),
}
TENSOR_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
CONFIGS = tuple(SPECS)
# The compared pairs (configuration, peer) and the issue's target for each: the largest
# ratio of step times (CPU time per rank where the ranks outnumber the cores); None: no target.
PAIRS = {
    ("shardfn_full", "fsdp2"): 0.85,
    ("shardfn_full", "ddp"): 1.03,
    ("shardfn_grad_op", "fsdp2_noreshard"): 0.85,
    ("shardfn_bf16", "fsdp2_bf16"): 0.80,
    ("shardfn_no_shard", "ddp"): 1.00,
    ("shardfn_w1", "single"): 1.02,
    ("shardfn_full_noprefetch", "shardfn_full"): None,
    ("shardfn_full_compiled", "shardfn_full"): None,
    ("shardfn_full_compiled", "fsdp2_compiled"): None,
    ("shardfn_full", "shardfn_full_rows"): None,
    ("shardfn_full_graph", "fsdp2"): 0.85,
    ("shardfn_full_graph", "ddp"): 1.00,
    ("shardfn_full_graph", "shardfn_full"): None,
}
# The two regimes (--preset): "big" units, where compute hides the collectives (the default
# GPT above), and "small" ones, latency-bound as a GPU is where compute shrinks a hundredfold:
# 25 units of 50k parameters, where each collective's latency and each unit's host work show
# (issue "Buckets"). Each preset has its model and its targets; explicit sizes override.
PRESETS = {
    "big": {"dims": {"d_model": 512, "layers": 8, "heads": 4, "seq": 128, "vocab": 256, "batch": 4}, "targets": PAIRS},
    "small": {"dims": {"d_model": 64, "layers": 24, "heads": 2, "seq": 16, "vocab": 64, "batch": 1},
              "targets": {("shardfn_no_shard", "ddp"): 1.10, ("shardfn_full", "fsdp2"): 0.50,
                          ("shardfn_full", "ddp"): 1.50, ("shardfn_grad_op", "fsdp2_noreshard"): None,
                          ("shardfn_no_shard", "shardfn_no_shard_nobuckets"): None,
                          ("shardfn_no_shard_graph", "ddp"): 0.80, ("shardfn_full_graph", "ddp"): 1.00,
                          ("shardfn_full_graph", "shardfn_full"): None,
                          ("shardfn_full_graph_ops", "shardfn_full"): None}},
}
WARMUP = 3  # a graph step: eager, then it records, then it compiles
LOSS_TOL = 1e-4  # fp32 configurations among themselves
BF16_LOSS_TOL = 0.02  # bf16 configurations against the fp32 median
MIB = 2**20


# ---------------------------------------------------------------------------------------
# Counting collectives

# op -> (kind, the argument whose tensors hold the textbook bytes); functional all-gathers
# take the input and the group size instead (their output is allocated by the op).
_COLLECTIVES = {
    "c10d::_allgather_base_": ("all_gather", "output_tensor"),
    "c10d::allgather_": ("all_gather", "output_tensors"),
    "c10d::allgather_coalesced_": ("all_gather", "output_lists"),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "c10d::allreduce_": ("all_reduce", "tensors"),
    "c10d::allreduce_coalesced_": ("all_reduce", "tensors"),
    "c10d::broadcast_": ("broadcast", "tensors"),
    "c10d::send": ("send", "tensors"),
    "c10d::recv_": ("recv", "tensors"),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_c10d_functional::all_to_all_single": ("reduce_scatter", "input"),  # a graph step's reduce-scatter on gloo
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "_c10d_functional::all_reduce": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_": ("all_reduce", "input"),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs"),
    "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs"),
    "_c10d_functional::broadcast": ("broadcast", "input"),
    "_c10d_functional::broadcast_": ("broadcast", "input"),
}
_NOT_DATA = {"c10d::barrier", "c10d::monitored_barrier_", "c10d::check_for_nan", "_c10d_functional::wait_tensor",
             "_c10d_functional::_wrap_tensor_autograd"}


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class CollectiveCounter(TorchDispatchMode):
    """Textbook bytes and calls per kind of every collective dispatched while active.

    Collectives not in the table above are counted under ``other:<op>`` with the bytes of
    all their tensor arguments, so that none is silently dropped. With ``keep_all_reduced``,
    ``all_reduced`` keeps the tensors all-reduced through ``c10d::allreduce_`` (DDP's
    gradient buckets); it keeps them alive, so only for tensors that live on anyway.
    """

    def __init__(self, keep_all_reduced: bool = False) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.keep_all_reduced = keep_all_reduced
        self.all_reduced: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if func.namespace in ("c10d", "_c10d_functional") and name not in _NOT_DATA:
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            if name in _COLLECTIVES:
                kind, arg = _COLLECTIVES[name]
                n = _nbytes(bound[arg])
                if name.startswith("_c10d_functional::all_gather_into_tensor") and arg != "out":
                    n *= bound["group_size"]
                if name == "c10d::allreduce_" and self.keep_all_reduced:
                    self.all_reduced += bound["tensors"]
            else:
                kind, n = f"other:{name}", _nbytes(list(bound.values()))
            self.bytes[kind] += n
            self.calls[kind] += 1
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# The configurations


def make_batches(n: int, global_batch: int, seq: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """``n`` global batches of ``seq + 1`` random tokens, the same in every process."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(vocab, (global_batch, seq + 1), generator=g) for _ in range(n)]


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor is a wrapper: its own storage has no data (it reports the global size);
    # the bytes this rank holds are those of its local tensor.
    return t.to_local() if isinstance(t, DTensor) else t


def build_torch_step(spec: Spec, model: torch.nn.Module, lr: float):
    """``step(x, y) -> local loss tensor`` and ``persistent() -> list of tensors``."""
    if spec.wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif spec.wrap == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if spec.bf16
              else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=spec.reshard, mp_policy=mp)
            if spec.compiled:  # regional compilation of the block's own forward, as shardfn's compile=True
                block.forward = torch.compile(block.forward)
        # The root at FSDP2's default, which keeps its parameters gathered from forward to
        # backward (resharding them would only gather them again at once), as shardfn keeps
        # its root unit; passing True here would add one all-gather of the root per step.
        fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=True)

    def step(x, y):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def persistent():
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return [_local(t) for t in [*model.parameters(), *state]]

    return step, persistent


def build_shardfn_step(spec: Spec, model: torch.nn.Module, lr: float):
    """The same pair built from shardfn; ``step`` returns the global mean loss (a float)."""
    mesh = sf.Mesh.from_group(tensor=spec.tensor) if spec.tensor > 1 else sf.Mesh.from_group()
    params, apply = sf.functionalize(model)
    opt = sf.optim.adamw(lr)
    precision = sf.Precision(param=torch.bfloat16, reduce=torch.float32) if spec.bf16 else None
    placement = {"placement": spec.placement} if spec.placement != "flat" else {}  # (an older shardfn has none)
    placement.update({} if spec.buckets else {"bucket_bytes": 0})
    placement.update({"tensor_parallel": TENSOR_PLAN} if spec.tensor > 1 else {})
    state = {"sharded": sf.shard(params, mesh, spec.strategy, precision=precision, **placement)}
    del params  # the full parameters are not part of the trained state
    state["opt"] = opt.init(state["sharded"])
    compiled = {"compile": True} if spec.compiled else {}  # (so that an older shardfn can be measured too)
    compiled.update({"graph": spec.graph} if spec.graph else {})
    jstep = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt, prefetch=spec.prefetch,
                        **compiled)

    def step(x, y):
        state["sharded"], state["opt"], metrics = jstep(state["sharded"], state["opt"], (x, y))
        return float(metrics["loss"]) if spec.graph else metrics["loss"]  # (a graph step's is a tensor, global)

    def persistent():
        return [state["sharded"], state["opt"]]

    return step, persistent


def global_mean(loss) -> float:
    """The mean over ranks of a local loss tensor (shardfn's metrics are already global)."""
    if isinstance(loss, float):
        return loss
    t = loss.reshape(1).float().clone()
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def run_group(configs: list[str], opts: dict) -> dict[str, dict]:
    """Runs on every rank of a fresh world: builds every configuration of the group, times
    them interleaved step by step, then counts each. Returns this rank's figures per configuration."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=opts["vocab"], seq_len=opts["seq"], d_model=opts["d_model"],
                    n_layers=opts["layers"], n_heads=opts["heads"])
    steps = {}
    for config in configs:
        spec = SPECS[config]
        torch.manual_seed(opts["seed"])  # the same initial weights for every configuration
        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        build = build_shardfn_step if spec.kind == "shardfn" else build_torch_step
        steps[config] = build(spec, model, opts["lr"])
        del model  # torch configurations keep it alive through their step

    # WARMUP + timed + 3 untimed steps (communication, memory twice), each configuration's
    # slices of the same global batches (the ranks of a tensor group take the same slice)
    global_batches = make_batches(WARMUP + opts["steps"] + 3, opts["batch"] * opts["world"], opts["seq"],
                                  opts["vocab"], opts["seed"])
    local = {}
    for config in configs:
        part, parts = SPECS[config].data(rank, world)
        per_rank = opts["batch"] * opts["world"] // parts
        local[config] = [(t[part * per_rank:(part + 1) * per_rank, :-1].contiguous(),
                          t[part * per_rank:(part + 1) * per_rank, 1:].contiguous()) for t in global_batches]

    out = {}
    for config, (step, _) in steps.items():
        batches = local[config]
        dist.barrier()
        t0 = time.perf_counter()
        first = step(*batches[0])  # a compiled configuration compiles here
        out[config] = {"n_params": n_params, "first_step_s": time.perf_counter() - t0,
                       "first_loss": global_mean(first)}
        for x, y in batches[1:WARMUP]:
            step(x, y)
    # Timed: one step of each configuration in turn (the order rotates every step), each
    # between two barriers, so that they share this world's machine, load and moment.
    wall, cpu, last = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0.0), {}
    for i in range(opts["steps"]):
        for config in configs[i % len(configs):] + configs[:i % len(configs)]:
            x, y = local[config][WARMUP + i]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            last[config] = steps[config][0](x, y)
            dist.barrier()
            wall[config] += time.perf_counter() - t0
            cpu[config] += time.process_time() - c0
    for config, (step, persistent) in steps.items():
        n = opts["steps"]
        out[config].update({"ms_per_step": 1e3 * wall[config] / n, "cpu_ms_per_step": 1e3 * cpu[config] / n,
                            "final_loss": global_mean(last[config])})
        if opts["count"]:
            out[config].update(count(config, step, persistent, local[config][-3:]))
    return out


def count(config: str, step, persistent, batches: list) -> dict:
    """Communication and memory of ``config`` over three untimed steps (see the docstring)."""
    spec = SPECS[config]
    comm_batch, *mem_batches = batches
    ddp = spec.wrap == "ddp"
    with sf.record_collectives() as log, CollectiveCounter(keep_all_reduced=ddp) as comm:
        step(*comm_batch)
    buckets = comm.all_reduced  # DDP's gradient buckets, which its reducer keeps; others: []

    trees = [*persistent(), buckets]
    # For DDP, see which tensors the reducer all-reduces this time.
    again = CollectiveCounter(keep_all_reduced=True) if ddp else contextlib.nullcontext()
    with track_live_bytes() as mem, again:
        state_bytes = mem.add(*trees)
        # Two steps: what a step leaves for the next (FSDP2 keeps its last reduce-scatter
        # buffer until the next step) is allocated inside the block by the first, so the
        # second starts and ends in the steady state and its peak is the step's peak.
        out = step(*mem_batches[0])
        del out
        gc.collect()  # garbage in reference cycles (any configuration's) is not state
        persistent_bytes = mem.current  # the state + whatever a step carries into the next
        mem.reset_peak()
        out = step(*mem_batches[1])
        del out
        gc.collect()
        end_bytes = mem.current
    del trees
    buckets_reused = None
    if ddp:  # the captured buckets are the ones the reducer uses every step, not a copy
        buckets_reused = bool(buckets) and [t.data_ptr() for t in buckets] == [t.data_ptr() for t in again.all_reduced[-len(buckets):]]
    return {"comm_bytes": dict(comm.bytes), "comm_calls": dict(comm.calls),
            "shardfn_recorded_bytes": dict(log.bytes()) if spec.kind == "shardfn" else None,
            "persistent_bytes": persistent_bytes, "peak_bytes": mem.peak, "end_bytes": end_bytes,
            "state_bytes": state_bytes, "ddp_buckets_reused": buckets_reused}


def measure(configs: list[str], opts: dict) -> dict[str, dict]:
    """One run of ``configs`` in a fresh set of processes: per configuration, rank 0's wall
    time and communication, every rank's CPU time and memory."""
    cluster = Cluster(1 if SPECS[configs[0]].world1 else opts["world"], timeout=opts["timeout"])
    try:
        ranks = cluster.run(run_group, configs, opts)
    finally:
        cluster.close()
    per_rank = ("cpu_ms_per_step", "persistent_bytes", "peak_bytes", "end_bytes")
    return {c: {**ranks[0][c], **{k: [r[c][k] for r in ranks] for k in per_rank if k in ranks[0][c]}} for c in configs}


# ---------------------------------------------------------------------------------------
# Summary, checks, output


def _residual_ok(run: dict) -> bool:
    """Live bytes after the second memory step are back to those before it, on every rank.

    Allowed: 64 KiB or 1% of the persistent bytes (the step's returned scalars and the like).
    """
    return all(abs(e - p) <= max(64 * 1024, 0.01 * p) for e, p in zip(run["end_bytes"], run["persistent_bytes"]))


def _time(run: dict, cpu: bool) -> float:
    """A run's step time: rank 0's wall ms, or the mean over ranks of CPU ms (``cpu``)."""
    return statistics.mean(run["cpu_ms_per_step"]) if cpu else run["ms_per_step"]


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def summarise_configs(alone: dict[str, list[dict]], counted: dict[str, list[dict]], world: int) -> dict[str, dict]:
    """Per configuration: step times from its separate-process runs (median, min, max), the
    first step's time (cold compile included where it compiles), memory and communication
    from the counted (interleaved) runs (medians; memory: the largest rank)."""
    out = {}
    for config, rs in alone.items():
        cs = counted.get(config, [])
        r0 = cs[0] if cs else None
        mem_ok = bool(cs) and all(_residual_ok(r) for r in cs)
        rec = r0["shardfn_recorded_bytes"] if r0 else None
        shards = world // SPECS[config].tensor  # the ranks a reduce-scatter spans
        out[config] = {
            "ms_per_step": _spread([r["ms_per_step"] for r in rs]),
            "cpu_ms_per_step": _spread([statistics.mean(r["cpu_ms_per_step"]) for r in rs]),
            "first_step_s": [r["first_step_s"] for r in rs],  # in run order: the first is the cold compile
            "peak_mib_per_rank": statistics.median(max(r["peak_bytes"]) for r in cs) / MIB if mem_ok else None,
            "persistent_mib_per_rank": statistics.median(max(r["persistent_bytes"]) for r in cs) / MIB if mem_ok
            else None,
            "memory_counted_consistently": mem_ok,
            "memory_residual_mib": max((e - p for r in cs for e, p in zip(r["end_bytes"], r["persistent_bytes"])),
                                       key=abs, default=0) / MIB,
            "comm_mib_per_step": sum(_as_shardfn_counts(r0["comm_bytes"], shards).values()) / MIB if r0 else None,
            "comm_bytes_per_step": r0["comm_bytes"] if r0 else None,
            "comm_calls_per_step": r0["comm_calls"] if r0 else None,
            "shardfn_recorded_bytes": rec,
            "comm_matches_shardfn_record": None if rec is None else _same_counts(rec, r0["comm_bytes"], shards),
            "ddp_buckets_reused": r0["ddp_buckets_reused"] if r0 else None,
            "bf16": SPECS[config].bf16,
            "first_loss": rs[0]["first_loss"],
            "final_loss_finite": all(math.isfinite(r["final_loss"]) for r in [*rs, *cs]),
        }
    return out


def _as_shardfn_counts(counted: dict[str, int], world: int) -> dict[str, int]:
    """The dispatch-mode count in shardfn's terms. On gloo shardfn reduce-scatters with sends
    and receives (shardfn._comm.collectives [Note: reduce-scatter on gloo]): each rank sends
    (world - 1) / world of the input, so the reduce-scatter's textbook bytes (its input) are
    the bytes sent x world / (world - 1), ``world`` the ranks it spans (the shard axis). Its
    schedule guard exchanges small headers (an all-reduce, an all-gather when ranks differ;
    not data, not recorded): all-gathered and all-reduced bytes within 1 KiB of shardfn's
    record are taken as equal."""
    out = dict(counted)
    sent, _ = out.pop("send", 0), out.pop("recv", 0)
    if sent:
        out["reduce_scatter"] = out.get("reduce_scatter", 0) + sent * world // (world - 1)
    return out


def _same_counts(recorded: dict[str, int], counted: dict[str, int], world: int) -> bool:
    mine = _as_shardfn_counts(counted, world)
    headers = [mine.pop(k, 0) - recorded.get(k, 0) for k in ("all_gather", "all_reduce")]  # the guard's
    return all(h >= 0 for h in headers) and sum(headers) <= 1024 and \
        mine == {k: v for k, v in recorded.items() if k not in ("all_gather", "all_reduce")}


def summarise_pairs(pairs: list[tuple[str, str]], together: dict, alone: dict, summary: dict, cpu: bool,
                    targets: dict) -> list[dict]:
    """Per pair: the ratio of step times measured both ways, with its spread over repeats.

    interleaved: in each repeat the pair alone in one fresh set of processes, a step of
    each in turn; the ratio within each repeat. separate: each configuration alone in its
    own fresh processes; the ratio of the runs of the same repeat (run back to back), and
    the ratio of the medians."""
    out = []
    for config, peer in pairs:
        runs = together[(config, peer)]
        inter = [_time(r[config], cpu) / _time(r[peer], cpu) for r in runs]
        sep = [_time(a, cpu) / _time(b, cpu) for a, b in zip(alone[config], alone[peer])]
        med = statistics.median(_time(a, cpu) for a in alone[config]) / statistics.median(
            _time(b, cpu) for b in alone[peer])
        limit = targets.get((config, peer))
        peak, peer_peak = summary[config]["peak_mib_per_rank"], summary[peer]["peak_mib_per_rank"]
        out.append({
            "config": config, "peer": peer, "metric": "cpu ms per rank" if cpu else "wall ms",
            "interleaved": {**_spread(inter), "ms": [[_time(r[config], cpu), _time(r[peer], cpu)] for r in runs]},
            "separate": {**_spread(sep), "of_medians": med},
            "limit": limit,
            "met": None if limit is None else (statistics.median(inter) <= limit and med <= limit),
            "peak_vs_peer": peak / peer_peak if peak and peer_peak else None,
        })
    return out


def _fmt(v, spec: str) -> str:
    return "?" if v is None else format(v, spec)


def config_table(summary: dict[str, dict]) -> str:
    head = (f"{'configuration':<24}{'ms/step':>9}{'min-max':>15}{'cpu ms/step':>13}{'first step s':>14}"
            f"{'peak MiB/rank':>15}{'persist MiB/rank':>18}{'comm MiB/step':>15}")
    rows = [head]
    for config, s in summary.items():
        t = s["ms_per_step"]
        rows.append(
            f"{config:<24}{t['median']:>9.1f}{t['min']:>7.0f}-{t['max']:<7.0f}{s['cpu_ms_per_step']['median']:>13.1f}"
            f"{s['first_step_s'][0]:>14.1f}{_fmt(s['peak_mib_per_rank'], '.2f'):>15}"
            f"{_fmt(s['persistent_mib_per_rank'], '.2f'):>18}{_fmt(s['comm_mib_per_step'], '.2f'):>15}")
    return "\n".join(rows)


def pair_table(pairs: list[dict]) -> str:
    rows = [f"{'configuration':<24}{'peer':<18}{'interleaved (min-max)':>24}{'separate (min-max)':>22}"
            f"{'of medians':>12}{'target':>8}  verdict   peak vs peer"]
    for p in pairs:
        i, s = p["interleaved"], p["separate"]
        verdict = "-" if p["met"] is None else ("met" if p["met"] else "MISSED")
        rows.append(f"{p['config']:<24}{p['peer']:<18}{i['median']:>10.3f} ({i['min']:.3f}-{i['max']:.3f})"
                    f"{s['median']:>8.3f} ({s['min']:.3f}-{s['max']:.3f}){s['of_medians']:>12.3f}"
                    f"{_fmt(p['limit'], '.2f'):>8}  {verdict:<8}  {_fmt(p['peak_vs_peer'], '.3f')}")
    return "\n".join(rows)


def check(summary: dict[str, dict]) -> tuple[list[str], str]:
    """Warnings (losses, counters) and a one-line summary of the first-step losses."""
    warnings = [f"WARNING: {c}: loss after the timed steps is not finite" for c, s in summary.items()
                if not s["final_loss_finite"]]
    fp32 = {c: s["first_loss"] for c, s in summary.items() if not s["bf16"]}
    bf16 = {c: s["first_loss"] for c, s in summary.items() if s["bf16"]}
    line = []
    if fp32:
        spread = max(fp32.values()) - min(fp32.values())
        ref = statistics.median(fp32.values())
        if spread > LOSS_TOL:
            warnings.append(f"WARNING: fp32 first-step losses differ by more than {LOSS_TOL:g}: {fp32}")
        line.append(f"first-step loss {ref:.6f}, spread over fp32 configurations {spread:.1e}")
        off = {c: v - ref for c, v in bf16.items()}
        if any(abs(d) > BF16_LOSS_TOL for d in off.values()):
            warnings.append(f"WARNING: bf16 first-step losses differ from the fp32 median by more than "
                            f"{BF16_LOSS_TOL:g}: {bf16}")
        if off:
            line.append("bf16 minus fp32: " + ", ".join(f"{c} {d:+.4f}" for c, d in off.items()))
    elif bf16:
        line.append(f"bf16 first-step losses {bf16}")
    for c, s in summary.items():
        if s["comm_mib_per_step"] is not None and not s["memory_counted_consistently"]:
            warnings.append(f"WARNING: {c}: after the memory step, live bytes minus persistent bytes were "
                            f"{s['memory_residual_mib']:+.2f} MiB (a free the counter missed, or persistent state "
                            f"left out); peak and persistent shown as ?")
        if s["comm_matches_shardfn_record"] is False:
            warnings.append(f"WARNING: {c}: the dispatch-mode collective count differs from "
                            f"shardfn.record_collectives ({s['shardfn_recorded_bytes']}): "
                            f"{s['comm_bytes_per_step']}")
        if c == "ddp" and s["comm_mib_per_step"] == 0:
            warnings.append("WARNING: ddp: no collective seen (its C++ reducer's all-reduces were not visible)")
        if c == "ddp" and s["ddp_buckets_reused"] is False:
            warnings.append("WARNING: ddp: the all-reduced buckets changed between steps; its persistent bytes "
                            "include a stale copy")
    return warnings, "; ".join(line)


def plot(summary: dict[str, dict], pairs: list[dict], path: Path, title: str) -> bool:
    """Pair ratios (interleaved and separate: medians, whiskers min-max) and peak/persistent
    MiB per rank; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(pairs) + 6), 5), constrained_layout=True)
    x = range(len(pairs))
    w = 0.38
    for off, key, color in ((-w / 2, "interleaved", "tab:orange"), (w / 2, "separate", "tab:blue")):
        med = [p[key]["median"] for p in pairs]
        lo = [m - p[key]["min"] for m, p in zip(med, pairs)]
        hi = [p[key]["max"] - m for m, p in zip(med, pairs)]
        ax_t.bar([i + off for i in x], med, w, yerr=[lo, hi], capsize=3, color=color, label=key)
    for i, p in enumerate(pairs):
        if p["limit"] is not None:
            ax_t.hlines(p["limit"], i - w, i + w, colors="k", linestyles="dashed")
    ax_t.axhline(1.0, color="gray", linewidth=0.8)
    ax_t.set_ylabel("step time / peer's (median; whiskers: min, max; dashes: target)")
    ax_t.set_xticks(list(x), [f"{p['config']}\nvs {p['peer']}" for p in pairs], rotation=45, ha="right")
    ax_t.legend()
    names = list(summary)
    xm = range(len(names))
    ax_m.bar([i - w / 2 for i in xm], [summary[c]["peak_mib_per_rank"] or 0 for c in names], w, label="peak",
             color="tab:red")
    ax_m.bar([i + w / 2 for i in xm], [summary[c]["persistent_mib_per_rank"] or 0 for c in names], w,
             label="persistent", color="tab:gray")
    ax_m.set_ylabel("MiB per rank (live tensor bytes)")
    ax_m.set_xticks(list(xm), names, rotation=45, ha="right")
    ax_m.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def provenance() -> dict:
    """Which shardfn was measured: its path, and its git commit and whether its tree was dirty."""
    root = Path(sf.__file__).resolve().parent
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "."], capture_output=True, text=True).stdout.strip()
    return {"path": str(root), "commit": commit or None, "dirty": bool(dirty) if commit else None}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks (single and shardfn_w1 use 1)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every measurement, each in fresh processes")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--preset", choices=sorted(PRESETS), default="big",
                   help="the model and targets of one regime: big units (default) or small, latency-bound ones")
    p.add_argument("--d-model", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--batch", type=int, help="sequences per rank (world-size-1 runs: world x this)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--pairs", help="comma list of configuration:peer, from " + ",".join(CONFIGS)
                   + "; default: the preset's compared pairs")
    p.add_argument("--out", default="benchmarks/results/step_time.json", help="JSON; the plot goes next to it (.png)")
    args = p.parse_args()
    preset = PRESETS[args.preset]
    for name, value in preset["dims"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.pairs = args.pairs or ",".join(f"{c}:{q}" for c, q in preset["targets"])
    args.pairs = [tuple(x.strip().split(":")) for x in args.pairs.split(",") if x.strip()]
    bad = [":".join(x) for x in args.pairs if len(x) != 2 or not all(c in SPECS for c in x) or x[0] == x[1]
           or SPECS[x[0]].world1 != SPECS[x[1]].world1]
    if bad or not args.pairs:
        p.error(f"--pairs: {bad or 'none'}: each must be configuration:peer, two different names of "
                f"{','.join(CONFIGS)} at the same world size")
    for name in ("world", "repeats", "steps", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    split = sorted({c for pair in args.pairs for c in pair if args.world % SPECS[c].tensor})
    if split:
        p.error(f"--pairs: {', '.join(split)} split layers over a tensor axis of {SPECS[split[0]].tensor} ranks, "
                f"which --world {args.world} is not a multiple of (--world 4: shard 2 x tensor 2)")
    return args


def main() -> None:
    args = parse_args()
    opts = {k: getattr(args, k) for k in ("world", "steps", "d_model", "layers", "heads", "seq", "vocab",
                                          "batch", "lr", "seed", "timeout")}
    cpu = args.world > (os.cpu_count() or 1)  # time-sliced ranks: compare CPU time per rank
    load_before = os.getloadavg()
    setup = (f"world {args.world}, batch {args.batch}/rank, seq {args.seq}, d_model {args.d_model}, "
             f"{args.layers} layers, {args.steps} timed steps x {args.repeats} repeats")
    print(f"{setup}; load average {load_before[0]:.2f} on {os.cpu_count()} cores", flush=True)
    prov = provenance()
    print(f"shardfn {prov['path']} at {prov['commit'] or '?'}{' (dirty)' if prov['dirty'] else ''}", flush=True)
    # The first run of each configuration gets an empty inductor cache of its own, so a
    # compiled one compiles cold (its first step says how long that takes); later runs
    # share one cache on disk.
    warm_cache = tempfile.mkdtemp(prefix="step_time_inductor_")
    configs = list(dict.fromkeys(c for pair in args.pairs for c in pair))
    alone: dict[str, list[dict]] = {c: [] for c in configs}
    together: dict[tuple[str, str], list[dict]] = {pair: [] for pair in args.pairs}
    counted: dict[str, list[dict]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        # Separate: each configuration alone in fresh processes (not counted: timing only).
        for config in configs[rep % len(configs):] + configs[:rep % len(configs)]:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="step_time_cold_") if rep == 0 else warm_cache
            r = measure([config], {**opts, "count": False})[config]
            alone[config].append(r)
            print(f"  repeat {rep + 1}/{args.repeats} alone     {config:<24} {r['ms_per_step']:8.1f} ms/step "
                  f"(first step {r['first_step_s']:.1f} s)", flush=True)
        # Interleaved: each pair alone together in fresh processes; counted once per repeat.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = warm_cache
        for config, peer in args.pairs:
            order = [peer, config] if rep % 2 == 0 else [config, peer]
            r = measure(order, {**opts, "count": True})
            together[(config, peer)].append(r)
            for c in order:
                counted[c].append(r[c])
            print(f"  repeat {rep + 1}/{args.repeats} together  {config:<24} {r[config]['ms_per_step']:8.1f}  "
                  f"{peer:<18} {r[peer]['ms_per_step']:8.1f} ms/step  ratio "
                  f"{r[config]['ms_per_step'] / r[peer]['ms_per_step']:.3f}", flush=True)
    summary = summarise_configs(alone, counted, args.world)
    pairs = summarise_pairs(args.pairs, together, alone, summary, cpu, PRESETS[args.preset]["targets"])
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f}\n")
    print(config_table(summary))
    n_params = next(iter(alone.values()))[0]["n_params"]
    print(f"\n{n_params:,} parameters. Per configuration: ms/step, median and min-max over {args.repeats} runs "
          f"of it alone in fresh processes (rank 0 wall time); cpu ms/step: mean over ranks; first step s: the "
          f"first step of its first run (a compiled configuration compiles in it, with an empty inductor cache). Memory: live tensor bytes "
          f"per rank (largest rank), from the runs of its pairs; persistent = all a step leaves for the next. Comm: "
          f"textbook bytes per rank and step, from a dispatch mode over the c10d ops (ddp's C++ reducer included; "
          f"shardfn's include its metrics all-reduce).\n")
    print(pair_table(pairs))
    print(f"\nRatios of {'CPU time per rank' if cpu else 'wall time'} to the peer: interleaved = the pair alone "
          f"in fresh processes, a step of each in turn (median over repeats of the ratio within each); separate = "
          f"each alone in its own fresh processes (median of the ratios of runs of the same repeat; of medians: "
          f"ratio of the medians). A target is met when both the interleaved median and the ratio of medians meet "
          f"it.")
    warnings, losses = check(summary)
    print(f"\n{losses}")
    for w in warnings:
        print(w)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": {**vars(args), "pairs": [":".join(x) for x in args.pairs]}, "torch": torch.__version__,
        "shardfn": prov, "n_params": n_params, "cpu_count": os.cpu_count(), "metric": "cpu" if cpu else "wall",
        "loadavg_before": load_before, "loadavg_after": load_after, "configs": summary, "pairs": pairs,
        "runs": {"alone": alone, "together": {":".join(k): v for k, v in together.items()}},
        "warnings": warnings}, indent=2) + "\n")
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if plot(summary, pairs, png, f"GPT {n_params / 1e6:.1f}M params, {setup}"):
        print(f"wrote {png}")
    else:
        print('no plot: matplotlib is not installed (pip install -e ".[bench]")')


if __name__ == "__main__":
    main()
