"""Nothing frozen: the program a graph step records for a device, run on the host.

The program is recorded as a device would record it (tests/fake_device.py: fake tensors on
a device that is not the host, over a fake process group), then made to run on the CPU and
gloo (its device arguments mapped to the CPU and its process groups to the real ones, one
pass over the graph), and run directly for 20 steps next to the eager step. A value that
the recording froze (a learning rate, a bias correction, a dropout mask, a count) would be
replayed as it was at the recording, and the two would part by the second step: the
negative control below shows that they do.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import fake_device
import shardfn as sf
from shardfn.testing import Cluster

STEPS = 20
DEVICE = fake_device.DEVICE
MICRO = 2
# A program replayed op by op next to the eager step: the same ops on the same values, but
# the program's reduce-scatter on gloo is an all-to-all and a sum in rank order where the
# eager step sends pairs ([Note: reduce-scatter on gloo]), so sums may round apart by an ulp
# and AdamW's division by sqrt(v) + eps (eps 1e-3, lr <= 1e-3: lr/eps <= 1) carries that into
# each step at most 1:1. test_graph.py compares the same two at these tolerances.
RTOL, ATOL = 1e-5, 1e-6


def _schedule(count):
    """Warm-up for 4 updates, then cosine decay to 0 at 20, written for a number and for a tensor."""
    if isinstance(count, torch.Tensor):
        warm = torch.clamp((count + 1) / 4, max=1.0)
        return 1e-3 * warm * 0.5 * (1 + torch.cos(math.pi * torch.clamp(count / STEPS, max=1.0)))
    return 1e-3 * min(1.0, (count + 1) / 4) * 0.5 * (1 + math.cos(math.pi * min(count / STEPS, 1.0)))


FROZEN = [0]  # the negative control's step number, read on the host


def _frozen_schedule(count):
    return 1e-3 * 0.7 ** FROZEN[0]


def _model():
    from shardfn.testing.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2))
    for block in model.blocks:
        block.mlp.append(torch.nn.Dropout(0.2))
    return model


def _optimizer(schedule):
    return sf.optim.chain(sf.optim.clip_by_global_norm(0.5),
                          sf.optim.adamw(schedule, eps=1e-3, weight_decay=0.1))


def _batches(rank, world):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        x, y = torch.randint(0, 32, (4 * world, 8), generator=g), torch.randint(0, 32, (4 * world, 8), generator=g)
        out.append({"x": x[4 * rank: 4 * rank + 4], "y": y[4 * rank: 4 * rank + 4]})
    return out


def _run(device, frozen, strategy):
    """Per step: the program's loss and the eager step's, and the largest difference of their shards."""
    import fake_device
    from shardfn._program.graph import _bases

    schedule = _frozen_schedule if frozen else _schedule
    rank, world = dist.get_rank(), dist.get_world_size()
    fake_group = dist.new_group(backend="fake")
    fake_mesh = fake_device.on_device(sf.Mesh.from_group(fake_group), device)
    plan = sf.Plan(strategy)
    batches = _batches(rank, world)
    options = {"micro_batches": MICRO}
    FROZEN[0] = 0  # the value the recording freezes: the first step's
    gm = fake_device.record_on(fake_mesh, _model(), plan, _optimizer(schedule), batches[0], **options)
    mesh = sf.Mesh.from_group()
    groups = {fake_mesh.channel(a).group.group_name: mesh.channel(a).group.group_name for a in mesh.axis_names}
    program = fake_device.to_host(gm, groups)

    params, _ = sf.functionalize(_model())
    runs = []
    for _ in range(2):
        sharded = sf.shard(params, mesh, plan)
        runs.append([sharded, _optimizer(schedule).init(sharded)])
    step = sf.jit_step(_loss, mesh, optimizer=_optimizer(schedule), on_nonfinite="raise_next", **options)
    out = []
    for k, batch in enumerate(batches):
        FROZEN[0] = k
        sharded, opt_state = runs[0]
        leaves = pytree.tree_leaves((sharded, opt_state))
        state = _bases([t for t in leaves if isinstance(t, torch.Tensor)])
        torch.manual_seed(100 + k)
        with torch.no_grad():
            loss = program(state, pytree.tree_leaves(batch))[0].item()
        torch.manual_seed(100 + k)
        runs[1][0], runs[1][1], metrics = step(runs[1][0], runs[1][1], batch)
        diff = max((a - b).abs().max().item() - RTOL * b.abs().max().item()
                   for a, b in zip(pytree.tree_leaves(runs[0][0]), pytree.tree_leaves(runs[1][0])) if a.numel())
        out.append((loss, metrics["loss"].item(), diff))
    dist.destroy_process_group(fake_group)
    return out


def _loss(apply, params, batch):
    from shardfn.testing.models import lm_loss

    return lm_loss(apply(params, batch["x"]), batch["y"])


@pytest.fixture(scope="module")
def world2():
    with Cluster(2, timeout=240) as cluster:  # its own: the fake device is registered for the process
        yield cluster


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_the_program_recorded_for_a_device_tracks_the_eager_step_on_the_host(world2, strategy):
    for rank, steps in enumerate(world2.run(_run, DEVICE, False, strategy)):
        for k, (program, eager, diff) in enumerate(steps):
            assert math.isclose(program, eager, rel_tol=RTOL, abs_tol=0), (rank, k, program, eager)
            assert diff <= ATOL, (rank, k, diff)
        assert len({round(e, 6) for _, e, _ in steps}) == STEPS  # the steps moved: nothing is vacuous


def test_a_frozen_value_parts_them_by_the_second_step(world2):
    steps = world2.run(_run, DEVICE, True, "FULL_SHARD")[0]
    assert steps[0][2] <= ATOL  # the first step's learning rate is the recorded one
    assert steps[1][2] > ATOL  # from then on the program replays it
