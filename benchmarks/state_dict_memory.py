"""Peak memory of building a full state dict (``gather(..., rank0_only=True, device="cpu")``).

Each rank gathers one unit at a time; rank 0 keeps a CPU copy of every unit, the other
ranks drop theirs. So rank 0's peak should be about the model plus one unit, and every
other rank's about one unit. Measured with ``torch.distributed._tools.mem_tracker.MemTracker``
(live tensor bytes seen inside the measured block; the tracker also counts the shards the
block reads, so the table shows the peak beyond them as well).

    python benchmarks/state_dict_memory.py --world 2 --d-model 512 --layers 8
"""

from __future__ import annotations

import argparse
import json

import torch

from shardfn.testing import Cluster


def measure(d_model: int, layers: int, strategy: str) -> dict:
    import shardfn as sf
    from shardfn.testing.models import GPT, GPTConfig
    from torch.distributed._tools.mem_tracker import MemTracker

    mesh = sf.Mesh.from_group()
    cfg = GPTConfig(vocab_size=256, seq_len=128, d_model=d_model, n_layers=layers, n_heads=8)
    with torch.device("meta"):
        model = GPT(cfg)
    params, _ = sf.functionalize(model)
    sharded = sf.shard(params, mesh, strategy, seed=0)
    tracker = MemTracker()
    with tracker:
        full = sf.gather(sharded, rank0_only=True, device="cpu")
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    layout = sharded.layout
    return {
        "rank": mesh.rank,
        "peak_bytes": peak,
        "model_bytes": layout.full_bytes(),
        "shard_bytes": layout.shard_bytes(),
        "largest_unit_bytes": max(u.numel * layout.world * u.dtype.itemsize for u in layout.units),
        "state_dict_entries": len(full),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--strategy", default="FULL_SHARD")
    p.add_argument("--out", default="benchmarks/results/state_dict_memory.json")
    args = p.parse_args()
    with Cluster(args.world) as cluster:
        results = cluster.run(measure, args.d_model, args.layers, args.strategy)
    mib = 2**20
    print(f"full state dict, {args.strategy}, world {args.world}, model {results[0]['model_bytes'] / mib:.1f} MiB, "
          f"largest unit (gathered) {results[0]['largest_unit_bytes'] / mib:.1f} MiB")
    for r in results:
        extra = r["peak_bytes"] - r["shard_bytes"]
        print(f"  rank {r['rank']}: peak {r['peak_bytes'] / mib:8.1f} MiB = {r['peak_bytes'] / r['model_bytes']:.2f} x model; "
              f"beyond its shards {extra / mib:7.1f} MiB = {extra / r['model_bytes']:.2f} x model "
              f"({extra / r['largest_unit_bytes']:.1f} x the largest unit); {r['state_dict_entries']} entries returned")
    import os

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
