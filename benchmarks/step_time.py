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
  SHARD_GRAD_OP / NO_SHARD; peers ``fsdp2`` / ``fsdp2_noreshard`` / ``ddp``;
* ``shardfn_full_noprefetch``: ``shardfn_full`` with ``jit_step(prefetch=False)``
  (peer ``fsdp2``; shows what prefetching buys);
* ``shardfn_bf16``: FULL_SHARD with ``shardfn.Precision(param=bfloat16, reduce=float32)``;
  peer ``fsdp2_bf16``;
* ``shardfn_w1``: FULL_SHARD at world size 1 (nothing to shard) on the global batch;
  peer ``single`` (target: within 1.05x of plain single-process training).

Method: the configurations fall in two groups, world size 1 (``single``, ``shardfn_w1``)
and the rest. Each repeat runs each group in one fresh set of processes (a new
``shardfn.testing.Cluster``), one torch thread per rank (on 2 cores, two threads per rank
oversubscribe them: DDP ran 2.4x slower at world size 2), which builds every configuration
of the group (each its own model, from the same seed). After 2 warm-up steps each, the
``--steps`` timed steps interleave the configurations step by step (the order rotates every
step), each step between two barriers: wall time on rank 0 and ``time.process_time()`` on
every rank. Interleaving matters on a shared machine: the speed of one set of processes
against another varies by 10-20% here, which separate processes per configuration turned
into ratios off by as much; interleaved, a configuration and its peer share the processes,
the load and the moment. What it does not remove: every configuration of the group lives in
the same processes, and that slows some more than others. Measured on a 2-core machine (GPT
d_model 512, 8 layers, world 2): with all the configurations built, FSDP2 ran at 1,907
ms/step and ``shardfn_full`` at 1,552; with only the pair built, 1,371 and 1,273. So
FULL_SHARD/FSDP2 read 0.81 with all of them, 0.93 as a pair, and 0.96 in separate fresh
processes; ``--configs fsdp2,shardfn_full`` measures a pair alone. Then, one configuration at
a time, three untimed steps, so that no counter perturbs the timing:

