"""HYBRID_SHARD and HYBRID_SHARD_ZERO2 on 2-D meshes, and a real two-node torchrun launch."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardfn as sf
from shardfn.testing import check_equivalence, free_port, split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss
from test_counts import padded_bytes
from test_equivalence import MODELS, OPTIMIZERS

HYBRID = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mesh", [(2, 2), (1, 4), (4, 1)], ids=["2x2", "1x4", "4x1"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_hybrid_matches_single_process(clusters, model_name, opt_name, mesh):
    model_fn, loss_fn, batches = MODELS[model_name]
    report = check_equivalence(
        model_fn, loss_fn, batches(), optimizer=OPTIMIZERS[opt_name], strategies=HYBRID, world_sizes=[mesh],
        clusters=clusters, rtol=1e-5, atol=1e-6,
    )
    assert set(report.leaves) == {(s, mesh) for s in HYBRID}


CFG = GPTConfig(vocab_size=31, seq_len=8, d_model=16, n_layers=3, n_heads=2)


def hybrid_counts(strategy, replicate):
    mesh = sf.Mesh.from_group(replicate=replicate)
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    numel = {n: p.numel() for n, p in params.items()}
    rows = {n: (p.shape[0] if p.dim() else 1) for n, p in params.items()}
    sharded = sf.shard(params, mesh, strategy)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=opt)
    g = torch.Generator().manual_seed(0)
    batch = split_batch({k: torch.randint(0, 31, (8, 8), generator=g) for k in ("x", "y")}, mesh.rank, mesh.size)
    sharded, state, _ = step(sharded, state, batch)
    with sf.record_collectives() as log:
        step(sharded, state, batch)
    shard_ranks = tuple(torch.distributed.get_process_group_ranks(mesh.group("shard")))
    rep_ranks = tuple(torch.distributed.get_process_group_ranks(mesh.group("replicate")))
    per_group = {}
    for c in log.calls:
        name = {shard_ranks: "shard", rep_ranks: "replicate"}[c.group]
        count, nbytes = per_group.get((name, c.kind), (0, 0))
        per_group[(name, c.kind)] = (count + 1, nbytes + c.nbytes)
    S = mesh.axis_size("shard")
    blocks = [padded_bytes([n for n in numel if n.startswith(f"blocks.{i}.")], numel, rows, S) for i in range(3)]
    root = padded_bytes([n for n in numel if not n.startswith("blocks.")], numel, rows, S)
    persistent = sum(t.numel() * t.element_size() for t in sharded.values())
    return per_group, blocks, root, persistent, shard_ranks, rep_ranks


@pytest.mark.parametrize("strategy", HYBRID)
def test_hybrid_collectives_per_process_group(clusters, strategy):
    for rank, (per_group, blocks, root, persistent, shard_ranks, rep_ranks) in enumerate(
        clusters[4].run(hybrid_counts, strategy, 2)
    ):
        assert shard_ranks == (rank // 2 * 2, rank // 2 * 2 + 1) and rep_ranks == (rank % 2, rank % 2 + 2)
        gathers = 2 * 3 + 1 if strategy == "HYBRID_SHARD" else 4
        gather_bytes = (2 if strategy == "HYBRID_SHARD" else 1) * sum(blocks) + root
        assert per_group == {
            # over "shard" (2 ranks): FULL_SHARD's (or SHARD_GRAD_OP's) gathers and reduce-scatters
            ("shard", "all_gather"): (gathers, gather_bytes),
            ("shard", "reduce_scatter"): (4, sum(blocks) + root),
            # over "replicate" (2 ranks): each unit's shard-sized gradient (half the unit)
            ("replicate", "all_reduce"): (4 + 1, (sum(blocks) + root) // 2 + 8),
            # the metrics (loss, gradient sum of squares): two floats per axis
            ("shard", "all_reduce"): (1, 8),
        }
        assert persistent == (sum(blocks) + root) // 2  # 1/|shard| of the padded total


def test_degenerate_axes_issue_only_what_they_need(clusters):
    per_group = clusters[4].run(hybrid_counts, "HYBRID_SHARD", 4)[0][0]  # 4x1: replicas only, as NO_SHARD:
    # every unit's gradient in one bucket's all-reduce ([Note: buckets]), and the metrics'
    assert set(per_group) == {("replicate", "all_reduce")} and per_group[("replicate", "all_reduce")][0] == 1 + 1
    per_group = clusters[4].run(hybrid_counts, "HYBRID_SHARD", 1)[0][0]  # 1x4: shards only
    # as FULL_SHARD: the root, then the blocks' bucket in forward and backward ([Note: buckets])
    assert ("replicate", "all_reduce") not in per_group and per_group[("shard", "all_gather")][0] == 3


def _train_lm_args(steps, run_dir):
    return [str(ROOT / "examples" / "train_lm.py"), "--steps", str(steps), "--d-model", "32", "--layers", "2",
            "--log-every", str(steps), "--report-all-ranks", "--progress", "plain", "--sample-tokens", "0",
            "--run-dir", str(run_dir)]


@pytest.mark.slow
def test_two_node_torchrun_launch_hybrid_matches_single_process(tmp_path):
    """Two torchrun launchers on loopback act as two nodes of 2 processes each."""
    steps, port = 4, free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"shardfn-{port}",
              "--max-restarts", "0"]
    args = _train_lm_args(steps, tmp_path / "nodes") + ["--strategy", "HYBRID_SHARD", "--replicate", "nodes"]
    nodes = [
        subprocess.Popen(launch + ["--node-rank", str(n)] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env, cwd=ROOT, start_new_session=True)
        for n in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:  # reap the launchers and their workers, whatever happened
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    finals = {int(r): float(x) for o in outputs for r, x in re.findall(r"^rank (\d+) final loss (\S+)$", o, re.M)}
    assert sorted(finals) == [0, 1, 2, 3], "\n=====\n".join(o[-3000:] for o in outputs)
    reference = subprocess.run([sys.executable] + _train_lm_args(steps, tmp_path / "reference"), capture_output=True, text=True, timeout=240,
                               env=env, cwd=ROOT)
    assert reference.returncode == 0, reference.stderr[-2000:]
    # both runs wrote their metrics into the test's directory, not into the checkout
    assert sorted(os.listdir(tmp_path)) == ["nodes", "reference"]
    (ref,) = [float(x) for x in re.findall(r"^rank 0 final loss (\S+)$", reference.stdout, re.M)]
    for rank, loss in finals.items():
        assert loss == pytest.approx(ref, rel=1e-5), (rank, loss, ref)
