"""Muon on shards: whole matrices on one rank each, against gathering every matrix everywhere
and against one process.

Three ways to train the same model (seed 0) with Muon on its hidden matrices and AdamW on
the rest, on the same global batches. ``--model mlp``: ``--layers`` square matrices of
``--width`` and their biases, one matrix per unit (the worst case for whole placement: a
unit's all-gather is as wide as its largest rank's share, here the whole matrix on every
rank's row); ``--model gpt``: the test GPT (d_model ``--width``, ``--layers`` blocks, seq 64,
vocab 256), Muon on the blocks' four matrices, AdamW on embeddings, norms, biases and head:

* ``whole``: shardfn FULL_SHARD with ``placement=shardfn.whole(matrices)`` and
  ``sf.optim.muon`` (what shardfn ships): each matrix lives whole on one rank, so its
  Newton-Schulz runs once in the world, on that rank, with no communication of its own;
* ``gather_all``: shardfn FULL_SHARD with ``placement="rows"`` and a Muon written here that
  all-gathers each matrix's momentum update onto every rank (one all-gather per matrix,
  recorded like the step's own collectives), runs Newton-Schulz on every rank, and keeps its
  own rows: every rank does all of the world's Newton-Schulz work;
* ``torch``: ``torch.optim.Muon`` + ``torch.optim.AdamW`` in one process on the global batch.

All three compute Newton-Schulz in ``--ns-dtype`` (torch's is bfloat16). Per configuration,
each repeat in fresh processes (one torch thread per rank), after 2 warm-up steps, the median
over ``--steps`` steps of: the step's wall time (rank 0) and CPU time (mean over ranks), the
time in Newton-Schulz (the largest rank's, and the mean over ranks), and the bytes the step's
collectives move per rank (``record_collectives``: the all-gathers' outputs, the
reduce-scatters' inputs). The ``whole`` and ``gather_all`` pair is also run interleaved: both
in the same fresh processes, a step of each in turn. At world sizes above the core count
(2 here) the ranks are time-sliced and the CPU time per rank is the figure to read.

Run::

    python benchmarks/muon_step.py --world 2
    python benchmarks/muon_step.py --world 4
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfn as sf
from shardfn._comm import collectives as C
from shardfn._comm.events import Purpose
from shardfn.optim import _muon
from shardfn.optim._whole import full_shape
from shardfn.testing import Cluster, split_batch
from shardfn.testing.models import GPT, MLP, GPTConfig, lm_loss

LR, ADAMW_LR, MOMENTUM = 0.02, 1e-3, 0.95
_NS = _muon.newton_schulz  # shardfn's Newton-Schulz (torch.optim.Muon's, op for op)


def matrices(name, shape) -> bool:
    """The matrices Muon takes: the hidden ones (the MLP's layers, the GPT's blocks; not the
    GPT's embeddings and head)."""
    return len(shape) == 2 and name.startswith(("layers.", "blocks."))


class Timer:
    """Seconds spent in a wrapped function since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def gather_all_muon(ns_dtype: torch.dtype, mesh: sf.Mesh, timer: Timer) -> sf.optim.GradientTransformation:
    """Muon on row shards by gathering: each matrix's update all-gathered onto every rank,
    orthogonalised there, this rank's rows kept (weight decay 0.1 and the step as torch's)."""

    def init(params):
        return {k: torch.zeros_like(v) for k, v in params.items() if v.requires_grad}

    def update(grads, state, params):
        group, rank, world = mesh.channel("shard"), mesh.rank, mesh.size
        updates, new = {}, {}
        for k, g in grads.items():
            buf = state[k].lerp(g, 1 - MOMENTUM)
            local = g.lerp(buf, MOMENTUM)  # Nesterov, this rank's rows
            rows, cols = full_shape(params, k)
            out = torch.empty(world * local.shape[0], cols, dtype=local.dtype)
            C.all_gather(out.view(-1), local.contiguous().view(-1), group, Purpose.PSUM, k)
            ortho = timer.wrap(_NS)(out[:rows], _COEF, 5, 1e-7, ns_dtype)
            chunk = local.shape[0]
            mine = torch.zeros_like(local)
            piece = ortho[rank * chunk:min(rows, (rank + 1) * chunk)]
            mine[: piece.shape[0]] = piece.to(mine.dtype)
            lr = LR * math.sqrt(max(1, rows / cols))
            updates[k] = -LR * 0.1 * params[k] - lr * mine
            new[k] = buf
        return updates, new

    return sf.optim.GradientTransformation(init, update, None)


_COEF = (3.4445, -4.775, 2.0315)


def _optimizer(config: str, ns_dtype: torch.dtype, mesh: sf.Mesh, timer: Timer):
    muon = (gather_all_muon(ns_dtype, mesh, timer) if config == "gather_all"
            else sf.optim.muon(LR, ns_dtype=ns_dtype))
    return sf.optim.partition({"muon": muon, "adamw": sf.optim.adamw(ADAMW_LR, weight_decay=0.01)},
                              lambda name, shape: "muon" if matrices(name, shape) else "adamw")


def _batches(opts: dict, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    rows = opts["batch"] * opts["world"]
    if opts["model"] == "gpt":
        return [{k: torch.randint(0, GPT_VOCAB, (rows, GPT_SEQ), generator=g) for k in ("x", "y")} for _ in range(n)]
    return [{"x": torch.randn(rows, opts["width"], generator=g), "y": torch.randn(rows, opts["width"], generator=g)}
            for _ in range(n)]


GPT_VOCAB, GPT_SEQ = 256, 64


def _model(opts: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if opts["model"] == "gpt":
        return GPT(GPTConfig(vocab_size=GPT_VOCAB, seq_len=GPT_SEQ, d_model=opts["width"], n_layers=opts["layers"],
                             n_heads=4))
    return MLP([opts["width"]] * (opts["layers"] + 1))


def _loss(opts: dict, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return lm_loss(out, y) if opts["model"] == "gpt" else F.mse_loss(out, y)


def _shardfn_step(config: str, opts: dict):
    """A step function of one shardfn configuration on this rank, and its timer."""
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(_model(opts))
    placement = sf.whole(matrices) if config == "whole" else "rows"
    sharded = sf.shard(params, mesh, "FULL_SHARD", placement=placement)
    timer = Timer()
    opt = _optimizer(config, opts["ns_dtype"], mesh, timer)
    state = opt.init(sharded)
    jstep = sf.jit_step(lambda apply, p, b: _loss(opts, apply(p, b["x"]), b["y"]), mesh, optimizer=opt)
    tree = [sharded, state]

    def step(batch):
        local = split_batch(batch, mesh.rank, mesh.size)
        timed = timer.wrap(_NS) if config == "whole" else _NS  # gather_all times its own calls
        with mock.patch.object(_muon, "newton_schulz", timed):
            tree[0], tree[1], m = jstep(tree[0], tree[1], local)
        return m

    return step, timer


def _measure_one(step, timer: Timer, batch: dict) -> dict:
    """One step: wall (after a barrier), CPU time, Newton-Schulz time, bytes."""
    if dist.is_initialized():
        dist.barrier()
    timer.seconds = 0.0
    w0, c0 = time.perf_counter(), time.process_time()
    with sf.record_collectives() as log:
        step(batch)
    if dist.is_initialized():
        dist.barrier()
    return {"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "ns": timer.seconds,
            "bytes": sum(log.bytes().values())}


def run_shardfn(configs: list[str], opts: dict) -> dict:
    """The configurations in this set of processes, a step of each in turn."""
    torch.set_num_threads(1)
    steps = {c: _shardfn_step(c, opts) for c in configs}
    batches = _batches(opts, opts["steps"] + 2)
    out = {c: [] for c in configs}
    for i, batch in enumerate(batches):
        order = configs if i % 2 == 0 else configs[::-1]
        for c in order:
            r = _measure_one(*steps[c], batch)
            if i >= 2:
                out[c].append(r)
    return out


def run_torch(opts: dict) -> dict:
    """torch.optim.Muon + AdamW in one process on the global batches."""
    torch.set_num_threads(1)
    net = _model(opts)
    mats = [p for n, p in net.named_parameters() if matrices(n, p.shape)]
    rest = [p for n, p in net.named_parameters() if not matrices(n, p.shape)]
    muon = torch.optim.Muon(mats, lr=LR)
    adamw = torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.01, foreach=True)
    timer = Timer()
    original = torch.optim._muon._zeropower_via_newtonschulz
    ns_dtype = opts["ns_dtype"]

    def ns(grad, coefficients, steps, eps):  # torch's bfloat16, or ours in another dtype
        if ns_dtype == torch.bfloat16:
            return original(grad, coefficients, steps, eps)
        return _NS(grad, coefficients, steps, eps, ns_dtype)

    def step(batch):
        _loss(opts, net(batch["x"]), batch["y"]).backward()
        muon.step()
        adamw.step()
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)

    out = []
    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", timer.wrap(ns)):
        for i, batch in enumerate(_batches(opts, opts["steps"] + 2)):
            r = _measure_one(step, timer, batch)
            if i >= 2:
                out.append(r)
    return {"torch": out}


def _medians(rank_runs: list[list[dict]]) -> dict:
    """Medians over steps: wall of rank 0, CPU mean over ranks, NS largest and mean over ranks, bytes of rank 0."""
    def med(rank, key):
        return statistics.median(r[key] for r in rank_runs[rank])

    n = len(rank_runs)
    ns = [med(r, "ns") for r in range(n)]
    return {"wall_ms": 1e3 * med(0, "wall"), "cpu_ms": 1e3 * sum(med(r, "cpu") for r in range(n)) / n,
            "ns_max_ms": 1e3 * max(ns), "ns_mean_ms": 1e3 * sum(ns) / n, "mib": med(0, "bytes") / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", choices=("mlp", "gpt"), default="gpt")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="rows (mlp) or sequences (gpt) per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ns-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--out", help="JSON of every measurement")
    args = p.parse_args()
    opts = {**vars(args), "ns_dtype": getattr(torch, args.ns_dtype)}
    separate = {"whole": [], "gather_all": [], "torch": []}
    together = []
    for _ in range(args.repeats):
        for config in ("whole", "gather_all"):
            with Cluster(args.world, timeout=900.0) as cluster:
                separate[config].append(_medians([r[config] for r in cluster.run(run_shardfn, [config], opts)]))
        with Cluster(1, timeout=900.0) as cluster:
            separate["torch"].append(_medians([cluster.run(run_torch, opts)[0]["torch"]]))
        with Cluster(args.world, timeout=900.0) as cluster:
            runs = cluster.run(run_shardfn, ["whole", "gather_all"], opts)
            together.append({c: _medians([r[c] for r in runs]) for c in ("whole", "gather_all")})
    time_key = "cpu_ms" if args.world > 2 else "wall_ms"
    what = (f"GPT d_model {args.width}, {args.layers} blocks, seq {GPT_SEQ}" if args.model == "gpt"
            else f"MLP {args.layers} x [{args.width}, {args.width}]")
    print(f"torch {torch.__version__}; world {args.world}; {what}; {args.batch} rows per rank; Newton-Schulz in {args.ns_dtype}; {args.repeats} repeats x {args.steps} steps "
          f"(medians; min-max over repeats)")
    head = f"{'config':<11}{'wall ms':>20}{'cpu ms/rank':>20}{'NS ms max rank':>18}{'NS ms mean':>12}{'MiB/step':>10}"
    print(head + "\n" + "-" * len(head))

    def cell(runs, key, spec=".1f"):
        v = [r[key] for r in runs]
        return f"{statistics.median(v):{spec}} ({min(v):.0f}-{max(v):.0f})"

    for c, runs in separate.items():
        print(f"{c:<11}{cell(runs, 'wall_ms'):>20}{cell(runs, 'cpu_ms'):>20}{cell(runs, 'ns_max_ms'):>18}"
              f"{statistics.median(r['ns_mean_ms'] for r in runs):>12.1f}{statistics.median(r['mib'] for r in runs):>10.2f}")
    ratio_sep = [w[time_key] / g[time_key] for w, g in zip(separate["whole"], separate["gather_all"])]
    ratio_int = [t["whole"][time_key] / t["gather_all"][time_key] for t in together]
    ratio_torch = [w[time_key] / t[time_key] for w, t in zip(separate["whole"], separate["torch"])]
    ns_int = [t["whole"]["ns_max_ms"] / t["gather_all"]["ns_max_ms"] for t in together]
    fmt = lambda v: f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f})"  # noqa: E731
    print(f"\nwhole / gather_all ({time_key}): interleaved {fmt(ratio_int)}, separate {fmt(ratio_sep)}; "
          f"Newton-Schulz time of the largest rank, interleaved {fmt(ns_int)}")
    print(f"whole / torch one process ({time_key}; torch trains the global batch alone): {fmt(ratio_torch)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"torch": torch.__version__, "opts": {k: str(v) for k, v in opts.items()},
                                              "separate": separate, "interleaved": together}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
