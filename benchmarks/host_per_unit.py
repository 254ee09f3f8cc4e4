"""Host time per unit: what shardfn's eager step adds to plain PyTorch's, unit by unit.

At world 1 a FULL_SHARD step does the model's compute plus shardfn's own host work (hooks,
views, reductions, checks); plain eager PyTorch does only the compute. On the small-unit
GPT of ``step_time.py --preset small`` (d_model 64, 24 layers, seq 16, batch 1) the compute
is small, so the difference is nearly all host work, and divided by the 24 block units it is
the host time per unit that a latency-bound GPU step pays.

Each repeat is a fresh process that builds both steps on the same model and batches, runs
3 warm-up steps of each, then times ``--steps`` steps of each in turn (shardfn, plain,
shardfn, ...); it reports the medians. Over the repeats: the median and the min-max of the
ratio and of the host time per unit. The shardfn measured is the one on ``PYTHONPATH``
(``step_time.py`` is taken from the same checkout), so two trees compare with the same
command::

    PYTHONPATH=$PWD python benchmarks/host_per_unit.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYERS = 24  # the small preset's blocks: one unit each (the root unit is gathered once, up front)


def one_run(steps: int, port: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import shardfn

    sys.path.insert(0, str(Path(shardfn.__file__).resolve().parent.parent / "benchmarks"))
    import step_time as st
    from shardfn.testing.models import GPT, GPTConfig

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        dims = st.PRESETS["small"]["dims"]
        cfg = GPTConfig(vocab_size=dims["vocab"], seq_len=dims["seq"], d_model=dims["d_model"],
                        n_layers=dims["layers"], n_heads=dims["heads"])
        torch.manual_seed(0)
        model = GPT(cfg)
        plain_model = GPT(cfg)
        plain_model.load_state_dict(model.state_dict())
        sf_step, _ = st.build_shardfn_step(st.SPECS["shardfn_w1"], model, 1e-3)
        plain_step, _ = st.build_torch_step(st.SPECS["single"], plain_model, 1e-3)
        tokens = st.make_batches(steps + 3, dims["batch"], dims["seq"], dims["vocab"], seed=0)
        times: dict[str, list[float]] = {"shardfn": [], "plain": []}
        for i, (x, y) in enumerate((t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens):
            for name, step in (("shardfn", sf_step), ("plain", plain_step)):
                t0 = time.perf_counter()
                float(step(x, y))  # (the loss read on the host: the step is done)
                if i >= 3:
                    times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        return {"shardfn_ms": med["shardfn"], "plain_ms": med["plain"], "ratio": med["shardfn"] / med["plain"],
                "host_ms_per_unit": (med["shardfn"] - med["plain"]) / LAYERS}
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes")
    p.add_argument("--steps", type=int, default=80, help="timed steps of each, interleaved")
    p.add_argument("--port", type=int, default=29561)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run, JSON out
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_run(args.steps, args.port)))
        return
    runs = []
    for r in range(args.repeats):
        out = subprocess.run([sys.executable, __file__, "--one", "--steps", str(args.steps), "--port",
                              str(args.port + r)], capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"repeat {r + 1}/{args.repeats}: shardfn {runs[-1]['shardfn_ms']:.2f} ms, plain "
              f"{runs[-1]['plain_ms']:.2f} ms, ratio {runs[-1]['ratio']:.3f}, host per unit "
              f"{runs[-1]['host_ms_per_unit']:.3f} ms", flush=True)
    for key in ("shardfn_ms", "plain_ms", "ratio", "host_ms_per_unit"):
        values = [run[key] for run in runs]
        print(f"{key}: median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})")


if __name__ == "__main__":
    main()
