"""shard(src_rank=...) on a mesh with a tensor axis: the source holds the whole values, every
other rank the model on the meta device, and each rank gets exactly the shards that shard()
gives it from whole values on every rank ([Note: loading from one rank with a tensor axis])."""

import pytest
import torch

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch
from test_tensor_parallel import PLAN, batches, loss_fn, model


def _loaded(strategy, src, replicate=None, placement=None):
    mesh = sf.Mesh.from_group(tensor=2, replicate=replicate)
    plan = sf.Plan(strategy, placement=placement)
    torch.manual_seed(0)
    whole = sf.functionalize(model())[0]
    want = sf.shard(whole, mesh, plan, tensor_parallel=PLAN)
    if mesh.rank == src:
        params = whole
    else:
        with torch.device("meta"):
            params = sf.functionalize(model())[0]
    with sf.record_collectives() as log:
        got = sf.shard(params, mesh, plan, src_rank=src, tensor_parallel=PLAN)
    same = sorted(n for n in want if torch.equal(want[n], got[n]) and want[n].dtype == got[n].dtype)
    opt = SGD_MOMENTUM()
    state = opt.init(got)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    _, _, metrics = step(got, state, split_batch(batches()[0], mesh.data_rank, mesh.data_size))
    loads = sorted({(c.kind.value, tuple(c.group)) for c in log.select("load")})
    return same, sorted(want), float(metrics["loss"]), loads


CASES = [("FULL_SHARD", 0, None, None), ("FULL_SHARD", 3, None, None), ("FULL_SHARD", 1, None, "rows"),
         ("SHARD_GRAD_OP", 2, None, None), ("NO_SHARD", 3, None, None), ("HYBRID_SHARD", 3, 2, None)]


@pytest.mark.parametrize("strategy,src,replicate,placement", CASES)
def test_src_rank_at_world_four_gives_every_rank_its_shards(clusters, strategy, src, replicate, placement):
    outs = clusters[4].run(_loaded, strategy, src, replicate, placement)
    group = tuple(r for r in range(4) if r // 2 == src // 2)  # the source's tensor group
    for same, names, loss, loads in outs:
        assert same == names, sorted(set(names) - set(same))  # bit for bit
        assert loss == outs[0][2]  # (the step runs; its loss is the same on every rank)
    for rank, (_, _, _, loads) in enumerate(outs):
        # the source's tensor group gets each unit whole from it; then the shard axis (or, at
        # shard 1, the replicate axis) hands each tensor rank its part
        assert (("broadcast", group) in loads) == (rank in group), (rank, loads)


def test_src_rank_at_tensor_two_alone(clusters):
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        for same, names, _, _ in clusters[2].run(_loaded, strategy, 1):
            assert same == names, sorted(set(names) - set(same))
