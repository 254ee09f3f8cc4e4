"""Tensor parallelism with optimizers that need whole matrices, recorded steps and psum
(issue 50): Muon on split leaves equal to one process, the tensor axis's gathers counted."""

import torch

import shardfn as sf
from shardfn.testing._equivalence import reference_training, split_batch
from test_tensor_parallel import PLAN, batches, loss_fn, model

SPLIT = sorted(f"blocks.{b}.mlp.{i}.weight" for b in range(2) for i in (0, 2))
D, HIDDEN = 16, 64  # the test GPT's d_model and MLP width: a split weight is 64 x 16 whole, 32 x 16 per tensor rank
# tests/test_muon.py's tolerances: Newton-Schulz in fp32, a gradient's terms summed in another order
RTOL, ATOL = 1e-5, 1e-6


def matrices(name, shape):
    return len(shape) >= 2


def muon():
    return sf.optim.partition({"muon": sf.optim.muon(0.02, ns_dtype=torch.float32), "sgd": sf.optim.sgd(0.1)},
                              lambda name, shape: "muon" if matrices(name, shape) else "sgd")


def _train_muon(strategy):
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model())
    sharded = sf.shard(params, mesh, sf.Plan(strategy, placement=sf.whole(matrices)), tensor_parallel=PLAN)
    opt = muon()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses, gathers = [], []
    for batch in batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
        gathers.append(sorted((c.unit, c.nbytes) for c in log.select("tensor") if c.kind.value == "all_gather"))
    return losses, gathers, sf.gather(sharded), mesh.axis_rank("tensor")


def test_muon_on_split_leaves_equals_one_process(clusters):
    ref_losses, ref_state = reference_training(model, loss_fn, batches(), muon)
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        results = clusters[4].run(_train_muon, strategy)
        for losses, _, full, _ in results:
            assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
            for name, ref in ref_state.items():
                diff = (full[name] - ref).abs() - RTOL * ref.abs()
                assert float(diff.max()) <= ATOL, (strategy, name, float(diff.max()))
        # each split weight's update pieces gathered once per step over the tensor axis, by the
        # tensor group (ranks 0, 1 or 2, 3) whose shard rank holds the weight whole: 64 x 16 fp32
        for t in range(2):
            for k in range(len(ref_losses)):
                got = sorted(g for s in range(2) for g in results[s * 2 + t][1][k])
                assert got == [(name, HIDDEN * D * 4) for name in SPLIT], (strategy, t, k, got)
