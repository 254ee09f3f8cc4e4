"""The guard on the tensor axis (issue 50): a rank of a tensor group that leaves the schedule
(skips a split layer, or raises inside one) makes every rank of the mesh raise the same
error, before the state changes, and not by the timeout; the steps after it run."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardfn as sf
from bounds import SGD_MOMENTUM
from test_ranks_differ import _outcome

PLAN = {"layers.*.0": "colwise", "layers.*.2": "rowwise"}


class Blocks(nn.Module):
    """Residual MLP blocks; ``skip`` drops some (LayerDrop, or a branch not taken)."""

    def __init__(self, d=8, n=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
                                    for _ in range(n))

    def forward(self, x, skip=()):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = x + layer(x)
        return x


def _unchanged(before, sharded):
    return all(torch.equal(before[k], sharded[k]) for k in before)


def leaving_the_schedule(tensor, how, at):
    """Tensor rank 1 of each group skips block 1 (``how="skip"``) or raises inside its
    rowwise layer (``"raise"``) in step ``at``; every rank catches its error and takes two more steps."""
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group(tensor=tensor, step_timeout=60.0)
    model = Blocks()
    bad = [False]

    def raise_on_tensor_rank_1(module, args):
        if bad[0] and how == "raise" and mesh.axis_rank("tensor") == 1:
            raise ValueError(f"boom in layers.1.2 on rank {dist.get_rank()}")

    model.layers[1][2].register_forward_pre_hook(raise_on_tensor_rank_1)
    params, _ = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=PLAN, bucket_bytes=0)

    def loss_fn(apply, params, batch):
        skip = (1,) if bad[0] and how == "skip" and mesh.axis_rank("tensor") == 1 else ()
        return apply(params, batch["x"], skip=skip).pow(2).mean()

    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    g = torch.Generator().manual_seed(mesh.data_rank)
    for _ in range(at):
        sharded, state, _ = step(sharded, state, {"x": torch.randn(4, 8, generator=g)})
    bad[0] = True
    before = {k: v.clone() for k, v in sharded.items()}
    out = _outcome(lambda: step(sharded, state, {"x": torch.randn(4, 8, generator=g)}))
    out["unchanged"] = _unchanged(before, sharded)
    bad[0] = False
    out["after"] = [_outcome(lambda: step(sharded, state, {"x": torch.randn(4, 8, generator=g)})) for _ in range(2)]
    return out


@pytest.mark.parametrize("at", [0, 4])  # a step checked collective by collective, and a pipelined one
@pytest.mark.parametrize("world", [2, 4])
def test_a_tensor_rank_that_skips_a_split_layer_makes_every_rank_raise(clusters, world, at):
    outs = clusters[world].run(leaving_the_schedule, 2, "skip", at)
    for r, out in enumerate(outs):
        assert out["error"] == "DivergenceError", (r, out)
        assert out["unchanged"] and out["seconds"] < 60.0, (r, out)  # told by the guard, not the timeout
        assert [a["error"] for a in out["after"]] == [None, None], (r, out["after"])


@pytest.mark.parametrize("world", [2, 4])
def test_a_tensor_rank_that_raises_in_a_split_layer_tells_every_rank(clusters, world):
    outs = clusters[world].run(leaving_the_schedule, 2, "raise", 0)
    for r, out in enumerate(outs):
        if r % 2 == 1:
            assert out["error"] == "ValueError" and f"boom in layers.1.2 on rank {r}" in out["message"], (r, out)
        else:
            assert out["error"] == "PeerError", (r, out)
            told = re.match(rf"\[rank {r}\] shardfn: rank (\d) raised(?: \(and ranks \[(\d)\]\))?", out["message"])
            assert told and {int(n) for n in told.groups() if n} == set(range(1, world, 2)), (r, out)  # every raiser
            assert "so this rank stops too (nothing was updated)" in out["message"], (r, out)
        assert out["unchanged"] and out["seconds"] < 60.0, (r, out)
        assert [a["error"] for a in out["after"]] == [None, None], (r, out["after"])
