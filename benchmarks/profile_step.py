"""Where a training step's time goes: compute, waiting on collectives, copies, Python.

Runs one configuration of ``benchmarks/step_time.py`` (same GPT, batches, seed, one thread
per rank) alone in fresh processes, and profiles ``--steps`` steps after 2 warm-up steps
with ``torch.profiler`` on every rank. Per step (rank 0; mean over the profiled steps):

* wall: the step's wall time;
* compute: self time of every aten op that is not a copy (matmuls, elementwise, the
  optimizer's kernels, ...);
* copies: self time of the ops that move bytes without arithmetic (``copy_``, ``cat``,
  ``clone``, ``_to_copy``, ``index_select``-free moves: see ``COPIES``);
* waiting: time blocked in the wait for a collective (shardfn waits through
  ``shardfn._comm.guard.wait``, wrapped here in a profiler range; for DDP and FSDP2 the wait
  happens inside their C++ / hooks and lands in "other");
* collective calls: self time of the ``c10d`` ops (issuing the collective, and for gloo
  nothing else: the transfer runs on gloo's threads);
* other: wall minus all of the above: Python (shardfn's or torch's), hooks, autograd's
  engine, the profiler's own cost.

Then the top ranges and ops by total time. Profiling costs time of its own (a few percent
here); compare breakdowns taken the same way, not with ``step_time.py``'s figures.

Run::

    python benchmarks/profile_step.py --config shardfn_full
    python benchmarks/profile_step.py --config shardfn_full --d-model 64 --layers 2 --seq 32 --steps 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

import shardfn as sf
import shardfn._comm.guard as guard
from shardfn.testing import Cluster
from shardfn.testing.models import GPT, GPTConfig
from step_time import SPECS, WARMUP, build_shardfn_step, build_torch_step, make_batches

COPIES = {"aten::copy_", "aten::cat", "aten::clone", "aten::_to_copy", "aten::to", "aten::contiguous",
          "aten::_foreach_copy_", "aten::stack", "aten::constant_pad_nd", "aten::fill_", "aten::zero_"}
WAIT = "profile::wait"


@contextlib.contextmanager
def _waits_as_ranges():
    """Every wait shardfn does for a collective, as a profiler range."""
    plain = guard.wait

    def timed(work, ch, what):
        with torch.profiler.record_function(WAIT):
            return plain(work, ch, what)

    guard.wait = timed
    try:
        yield
    finally:
        guard.wait = plain


def _self_times(prof) -> tuple[dict[str, float], float]:
    """Self CPU ms per op/range name on the main thread, and the ms inside WAIT ranges."""
    out: dict[str, float] = defaultdict(float)
    wait = 0.0
    for e in prof.events():
        if e.name == WAIT:
            wait += e.cpu_time_total / 1e3
        else:
            out[e.name] += e.self_cpu_time_total / 1e3
    return out, wait


def profile(config: str, opts: dict) -> dict:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = SPECS[config]
    cfg = GPTConfig(vocab_size=opts["vocab"], seq_len=opts["seq"], d_model=opts["d_model"], n_layers=opts["layers"],
                    n_heads=opts["heads"])
    torch.manual_seed(opts["seed"])
    build = build_shardfn_step if spec.kind == "shardfn" else build_torch_step
    step, _ = build(spec, GPT(cfg), opts["lr"])
    per_rank = opts["batch"] * opts["world"] // world
    batches = make_batches(WARMUP + opts["steps"], opts["batch"] * opts["world"], opts["seq"], opts["vocab"],
                           opts["seed"])
    batches = [t[rank * per_rank:(rank + 1) * per_rank] for t in batches]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in batches]
    for x, y in batches[:WARMUP]:
        step(x, y)
    walls = []
    with _waits_as_ranges(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x, y in batches[WARMUP:]:
            dist.barrier()
            t0 = time.perf_counter()
            step(x, y)
            walls.append(time.perf_counter() - t0)
    times, wait = _self_times(prof)
    n = len(walls)
    aten = {k: v for k, v in times.items() if k.startswith("aten::")}
    c10d = sum(v for k, v in times.items() if k.startswith(("c10d::", "_c10d_functional::")))
    copies = sum(v for k, v in aten.items() if k in COPIES)
    compute = sum(v for k, v in aten.items() if k not in COPIES)
    wall = 1e3 * sum(walls)
    totals = defaultdict(float)
    for e in prof.key_averages():
        totals[e.key] += e.cpu_time_total / 1e3
    top = sorted(((k, v / n) for k, v in totals.items() if k.startswith(("shardfn::", "aten::", "c10d::"))),
                 key=lambda kv: -kv[1])[:15]
    return {"wall": wall / n, "compute": compute / n, "copies": copies / n, "waiting": wait / n,
            "collective calls": c10d / n, "other": (wall - compute - copies - wait - c10d) / n, "top": top}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="shardfn_full", choices=[c for c, s in SPECS.items() if not s.world1])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON of every rank's breakdown")
    args = p.parse_args()
    opts = {k: getattr(args, k) for k in ("world", "steps", "d_model", "layers", "heads", "seq", "vocab", "batch",
                                          "lr", "seed")}
    cluster = Cluster(args.world, timeout=900)
    try:
        ranks = cluster.run(profile, args.config, opts)
    finally:
        cluster.close()
    r = ranks[0]
    print(f"shardfn from {Path(sf.__file__).parent}")
    print(f"{args.config}, world {args.world}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, "
          f"batch {args.batch}/rank; mean of {args.steps} profiled steps, rank 0 (ms per step)")
    for k in ("wall", "compute", "copies", "waiting", "collective calls", "other"):
        share = "" if k == "wall" else f"  {100 * r[k] / r['wall']:5.1f}%"
        print(f"  {k:<18}{r[k]:9.1f}{share}")
    print("top ranges and ops by total time per step:")
    for name, ms in r["top"]:
        print(f"  {ms:9.1f}  {name}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "ranks": ranks}, indent=2) + "\n")


if __name__ == "__main__":
    main()
