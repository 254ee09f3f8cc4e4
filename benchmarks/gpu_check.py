"""One-command GPU check: shardfn against plain PyTorch, FSDP2 and DDP on a CUDA device.

For world 1 and world 2 (two processes on the same GPU), every strategy (FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD; the hybrid strategies need a 2-D mesh of 4 ranks and are skipped)
in three variants: fp32; bf16 mixed precision (``Precision(param=bfloat16, reduce=float32)``);
offload (``Offload(params=True, optimizer=True)``, fp32). For each row:

* equivalence: shardfn trains the GPT of ``shardfn.testing.models`` for ``--steps`` steps,
  each rank on its contiguous slice (dim 0) of every global batch, and is compared with a
  plain ``nn.Module`` trained on the global batches in one process: the loss of every step
  and the final parameters (``sf.gather``). So is the peer (FSDP2, or DDP), trained the same
  way (its full state: DDP's module's, FSDP2's local shards gathered on the host). [Note: an honest equivalence] The
  optimizer of these steps is SGD with momentum (``--eq-lr``, momentum 0.9), not AdamW:
  Adam divides by sqrt(v), so float noise in a gradient that is zero in theory (the
  reduction order of two runs differs) becomes a step of +-lr, and two correct runs end
  lr apart (at world 2 over gloo: max|dp| 3.5e-5, a FAIL that meant nothing). SGD's update
  is linear in the gradient, so a run's parameters differ from the reference's by the
  difference of the gradients times lr, summed over the steps. Per tensor, the bound is a
  fraction of the sum over steps of its largest update: fp32 and offload 1e-3 on CUDA
  (TF32 off; cuBLAS and the collectives add in other orders than one process on the whole
  batch), 1e-4 on CPU; bf16 against the fp32 reference 5e-2 (the casts' roundings,
  compounded through the layers); plus one fp32 spacing of the tensor's largest value per
  step (each update rounds the parameter: a LayerNorm weight near 1 moved by 1e-3 is one
  ulp, 1.2e-7, apart after a step). ``x bound``: the largest ratio of a tensor's max|dp|
  to its bound; PASS at most 1. A defect (a wrong shard, a lost or doubled reduction)
  moves a parameter by the order of its update: 10-1000x past. Losses: fp32 within 1e-5
  relative, bf16 within 5e-2.
  The timed steps below use AdamW (``--lr``, ``--wd``), as training does; shardfn's with
  ``--on-nonfinite raise_next`` read nothing from the device (``sync`` 0: the step's check
  of its loss moves to the next call), by default their loss and norm once.
* timing: median ms/step (rank 0) over ``--timed-steps`` steps after ``--warmup`` steps,
  each step between ``torch.cuda.synchronize()`` and a host barrier of the ranks; MFU =
  6 x parameters x tokens per step per rank / step seconds / peak FLOP/s (per rank: in the
  world-2 rows two ranks share the GPU, so the GPU's own utilisation is twice that);
  ``torch.cuda.max_memory_allocated()`` of rank 0 over the timed steps.
* counts, on one more step: ``ops``, the aten ops it dispatched that launch a kernel on a
  GPU (``shardfn.testing.count_ops``: [Note: counting launches on a CPU]), and on CUDA,
  from ``torch.profiler`` on another step: ``launch``, the kernel launches
  (``cudaLaunchKernel`` and its kin); ``sync``, the host-device synchronisations
  (``cuda*Synchronize``); ``host us/unit``, the host time of the step call, less the time
  spent waiting in those synchronisations, per unit (shardfn rows; the profiler's own
  overhead included, so an upper bound), and ``host ms`` the same per step. World 1 only:
  at world 2 both ranks share the one GPU and gloo adds copies and synchronisations of
  its own, which a real multi-GPU run does not make. On a
  GPU a unit's host work is hidden only while it is shorter than the unit's compute, and
  a step's only while the host need not wait for the device (a synchronisation);
* the same timing and memory for the peer: FSDP2 (``fully_shard`` on each block, then the
  root; ``reshard_after_forward=False`` on the blocks for SHARD_GRAD_OP;
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` for bf16;
  ``CPUOffloadPolicy()`` for offload) or, for NO_SHARD, DDP (bf16: under
  ``torch.autocast``; DDP has no offload, so the offload row's peer keeps everything on the
  GPU); and for plain PyTorch in one process on the same per-rank batch (fp32, and bf16
  under ``torch.autocast``): the "plain torch" rows, and the "x plain" column. On CUDA,
  the plain step is also captured as one CUDA graph (variants ``fp32 cg`` and ``bf16 cg``,
  :func:`graphed_step`): the floor a whole-step program can reach, its "x plain" against
  the eager plain step. ``jit_step(graph=True)`` on CUDA has its own run, ``--graph``
  (benchmarks/gpu_graph.py).

World 2 on one GPU: NCCL first (which normally refuses two ranks on one GPU: "Duplicate GPU
detected"), then gloo over CUDA tensors; a backend counts as usable when the process group
starts and a first all-reduce, all-gather and reduce-scatter of CUDA tensors give the right
values. If neither does, world 2 is reported as not runnable and the check goes on. Every
run is bounded: a 120 s process-group timeout, and ``--timeout`` for a whole run, after
which its processes are killed.

Exit status: 0 when every equivalence row that ran passed, 1 otherwise (or when nothing
ran, or a run died or timed out), 2 without a CUDA device (unless ``--device cpu``).

Run::

    python benchmarks/gpu_check.py                    # on a CUDA machine: GPT d_model 1024, 8 layers, seq 1024
    python benchmarks/gpu_check.py --d-model 512 --layers 4 --batch 4
    python benchmarks/gpu_check.py --device cpu       # smoke run of the logic on CPU (gloo, tiny GPT)
    python benchmarks/gpu_check.py --graph            # jit_step(graph=True) captured: benchmarks/gpu_graph.py
    python benchmarks/gpu_check.py --device cpu --worlds 1 --tensor on   # the tensor-parallel row on CPU (gloo)

With 4 GPUs or more, a tensor-parallel row follows the table (benchmarks/gpu_tensor.py: shard
2 x tensor 2 against FULL_SHARD at world 4, one GPU per rank); with fewer, one line says it
was skipped and why, which is not a failure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import queue as queue_module
import socket
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

import shardfn as sf
from shardfn._compat import all_gather_single, reduce_scatter_single  # torch 2.11: other names
from shardfn.testing import count_ops
from shardfn.testing.models import GPT, GPTConfig, lm_loss

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
SKIPPED = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
VARIANTS = ("fp32", "bf16", "offload")
# Equivalence bounds ([Note: an honest equivalence]): a parameter's difference from the
# reference over the sum of its steps' largest updates, and the losses' relative difference.
PARAM_TOL = {"cuda": 1e-3, "cpu": 1e-4}
LOSS_RTOL = 1e-5
BF16_TOL = 5e-2  # bf16 rows against the fp32 reference: parameters (as above) and losses
EQ_MOMENTUM = 0.9
# Dense peak FLOP/s by device name (bf16; fp32 without TF32).
PEAKS = {"H100": {"bf16": 989e12, "fp32": 67e12}, "H200": {"bf16": 989e12, "fp32": 67e12}}
# Model and run sizes by device type: a GPU does real work; a CPU smoke run finishes quickly.
DEFAULTS = {
    "cuda": {"vocab": 32000, "seq": 1024, "d_model": 1024, "layers": 8, "heads": 16, "batch": 8, "warmup": 2,
             "timed_steps": 10},
    "cpu": {"vocab": 256, "seq": 32, "d_model": 64, "layers": 2, "heads": 4, "batch": 2, "warmup": 1,
            "timed_steps": 3},
}
PG_TIMEOUT = datetime.timedelta(seconds=120)
PROBE_LIMIT_S = PG_TIMEOUT.total_seconds() + 60  # start-up and the probe of one attempt
MIB = 2**20
NO_CUDA = ("gpu_check.py needs a CUDA device (torch.cuda.is_available() is False here). "
           "Run it on a CUDA machine, or pass --device cpu for a smoke run of the logic on CPU.")


# ---------------------------------------------------------------------------------------
# In each rank's process


@dataclasses.dataclass
class Ctx:
    """What every measurement in one rank's process shares."""

    rank: int
    world: int
    device: torch.device
    opts: dict
    cfg: GPTConfig
    mesh: sf.Mesh | None = None
    host_group: Any = None  # gloo group for barriers and agreeing on errors (world > 1)


