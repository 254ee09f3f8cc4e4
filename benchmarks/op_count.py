"""Ops per training step: plain PyTorch, shardfn NO_SHARD and FULL_SHARD, on CPU.

Counts what one steady-state step dispatches that would launch a kernel on a GPU
(``shardfn.testing.count_ops``; [Note: counting launches on a CPU]): per step, per unit
(shardfn's ops beyond plain's, over the units) and the collectives, for two GPTs (the
small-unit GPT: d_model 64, 24 layers, seq 16, batch 1 per rank, vocab 64, 25 units; the
benchmark GPT of ``step_time.py``: d_model 512, 8 layers, 4 heads, seq 128, batch 4, vocab
256, 9 units), fp32 and bf16 (plain: ``torch.autocast``; shardfn:
``Precision(param=bfloat16, reduce=float32)``), world 1 and 2. Plain PyTorch runs
``torch.optim.AdamW(foreach=True)`` (CUDA's default) in one process on a rank's batch;
shardfn runs ``shardfn.optim.adamw``. The counts are exact (no timing): one run suffices.

At world 2 the collectives run on gloo, whose reduce-scatter shardfn builds from
point-to-point exchanges and adds ([Note: the order of the sum]): those adds are counted
among the ops here; on NCCL the reduce-scatter is one collective and they do not exist.

Run::

    python benchmarks/op_count.py            # the table; --json PATH writes it too
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch

import shardfn as sf
from shardfn.testing import Cluster, count_ops
from shardfn.testing.models import GPT, GPTConfig, lm_loss

MODELS = {
    "small": (GPTConfig(vocab_size=64, seq_len=16, d_model=64, n_layers=24, n_heads=2), 1),
    "benchmark": (GPTConfig(vocab_size=256, seq_len=128, d_model=512, n_layers=8, n_heads=4), 4),
}


def _batch(cfg: GPTConfig, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g) for _ in range(2))


def plain_ops(model_name: str, dtype: str) -> dict:
    """One plain PyTorch step's counts (after two steps: the optimizer's state exists)."""
    torch.set_num_threads(1)
    cfg, rows = MODELS[model_name]
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    x, y = _batch(cfg, rows)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    step()
    with count_ops() as c:
        step()
    steps = [s["step"] for s in opt.state.values()]  # host tensors (capturable=False)
    return {"ops": c.total, "collectives": 0, "syncs": len(c.device_reads(steps)), "by_op": dict(c.ops)}


def shardfn_ops(model_name: str, dtype: str, strategy: str, on_nonfinite: str | None = None) -> dict:
    """One shardfn step's counts on this rank (after two steps)."""
    cfg, rows = MODELS[model_name]
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(cfg))
    precision = sf.Precision(param=torch.bfloat16, reduce=torch.float32) if dtype == "bf16" else None
    sharded = sf.shard(params, mesh, strategy, precision=precision)
    opt = sf.optim.adamw(1e-3, weight_decay=0.1)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b[0]), b[1]), mesh, optimizer=opt,
                       on_nonfinite=on_nonfinite)
    batch = _batch(cfg, rows)
    for _ in range(2):
        sharded, state, _ = step(sharded, state, batch)
    late = [sharded._verdict.values] if sharded._verdict is not None else []
    with count_ops() as c:
        sharded, state, _ = step(sharded, state, batch)
    return {"ops": c.total, "collectives": sum(c.collectives.values()),
            "syncs": len(c.device_reads([state.count, *late], mesh.size)), "by_op": dict(c.ops),
            "units": len(sharded.layout.units), "leaves": len(sharded.layout.leaves)}


def measure() -> list[dict]:
    rows = []
    for world in (1, 2):
        with Cluster(world, timeout=300.0) as cluster:
            for model_name in MODELS:
                for dtype in ("fp32", "bf16"):
                    plain = plain_ops(model_name, dtype)
                    rows.append({"world": world, "model": model_name, "dtype": dtype, "config": "plain", **plain})
                    for strategy, on_nonfinite in (("NO_SHARD", None), ("FULL_SHARD", None),
                                                   ("FULL_SHARD", "raise_next")):
                        r = cluster.run(shardfn_ops, model_name, dtype, strategy, on_nonfinite)[0]
                        extra = collections.Counter(r["by_op"])
                        extra.subtract(plain["by_op"])
                        config = strategy + (" next" if on_nonfinite else "")
                        rows.append({"world": world, "model": model_name, "dtype": dtype, "config": config, **r,
                                     "x_plain": r["ops"] / plain["ops"],
                                     "per_unit": (r["ops"] - plain["ops"]) / r["units"],
                                     "extra": {k: v for k, v in extra.most_common() if v}})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'world':>5}  {'model':<10}{'dtype':<6}{'config':<17}{'ops/step':>9}{'x plain':>8}{'units':>6}"
            f"{'extra/unit':>11}{'collectives':>12}{'syncs':>6}  largest differences from plain")
    lines = [head, "-" * len(head)]
    for r in rows:
        extra = ", ".join(f"{k} {v:+d}" for k, v in list(r.get("extra", {}).items())[:5])
        lines.append(f"{r['world']:>5}  {r['model']:<10}{r['dtype']:<6}{r['config']:<17}{r['ops']:>9}"
                     f"{r.get('x_plain', 1.0):>8.2f}{r.get('units', '-'):>6}{r.get('per_unit', 0.0):>11.1f}"
                     f"{r['collectives']:>12}{r['syncs']:>6}  {extra}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = measure()
    print(f"torch {torch.__version__}; shardfn {sf.__version__}")
    print(table(rows))
    print("\nops/step: aten ops of one step that launch a kernel on a GPU (rank 0); x plain: over plain PyTorch's "
          "on the same per-rank batch; extra/unit: (ops - plain's) / units; collectives: c10d ops of the step "
          "(world 2, gloo); syncs: reads of device tensors by the host (.item(), .tolist() and the like; each a "
          "synchronisation on a GPU); 'next': jit_step(on_nonfinite=\"raise_next\"). plain: torch.optim.AdamW(foreach=True); bf16 plain runs "
          "under torch.autocast, shardfn with Precision(param=bfloat16, reduce=float32).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": [{k: v for k, v in r.items() if k != "by_op"} for r in rows]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
