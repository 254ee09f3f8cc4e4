"""What a recorded program is keyed by (jit_step(graph=True)): the modules' training flags
as well as the shapes, and the ranks agreeing on the key before every call."""

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing import split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.5)
        self.down = nn.Linear(32, 4)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x))))


def _mse(apply, params, batch):
    return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()


def _eval_after_recording(switch):
    """Three train-mode graph steps, then eval mode (``switch``: by ``apply.eval()``, or on the
    dropout module alone) and one more step: its
    loss and parameters, and those of an eager step from the same state in the same mode."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(_DropoutMLP())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = sf.optim.sgd(0.1)
    step = sf.jit_step(_mse, mesh, optimizer=opt, graph="eager")
    state = step.init(sharded)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(16, 8, generator=g), "y": torch.randn(16, 4, generator=g)} for _ in range(4)]
    for b in batches[:3]:
        sharded, state, _ = step(sharded, state, b)
    if switch == "apply":
        apply.eval()
    else:  # a flag set on one module of the tree, not through apply
        apply.module.drop.eval()
    before = {k: v.clone() for k, v in sf.gather(sharded).items()}
    sharded, state, metrics = step(sharded, state, batches[3])
    graph = (float(metrics["loss"]), sf.gather(sharded), step.recordings)
    params.update({k: v.requires_grad_() for k, v in before.items()})  # the same state, stepped eagerly
    eager_step = sf.jit_step(_mse, mesh, optimizer=opt)
    again = sf.shard(params, mesh, "FULL_SHARD")
    again, _, metrics = eager_step(again, eager_step.init(again), batches[3])
    return graph, (float(metrics["loss"]), sf.gather(again))


def test_eval_after_recording_records_an_eval_program(clusters):
    (loss, params, recordings), (eager_loss, eager_params) = clusters[1].run(
        _eval_after_recording, "apply")[0]
    # The same arithmetic, op by op: a single step's rounding (a few 2^-24 relative) at most.
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(params, eager_params, rtol=1e-6, atol=1e-7)
    assert recordings == 2  # train mode's program, then eval's


def test_a_submodule_switched_to_eval_records_again(clusters):
    (loss, params, recordings), (eager_loss, eager_params) = clusters[1].run(
        _eval_after_recording, "module")[0]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(params, eager_params, rtol=1e-6, atol=1e-7)
    assert recordings == 2



class _Counting(_DropoutMLP):
    """A forward that changes a module attribute once ``counting`` is on: no program can replay that."""

    def __init__(self):
        super().__init__()
        self.calls, self.counting = 0, False

    def forward(self, x):
        self.calls += self.counting
        return super().forward(x)


def _counting(at):
    """Counting from call ``at`` on (1: the first call, eager under a recording's rules; 2:
    the call that records): that call's error, and whether it left the state as it was."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(_Counting())
    model = apply.module
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    step = sf.jit_step(_mse, mesh, optimizer=sf.optim.sgd(0.1, momentum=0.9), graph="eager")
    opt_state = step.init(sharded)
    for call in range(1, at + 1):
        model.counting = call == at
        before = [t.clone() for t in torch.utils._pytree.tree_leaves((dict(sharded), opt_state))]
        try:
            sharded, opt_state, _ = step(sharded, opt_state, {"x": torch.ones(4, 8), "y": torch.zeros(4, 4)})
        except ValueError as e:
            after = torch.utils._pytree.tree_leaves((dict(sharded), opt_state))
            return str(e), all(torch.equal(a, b) for a, b in zip(before, after))
    return "accepted", None


@pytest.mark.parametrize("at", [1, 2])
def test_a_forward_that_changes_a_module_attribute_is_refused_and_changes_nothing(clusters, at):
    # The refusal comes after the call ran the step, which updated the state in place: the
    # call puts the state back before it raises ([Note: a recording that raises]). Before,
    # the state was left one step on (`unchanged` was False) at both calls.
    message, unchanged = clusters[1].run(_counting, at)[0]
    assert "the step changed module attributes (calls: 0 -> 1)" in message, message
    assert "graph=False" in message
    assert unchanged


_STEP_TIMEOUT = 5.0


