"""A step's backward without the caller's ContextVars, as CUDA runs it on autograd's device
threads (tests/device_thread.py): the step is bit for bit the step on the calling thread.
DESIGN.md: "nothing that backward reads lives in a ContextVar"."""

import pytest
import torch

import shardfn as sf
from bounds import ADAMW
from device_thread import backward_without_context
from shardfn.testing import count_ops, split_batch
from test_equivalence import GPT_CFG, gpt_batches, gpt_loss, gpt_model

# A graph step runs its first call eagerly, records the second and replays the others.
STEPS = 4
GPT_LAYERS = GPT_CFG.n_layers  # one unit (and one recompute) per block


def _train(strategy, how, without_context):
    """The loss of every call, the collectives it dispatched and the guard's header exchanges,
    the full parameters after them, how many backwards ran and recordings were made; the
    backwards run without the caller's context, or with it."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, sf.Plan(strategy))
    options = {"graph": "eager"} if how == "graph" else {"on_nonfinite": "raise_next"}
    step = sf.jit_step(gpt_loss, mesh, optimizer=ADAMW(), **options)
    state = step.init(sharded)
    losses, collectives, headers = [], [], []
    with backward_without_context(empty=without_context) as seen:
        for b in gpt_batches(STEPS):
            before = mesh.guard.headers
            with count_ops() as ops:
                sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
            losses.append(metrics["loss"].detach().clone())
            collectives.append(sorted(ops.collectives.items()))
            headers.append(mesh.guard.headers - before)
    return {"losses": torch.stack(losses), "params": sf.gather(sharded), "collectives": collectives,
            "headers": headers, "backwards": seen.calls, "recordings": getattr(step, "recordings", None)}


@pytest.mark.parametrize("how", ["eager", "graph"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_a_backward_without_the_callers_context_gives_the_same_step(clusters, strategy, how):
    plain = clusters[2].run(_train, strategy, how, False)
    moved = clusters[2].run(_train, strategy, how, True)
    for rank, (a, b) in enumerate(zip(plain, moved)):
        # Every backward went through the helper: one per eager call, those of the recording.
        assert b["backwards"] == a["backwards"] >= (2 if how == "graph" else STEPS), (rank, a["backwards"],
                                                                                   b["backwards"])
        assert b["recordings"] == a["recordings"] == (1 if how == "graph" else None)
        # The same collectives, checked by the same headers: in the recorded program too.
        assert b["collectives"] == a["collectives"], (rank, a["collectives"], b["collectives"])
        assert b["headers"] == a["headers"], (rank, a["headers"], b["headers"])
        assert torch.equal(b["losses"], a["losses"]), (rank, a["losses"], b["losses"])
        assert a["params"].keys() == b["params"].keys()
        for name, p in a["params"].items():
            assert torch.equal(b["params"][name], p), (rank, name, (b["params"][name] - p).abs().max())


def _compiled_recomputes(without_context):
    """How many times a compiled unit forward ran in backward (a remat recompute) in one step
    with ``compile="aot_eager"`` and full remat, and how many backwards ran; the backward
    without the caller's context, or with it."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, sf.Plan("FULL_SHARD", remat=sf.Remat()))
    step = sf.jit_step(gpt_loss, mesh, optimizer=ADAMW(), compile="aot_eager")
    state = step.init(sharded)
    recomputes = [0]
    compile_ = torch.compile

    def counting(fn, **kwargs):  # (the units' forwards are compiled anew for each model)
        compiled = compile_(fn, **kwargs)

        def run(*args, **kw):
            recomputes[0] += torch._C._current_graph_task_id() != -1  # in backward
            return compiled(*args, **kw)
        return run

    torch.compile = counting
    try:
        with backward_without_context(empty=without_context) as seen:
            step(sharded, state, split_batch(gpt_batches(1)[0], mesh.rank, mesh.size))
    finally:
        torch.compile = compile_
    return recomputes[0], seen.calls


def test_a_remat_recompute_without_the_callers_context_runs_the_compiled_forward(clusters):
    plain, moved = (clusters[1].run(_compiled_recomputes, empty)[0] for empty in (False, True))
    # The recompute runs the forward compiled, as the forward ran: else the checkpoint finds
    # other saved tensors (CheckpointError), or the same ones with other roundings.
    assert moved[1] >= 1  # (torch's own backwards count too: aot_autograd's, tracing a new forward)
    assert moved[0] == plain[0] == GPT_LAYERS, (plain, moved)


class _ReadsInBackward(torch.autograd.Function):
    """The identity, whose backward reads its gradient on the host (a user's custom op)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * (1 + 0 * sum(g.reshape(-1).tolist()))


def _record_a_host_read_in_backward(without_context):
    """What jit_step(graph=True) says of a loss whose backward reads a value on the host."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, sf.Plan("FULL_SHARD"))

    def loss(apply, params, batch):
        return _ReadsInBackward.apply(gpt_loss(apply, params, batch))

    step = sf.jit_step(loss, mesh, optimizer=ADAMW(), graph="eager")
    state = step.init(sharded)
    try:
        with backward_without_context(empty=without_context):
            for b in gpt_batches(2):
                sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    except ValueError as e:
        return str(e)
    return "recorded"


def test_a_host_read_in_backward_is_refused_without_the_callers_context(clusters):
    for without_context in (False, True):
        message = clusters[1].run(_record_a_host_read_in_backward, without_context)[0]
        assert "Tensor.tolist() reads a tensor's values on the host" in message, (without_context, message)
