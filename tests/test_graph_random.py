"""Random ops in a recorded step (jit_step(graph=True)): dropout draws fresh masks at every
replay, from torch's generator, the same masks as the eager step draws from the same state,
in the forward and again in a rematerialised unit's recompute."""

import pytest
import torch
import torch.nn as nn

import shardfn as sf
from shardfn.testing import split_batch


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(self.drop(torch.tanh(self.up(x)))) + 0.01 * torch.randn_like(x)


class _DropNet(nn.Module):
    """Two units with dropout and noise inside (remat recomputes them), and a dropout written
    with ``rand_like`` at the root, whose output the loss returns as its aux: the mask a step
    drew. (On the CPU nn.Dropout draws by ``bernoulli_``, which inductor leaves to torch;
    ``rand_like`` and ``randn_like`` it generates itself, as it does CUDA's dropout.)"""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.blocks(x)
        h = h * (torch.rand_like(h) < 0.5) * 2
        return self.head(h), h


def _loss(apply, params, batch):
    y, h = apply(params, batch["x"])
    return ((y - batch["y"]) ** 2).mean(), (h != 0).float()


def _train(graph, remat, steps=6):
    """Per step: the loss, the root dropout's mask (this rank's rows) and the full parameters."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(_DropNet())
    plan = sf.Plan("FULL_SHARD", units=sf.by_module_type(_Block), remat=sf.Remat() if remat else None)
    sharded = sf.shard(params, mesh, plan)
    step = sf.jit_step(_loss, mesh, optimizer=sf.optim.sgd(0.1, momentum=0.9), aux="rank", graph=graph,
                       **({} if graph else {"on_nonfinite": "raise_next"}))
    state = step.init(sharded)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(steps)]
    torch.manual_seed(2)  # the masks' stream: the same for both steps from here
    out = []
    for b in batches:
        sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        out.append((float(metrics["loss"]), metrics["aux"][0].clone(), sf.gather(sharded)))
    return out


def _check_same(graph, eager, exact):
    for i, ((gl, gm, gp), (el, em, ep)) in enumerate(zip(graph, eager)):
        assert torch.equal(gm, em), f"step {i}: the graph step drew another mask than the eager step"
        if exact:
            assert gl == el, f"step {i}: loss {gl} != {el}"
            for name, p in ep.items():
                assert torch.equal(gp[name], p), f"step {i}: {name} differs by {(gp[name] - p).abs().max()}"
        else:
            torch.testing.assert_close(gl, el, rtol=1e-6, atol=0, msg=lambda m: f"step {i}: loss: {m}")
            torch.testing.assert_close(gp, ep, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {i}: {m}")
    # Replays draw fresh masks: no two steps' masks are one (1/2^32 that two draws agree).
    masks = [m for _, m, _ in graph]
    assert all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1:])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_dropout_in_a_replay_draws_the_eager_masks(clusters, world, remat):
    eager = clusters[world].run(_train, False, remat)
    graph = clusters[world].run(_train, "eager", remat)
    for g, e in zip(graph, eager):
        _check_same(g, e, exact=False)


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_dropout_in_a_compiled_replay_draws_the_eager_masks(clusters, remat):
    eager = clusters[2].run(_train, False, remat)
    graph = clusters[2].run(_train, "inductor", remat)
    for g, e in zip(graph, eager):
        _check_same(g, e, exact=False)
