"""A Lightning Trainer step under shardfn.lightning.TrainerStrategy, against the same model
under shardfn's own ``jit_step`` and, with ``--fsdp2``, under Lightning's own FSDP2 path
(``ModelParallelStrategy``, the module's ``configure_model`` calling torch's ``fully_shard`` on
each layer and the root: FULL_SHARD), world 2 on the CPU (gloo). ``--fsdp`` adds Lightning's
``FSDPStrategy`` (torch FSDP1): Lightning refuses it with ``accelerator="cpu"`` ("requires a
GPU accelerator"), and torch's FSDP1 itself refuses a CPU-only machine ("FSDP needs a non-CPU
accelerator device"), so that ratio needs a GPU.

The model is Lightning's FSDP example (``lightning.pytorch.demos.Transformer``) in a
LightningModule, SGD with momentum, FULL_SHARD with each encoder and decoder layer a unit
(``auto_wrap_policy``). A step's time is taken from ``on_train_batch_start`` to
``on_train_batch_end`` (training_step, backward, the optimizer; not the data loader); for
``jit_step`` the call. Two methods, as docs/benchmarks.md asks of a ratio:

* interleaved (default): each repeat is one fresh pair of processes that runs them in
  turn, ``--rounds`` rounds of ``--steps`` steps each (after a warm-up round), and takes each
  one's median step; the ratios are of those medians;
* ``--separate``: each configuration in its own fresh pair of processes, one after another.

Over the repeats: the median and the min-max of each ratio::

    PYTHONPATH=$PWD python benchmarks/lightning_step.py --repeats 4 --fsdp2
    PYTHONPATH=$PWD python benchmarks/lightning_step.py --repeats 4 --fsdp2 --separate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NAMES = ["trainer", "jit_step"]


def _module():
    import lightning.pytorch as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.demos import Transformer

    class LanguageModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Transformer(vocab_size=1024, ninp=256, nhead=4, nhid=512, nlayers=2, dropout=0.0)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.nll_loss(self.model(x, y), y.view(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return LanguageModel


def _data(n):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 1024, (n * 2 * 8, 64), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=8)


def _trainer_times(name: str, steps: int) -> list[float]:
    import lightning.pytorch as L
    import torch
    import torch.nn as nn
    from lightning.pytorch.strategies import FSDPStrategy

    from shardfn.lightning import TrainerStrategy

    layers = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a):
            times.append(time.perf_counter() - self.t)

    module = _module()
    if name == "trainer":
        strategy = TrainerStrategy(auto_wrap_policy=layers)
    elif name == "fsdp":
        strategy = FSDPStrategy(auto_wrap_policy=layers)
    else:  # Lightning's FSDP2 path: ModelParallelStrategy, the module's configure_model calls fully_shard
        from lightning.pytorch.strategies import ModelParallelStrategy
        from torch.distributed.fsdp import fully_shard

        class Sharded(module):
            def configure_model(self):
                mesh = self.device_mesh["data_parallel"]
                for m in self.model.modules():
                    if isinstance(m, tuple(layers)):
                        fully_shard(m, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        module, strategy = Sharded, ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()])
    trainer.fit(module(), _data(steps))
    return times


def _jit_times(steps: int) -> list[float]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import shardfn as sf

    torch.manual_seed(0)
    module = _module()()
    params, _ = sf.functionalize(module.model)
    mesh = sf.Mesh.from_group()
    plan = sf.Plan("FULL_SHARD", units=sf.by_module_type(nn.TransformerEncoderLayer, nn.TransformerDecoderLayer))
    sharded = sf.shard(params, mesh, plan)
    opt = sf.optim.sgd(0.1, momentum=0.9)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: F.nll_loss(apply(p, b[0], b[1]), b[1].view(-1)), mesh, optimizer=opt)
    times = []
    for _, (x, y) in zip(range(steps), _data(steps)):  # (8 rows a rank, as the Trainer's)
        t = time.perf_counter()
        sharded, state, _ = step(sharded, state, (x, y))
        times.append(time.perf_counter() - t)
    return times


def worker(names: list[str], steps: int, rounds: int) -> None:
    """In each of the world's processes: the configurations ``names`` in turn, a warm-up
    round then ``rounds`` rounds; rank 0 prints each one's median step as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    got: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in names:
            times = _jit_times(steps) if n == "jit_step" else _trainer_times(n, steps)
            if r:  # (round 0 warms up)
                got[n] += times[2:]
    if dist.get_rank() == 0:
        print(json.dumps({n: statistics.median(t) for n, t in got.items()}), flush=True)
    dist.destroy_process_group()


def _pair(names: list[str], steps: int, rounds: int, port: int) -> dict[str, float]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import lightning_step as b; b.worker({names!r}, {steps}, {rounds})")
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode)
        raise RuntimeError(f"a benchmark process failed: {[p.returncode for p in procs]}; rank {bad}:\n"
                           f"{outs[bad][1][-3000:]}")
    outs = [o for o, _ in outs]
    return json.loads([line for line in outs[0].splitlines() if line.startswith("{")][-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--separate", action="store_true", help="each configuration in its own fresh processes")
    p.add_argument("--fsdp", action="store_true", help="Lightning's FSDPStrategy too (it needs a GPU)")
    p.add_argument("--fsdp2", action="store_true",
                   help="Lightning's ModelParallelStrategy with torch's fully_shard (FSDP2) too; it runs on the CPU")
    args = p.parse_args()
    NAMES.extend(n for n, on in (("fsdp", args.fsdp), ("fsdp2", args.fsdp2)) if on)
    ratios: dict[str, list[float]] = {f"trainer / {n}": [] for n in NAMES[1:]}
    from shardfn.testing._cluster import free_port

    for r in range(args.repeats):
        if args.separate:
            med = {}
            for n in NAMES:
                med.update(_pair([n], args.steps, args.rounds, free_port()))
        else:
            med = _pair(list(NAMES), args.steps, args.rounds, free_port())
        print(f"repeat {r}: median step " + ", ".join(f"{n} {med[n] * 1e3:.1f} ms" for n in NAMES), flush=True)
        for k in ratios:
            ratios[k].append(med["trainer"] / med[k.split(" / ")[1]])
    how = "separate processes" if args.separate else "interleaved in the same processes"
    for k, v in ratios.items():
        print(f"{k} ({how}): median {statistics.median(v):.3f}, min {min(v):.3f}, max {max(v):.3f} "
              f"over {len(v)} repeats")


if __name__ == "__main__":
    main()
