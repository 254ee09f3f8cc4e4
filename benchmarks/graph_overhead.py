"""Host time per step outside the compiled code: eager jit_step against jit_step(graph=True).

World 1, the small preset of ``step_time.py`` (GPT d_model 64, 24 layers, seq 16, batch 1:
25 units of ~50k parameters), NO_SHARD by default, one torch thread, on CPU. For each
configuration, after warm-up (the graph step records and compiles in it), ``--steps`` steps
run under ``torch.profiler``:

* eager: the time outside kernels is the step's wall time minus the self time of every
  aten op (a kernel on CPU, plus the dispatcher's share of it, so this undercounts the
  host work a little);
* graph: the time outside the compiled code is the step's wall time minus the time inside
  the compiled region (``Torch-Compiled Region`` events: inductor's generated code, its
  kernels and the collectives it calls).

Both configurations run in the same fresh process, interleaved step by step, ``--repeats``
times; the ratio of each repeat and its spread are printed, and the JSON goes to ``--out``.
The warm-up time (3 steps: the graph step runs eagerly, records, then compiles) is printed for each
repeat: run with a new ``TORCHINDUCTOR_CACHE_DIR`` to see the first repeat with a cold
inductor cache and the later ones with a warm one.

Run::

    python benchmarks/graph_overhead.py --repeats 3 --out benchmarks/results/graph_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import shardfn as sf
from shardfn.testing import Cluster
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=24, n_heads=2)


def _loss(apply, params, batch):
    return lm_loss(apply(params, batch[0]), batch[1])


def _build(strategy: str, graph: bool | str):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, strategy)
    step = sf.jit_step(_loss, mesh, optimizer=sf.optim.adamw(1e-3), graph=graph,
                       **({} if graph else {"on_nonfinite": "raise_next"}))
    state = {"sharded": sharded, "opt": step.init(sharded)}

    def run(batch):
        state["sharded"], state["opt"], metrics = step(state["sharded"], state["opt"], batch)
        return metrics["loss"]

    return run


def _outside(prof, wall: float, graph: bool) -> float:
    """Seconds of ``wall`` spent outside kernels (eager) or outside the compiled code (graph)."""
    events = prof.events()
    if graph:
        inside = sum(e.cpu_time_total for e in events if e.name.startswith("Torch-Compiled Region"))
    else:
        inside = sum(e.self_cpu_time_total for e in events if e.name.startswith("aten::"))
    return wall - inside / 1e6


def measure(strategy: str, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    runs = {"eager": _build(strategy, False), "graph": _build(strategy, "inductor")}  # (the compiled program)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (warmup + steps, 1, CFG.seq_len + 1), generator=g)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    first = {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        for b in batches[:warmup]:
            float(run(b))
        first[name] = time.perf_counter() - t0
    out = {name: {"wall": 0.0, "outside": 0.0} for name in runs}
    for b in batches[warmup:]:
        for name, run in runs.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                loss = run(b)
                wall = time.perf_counter() - t0
            float(loss)
            out[name]["wall"] += wall / steps
            out[name]["outside"] += _outside(prof, wall, name == "graph") / steps
    return {"warmup_s": first, **out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--strategies", default="NO_SHARD", help="comma list (at world 1 every strategy gathers nothing)")
    p.add_argument("--out", default="benchmarks/results/graph_overhead.json")
    args = p.parse_args()
    results = {}
    for strategy in args.strategies.split(","):
        rows = []
        for _ in range(args.repeats):
            with Cluster(1, timeout=1800.0) as c:
                rows.append(c.run(measure, strategy, args.steps, 3)[0])
        ratios = [r["graph"]["outside"] / r["eager"]["outside"] for r in rows]
        walls = [r["graph"]["wall"] / r["eager"]["wall"] for r in rows]
        results[strategy] = {"runs": rows, "outside_ratio": ratios, "wall_ratio": walls}
        print(f"{strategy}: outside the compiled code, graph / eager: median {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}); wall {statistics.median(walls):.3f} "
              f"({min(walls):.3f}-{max(walls):.3f})")
        for r in rows:
            print("  " + ", ".join(f"{k}: wall {v['wall'] * 1e3:.2f} ms, outside {v['outside'] * 1e3:.2f} ms"
                                   for k, v in r.items() if k != "warmup_s")
                  + f"; warm-up (3 steps) eager {r['warmup_s']['eager']:.1f} s, graph {r['warmup_s']['graph']:.1f} s")
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