1. Communication: a ``TorchDispatchMode`` over the ``c10d`` and ``_c10d_functional`` ops,
   which sees collectives issued from Python and from C++ (DDP's reducer included), counts
   textbook bytes per rank: all-gather output, reduce-scatter input, all-reduce tensor,
   broadcast tensor. For shardfn it is cross-checked against ``shardfn.record_collectives``
   (and includes the small all-reduce ``jit_step`` does for its metrics).
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

The table shows medians over repeats: ms/step (rank 0 wall time), cpu ms/step (mean over
ranks), peak and persistent MiB per rank (the largest rank), comm MiB/step (rank 0), the
peer and the ratios to the peer and to ``ddp``: the median over repeats of the ratio within
each repeat (both ran in the same processes; ``shardfn_w1`` to ``ddp``: ratio of medians). At world sizes above
the core count compare CPU time, not wall time. The targets of the issue are checked at
the end (time ratios to the peer; peak live bytes at most the FSDP2 peer's).

Sanity checks: the loss after the timed steps must be finite; first-step losses (global
means, before any update) of the fp32 configurations must agree within 1e-4; the bf16
configurations compute in bfloat16 (8 significant bits), so theirs must lie within 0.02 of
the fp32 median (at d_model 64 they differed from it by 0.0016).

Output: the table, JSON (``--out``) and a PNG plot next to it (same name, ``.png``), which
needs matplotlib (``pip install -e ".[bench]"``).

Run::

    pip install -e ".[bench]"
    python benchmarks/step_time.py    # the issue's measurement: world 2, d_model 512, 8 layers, seq 128
    python benchmarks/step_time.py --d-model 64 --layers 2 --seq 32 --repeats 1 --steps 2 --out /tmp/smoke.json
    python benchmarks/step_time.py --configs ddp,fsdp2,shardfn_full
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
    """One configuration: who trains (``torch`` or ``shardfn``), how, and its peer."""

    kind: str  # "torch" (wrap: "none", "ddp" or "fsdp2") or "shardfn"
    wrap: str = "none"
    peer: str | None = None  # the configuration its time and memory are compared with
    world1: bool = False  # a 1-rank process on the global batch
    strategy: str = "FULL_SHARD"  # shardfn
    prefetch: bool = True  # shardfn
    reshard: bool = True  # fsdp2
    bf16: bool = False  # parameters gathered and computed in bfloat16, gradients reduced in fp32


SPECS = {
    "single": Spec("torch", world1=True),
    "ddp": Spec("torch", "ddp"),
    "fsdp2": Spec("torch", "fsdp2"),
    "fsdp2_noreshard": Spec("torch", "fsdp2", reshard=False),
    "fsdp2_bf16": Spec("torch", "fsdp2", bf16=True),
    "shardfn_full": Spec("shardfn", peer="fsdp2"),
    "shardfn_full_noprefetch": Spec("shardfn", peer="fsdp2", prefetch=False),
    "shardfn_grad_op": Spec("shardfn", peer="fsdp2_noreshard", strategy="SHARD_GRAD_OP"),
    "shardfn_bf16": Spec("shardfn", peer="fsdp2_bf16", bf16=True),
    "shardfn_no_shard": Spec("shardfn", peer="ddp", strategy="NO_SHARD"),
    "shardfn_w1": Spec("shardfn", peer="single", world1=True),
}
CONFIGS = tuple(SPECS)
# The issue's targets: (configuration, largest ratio of wall-time medians to its peer).
TIME_TARGETS = {"shardfn_full": 0.9, "shardfn_grad_op": 0.9, "shardfn_bf16": 0.9, "shardfn_no_shard": 1.1,
                "shardfn_w1": 1.05}
WARMUP = 2
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
    "_c10d_functional::all_gather_into_tensor": ("all_gather", "input"),
    "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input"),
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
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(model)
    opt = sf.optim.adamw(lr)
    precision = sf.Precision(param=torch.bfloat16, reduce=torch.float32) if spec.bf16 else None
    state = {"sharded": sf.shard(params, mesh, spec.strategy, precision=precision)}
    del params  # the full parameters are not part of the trained state
    state["opt"] = opt.init(state["sharded"])
    jstep = sf.jit_step(lambda p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt, prefetch=spec.prefetch)

    def step(x, y):
        state["sharded"], state["opt"], metrics = jstep(state["sharded"], state["opt"], (x, y))
        return metrics["loss"]

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

    # WARMUP + timed + 3 untimed steps (communication, memory twice)
    per_rank = opts["batch"] * opts["world"] // world
    batches = make_batches(WARMUP + opts["steps"] + 3, opts["batch"] * opts["world"], opts["seq"], opts["vocab"],
                           opts["seed"])
    batches = [t[rank * per_rank:(rank + 1) * per_rank] for t in batches]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in batches]
    timed, extra = batches[WARMUP:-3], batches[-3:]

    out = {}
    for config, (step, _) in steps.items():
        out[config] = {"n_params": n_params, "first_loss": global_mean(step(*batches[0]))}
        for x, y in batches[1:WARMUP]:
            step(x, y)
    # Timed: one step of each configuration in turn (the order rotates every step), each
    # between two barriers, so that they share this world's machine, load and moment.
    wall, cpu, last = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0.0), {}
    for i, (x, y) in enumerate(timed):
        for config in configs[i % len(configs):] + configs[:i % len(configs)]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            last[config] = steps[config][0](x, y)
            dist.barrier()
            wall[config] += time.perf_counter() - t0
            cpu[config] += time.process_time() - c0
    for config, (step, persistent) in steps.items():
        n = len(timed)
        out[config].update({"ms_per_step": 1e3 * wall[config] / n, "cpu_ms_per_step": 1e3 * cpu[config] / n,
                            "final_loss": global_mean(last[config]), **count(config, step, persistent, extra)})
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
    """One run of a group in fresh processes: per configuration, rank 0's wall time and
    communication, every rank's CPU time and memory."""
    cluster = Cluster(1 if SPECS[configs[0]].world1 else opts["world"], timeout=opts["timeout"])
    try:
        ranks = cluster.run(run_group, configs, opts)
    finally:
        cluster.close()
    per_rank = ("cpu_ms_per_step", "persistent_bytes", "peak_bytes", "end_bytes")
    return {c: {**ranks[0][c], **{k: [r[c][k] for r in ranks] for k in per_rank},
                "comm_bytes_total_per_rank": [sum(r[c]["comm_bytes"].values()) for r in ranks]} for c in configs}


# ---------------------------------------------------------------------------------------
# Summary, checks, output


