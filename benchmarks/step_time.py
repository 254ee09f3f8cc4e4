"""Step time of one GPT training step: shardfn against DDP, FSDP2 and a single process.

Every configuration trains the same ``shardfn.testing.models.GPT`` (same seed, so the same
initial weights) on the same global batches with AdamW, on CPU with gloo:

* ``single``: plain ``nn.Module`` + ``torch.optim.AdamW`` on the whole global batch
  (world x per-rank batch), in a 1-rank process;
* ``ddp``: ``DistributedDataParallel`` + ``torch.optim.AdamW``;
* ``fsdp2`` / ``fsdp2_noreshard``: ``fully_shard`` on each Block and on the root, with
  ``reshard_after_forward`` True / False, + ``torch.optim.AdamW``;
* ``shardfn_full_prefetch``: ``shardfn_full`` with ``jit_step(prefetch=True)``.
* ``shardfn_full`` / ``shardfn_grad_op`` / ``shardfn_no_shard``: ``shardfn.shard`` with
  FULL_SHARD / SHARD_GRAD_OP / NO_SHARD (default units: one per Block, plus the root),
  ``shardfn.optim.adamw`` and ``shardfn.jit_step``.

Method (see /work/shared/NOTES.md): each (repeat, configuration) runs in a fresh set of
processes (a new ``shardfn.testing.Cluster``), one torch thread per rank. Repeats are the
outer loop and configurations the inner one, so slow drift in machine load hits every
configuration alike. Each run does 2 warm-up steps, then times ``--steps`` steps between
two barriers: wall time on rank 0 and ``time.process_time()`` on every rank. The table
shows medians over repeats; at world sizes above the core count compare CPU time, not
wall time. Communication is counted for shardfn only (``shardfn.record_collectives``,
textbook bytes: all-gather output, reduce-scatter input, all-reduce tensor; this includes the
4-byte loss all-reduce that ``jit_step`` does for its metrics).

Sanity checks: the loss after the timed steps must be finite, and the first-step losses
(global means, before any update) of all configurations must agree within 1e-4.

Run::

    python benchmarks/step_time.py --world 2 --repeats 3 --steps 8
    python benchmarks/step_time.py --d-model 64 --layers 2 --seq 32 --repeats 1 --steps 3
    python benchmarks/step_time.py --configs ddp,fsdp2,shardfn_full
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import shardfn as sf
from shardfn.testing import Cluster
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CONFIGS = ("single", "ddp", "fsdp2", "fsdp2_noreshard", "shardfn_full", "shardfn_full_prefetch", "shardfn_grad_op",
           "shardfn_no_shard")
FSDP2_PEER = {"fsdp2": "fsdp2", "fsdp2_noreshard": "fsdp2_noreshard", "shardfn_full": "fsdp2",
              "shardfn_full_prefetch": "fsdp2", "shardfn_grad_op": "fsdp2_noreshard"}
SHARDFN_STRATEGY = {"shardfn_full": "FULL_SHARD", "shardfn_full_prefetch": "FULL_SHARD",
                    "shardfn_grad_op": "SHARD_GRAD_OP", "shardfn_no_shard": "NO_SHARD"}
WARMUP = 2
LOSS_TOL = 1e-4


def make_batches(n: int, global_batch: int, seq: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """``n`` global batches of ``seq + 1`` random tokens, the same in every process."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(vocab, (global_batch, seq + 1), generator=g) for _ in range(n)]


