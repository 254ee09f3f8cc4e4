"""Memory and communication of the memory plans, counted (not timed): CPU offload, per-unit
and sub-group reshard after forward (hpZ), SHARD_OPTIMIZER (ZeRO-1), prefetch depth and
keep_gathered, on the benchmark GPT (step_time.py's: d_model 512, 8 layers, seq 128,
batch 4 per rank, AdamW).

For each configuration, rank 0 of a fresh world runs two steps and counts the second:
bytes of live tensors on the compute device between steps and at the step's peak, the same
in host memory (offload), host <-> device copies, and every collective by kind, purpose
and process group (``sf.record_collectives``; ``sf.track_live_bytes``, which tells host
from device memory by offload's marks on this CPU-only machine, see [Note: offload]).
Exact counts: a rerun prints the same figures.

    python benchmarks/memory_plans.py                  # world 2, and world 4 for the sub-group rows
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

import shardfn as sf
from shardfn.testing import Cluster
from shardfn.testing.models import GPT, GPTConfig, lm_loss

OFF = sf.Offload(params=True, optimizer=True)
CONFIGS = {  # name -> (world, plan, jit_step options)
    "FULL_SHARD": (2, sf.Plan("FULL_SHARD"), {}),
    "FULL_SHARD + offload": (2, sf.Plan("FULL_SHARD", offload=OFF), {}),
    "SHARD_GRAD_OP": (2, sf.Plan("SHARD_GRAD_OP"), {}),
    "SHARD_GRAD_OP + offload": (2, sf.Plan("SHARD_GRAD_OP", offload=OFF), {}),
    "FULL_SHARD, blocks.7 kept (per unit)": (2, sf.Plan("FULL_SHARD", reshard_after_forward={"blocks.7": False}), {}),
    "SHARD_OPTIMIZER (ZeRO-1)": (2, sf.Plan("SHARD_OPTIMIZER"), {}),
    "FULL_SHARD, prefetch 0": (2, sf.Plan("FULL_SHARD"), {"prefetch": 0}),
    "FULL_SHARD, prefetch 2": (2, sf.Plan("FULL_SHARD"), {"prefetch": 2}),
    "FULL_SHARD, 4 micro-batches": (2, sf.Plan("FULL_SHARD"), {"micro_batches": 4}),
    "FULL_SHARD, 4 micro-batches, keep_gathered": (2, sf.Plan("FULL_SHARD"), {"micro_batches": 4,
                                                                              "keep_gathered": True}),
    "FULL_SHARD (world 4)": (4, sf.Plan("FULL_SHARD"), {}),
    "FULL_SHARD, reshard to pairs (hpZ, world 4)": (4, sf.Plan("FULL_SHARD", reshard_after_forward=2), {}),
}


def measure(plan: sf.Plan, options: dict, cfg: GPTConfig, batch: int) -> dict:
    """Rank's figures for the second of two steps."""
    torch.set_num_threads(1)
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(cfg))
    sharded = sf.shard(params, mesh, plan)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt, **options)
    g = torch.Generator().manual_seed(mesh.rank)
    x, y = (torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g) for _ in range(2))
    sharded, state, _ = step(sharded, state, (x, y))
    with sf.track_live_bytes(sharded, state, (x, y)) as mem, sf.record_collectives() as log:
        held = (mem.device_current, mem.host_current)
        sharded, state, metrics = step(sharded, state, (x, y))
    table = collections.Counter()
    for c in log.calls:
        group = "all" if len(c.group) == mesh.size else "ranks " + ",".join(map(str, c.group))
        table[(c.kind.value, c.purpose.value, group, "count")] += 1
        table[(c.kind.value, c.purpose.value, group, "bytes")] += c.nbytes
    return {
        "device_persistent": held[0], "device_peak": mem.device_peak, "host_persistent": held[1],
        "host_peak": mem.host_peak, "copies": dict(log.transfer_copies()), "copy_bytes": dict(log.transfer_bytes()),
        "collectives": [[*k, v] for k, v in sorted(table.items())], "loss": metrics["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--out", default="benchmarks/results/memory_plans.json")
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=256, seq_len=128, d_model=args.d_model, n_layers=args.layers, n_heads=4)
    results = {}
    for world in sorted({w for w, _, _ in CONFIGS.values()}):
        cluster = Cluster(world, timeout=900.0)
        try:
            for name, (w, plan, options) in CONFIGS.items():
                if w == world:
                    results[name] = cluster.run(measure, plan, options, cfg, args.batch)[0]  # rank 0
        finally:
            cluster.close()
    mib = 2**-20
    print(f"GPT d_model {args.d_model}, {args.layers} layers, batch {args.batch} x seq 128 per rank; rank 0, MiB")
    print(f"{'configuration':<46} {'dev persist':>11} {'dev peak':>9} {'host persist':>12} {'host peak':>9}  "
          "host<->device copies per step")
    for name, r in results.items():
        copies = ", ".join(f"{d} {r['copies'][d]} copies {r['copy_bytes'][d] * mib:.2f} MiB" for d in sorted(r["copies"]))
        print(f"{name:<46} {r['device_persistent'] * mib:>11.2f} {r['device_peak'] * mib:>9.2f} "
              f"{r['host_persistent'] * mib:>12.2f} {(r['host_peak'] or 0) * mib:>9.2f}  {copies or '-'}")
    print("\ncollectives per step (kind, purpose, process group: count, MiB)")
    for name, r in results.items():
        rows = collections.defaultdict(dict)
        for kind, purpose, group, what, v in r["collectives"]:
            rows[(kind, purpose, group)][what] = v
        desc = "; ".join(f"{k} {p} [{g}] x{v['count']} {v['bytes'] * mib:.2f}" for (k, p, g), v in rows.items())
        print(f"{name:<46} {desc}")
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "results": results}, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