def _residual_ok(run: dict) -> bool:
    """Live bytes after the second memory step are back to those before it, on every rank.

    Allowed: 64 KiB or 1% of the persistent bytes (the step's returned scalars and the like).
    """
    return all(abs(e - p) <= max(64 * 1024, 0.01 * p) for e, p in zip(run["end_bytes"], run["persistent_bytes"]))


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians over repeats (CPU time: mean over ranks first; memory: largest rank) and ratios of medians."""
    out = {}
    for config, rs in runs.items():
        spec = SPECS[config]
        r0 = rs[0]
        counted = sum(r0["comm_bytes"].values())
        rec = r0["shardfn_recorded_bytes"]  # shardfn: its own count, to check the dispatch-mode count
        mem_ok = all(_residual_ok(r) for r in rs)
        peak = statistics.median(max(r["peak_bytes"]) for r in rs) / MIB
        pers = statistics.median(max(r["persistent_bytes"]) for r in rs) / MIB
        out[config] = {
            "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
            "ms_per_step_min_max": [min(r["ms_per_step"] for r in rs), max(r["ms_per_step"] for r in rs)],
            "cpu_ms_per_step": statistics.median(statistics.mean(r["cpu_ms_per_step"]) for r in rs),
            "peak_mib_per_rank": peak if mem_ok else None,
            "persistent_mib_per_rank": pers if mem_ok else None,
            "memory_counted_consistently": mem_ok,
            "memory_residual_mib": max((e - p for r in rs for e, p in zip(r["end_bytes"], r["persistent_bytes"])),
                                       key=abs) / MIB,
            "comm_mib_per_step": counted / MIB,
            "comm_bytes_per_step": r0["comm_bytes"],
            "comm_calls_per_step": r0["comm_calls"],
            "shardfn_recorded_bytes": rec,
            "comm_matches_shardfn_record": None if rec is None else rec == r0["comm_bytes"],
            "ddp_buckets_reused": r0["ddp_buckets_reused"],
            "bf16": spec.bf16,
            "peer": spec.peer,
            "first_loss": r0["first_loss"],
            "final_loss_finite": all(math.isfinite(r["final_loss"]) for r in rs),
        }
    for config, s in out.items():
        p = out.get(s["peer"])
        s["vs_peer"] = _ratio(runs, config, s["peer"])
        s["peak_vs_peer"] = (s["peak_mib_per_rank"] / p["peak_mib_per_rank"]
                             if p and s["peak_mib_per_rank"] and p["peak_mib_per_rank"] else None)
        s["vs_ddp"] = _ratio(runs, config, "ddp")
    return out


def _ratio(runs: dict[str, list[dict]], config: str, peer: str | None) -> float | None:
    """Step time of ``config`` over ``peer``'s: the median over repeats of the ratio within
    each repeat when both ran in the same processes (the same group), else the ratio of medians."""
    if peer not in runs:
        return None
    if SPECS[config].world1 == SPECS[peer].world1:
        return statistics.median(a["ms_per_step"] / b["ms_per_step"] for a, b in zip(runs[config], runs[peer]))
    return statistics.median(r["ms_per_step"] for r in runs[config]) / statistics.median(
        r["ms_per_step"] for r in runs[peer])


def _fmt(v, spec: str) -> str:
    return "?" if v is None else format(v, spec)


def table(summary: dict[str, dict]) -> str:
    head = (f"{'configuration':<24}{'ms/step':>9}{'cpu ms/step':>13}{'peak MiB/rank':>15}{'persist MiB/rank':>18}"
            f"{'comm MiB/step':>15}  {'peer':<16}{'vs peer':>8}{'vs ddp':>8}")
    rows = [head]
    for config, s in summary.items():
        rows.append(
            f"{config:<24}{s['ms_per_step']:>9.1f}{s['cpu_ms_per_step']:>13.1f}"
            f"{_fmt(s['peak_mib_per_rank'], '.2f'):>15}"
            f"{_fmt(s['persistent_mib_per_rank'], '.2f'):>18}{s['comm_mib_per_step']:>15.2f}  {s['peer'] or '-':<16}"
            f"{'-' if s['vs_peer'] is None else format(s['vs_peer'], '.2f'):>8}"
            f"{'-' if s['vs_ddp'] is None else format(s['vs_ddp'], '.2f'):>8}")
    return "\n".join(rows)


def targets(summary: dict[str, dict]) -> list[dict]:
    """The issue's targets that this run can judge: time ratios to the peer, and peak memory vs FSDP2."""
    out = []
    for config, limit in TIME_TARGETS.items():
        s = summary.get(config)
        if s and s["vs_peer"] is not None:
            out.append({"what": f"{config} time vs {s['peer']}", "value": s["vs_peer"], "limit": limit,
                        "met": s["vs_peer"] <= limit})
    for config in TIME_TARGETS:
        s = summary.get(config)
        if s and s["peer"].startswith("fsdp2") and s["peer"] in summary:
            v = s["peak_vs_peer"]
            out.append({"what": f"{config} peak bytes vs {s['peer']}", "value": v, "limit": 1.0,
                        "met": None if v is None else v <= 1.0})
    return out


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
        if not s["memory_counted_consistently"]:
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


