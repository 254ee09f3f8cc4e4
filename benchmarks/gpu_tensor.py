"""gpu_check's tensor-parallel row: shard 2 x tensor 2 against FULL_SHARD at world 4.

Four ranks, one GPU each (NCCL), train the GPT of ``shardfn.testing.models`` on the same
global batches twice: FULL_SHARD over all four ranks, and FULL_SHARD over 2 shards of the
MLPs split over a tensor axis of 2 (``tensor_parallel={"blocks.*.mlp.0": "colwise",
"blocks.*.mlp.2": "rowwise"}``, docs/tensor-parallel.md). Equivalence: the losses of the
``--steps`` SGD steps (gpu_check's [Note: an honest equivalence]) of the two runs within
gpu_check's fp32 loss bound. Timing: median ms/step of AdamW steps and the peak of allocated
device memory, rank 0, as gpu_check times its rows. With fewer than 4 GPUs the row is not
run: one "skipped: needs 4 GPUs" line, not an error. ``--tensor on`` runs it anyway, on the
CPU with gloo when ``--device cpu`` (a check of the logic; its times mean nothing).
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpu_check as G
import shardfn as sf
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

WORLD, TENSOR = 4, 2
PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
RUNS = (("FULL_SHARD", None), (f"shard {WORLD // TENSOR} x tensor {TENSOR}", TENSOR))


def skip_reason(opts: dict) -> str | None:
    """Why the row does not run here, or None."""
    if opts["tensor"] == "off":
        return "skipped: --tensor off"
    if opts["tensor"] == "on":
        return None
    if opts["device"] != "cuda":
        return "skipped on CPU (--tensor on runs it with gloo)"
    found = torch.cuda.device_count()
    return f"skipped: needs {WORLD} GPUs (found {found})" if found < WORLD else None


def worker(rank: int, port: int, opts: dict, out: Any) -> None:
    """One rank on its own GPU: both runs, rank 0 sends the results."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    cuda = opts["device"] == "cuda"
    torch.set_num_threads(1 if not cuda else max(1, (os.cpu_count() or 1) // WORLD))
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    try:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD, timeout=G.PG_TIMEOUT)
        results = {name: run(tensor, opts) for name, tensor in RUNS}
        if rank == 0:
            out.put(("result", 0, results))
        out.put(("done", rank, None))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("fatal", rank, traceback.format_exc()))
        G.leave(out, 1)
    G.leave(out, 0)


def run(tensor: int | None, opts: dict) -> dict:
    """The SGD steps' losses, then AdamW's median ms/step and peak MiB, on this mesh."""
    mesh = sf.Mesh.from_group(tensor=tensor)
    cfg = GPTConfig(vocab_size=opts["vocab"], seq_len=opts["seq"], d_model=opts["d_model"], n_layers=opts["layers"],
                    n_heads=opts["heads"])
    g = torch.Generator().manual_seed(opts["seed"] + 1)
    rows = WORLD * opts["batch"]  # the global batch, the same for both runs
    batches = [torch.randint(cfg.vocab_size, (rows, cfg.seq_len + 1), generator=g)
               for _ in range(opts["steps"] + opts["warmup"] + opts["timed_steps"])]
    local = [split_batch((t[:, :-1].contiguous().to(mesh.device), t[:, 1:].contiguous().to(mesh.device)),
                         mesh.data_rank, mesh.data_size) for t in batches]

    def make_step(opt: Any) -> Any:
        torch.manual_seed(opts["seed"])
        params, _ = sf.functionalize(GPT(cfg))
        state = {"p": sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=PLAN if tensor else None)}
        state["o"] = opt.init(state["p"])
        jstep = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt)

        def step(batch: Any) -> float:
            state["p"], state["o"], metrics = jstep(state["p"], state["o"], batch)
            return metrics["loss"]

        return step

    step = make_step(sf.optim.sgd(opts["eq_lr"], momentum=G.EQ_MOMENTUM))
    losses = [float(step(b)) for b in local[:opts["steps"]]]
    step = make_step(sf.optim.adamw(opts["lr"], weight_decay=opts["wd"]))
    timed = local[opts["steps"]:]
    for b in timed[:opts["warmup"]]:
        step(b)
    _sync(mesh)
    if mesh.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for b in timed[opts["warmup"]:]:
        _sync(mesh)
        t0 = time.perf_counter()
        step(b)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    mib = torch.cuda.max_memory_allocated() / G.MIB if mesh.device.type == "cuda" else None
    return {"losses": losses, "ms": 1e3 * statistics.median(times), "mib": mib}


def _sync(mesh: sf.Mesh) -> None:
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def launch(opts: dict) -> dict | str:
    """Spawns the four ranks; their results, or why there are none."""
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    port = G.free_port()
    procs = [spawn.Process(target=worker, args=(rank, port, opts, out), daemon=True) for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        waiting, results = set(range(WORLD)), None
        deadline = time.monotonic() + opts["timeout"]
        while waiting:
            msg = G.receive(out, procs, waiting, deadline)
            if isinstance(msg, str):
                return msg or f"timed out after {opts['timeout']:.0f} s (--timeout); ranks killed"
            kind, rank, body = msg
            if kind == "result":
                results = body
            elif kind == "done":
                waiting.discard(rank)
            elif kind == "fatal":
                return f"rank {rank} failed:\n{body}"
        return results if results is not None else "no result from rank 0"
    finally:
        G.stop(procs)


def main(opts: dict) -> tuple[list[str], bool]:
    """The row's lines for gpu_check's report, and whether it passed (a skip passes)."""
    title = f"tensor parallel, world {WORLD}: {RUNS[1][0]} against FULL_SHARD"
    reason = skip_reason(opts)
    if reason is not None:
        return [f"{title}: {reason}"], True
    print(f"{title}: running", flush=True)
    got = launch(opts)
    if isinstance(got, str):
        return [f"{title}: run FAILED: {got}"], False
    (base_name, _), (tp_name, _) = RUNS
    base, tp = got[base_name], got[tp_name]
    rel = max(abs(a - b) / abs(b) for a, b in zip(tp["losses"], base["losses"]))
    ok = rel <= G.LOSS_RTOL
    lines = [f"{title}: {'PASS' if ok else 'FAIL'} (losses of {len(base['losses'])} SGD steps: largest relative "
             f"difference {rel:.1e}, bound {G.LOSS_RTOL:g})"]
    for name, r in ((base_name, base), (tp_name, tp)):
        lines.append(f"  {name:<20} {G.fmt(r['ms'], '.1f'):>9} ms/step  {G.fmt(r['mib'], '.0f'):>7} MiB (rank 0)")
    lines.append(f"  x FULL_SHARD: {tp['ms'] / base['ms']:.2f} (ms/step)")
    return lines, ok