def build_torch_step(config: str, model: torch.nn.Module, lr: float):
    """A ``step(x, y) -> local loss tensor`` for the plain-torch configurations."""
    if config == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif config.startswith("fsdp2"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        reshard = config == "fsdp2"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(x, y):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_shardfn_step(config: str, model: torch.nn.Module, lr: float):
    """The same ``step(x, y)`` built from shardfn; returns the global mean loss (a float)."""
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(model)
    opt = sf.optim.adamw(lr)
    state = {"sharded": sf.shard(params, mesh, SHARDFN_STRATEGY[config])}
    state["opt"] = opt.init(state["sharded"])
    jstep = sf.jit_step(lambda p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt,
                        prefetch=config.endswith("_prefetch"))

    def step(x, y):
        state["sharded"], state["opt"], metrics = jstep(state["sharded"], state["opt"], (x, y))
        return metrics["loss"]

    return step


def global_mean(loss) -> float:
    """The mean over ranks of a local loss tensor (shardfn's metrics are already global)."""
    if isinstance(loss, float):
        return loss
    t = loss.reshape(1).float().clone()
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def run_config(config: str, opts: dict) -> dict:
    """Runs on every rank of a fresh world: build, warm up, time. Returns this rank's figures."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=opts["vocab"], seq_len=opts["seq"], d_model=opts["d_model"],
                    n_layers=opts["layers"], n_heads=opts["heads"])
    torch.manual_seed(opts["seed"])
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    build = build_shardfn_step if config.startswith("shardfn") else build_torch_step
    step = build(config, model, opts["lr"])

    b = opts["batch"]
    batches = make_batches(WARMUP + opts["steps"], b * opts["world"], opts["seq"], opts["vocab"], opts["seed"])
    if config != "single":  # every rank trains on its contiguous slice of the global batch
        batches = [t[rank * b:(rank + 1) * b] for t in batches]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in batches]

    first_loss = global_mean(step(*batches[0]))
    for x, y in batches[1:WARMUP]:
        step(x, y)
    with sf.record_collectives() as log:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for x, y in batches[WARMUP:]:
            loss = step(x, y)
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = opts["steps"]
    return {"n_params": n_params, "ms_per_step": 1e3 * wall / n,
            "cpu_ms_per_step": 1e3 * cpu / n, "first_loss": first_loss, "final_loss": global_mean(loss),
            "comm_bytes_per_step": {k: v / n for k, v in log.bytes().items()}}


def measure(config: str, opts: dict) -> dict:
    """One measurement in a fresh set of processes; rank 0's wall time, every rank's CPU time."""
    cluster = Cluster(1 if config == "single" else opts["world"], timeout=opts["timeout"])
    try:
        ranks = cluster.run(run_config, config, opts)
    finally:
        cluster.close()
    return {**ranks[0], "cpu_ms_per_step": [r["cpu_ms_per_step"] for r in ranks]}


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians over repeats (CPU time: mean over ranks first) and ratios of the wall-time medians."""
    out = {}
    for config, rs in runs.items():
        comm = rs[0]["comm_bytes_per_step"]
        out[config] = {
            "ms_per_step": statistics.median(r["ms_per_step"] for r in rs),
            "ms_per_step_min_max": [min(r["ms_per_step"] for r in rs), max(r["ms_per_step"] for r in rs)],
            "cpu_ms_per_step": statistics.median(statistics.mean(r["cpu_ms_per_step"]) for r in rs),
            "comm_mib_per_step": sum(comm.values()) / 2**20 if config.startswith("shardfn") else None,
            "first_loss": rs[0]["first_loss"],
            "final_loss_finite": all(math.isfinite(r["final_loss"]) for r in rs),
        }
    for config, s in out.items():
        peer = FSDP2_PEER.get(config)
        s["vs_fsdp2"] = s["ms_per_step"] / out[peer]["ms_per_step"] if peer in out else None
        s["vs_ddp"] = s["ms_per_step"] / out["ddp"]["ms_per_step"] if "ddp" in out else None
    return out


def table(summary: dict[str, dict]) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    rows = [f"{'configuration':<18} {'ms/step':>8} {'cpu ms/step':>12} {'vs fsdp2':>9} {'vs ddp':>7} {'comm MiB/step':>14}"]
    for config, s in summary.items():
        rows.append(f"{config:<18} {s['ms_per_step']:>8.1f} {s['cpu_ms_per_step']:>12.1f} {fmt(s['vs_fsdp2'], '.2f'):>9} "
                    f"{fmt(s['vs_ddp'], '.2f'):>7} {fmt(s['comm_mib_per_step'], '.2f'):>14}")
    return "\n".join(rows)


def check(summary: dict[str, dict]) -> tuple[list[str], str]:
    """Warnings for non-finite final losses and disagreeing first-step losses, and a one-line summary."""
    warnings = [f"WARNING: {c}: loss after the timed steps is not finite" for c, s in summary.items()
                if not s["final_loss_finite"]]
    firsts = {c: s["first_loss"] for c, s in summary.items()}
    spread = max(firsts.values()) - min(firsts.values())
    if spread > LOSS_TOL:
        warnings.append(f"WARNING: first-step losses differ by more than {LOSS_TOL:g}: {firsts}")
    return warnings, f"first-step loss {statistics.median(firsts.values()):.6f}, spread over configurations {spread:.1e}"


def provenance() -> dict:
    """Which shardfn was measured: its path, and its git commit and whether its tree was dirty."""
    root = Path(sf.__file__).resolve().parent
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "."], capture_output=True, text=True).stdout.strip()
    return {"path": str(root), "commit": commit or None, "dirty": bool(dirty) if commit else None}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="ranks (the single run uses 1)")
    p.add_argument("--repeats", type=int, default=3, help="fresh-process runs per configuration")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list, a subset of " + ",".join(CONFIGS))
    p.add_argument("--out", default="benchmarks/results/step_time.json")
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
    print(f"world {args.world}, batch {args.batch}/rank, seq {args.seq}, d_model {args.d_model}, "
          f"{args.layers} layers, {args.steps} timed steps x {args.repeats} repeats; "
          f"load average {load_before[0]:.2f} on {os.cpu_count()} cores", flush=True)
    prov = provenance()
    print(f"shardfn {prov['path']} at {prov['commit'] or '?'}{' (dirty)' if prov['dirty'] else ''}", flush=True)
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for rep in range(args.repeats):  # repeats outermost: interleaved configurations
        for config in args.configs:
            r = measure(config, opts)
            runs[config].append(r)
            print(f"  repeat {rep + 1}/{args.repeats} {config:<18} {r['ms_per_step']:8.1f} ms/step", flush=True)
    summary = summarise(runs)
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f}\n")
    print(table(summary))
    warnings, losses = check(summary)
    for w in warnings:
        print(w)
    n_params = next(iter(runs.values()))[0]["n_params"]
    print(f"\n{n_params:,} parameters; medians over {args.repeats} fresh-process runs; {losses}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "args": vars(args), "torch": torch.__version__, "shardfn": prov, "n_params": n_params, "cpu_count": os.cpu_count(),
        "loadavg_before": load_before, "loadavg_after": load_after, "summary": summary, "runs": runs,
        "warnings": warnings}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