def plot(summary: dict[str, dict], path: Path, title: str) -> bool:
    """Step time (median bars, min/max whiskers) and peak/persistent MiB per rank; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary)
    x = range(len(names))
    colors = ["tab:orange" if SPECS[c].kind == "shardfn" else "tab:blue" for c in names]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(names) + 4), 5), constrained_layout=True)
    med = [summary[c]["ms_per_step"] for c in names]
    lo = [m - summary[c]["ms_per_step_min_max"][0] for c, m in zip(names, med)]
    hi = [summary[c]["ms_per_step_min_max"][1] - m for c, m in zip(names, med)]
    ax_t.bar(x, med, color=colors, yerr=[lo, hi], capsize=3)
    ax_t.set_ylabel("ms / step (median; whiskers: min, max)")
    ax_t.set_title("step time (orange: shardfn, blue: torch)")
    w = 0.4
    peak = [summary[c]["peak_mib_per_rank"] or 0 for c in names]
    pers = [summary[c]["persistent_mib_per_rank"] or 0 for c in names]
    ax_m.bar([i - w / 2 for i in x], peak, w, label="peak", color="tab:red")
    ax_m.bar([i + w / 2 for i in x], pers, w, label="persistent", color="tab:gray")
    for i, c in enumerate(names):
        if summary[c]["peak_mib_per_rank"] is None:
            ax_m.annotate("?", (i, 0), ha="center", va="bottom")
    ax_m.set_ylabel("MiB per rank (live tensor bytes)")
    ax_m.set_title("memory per rank (?: not counted consistently)")
    ax_m.legend()
    for ax in (ax_t, ax_m):
        ax.set_xticks(list(x), names, rotation=45, ha="right")
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
    p.add_argument("--repeats", type=int, default=5, help="fresh-process runs per configuration")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank (world-size-1 runs: world x this)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list, a subset of " + ",".join(CONFIGS))
    p.add_argument("--out", default="benchmarks/results/step_time.json", help="JSON; the plot goes next to it (.png)")
    args = p.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    for name in ("world", "repeats", "steps", "batch"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    opts = {k: getattr(args, k) for k in ("world", "steps", "d_model", "layers", "heads", "seq", "vocab",
                                          "batch", "lr", "seed", "timeout")}
    load_before = os.getloadavg()
    setup = (f"world {args.world}, batch {args.batch}/rank, seq {args.seq}, d_model {args.d_model}, "
             f"{args.layers} layers, {args.steps} timed steps x {args.repeats} repeats")
    print(f"{setup}; load average {load_before[0]:.2f} on {os.cpu_count()} cores", flush=True)
    prov = provenance()
    print(f"shardfn {prov['path']} at {prov['commit'] or '?'}{' (dirty)' if prov['dirty'] else ''}", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    # Two groups: the world-size-1 configurations and the rest; each repeat runs each group
    # in one fresh set of processes, its configurations interleaved step by step.
    groups = [g for g in ([c for c in args.configs if not SPECS[c].world1],
                          [c for c in args.configs if SPECS[c].world1]) if g]
    for rep in range(args.repeats):
        for group in groups:
            for config, r in measure(group, opts).items():
                runs[config].append(r)
                print(f"  repeat {rep + 1}/{args.repeats} {config:<24} {r['ms_per_step']:8.1f} ms/step", flush=True)
    summary = summarise(runs)
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f}\n")
    print(table(summary))
    n_params = next(iter(runs.values()))[0]["n_params"]
    print(f"\n{n_params:,} parameters; medians over {args.repeats} fresh-process runs (vs peer, vs ddp: medians of "
          f"the ratios within each run, where both configurations ran interleaved in the same processes). Memory: live tensor bytes per "
          f"rank (largest rank); persistent = all a step leaves for the next (parameters or shards, optimizer state, "
          f"ddp's gradient buckets, fsdp2's last reduce-scatter buffer). "
          f"Comm: textbook bytes per rank and step, from a dispatch mode over the c10d ops (ddp's C++ reducer "
          f"included; shardfn's include its metrics all-reduce). ?: not counted consistently (see warnings).")
    goals = targets(summary)
    if goals:
        print("\ntargets:")
        for g in goals:
            verdict = "?" if g["met"] is None else ("met" if g["met"] else "MISSED")
            print(f"  {g['what']:<46} {_fmt(g['value'], '.2f'):>5} (<= {g['limit']:.2f}) {verdict}")
    warnings, losses = check(summary)
    print(f"\n{losses}")
    for w in warnings:
        print(w)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(args), "torch": torch.__version__, "shardfn": prov, "n_params": n_params,
        "cpu_count": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after, "summary": summary, "targets": goals,
        "runs": runs, "warnings": warnings}, indent=2) + "\n")
    print(f"wrote {out}")
    png = out.with_suffix(".png")
    if plot(summary, png, f"GPT {n_params / 1e6:.1f}M params, {setup}"):
        print(f"wrote {png}")
    else:
        print('no plot: matplotlib is not installed (pip install -e ".[bench]")')


if __name__ == "__main__":
    main()