def _shapes_change(who):
    """Two calls at 8 tokens (the first eager, the second records), then a third where the
    ranks in ``who`` have 5 tokens: the error each rank raises, the time it took and whether
    the state changed; or the losses and parameters."""
    import time

    mesh = sf.Mesh.from_group(step_timeout=_STEP_TIMEOUT)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, "FULL_SHARD")
    step = sf.jit_step(gpt_loss, mesh, optimizer=SGD_MOMENTUM(), graph=True)
    state = step.init(sharded)
    batches = [split_batch(b, mesh.rank, mesh.size) for b in gpt_batches(3)]
    batches = [{k: v[:, :8] for k, v in b.items()} for b in batches]
    if mesh.rank in who:
        batches[2] = {k: v[:, :5] for k, v in batches[2].items()}
    losses = []
    for b in batches[:2]:
        sharded, state, metrics = step(sharded, state, b)
        losses.append(float(metrics["loss"]))
    leaves = lambda: [t for t in pytree.tree_leaves((dict(sharded), state)) if isinstance(t, torch.Tensor)]  # noqa: E731
    before = [t.clone() for t in leaves()]
    t0 = time.monotonic()
    try:
        sharded, state, metrics = step(sharded, state, batches[2])
    except Exception as e:  # noqa: BLE001 - the test reads it
        after = leaves()
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, after))}
    losses.append(float(metrics["loss"]))
    return {"losses": losses, "params": sf.gather(sharded), "recordings": step.recordings}


def _eager_reference():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, "FULL_SHARD")
    step = sf.jit_step(gpt_loss, mesh, optimizer=SGD_MOMENTUM())
    state = step.init(sharded)
    losses = []
    for i, b in enumerate(gpt_batches(3)):
        b = {k: v[:, :5 if i == 2 else 8] for k, v in split_batch(b, mesh.rank, mesh.size).items()}
        sharded, state, metrics = step(sharded, state, b)
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "params": sf.gather(sharded)}


def test_one_rank_whose_batch_changes_shape_makes_every_rank_raise_naming_it(clusters):
    out = clusters[2].run(_shapes_change, [1])
    for rank, result in enumerate(out):
        assert result.get("error") == "DivergenceError", result
        message = result["message"]
        assert message.startswith(f"[rank {rank}] shardfn: jit_step(graph=True): the ranks on [0, 1] would run "
                                  "different programs, so none runs and nothing was updated: "), message
        assert ("rank 1's batch changed shape (batch['x']: (6, 5) int64, batch['y']: (6, 5) int64); its program was "
                "recorded for (batch['x']: (6, 8) int64, batch['y']: (6, 8) int64); rank 0 did not change. ") in message
        assert result["seconds"] < _STEP_TIMEOUT
        assert result["unchanged"]
    assert out[0]["message"].partition("]")[2] == out[1]["message"].partition("]")[2]  # the same error


def test_every_rank_changing_shape_together_records_a_new_program(clusters):
    graph = clusters[2].run(_shapes_change, [0, 1])[0]
    eager = clusters[2].run(_eager_reference)[0]
    assert graph["recordings"] == 2
    # As tests/test_graph.py compares a program with the eager step (the program's update takes
    # its scalars as tensors): losses to a few roundings, parameters at every sharded run's bound.
    torch.testing.assert_close(torch.tensor(graph["losses"]), torch.tensor(eager["losses"]), rtol=1e-6, atol=0)
    torch.testing.assert_close(graph["params"], eager["params"], rtol=1e-5, atol=1e-6)