def worker(rank: int, world: int, backend: str, port: int, opts: dict, out: Any) -> None:
    """One rank: starts the process group, probes it, then measures every row and sends
    the results to the parent (rank 0 sends the rows; every rank says when it is done)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(world))  # every rank on the one GPU
    device = torch.device("cuda", 0) if opts["device"] == "cuda" else torch.device("cpu")
    # On CPU one thread per rank (more oversubscribe the cores); on CUDA the host's cores
    # are shared among the ranks (offload runs the optimizer there).
    torch.set_num_threads(1 if device.type == "cpu" else max(1, (os.cpu_count() or 1) // world))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=PG_TIMEOUT)
        probe(device)
    except Exception as e:  # noqa: BLE001 - the reason goes to the parent, which tries the next backend
        out.put(("probe", rank, f"{type(e).__name__}: {first_line(e)}"))
        leave(out, 0)  # no destroy_process_group: a failed NCCL communicator may hang in it
    out.put(("probe", rank, None))
    try:
        cfg = GPTConfig(vocab_size=opts["vocab"], seq_len=opts["seq"], d_model=opts["d_model"],
                        n_layers=opts["layers"], n_heads=opts["heads"])
        ctx = Ctx(rank, world, device, opts, cfg)
        ctx.host_group = dist.new_group(backend="gloo", timeout=PG_TIMEOUT) if world > 1 else None
        ctx.mesh = make_mesh(device)
        measure_all(ctx, out)
        out.put(("done", rank, None))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("fatal", rank, traceback.format_exc()))
        leave(out, 1)
    leave(out, 0)


def leave(out: Any, code: int) -> None:
    """Exits once every message is sent (os._exit: no teardown of the backend's threads)."""
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def first_line(e: BaseException) -> str:
    """The first non-empty line of an error's message (at most 300 characters)."""
    lines = [s for s in str(e).splitlines() if s.strip()]
    return lines[0][:300] if lines else repr(e)


def probe(device: torch.device) -> None:
    """The collectives shardfn and FSDP2 issue, once each on small tensors of ``device``
    (all-reduce and reduce-scatter with SUM, as in a step): raises unless all give the right values."""
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.full((2,), float(rank + 1), device=device)
    dist.all_reduce(x)
    gathered = torch.empty(2 * world, device=device)
    all_gather_single(gathered, torch.full((2,), float(rank), device=device))
    scattered = torch.empty(2, device=device)
    reduce_scatter_single(scattered, torch.arange(2.0 * world, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    total = world * (world + 1) / 2
    expect = (torch.full((2,), total), torch.arange(world).float().repeat_interleave(2),
              world * torch.arange(2.0 * rank, 2.0 * rank + 2))
    if not all(torch.equal(got.cpu(), want) for got, want in zip((x, gathered, scattered), expect)):
        raise RuntimeError(f"the probe collectives on {device} returned wrong values")


def make_mesh(device: torch.device) -> sf.Mesh:
    """shardfn's mesh over the default group, its shards on ``device``."""
    if device.type == "cuda" and dist.get_backend() != "nccl":
        # Mesh.from_group() puts a gloo mesh on the CPU; a CUDA DeviceMesh over the same
        # group keeps the shards and the compute on the GPU, the collectives on gloo.
        return sf.Mesh(init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("shard",)))
    return sf.Mesh.from_group()


def make_batches(n: int, rows: int, ctx: Ctx, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of ``rows`` random token sequences (inputs, next-token targets), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(ctx.cfg.vocab_size, (rows, ctx.cfg.seq_len + 1), generator=g) for _ in range(n)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def to_device(batches: list, device: torch.device) -> list:
    """The batches on ``device``, moved before any step is timed."""
    return [(x.to(device), y.to(device)) for x, y in batches]


def build_model(ctx: Ctx) -> GPT:
    """The GPT, with the same initial weights in every process (built on the CPU, seeded)."""
    torch.manual_seed(ctx.opts["seed"])
    return GPT(ctx.cfg)


def torch_step(model: torch.nn.Module, ctx: Ctx, autocast: bool, eq: bool = False) -> Callable:
    """A plain PyTorch training step of ``model`` (plain, DDP or FSDP2) with AdamW (``eq``:
    the equivalence steps' SGD), under bf16 autocast if ``autocast``; it returns the local loss."""
    if eq:
        opt = torch.optim.SGD(model.parameters(), lr=ctx.opts["eq_lr"], momentum=EQ_MOMENTUM, foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=ctx.opts["lr"], weight_decay=ctx.opts["wd"], foreach=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cast = torch.autocast(ctx.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with cast:
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def sync(ctx: Ctx) -> None:
    """Waits for the device, then for the other ranks."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    if ctx.world > 1:
        dist.barrier(group=ctx.host_group)


def time_steps(step: Callable, batches: list, ctx: Ctx, units: int | None = None) -> dict:
    """Median ms/step over the batches after the warm-up ones, the peak of allocated
    device memory over the timed steps (MiB; None on CPU), and the counts of one more
    step (:func:`count_step`; ``units``: the step's units, for host time per unit)."""
    warmup = ctx.opts["warmup"]
    for x, y in batches[:warmup]:
        step(x, y)
    sync(ctx)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for x, y in batches[warmup:]:
        sync(ctx)
        t0 = time.perf_counter()
        step(x, y)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    mib = torch.cuda.max_memory_allocated() / MIB if ctx.device.type == "cuda" else None
    return {"ms": 1e3 * statistics.median(times), "mib": mib, **count_step(step, *batches[-1], ctx, units)}


def count_step(step: Callable, x: torch.Tensor, y: torch.Tensor, ctx: Ctx, units: int | None) -> dict:
    """Two more steps, counted: the ops the first dispatched that launch a kernel on a GPU;
    on CUDA, the second under ``torch.profiler``: its kernel launches, synchronisations, and
    host time less the time waiting in them (per unit when ``units``). A failure of the
    profiler is reported, not raised (it says nothing about the step)."""
    sync(ctx)
    with count_ops() as c:
        step(x, y)
    out: dict[str, Any] = {"ops": c.total}
    if ctx.device.type != "cuda" or ctx.world > 1:  # world 2 here: two ranks on one GPU, over gloo (see the docstring)
        return out
    sync(ctx)
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            with record_function("gpu_check_step"):
                step(x, y)
            host_us = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
        events = prof.events()
        mark = next(e for e in events if e.name == "gpu_check_step")
        inside = [e for e in events if e.device_type == DeviceType.CPU and e is not mark
                  and mark.time_range.start <= e.time_range.start <= mark.time_range.end]
        syncs = [e for e in inside if e.name.startswith("cu") and "Synchronize" in e.name]
        out["launch"] = sum(e.name.startswith("cu") and "Launch" in e.name and "Kernel" in e.name for e in inside)
        out["sync"] = len(syncs)
        out["host_us"] = host_us - sum(e.time_range.elapsed_us() for e in syncs)
        out["host_ms"] = out["host_us"] / 1e3
        if units:
            out["host_us_unit"] = out["host_us"] / units
    except Exception as e:  # noqa: BLE001 - the counts are extra; the row stands without them
        out["count_error"] = f"{type(e).__name__}: {first_line(e)}"
    return out


def guarded(ctx: Ctx, fn: Callable[[], dict]) -> dict:
    """Runs ``fn`` on every rank; an error on any rank becomes ``{"error": ...}`` on all of
    them, so the ranks go on to the next measurement together. Frees what it left behind."""
    before = torch.cuda.memory_allocated() if ctx.device.type == "cuda" else 0
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - reported in the table
        result, error = {}, f"rank {ctx.rank}: {type(e).__name__}: {first_line(e)}"
    if ctx.world > 1:
        errors: list = [None] * ctx.world
        dist.all_gather_object(errors, error, group=ctx.host_group)
        error = "; ".join(e for e in errors if e) or None
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        result["leftover_mib"] = before / MIB  # device memory still allocated when it started
    return {**result, "error": error} if error else result


def reference(ctx: Ctx, batches: list) -> dict:
    """Plain single-process fp32 training on the global batches with the equivalence steps'
    SGD: losses, final state (CPU) and, per tensor, the sum over steps of its largest update."""
    model = build_model(ctx).to(ctx.device)
    step = torch_step(model, ctx, autocast=False, eq=True)
    params = dict(model.named_parameters())
    moved = {k: 0.0 for k in params}
    losses = []
    for x, y in to_device(batches, ctx.device):
        before = {k: p.detach().clone() for k, p in params.items()}
        losses.append(float(step(x, y)))
        for k, p in params.items():
            moved[k] += float((p.detach() - before[k]).abs().max())
    return {"losses": losses, "state": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "moved": moved}


def local_slices(batches: list, ctx: Ctx) -> list:
    """This rank's contiguous slice (dim 0) of every global batch."""
    rows = ctx.opts["batch"]
    return [(x[ctx.rank * rows:(ctx.rank + 1) * rows], y[ctx.rank * rows:(ctx.rank + 1) * rows]) for x, y in batches]


def global_loss(local: float, ctx: Ctx) -> float:
    """The mean of the ranks' losses (equal slices: the loss of the global batch)."""
    if ctx.world == 1:
        return local
    t = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(t, group=ctx.host_group)
    return float(t) / ctx.world


def shardfn_row(ctx: Ctx, strategy: str, variant: str, eq_batches: list, timed: list, ref: dict | None) -> dict:
    """shardfn trained on this rank's slices of the global batches, compared with the
    reference (rank 0), then timed on per-rank batches."""
    mesh = ctx.mesh
    precision = sf.Precision(param=torch.bfloat16, reduce=torch.float32) if variant == "bf16" else None
    offload = sf.Offload(params=True, optimizer=True) if variant == "offload" else None

    def make_step(opt: Any, on_nonfinite: str | None = None) -> Callable:
        params, apply = sf.functionalize(build_model(ctx))
        tree = {"sharded": sf.shard(params, mesh, strategy, precision=precision, offload=offload)}
        del params
        tree["opt"] = opt.init(tree["sharded"])
        jstep = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt,
                            on_nonfinite=on_nonfinite)

        def step(x: torch.Tensor, y: torch.Tensor) -> float | torch.Tensor:
            tree["sharded"], tree["opt"], metrics = jstep(tree["sharded"], tree["opt"], (x, y))
            return metrics["loss"]  # (a device tensor with on_nonfinite="raise_next")

        step.tree = tree
        step.units = len(tree["sharded"].layout.units)
        return step

    step = make_step(sf.optim.sgd(ctx.opts["eq_lr"], momentum=EQ_MOMENTUM))
    losses = [step(x, y) for x, y in to_device(local_slices(eq_batches, ctx), mesh.device)]
    full = sf.gather(step.tree["sharded"], rank0_only=True, device="cpu")
    result = compare(losses, full, ref, variant, ctx) if ctx.rank == 0 else {}
    del full, step
    step = make_step(sf.optim.adamw(ctx.opts["lr"], weight_decay=ctx.opts["wd"]), ctx.opts["on_nonfinite"])
    return {**result, **time_steps(step, to_device(timed, mesh.device), ctx, step.units)}


def compare(losses: list[float], full: dict, ref: dict, variant: str, ctx: Ctx) -> dict:
    """PASS/FAIL against the reference ([Note: an honest equivalence]): the largest
    parameter difference, the largest over tensors of a difference over the tensor's bound
    (``of_bound``; PASS at most 1) and the largest relative loss difference."""
    param_tol, loss_tol = (BF16_TOL, BF16_TOL) if variant == "bf16" else (PARAM_TOL[ctx.device.type], LOSS_RTOL)
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    if set(full) != set(ref["state"]):
        return {"equiv": "FAIL", "loss_rel": loss_rel,
                "error": f"the full state's keys differ from state_dict(): {sorted(set(full) ^ set(ref['state']))[:4]}"}
    diffs = {k: float((full[k].float() - v.float()).abs().max()) for k, v in ref["state"].items()}
    # Each step's addition rounds a parameter to its own fp32 spacing: one ulp of |p| per
    # step on top of the fraction of its updates (a tensor never moved, a buffer, gets only that).
    bounds = {k: param_tol * ref["moved"].get(k, 0.0) + len(losses) * 2**-23 * float(v.float().abs().max())
              for k, v in ref["state"].items()}
    ratios = {k: d / bounds[k] if bounds[k] else (0.0 if d == 0 else float("inf")) for k, d in diffs.items()}
    worst = max(ratios, key=ratios.get)
    ok = loss_rel <= loss_tol and ratios[worst] <= 1
    return {"equiv": "PASS" if ok else "FAIL", "dp": max(diffs.values()), "of_bound": ratios[worst], "worst": worst,
            "worst_dp": diffs[worst], "worst_bound": bounds[worst], "loss_rel": loss_rel}


def peer_model(ctx: Ctx, strategy: str, variant: str) -> tuple[torch.nn.Module, bool]:
    """The peer of a shardfn row (FSDP2, or DDP for NO_SHARD), and whether its steps run
    under autocast."""
    model = build_model(ctx).to(ctx.device)
    bf16, offload = variant == "bf16", variant == "offload"
    if strategy == "NO_SHARD":
        return DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None), bf16
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
          else MixedPrecisionPolicy()}
    if offload:  # pinned host memory needs a CUDA device
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
    dm = ctx.mesh.device_mesh
    for block in model.blocks:
        fully_shard(block, mesh=dm, reshard_after_forward=strategy == "FULL_SHARD", **kw)
    fully_shard(model, mesh=dm, **kw)  # the root at FSDP2's default: gathered from forward to backward
    return model, False


def peer_row(ctx: Ctx, strategy: str, variant: str, eq_batches: list, timed: list, ref: dict | None) -> dict:
    """The peer trained like the shardfn row and compared with the same reference and bounds,
    then timed on the same per-rank batches."""
    model, autocast = peer_model(ctx, strategy, variant)
    step = torch_step(model, ctx, autocast=autocast, eq=True)
    losses = [global_loss(float(step(x, y)), ctx) for x, y in to_device(local_slices(eq_batches, ctx), ctx.device)]
    full = peer_full_state(model, ctx)
    result = compare(losses, full, ref, variant, ctx) if ref is not None else {}
    del full, model, step
    model, autocast = peer_model(ctx, strategy, variant)
    return {**result, **time_steps(torch_step(model, ctx, autocast=autocast), to_device(timed, ctx.device), ctx)}


def peer_full_state(model: torch.nn.Module, ctx: Ctx) -> dict[str, torch.Tensor]:
    """The peer's full state on CPU (complete on rank 0): DDP's module's own; FSDP2's
    parameters are DTensors sharded on dim 0, whose local pieces are gathered to the host
    and concatenated. Not ``get_model_state_dict``: its gather runs functional collectives,
    which over gloo with CUDA tensors (world 2 on one GPU, torch 2.11) killed rank 0 (SIGSEGV)."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    state = {k: v.detach() for k, v in module.state_dict().items()}
    sharded = {k for k, v in state.items() if isinstance(v, DTensor)}
    for k in sharded:
        if tuple(state[k].placements) != (Shard(0),):
            raise RuntimeError(f"{k}: placements {state[k].placements}, expected (Shard(0),)")
    local = {k: (v.to_local() if k in sharded else v).cpu() for k, v in state.items()}
    if ctx.world == 1 or not sharded:
        return local
    pieces: list = [None] * ctx.world
    dist.all_gather_object(pieces, {k: local[k] for k in sharded}, group=ctx.host_group)
    return {**local, **{k: torch.cat([p[k] for p in pieces]) for k in sharded}}


def peer_name(strategy: str, variant: str) -> str:
    """How the table names the peer of a row."""
    if strategy == "NO_SHARD":
        return {"fp32": "ddp", "bf16": "ddp+autocast", "offload": "ddp (no offload)"}[variant]
    name = "fsdp2" if strategy == "FULL_SHARD" else "fsdp2 noreshard"
    return name + {"fp32": "", "bf16": " bf16", "offload": " offload"}[variant]


def plain_row(ctx: Ctx, variant: str, timed: list) -> dict:
    """Plain PyTorch in one process on the per-rank batch: fp32, or bf16 under autocast;
    "... cg": the same step captured as one CUDA graph (the floor of a whole-step program)."""
    model = build_model(ctx).to(ctx.device)
    batches = to_device(timed, ctx.device)
    if variant.endswith(" cg"):
        step = graphed_step(model, ctx, variant.startswith("bf16"), *batches[0])
    else:
        step = torch_step(model, ctx, autocast=variant == "bf16")
    return time_steps(step, batches, ctx)


def graphed_step(model: torch.nn.Module, ctx: Ctx, autocast: bool, x0: torch.Tensor, y0: torch.Tensor) -> Callable:
    """Plain PyTorch's training step (forward, backward, AdamW) captured as one CUDA graph,
    as the CUDA-graph recipe of PyTorch's documentation does it: a few eager steps on a side
    stream first, AdamW's state on the device (``capturable=True``), autocast without its
    cache, the batch copied into static input tensors before each replay."""
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.opts["lr"], weight_decay=ctx.opts["wd"], foreach=True,
                            capturable=True)
    static_x, static_y = x0.clone(), y0.clone()

    def body() -> torch.Tensor:
        cast = (torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if autocast
                else contextlib.nullcontext())
        with cast:
            loss = lm_loss(model(static_x), static_y)
        loss.backward()
        opt.step()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)  # the gradients are allocated in the graph's pool, written by every replay
    with torch.cuda.graph(graph):
        static_loss = body()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return static_loss

    return step


def measure_all(ctx: Ctx, out: Any) -> None:
    """Every row of this world; rank 0 sends each to the parent as it is done."""
    opts = ctx.opts
    eq_batches = make_batches(opts["steps"], ctx.world * opts["batch"], ctx, opts["seed"] + 1)
    timed = make_batches(opts["warmup"] + opts["timed_steps"], opts["batch"], ctx, opts["seed"] + 2 + ctx.rank)
    if ctx.rank == 0:
        with torch.device("meta"):
            n_params = sum(p.numel() for p in GPT(ctx.cfg).parameters())
        name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        out.put(("info", 0, {"device": name, "n_params": n_params, "backend": dist.get_backend(),
                             "mesh": repr(ctx.mesh)}))
    ref = guarded(ctx, lambda: reference(ctx, eq_batches) if ctx.rank == 0 else {})
    if ctx.world == 1:
        for variant in ("fp32", "bf16") + (("fp32 cg", "bf16 cg") if ctx.device.type == "cuda" else ()):
            row = guarded(ctx, lambda: plain_row(ctx, variant, timed))
            out.put(("plain", 0, {"variant": variant, **row}))
    for strategy in STRATEGIES:
        for variant in VARIANTS:
            row = {"world": ctx.world, "strategy": strategy, "variant": variant, "peer": peer_name(strategy, variant)}
            if "error" in ref:
                row.update(equiv="ERROR", error=f"reference: {ref['error']}")
            else:
                row.update(guarded(ctx, lambda: shardfn_row(ctx, strategy, variant, eq_batches, timed,
                                                            ref if ctx.rank == 0 else None)))
                row.setdefault("equiv", "ERROR")
            peer = guarded(ctx, lambda: peer_row(ctx, strategy, variant, eq_batches, timed,
                                                 ref if ctx.rank == 0 and "error" not in ref else None))
            row.update({f"peer_{k}": v for k, v in peer.items()})
            if ctx.rank == 0:
                out.put(("row", 0, row))


# ---------------------------------------------------------------------------------------
# In the parent


@dataclasses.dataclass
class Outcome:
    """One world's run: its backend, or why no backend could run it; what came back."""

    world: int
    backend: str | None = None
    unrunnable: str | None = None  # every backend failed its probe
    failure: str | None = None  # a run that started but died or timed out
    info: dict = dataclasses.field(default_factory=dict)
    plain: dict = dataclasses.field(default_factory=dict)
    rows: list = dataclasses.field(default_factory=list)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(world: int, opts: dict) -> Outcome:
    """Runs ``world`` ranks with the first backend that passes the probe."""
    backends = ("nccl", "gloo") if opts["device"] == "cuda" else ("gloo",)
    reasons = []
    for backend in backends:
        outcome = launch(world, backend, opts)
        if outcome.unrunnable is None:
            return outcome
        reasons.append(f"{backend}: {outcome.unrunnable}")
        print(f"world {world}: {backend} is not usable here ({outcome.unrunnable})", flush=True)
    return Outcome(world, unrunnable="; ".join(reasons))


def launch(world: int, backend: str, opts: dict) -> Outcome:
    """Spawns the ranks, waits for their probe (bounded), then for their results (bounded
    by ``--timeout``); kills whatever outlives that."""
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    port = free_port()
    procs = [spawn.Process(target=worker, args=(rank, world, backend, port, opts, out), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    outcome = Outcome(world, backend)
    try:
        probed: dict[int, str | None] = {}
        waiting = set(range(world))
        deadline = time.monotonic() + PROBE_LIMIT_S
        while waiting:
            msg = receive(out, procs, waiting, deadline)
            if isinstance(msg, str):  # a rank died or the time is up
                if len(probed) < world:
                    outcome.unrunnable = msg or f"no probe result within {PROBE_LIMIT_S:.0f} s"
                else:
                    outcome.failure = msg or f"timed out after {opts['timeout']:.0f} s (--timeout); ranks killed"
                return outcome
            kind, rank, body = msg
            if kind == "probe":
                probed[rank] = body
                if body is not None:
                    outcome.unrunnable = f"rank {rank}: {body}"
                    return outcome
                if len(probed) == world:
                    deadline = time.monotonic() + opts["timeout"]
                    print(f"world {world}: running on {backend}", flush=True)
            elif kind == "info":
                outcome.info = body
            elif kind == "plain":
                outcome.plain[body["variant"]] = body
                print(f"  plain torch {body['variant']}: {fmt(body.get('ms'), '.1f')} ms/step"
                      + (f"  ERROR {body['error']}" if "error" in body else ""), flush=True)
            elif kind == "row":
                outcome.rows.append(body)
                peer = "ERROR" if "peer_error" in body else fmt(body.get("peer_ms"), ".1f")
                print(f"  {body['strategy']} {body['variant']}: {body['equiv']}, {fmt(body.get('ms'), '.1f')} "
                      f"ms/step ({body['peer']} {peer})", flush=True)
            elif kind == "done":
                waiting.discard(rank)
            elif kind == "fatal":
                outcome.failure = f"rank {rank} failed:\n{body}"
                return outcome
        return outcome
    finally:
        stop(procs)


def receive(out: Any, procs: list, waiting: set[int], deadline: float) -> tuple | str:
    """The next message, or why none will come: a rank died (its exit code), or "" when
    the deadline passed."""
    while True:
        try:
            return out.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except queue_module.Empty:
            pass
        dead = [r for r in waiting if not procs[r].is_alive()]
        if dead:  # what it sent before dying is in the pipe already
            try:
                return out.get(timeout=1.0)
            except queue_module.Empty:
                return f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
        if time.monotonic() >= deadline:
            return ""


def stop(procs: list) -> None:
    """Terminates, then kills, the ranks still alive."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def fmt(v: Any, spec: str) -> str:
    """``v`` formatted with ``spec``, or "-" when there is none."""
    return "-" if v is None else format(v, spec)


def peaks_for(device_name: str, peak_tflops: float | None) -> tuple[dict | None, str]:
    """Peak FLOP/s per precision, and where they come from."""
    if peak_tflops is not None:
        peak = peak_tflops * 1e12
        return {"bf16": peak, "fp32": peak}, f"{peak_tflops:g} TFLOP/s (--peak-tflops), every row"
    for key, peaks in PEAKS.items():
        if key in device_name:
            return peaks, (f"{key} table: bf16 {peaks['bf16'] / 1e12:g} TFLOP/s (bf16 rows), fp32 without TF32 "
                           f"{peaks['fp32'] / 1e12:g} TFLOP/s (fp32 and offload rows)")
    return None, f"none: {device_name!r} is not in the table ({', '.join(PEAKS)}); pass --peak-tflops for MFU"


def table(outcomes: list[Outcome], opts: dict, peaks: dict | None, n_params: int) -> str:
    """The one table: plain torch rows, then every shardfn row with its peer."""
    head = (f"{'world':>5}  {'strategy':<14}{'variant':<9}{'equiv':<7}{'max|dp|':>9}{'x bound':>9}{'loss rel':>10}"
            f"{'ms/step':>10}  {'peer':<24}{'peer eq':<8}{'x bound':>9}{'peer ms':>9}{'x peer':>8}{'x plain':>8}"
            f"{'MFU':>7}{'MiB':>9}{'peer MiB':>10}{'ops':>7}{'peer ops':>9}{'x plain':>8}{'launch':>8}{'peer':>7}"
            f"{'sync':>5}{'host ms':>8}{'peer':>6}{'host us/unit':>13}")
    lines = [head, "-" * len(head)]
    tokens = opts["batch"] * opts["seq"]

    def mfu(ms: float | None, variant: str) -> str:
        if ms is None or peaks is None:
            return "-"
        return f"{6 * n_params * tokens / (ms / 1e3) / peaks['bf16' if variant.startswith('bf16') else 'fp32']:.1%}"

    plain = next((o.plain for o in outcomes if o.plain), {})
    for variant, p in plain.items():
        eager = plain.get(variant[:4], {}).get("ms")  # a captured step against the eager one
        lines.append(f"{1:>5}  {'plain torch':<14}{variant:<9}{'-':<7}{'-':>9}{'-':>9}{'-':>10}"
                     f"{fmt(p.get('ms'), '.1f'):>10}  {'-':<24}{'-':<8}{'-':>9}{'-':>9}{'-':>8}"
                     f"{fmt(p['ms'] / eager if 'ms' in p and eager else None, '.2f'):>8}"
                     f"{mfu(p.get('ms'), variant):>7}{fmt(p.get('mib'), '.0f'):>9}{'-':>10}"
                     f"{fmt(p.get('ops'), 'd'):>7}{'-':>9}{'1.00' if 'ops' in p else '-':>8}{fmt(p.get('launch'), 'd'):>8}"
                     f"{'-':>7}{fmt(p.get('sync'), 'd'):>5}{fmt(p.get('host_ms'), '.1f'):>8}{'-':>6}{'-':>13}")
    for o in outcomes:
        for r in o.rows:
            ms, peer_ms = r.get("ms"), r.get("peer_ms")
            base = plain.get("bf16" if r["variant"] == "bf16" else "fp32", {}).get("ms")
            base_ops = plain.get("bf16" if r["variant"] == "bf16" else "fp32", {}).get("ops")
            lines.append(
                f"{r['world']:>5}  {r['strategy']:<14}{r['variant']:<9}{r['equiv']:<7}{fmt(r.get('dp'), '.1e'):>9}"
                f"{fmt(r.get('of_bound'), '.1e'):>9}{fmt(r.get('loss_rel'), '.1e'):>10}{fmt(ms, '.1f'):>10}  "
                f"{r['peer']:<24}{r.get('peer_equiv', 'ERROR'):<8}{fmt(r.get('peer_of_bound'), '.1e'):>9}"
                f"{fmt(peer_ms, '.1f'):>9}"
                f"{fmt(ms / peer_ms if ms and peer_ms else None, '.2f'):>8}"
                f"{fmt(ms / base if ms and base else None, '.2f'):>8}{mfu(ms, r['variant']):>7}"
                f"{fmt(r.get('mib'), '.0f'):>9}{fmt(r.get('peer_mib'), '.0f'):>10}"
                f"{fmt(r.get('ops'), 'd'):>7}{fmt(r.get('peer_ops'), 'd'):>9}"
                f"{fmt(r['ops'] / base_ops if r.get('ops') and base_ops else None, '.2f'):>8}"
                f"{fmt(r.get('launch'), 'd'):>8}{fmt(r.get('peer_launch'), 'd'):>7}{fmt(r.get('sync'), 'd'):>5}"
                f"{fmt(r.get('host_ms'), '.1f'):>8}{fmt(r.get('peer_host_ms'), '.1f'):>6}"
                f"{fmt(r.get('host_us_unit'), '.0f'):>13}")
        if o.unrunnable:
            lines.append(f"{o.world:>5}  not runnable here: {o.unrunnable}")
        elif o.failure:
            lines.append(f"{o.world:>5}  run FAILED: {o.failure.splitlines()[0]}")
    return "\n".join(lines)


def notes(outcomes: list[Outcome]) -> list[str]:
    """Errors, leftover memory and failures worth a line under the table."""
    lines = []
    for o in outcomes:
        for r in [*o.plain.values(), *o.rows]:
            where = f"world {o.world} {r.get('strategy', 'plain torch')} {r['variant']}"
            if r.get("error"):
                lines.append(f"{where}: shardfn: {r['error']}" if "strategy" in r else f"{where}: {r['error']}")
            for who, pre in (("shardfn", ""), ("peer", "peer_")):
                if r.get(f"{pre}worst") and r.get(f"{pre}of_bound", 0) > 0.5:
                    lines.append(f"{where}: {who}'s nearest to its bound is {r[pre + 'worst']}: |dp| "
                                 f"{r[pre + 'worst_dp']:.2e}, bound {r[pre + 'worst_bound']:.2e}")
            for pre in ("", "peer_"):
                if r.get(f"{pre}count_error"):
                    lines.append(f"{where}: {pre or 'shardfn '}counts: {r[pre + 'count_error']}")
            if r.get("peer_error"):
                lines.append(f"{where}: peer {r['peer']}: {r['peer_error']}")
            for key in ("leftover_mib", "peer_leftover_mib"):
                if r.get(key, 0) > 1:
                    who = "peer" if key.startswith("peer") else "measurement"
                    lines.append(f"{where}: {r[key]:.0f} MiB were still allocated when the {who} started "
                                 "(its MiB include them)")
        if o.failure:
            lines.append(f"world {o.world}: run failed: {o.failure}")
    return lines


def versions() -> str:
    """torch, and the CUDA and NCCL it was built with (what a result depends on)."""
    nccl = "-"
    if torch.cuda.is_available() and dist.is_nccl_available():
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, NCCL {nccl}, python {sys.version.split()[0]}"


def parse_args() -> argparse.Namespace:
    """The options, with the defaults of the chosen device filled in."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu for a smoke run of the logic (gloo, tiny sizes, no memory figures)")
    p.add_argument("--d-model", type=int, help="default 1024 (cuda), 64 (cpu)")
    p.add_argument("--layers", type=int, help="default 8 (cuda), 2 (cpu)")
    p.add_argument("--heads", type=int, help="default 16 (cuda), 4 (cpu)")
    p.add_argument("--seq", type=int, help="sequence length; default 1024 (cuda), 32 (cpu)")
    p.add_argument("--vocab", type=int, help="default 32000 (cuda), 256 (cpu)")
    p.add_argument("--batch", type=int, help="sequences per rank; default 8 (cuda), 2 (cpu)")
    p.add_argument("--steps", type=int, default=5, help="training steps compared with plain PyTorch")
    p.add_argument("--warmup", type=int, help="untimed steps before the timed ones; default 2 (cuda), 1 (cpu)")
    p.add_argument("--timed-steps", type=int, help="timed steps per configuration; default 10 (cuda), 3 (cpu)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the timed steps")
    p.add_argument("--eq-lr", type=float, default=0.1, help="SGD learning rate of the compared steps")
    p.add_argument("--wd", type=float, default=0.1, help="AdamW weight decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s for MFU, every row (default: by device name)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one world's run may take once started")
    p.add_argument("--worlds", default="1,2", help="the world sizes to run (1, 2 or both: 1,2)")
    p.add_argument("--graph", action="store_true",
                   help="jit_step(graph=True) captured as one CUDA graph against shardfn eager, plain eager and the "
                        "plain CUDA-graph floor, on three models (benchmarks/gpu_graph.py); one process, under 8 "
                        "minutes on one H100/H200; the other options are not used")
    p.add_argument("--tensor", choices=("auto", "on", "off"), default="auto",
                   help="the tensor-parallel row (benchmarks/gpu_tensor.py: shard 2 x tensor 2 against FULL_SHARD at "
                        "world 4, one GPU per rank): auto runs it with 4 GPUs and prints why not otherwise; on runs "
                        "it anyway (gloo on CPU with --device cpu); off leaves it out")
    p.add_argument("--on-nonfinite", choices=("raise", "raise_next"), default="raise",
                   help="jit_step's on_nonfinite for shardfn's timed steps: raise_next reads nothing from the device "
                        "(no synchronisation in the step; the sync column shows it)")
    args = p.parse_args()
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("d_model", "layers", "heads", "seq", "vocab", "batch", "steps", "timed_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        args.worlds = sorted({int(w) for w in args.worlds.split(",")})
    except ValueError:
        args.worlds = []
    if not args.worlds or not set(args.worlds) <= {1, 2}:
        p.error("--worlds takes 1, 2 or 1,2")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    return args


def main() -> int:
    """Runs world 1 and world 2, prints the table; returns the exit status."""
    args = parse_args()
    if args.graph:  # [Note: capturing a step] in shardfn._program.capture: the GPU check of the CUDA path
        import gpu_graph

        return gpu_graph.main(args.device, gpu_graph.ROWS if args.device == "cuda" else gpu_graph.CPU_ROWS)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    opts = vars(args)
    print(versions(), flush=True)
    print(f"shardfn {sf.__version__}; GPT vocab {args.vocab}, seq {args.seq}, d_model "
          f"{args.d_model}, {args.layers} layers, {args.heads} heads; batch {args.batch} per rank; {args.steps} "
          f"compared steps (SGD lr {args.eq_lr:g}, momentum {EQ_MOMENTUM:g}), {args.warmup} warm-up + "
          f"{args.timed_steps} timed steps (AdamW lr {args.lr:g}, weight decay {args.wd:g}; shardfn's with "
          f"on_nonfinite={args.on_nonfinite!r})", flush=True)
    outcomes = [run_world(world, opts) for world in args.worlds]
    info = next((o.info for o in outcomes if o.info), {})
    peaks, peak_source = peaks_for(info.get("device", "?"), args.peak_tflops) if args.device == "cuda" else (
        None, "none on CPU")
    print(f"\ndevice: {info.get('device', '?')}; {info.get('n_params', 0):,} parameters; "
          f"{args.batch * args.seq:,} tokens per step per rank")
    for o in outcomes:
        print(f"world {o.world}: " + (f"not runnable here: {o.unrunnable}" if o.unrunnable else
                                      f"{o.backend} ({o.info.get('mesh', '?')})"))
    print(f"skipped: {', '.join(SKIPPED)} (they need a 2-D mesh: 4 ranks at least, 2 replicas x 2 shards)")
    print(f"MFU peak: {peak_source}\n")
    print(table(outcomes, opts, peaks, info.get("n_params", 0)))
    print(f"\nequiv, peer eq: losses of every step and final parameters against plain single-process training on "
          f"the global batches, SGD lr {args.eq_lr:g} momentum {EQ_MOMENTUM:g} (docstring: [Note: an honest "
          f"equivalence]). x bound: the largest over tensors of max|dp| over the tensor's bound ("
          f"{PARAM_TOL[args.device]:g} (bf16: {BF16_TOL:g}) of the sum over steps of its largest update, plus an "
          f"fp32 spacing of its largest value per step); PASS: x bound <= 1 and loss rel <= {LOSS_RTOL:g} (bf16, "
          f"against the fp32 reference: {BF16_TOL:g}). max|dp|: largest parameter "
          f"difference; loss rel: largest relative loss difference. ms/step: median, rank 0. x peer, x plain: ms/step over the peer's "
          f"and over plain torch's (bf16 rows: plain torch bf16, under autocast). MFU: 6 x parameters x tokens per "
          f"rank / step time / peak (world 2: two ranks share the GPU, which does twice that). MiB: "
          f"torch.cuda.max_memory_allocated() over the timed steps, rank 0. ops: aten ops of one step that launch "
          f"a kernel on a GPU (views, empty allocations, .item() and collectives not counted), rank 0; x plain: over "
          f"plain torch's. launch, sync: kernel launches and host-device synchronisations of one step (profiler, "
          f"rank 0, world 1; peer: the peer's launches); host ms: the step's host time less its waiting in "
          f"synchronisations (profiled: an upper bound), per step, and host us/unit the same per unit.")
    for line in notes(outcomes):
        print(f"NOTE {line}")
    import gpu_tensor  # the tensor-parallel row: its own processes, one GPU each

    tensor_lines, tensor_ok = gpu_tensor.main(opts)
    print("\n" + "\n".join(tensor_lines))
    ran = [r for o in outcomes for r in o.rows]
    failed = [r for r in ran if r["equiv"] != "PASS"]
    peers_failed = [r for r in ran if r.get("peer_equiv") != "PASS"]
    broken = [o for o in outcomes if o.failure]
    ok = bool(ran) and not failed and not peers_failed and not broken and tensor_ok
    print(f"\n{'PASS' if ok else 'FAIL'}: {len(ran) - len(failed)} of {len(ran)} equivalence rows passed, "
          f"their peers {len(ran) - len(peers_failed)} of {len(ran)}"
          + (f"; {len(broken)} run(s) failed" if broken else "") + ("; nothing ran" if not ran else "")
          + ("" if tensor_ok else "; the tensor-parallel row failed"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
