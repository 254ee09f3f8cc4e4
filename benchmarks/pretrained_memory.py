"""Peak memory per rank of loading safetensors into shards, and of exporting them back.

``shard(params, mesh, "FULL_SHARD", weights=file)`` on a meta-device model: each rank reads
only its rows, so its peak should be its shards plus about one parameter's rows in flight.
``save_pretrained(sharded, dir)``: rank 0 should hold its shards plus about one gathered
unit, the others about one unit. Measured as live tensor bytes (``shardfn.track_live_bytes``,
the shards included) and, beside it, the growth of the process's peak resident set over the
block (which also counts the file pages the rank touched and allocator slack).

    python benchmarks/pretrained_memory.py --world 2 --d-model 512 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import torch

from shardfn.testing import Cluster


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(path: str, out_dir: str, d_model: int, layers: int) -> dict:
    import gc

    import shardfn as sf
    from shardfn.testing.models import GPT, GPTConfig

    mesh = sf.Mesh.from_group()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=128, d_model=d_model, n_layers=layers, n_heads=8))
    params, _ = sf.functionalize(model)
    gc.collect()
    rss0 = _rss()
    with sf.track_live_bytes() as live:
        sharded = sf.shard(params, mesh, "FULL_SHARD", weights=path)
    load_peak, load_rss = live.peak, _rss() - rss0
    gc.collect()
    rss0 = _rss()
    with sf.track_live_bytes() as live:
        live.add(sharded)
        sf.save_pretrained(sharded, out_dir)
    layout = sharded.layout
    return {
        "rank": mesh.rank,
        "load_peak_bytes": load_peak,
        "load_rss_growth_bytes": load_rss,
        "export_peak_bytes": live.peak,
        "export_rss_growth_bytes": _rss() - rss0,
        "model_bytes": layout.full_bytes(),
        "shard_bytes": layout.shard_bytes() + layout.buffer_bytes(),
        "largest_unit_bytes": max(u.numel * layout.world * u.dtype.itemsize for u in layout.units),
        "largest_param_bytes": max((leaf.numel if leaf.flat else leaf.shard_numel * layout.world) * leaf.dtype.itemsize
                                   for leaf in layout.leaves.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/pretrained_memory.json")
    args = p.parse_args()
    from safetensors.torch import save_model

    from shardfn.testing.models import GPT, GPTConfig

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        weights = os.path.join(tmp, "gpt.safetensors")
        save_model(GPT(GPTConfig(vocab_size=256, seq_len=128, d_model=args.d_model, n_layers=args.layers,
                                 n_heads=8)), weights)
        with Cluster(args.world) as cluster:
            results = cluster.run(measure, weights, os.path.join(tmp, "export"), args.d_model, args.layers)
    mib, r0 = 2**20, results[0]
    print(f"FULL_SHARD, world {args.world}: model {r0['model_bytes'] / mib:.1f} MiB, shards {r0['shard_bytes'] / mib:.1f} "
          f"MiB per rank, largest unit {r0['largest_unit_bytes'] / mib:.1f} MiB, largest parameter "
          f"{r0['largest_param_bytes'] / mib:.1f} MiB")
    for r in results:
        for what in ("load", "export"):
            peak, beyond = r[f"{what}_peak_bytes"], r[f"{what}_peak_bytes"] - r["shard_bytes"]
            print(f"  rank {r['rank']} {what:6}: peak {peak / mib:7.1f} MiB = {peak / r['model_bytes']:.2f} x model; "
                  f"beyond its shards {beyond / mib:6.1f} MiB = {beyond / r['largest_unit_bytes']:.2f} x the largest "
                  f"unit; peak RSS grew {r[f'{what}_rss_growth_bytes'] / mib:6.1f} MiB")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