def _fails_on_rank_0(gm, example_inputs):
    """A torch.compile backend that fails on rank 0 only (on the others: the graph as traced)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        raise RuntimeError("the compiler failed here (a test)")
    return gm.forward


def _compile_fails_on_one_rank():
    """The first replay compiles; rank 0's compiler fails. Then one more call."""
    import time

    from torch._dynamo import list_backends, register_backend

    if "shardfn_test_fails_on_rank_0" not in list_backends(exclude_tags=()):
        register_backend(_fails_on_rank_0, name="shardfn_test_fails_on_rank_0")
    mesh = sf.Mesh.from_group(step_timeout=_STEP_TIMEOUT)
    torch.manual_seed(0)
    params, _ = sf.functionalize(_DropoutMLP().eval())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    step = sf.jit_step(_mse, mesh, optimizer=sf.optim.sgd(0.1), graph="shardfn_test_fails_on_rank_0")
    state = step.init(sharded)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(4)]
    out = []
    for b in batches:
        t0 = time.monotonic()
        try:
            sharded, state, _ = step(sharded, state, b)
            out.append(("ok", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001 - the test reads it
            notes = "\n".join(getattr(e, "__notes__", []))
            out.append((f"{type(e).__name__}: {e}\n{notes}", time.monotonic() - t0))
            break
    torch.manual_seed(0)
    params, _ = sf.functionalize(_DropoutMLP().eval())
    eager = sf.jit_step(_mse, mesh, optimizer=sf.optim.sgd(0.1))
    again = sf.shard(params, mesh, "FULL_SHARD")
    kept = eager.init(again)
    for b in batches[:3]:
        again, kept, _ = eager(again, kept, b)
    return out, sf.gather(sharded), sf.gather(again)


def test_a_compiler_error_on_one_rank_leaves_no_peer_waiting(clusters):
    (zero, params, eager), (one, _, _) = clusters[2].run(_compile_fails_on_one_rank)
    assert [what for what, _ in zero[:2]] == ["ok", "ok"] and [what for what, _ in one[:3]] == ["ok", "ok", "ok"]
    # Rank 0 raises its compiler's error at the third call, once its peer's collectives are served...
    assert zero[2][0].startswith("BackendCompilerFailed") and "the compiler failed here" in zero[2][0], zero
    assert "this rank then ran the same program op by op" in zero[2][0]
    # ... and rank 1 at its next call, naming it, before anything changed: both ranks hold three
    # steps, as three eager steps do (at every sharded run's bound).
    assert one[3][0].startswith("PeerError: [rank 1] shardfn: rank 0 raised"), one
    assert "BackendCompilerFailed: backend='shardfn_test_fails_on_rank_0' raised" in one[3][0]
    assert max(seconds for _, seconds in zero + one) < _STEP_TIMEOUT
    torch.testing.assert_close(params, eager, rtol=1e-5, atol=1e-6)


def _replay_raises_on_rank_0(rank, world, port, scenario, queue):
    """Rank 0's program raises at its second replay (a stand-in for an error inside it)."""
    import datetime
    import os
    import time

    import torch.distributed as dist

    from test_ranks_differ import _outcome

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    mesh = sf.Mesh.from_group(step_timeout=2.0)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(_DropoutMLP().eval())[0], mesh, "FULL_SHARD")
    step = sf.jit_step(_mse, mesh, optimizer=sf.optim.sgd(0.1), graph="eager")
    state = step.init(sharded)
    b = {"x": torch.ones(4, 8), "y": torch.zeros(4, 4)}
    for _ in range(3):
        sharded, state, _ = step(sharded, state, b)
    if rank == 0:
        def boom(*args):
            raise RuntimeError("boom (a test)")

        (program,) = step.programs.values()
        program.gm = program.fn = boom
    out = _outcome(lambda: step(sharded, state, b))
    queue.put((rank, out))
    time.sleep(4 if rank == 0 else 0)  # rank 0 holds the store the peer reads
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_a_replay_that_raises_on_one_rank_ends_the_peers_within_the_step_timeout():
    from test_faults import _run

    results = _run("replay raises", worker=_replay_raises_on_rank_0)
    assert results[0]["error"] == "RuntimeError" and "boom" in results[0]["message"], results
    peer = results[1]
    assert peer["error"] == "CommError", peer
    assert "rank 0 raised in its replay: RuntimeError: boom (a test)" in peer["message"], peer
    assert peer["seconds"] < 2.0 + 3.0  # the step timeout, and the roll call's few seconds at most


def test_a_replay_leaves_an_nccl_groups_timeout_to_its_watchdog():
    # bounded() sets gloo's timeout through the group's CPU backend, which an NCCL group does
    # not have: there it must leave the group alone (its watchdog bounds the replay)
    from types import SimpleNamespace

    from shardfn._program.replay import bounded

    class Group:
        def __init__(self):
            self.timeouts = []

        def _get_backend(self, device):
            backend = SimpleNamespace(options=SimpleNamespace(_timeout="before"))
            backend.set_timeout = self.timeouts.append
            return backend

    gloo, nccl = Group(), Group()
    nccl._get_backend = None  # calling it would raise TypeError, as a missing backend raises
    channels = {"shard": SimpleNamespace(off=False, on_stream=False, group=gloo, timeout=7.0),
                "replicate": SimpleNamespace(off=False, on_stream=True, group=nccl, timeout=7.0)}
    mesh = SimpleNamespace(axis_names=("replicate", "shard"), channel=channels.__getitem__)
    with bounded(mesh, True):
        assert [t.total_seconds() for t in gloo.timeouts] == [7.0]
    assert gloo.timeouts[-1] == "before" and nccl.timeouts == []
