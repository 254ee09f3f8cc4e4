"""Optional units on a mesh with a tensor axis: a mixture of experts whose experts are
optional units, its other layers split over the tensor axis, equal to one process; a tensor
group whose ranks run different experts raises on every rank before anything changes; a
split layer inside an optional unit refused."""

import time

import torch

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch
from test_ranks_differ import EXPERTS, moe_batches, moe_model, mse

RTOL, ATOL = 1e-5, 1e-6  # tests/bounds.py's for SGD_MOMENTUM: the same terms summed in another order
# The layers around the experts split: every rank gets their whole output (optional units
# hold no split layer: their tensor collectives would run only where the data chose them)
PLAN = {"embed": "colwise_gather_output", "head": "colwise_gather_output"}


def _train(tensor, strategy="FULL_SHARD", diverge=False, steps=3):
    mesh = sf.Mesh.from_group(tensor=tensor, step_timeout=60.0)
    model = moe_model()
    if diverge and mesh.rank == 1:  # tensor rank 1 of the first group routes block 1's tokens elsewhere
        model.blocks[1].router.register_forward_hook(lambda m, a, out: out.flip(-1))
    params, _ = sf.functionalize(model)
    sharded = sf.shard(params, mesh, strategy, optional=EXPERTS, tensor_parallel=PLAN)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(mse, mesh, optimizer=opt)
    losses = []
    for batch in moe_batches(steps, rows=6):
        before = sf.testing.full_state(sharded) if diverge else None
        start = time.monotonic()
        try:
            sharded, state, m = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            after = sf.testing.full_state(sharded)
            unchanged = all(torch.equal(after[n], before[n]) for n in before)
            return type(e).__name__, str(e).split("\n")[0], unchanged, time.monotonic() - start
        losses.append(float(m["loss"]))
    return losses, sf.testing.full_state(sharded)


def test_optional_experts_with_a_tensor_axis_train_as_one_process(clusters):
    from shardfn.testing import reference_training

    ref_losses, expected = reference_training(moe_model, mse, moe_batches(3, rows=6), SGD_MOMENTUM)
    for world in (2, 4):
        for losses, full in clusters[world].run(_train, 2):
            assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
            for name, ref in expected.items():
                assert float(((full[name] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, name


def test_a_tensor_group_that_runs_other_experts_raises_on_every_rank(clusters):
    outs = clusters[4].run(_train, 2, "FULL_SHARD", True, 1)
    for rank, (kind, message, unchanged, seconds) in enumerate(outs):
        assert unchanged and seconds < 60, (rank, outs)  # told by the guard, not the timeout
        if rank in (0, 1):  # the group whose ranks differ: each learns it from the header
            assert kind == "DivergenceError" and "ran different optional units" in message, (rank, message)
        else:
            assert kind in ("DivergenceError", "PeerError"), (rank, kind, message)


def _refused():
    mesh = sf.Mesh.from_group(tensor=2)
    try:
        sf.shard(sf.functionalize(moe_model())[0], mesh, "FULL_SHARD", optional=EXPERTS,
                 tensor_parallel={"blocks.*.experts.*.0": "colwise", "blocks.*.experts.*.2": "rowwise"})
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_split_layer_inside_an_optional_unit_is_refused(clusters):
    first, second = clusters[2].run(_refused)
    assert first == second and "'blocks.0.experts.0.0' is split" in first and "optional unit" in first, first
