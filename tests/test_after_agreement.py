"""A rank that fails after the step's point of no return (the metrics all-reduce, after which
every rank updates): every rank raises and says which ranks updated and which did not, the
trees refuse what comes next, naming the way back (shardfn.checkpoint.latest), and the
failing rank's own state is not half-advanced. See shardfn._run.no_return [Note: the point of no return]."""

import os

import pytest
import torch

import shardfn as sf
import shardfn.optim._adamw as adamw_module
from shardfn.optim import GradientTransformation, adamw, sgd
from test_ranks_differ import Stack, _outcome, _snapshot, _unchanged

# The failing rank waits in its failed-header exchange until the peer's next call; a peer
# that never came would end it after this (a CommError, which the tests refuse).
STEP_TIMEOUT = 20.0
BAD_STEP = 2


def _optimizer(kind, mesh, bad):
    if kind == "kernel":  # the built-in in-place AdamW; rank 1's kernel runs out of memory
        return adamw(1e-2)
    inner = sgd(0.05, momentum=0.9)

    def update(grads, state, params=None):  # a user's optimizer: no update_, so the step adds its updates
        if bad["now"] and mesh.rank == 1 and kind == "user":
            raise ValueError("the user's optimizer failed on rank 1")
        updates, new = inner.update(grads, state, params)
        if bad["now"] and mesh.rank == 1 and kind == "bad_state":  # a state the next update could not take
            new = new._replace(momentum_buffer={})
        return updates, new

    return GradientTransformation(inner.init, update)


def failing_after_agreement(kind, directory):
    """Rank 1 fails in the update of step BAD_STEP (``kind``: "user", its optimizer raises;
    "bad_state", its optimizer returns a state without momentum; "kernel", the AdamW kernel
    raises MemoryError). Every rank then tries one more step and a
    save, and finally loads the checkpoint saved before and steps on."""
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group(step_timeout=STEP_TIMEOUT)
    params, _ = sf.functionalize(Stack())
    sharded = sf.shard(params, mesh, "FULL_SHARD", bucket_bytes=0)
    bad = {"now": False}
    opt = _optimizer(kind, mesh, bad)
    step = sf.jit_step(lambda apply, p, b: apply(p, b).pow(2).mean(), mesh, optimizer=opt)
    state = opt.init(sharded)
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * n + mesh.rank)) for n in range(6)]
    for n in range(BAD_STEP):
        sharded, state, _ = step(sharded, state, batches[n])
    sf.checkpoint.save(os.path.join(directory, f"step-{BAD_STEP - 1}"), sharded, state, extra={"step": BAD_STEP - 1})
    before = _snapshot(sharded, state)
    original = adamw_module._adamw_kernel

    def out_of_memory(*args, **kwargs):
        raise MemoryError("injected: out of memory in the AdamW kernel")

    bad["now"] = True
    if kind == "kernel" and mesh.rank == 1:
        adamw_module._adamw_kernel = out_of_memory
    try:
        result = {}

        def failing():
            nonlocal sharded, state
            sharded, state, _ = step(sharded, state, batches[BAD_STEP])

        try:
            failing()
            result["failed"] = {"error": None}
        except Exception as e:  # noqa: BLE001 - the test inspects it
            result["failed"] = {"error": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
    finally:
        adamw_module._adamw_kernel = original
        bad["now"] = False
    result["unchanged"] = _unchanged(before, sharded, state)
    result["next_step"] = _outcome(lambda: step(sharded, state, batches[BAD_STEP + 1]))
    result["save"] = _outcome(lambda: sf.checkpoint.save(os.path.join(directory, "after"), sharded, state))
    result["export"] = _outcome(lambda: sf.save_pretrained(sharded, os.path.join(directory, "export")))
    result["gather"] = _outcome(lambda: sf.gather(sharded))
    def resume():
        nonlocal sharded, state
        path = sf.checkpoint.latest(directory)
        sharded, state, extra = sf.checkpoint.load(path, sharded, state)
        result["resumed_from"] = (os.path.basename(path), extra["step"])
        result["loss_after_load"] = step(sharded, state, batches[BAD_STEP])[2]["loss"]

    result["resume"] = _outcome(resume)
    result["timed_out"] = mesh.guard.broken is not None
    return result


@pytest.mark.parametrize("kind", ["user", "bad_state", "kernel"])
def test_a_failure_after_the_point_of_no_return_is_told_truthfully(clusters, tmp_path, kind):
    outs = clusters[2].run(failing_after_agreement, kind, str(tmp_path))
    peer, failing = outs
    original = {"user": "ValueError: the user's optimizer failed on rank 1",
                "bad_state": "ValueError: step: the optimizer's update(grads, state, params) returned outputs that "
                             "do not fit these shards, so nothing was written on this rank",
                "kernel": "MemoryError: injected: out of memory in the AdamW kernel"}[kind]
    # Rank 0 updated in that step and learns of rank 1's failure at its next step: a PeerError
    # that says so, and never that nothing was updated.
    assert peer["failed"]["error"] is None, peer
    message = peer["next_step"]["message"]
    assert peer["next_step"]["error"] == "PeerError", peer
    assert "nothing was updated" not in message, message
    assert original in message and "ranks [0] updated" in message, message
    kept = "may be partly updated" if kind == "kernel" else "as before the step"
    assert f"rank 1 did not" in message and kept in message, message
    assert "shardfn.checkpoint.latest" in message, message
    # Rank 1 raised its own error, with a note saying the same.
    assert failing["failed"]["error"] == original.split(":")[0], failing
    if kind == "bad_state":  # named by its path, before anything was written
        assert "new_state.momentum_buffer['layers.0.weight']: missing" in failing["failed"]["message"], failing
    note = "\n".join(failing["failed"]["notes"])
    assert "nothing was updated" not in note and "ranks [0] updated" in note and kept in note, note
    # Its state is not half-advanced: its optimizer raised before writing (user), or the
    # kernel raised before the count advanced (kernel).
    assert failing["unchanged"], failing
    # Every rank's trees refuse the next step, a save, an export and a gather, naming the way back.
    for rank, out in enumerate(outs):
        calls = ["save", "export", "gather"] + (["next_step"] if rank == 1 else [])
        for call in calls:
            assert out[call]["error"] == "RuntimeError", (rank, call, out[call])
            assert "unusable" in out[call]["message"] and "shardfn.checkpoint.latest" in out[call]["message"], (
                rank, call, out[call])
        assert out["resume"]["error"] is None, out["resume"]
        assert out["resumed_from"] == (f"step-{BAD_STEP - 1}", BAD_STEP - 1)
        assert not out["timed_out"] and out["next_step"]["seconds"] < STEP_TIMEOUT, out
    # Loading the checkpoint is the way back: both ranks step on together.
    assert peer["loss_after_load"] == failing["loss_after_load"]
    assert not os.path.exists(tmp_path / "after") and not os.path.exists(tmp_path / "export")


@pytest.mark.parametrize("name", ["adamw", "sgd", "muon"])
def test_an_in_place_update_that_raises_leaves_its_count(monkeypatch, name):
    """The count is what the next update's bias correction and schedule read: an update_ that
    raised must not have advanced it (the step says the state is as it was, or may be partly
    updated, never one count ahead of its moments)."""
    import shardfn.optim as optim
    import shardfn.optim._muon as muon_module
    import shardfn.optim._sgd as sgd_module

    params = {"w": torch.randn(4, 3, requires_grad=True)}
    opt = {"adamw": optim.adamw(1e-2), "sgd": optim.sgd(0.1, momentum=0.9), "muon": optim.muon(1e-2)}[name]
    state = opt.init(params)

    def out_of_memory(*args, **kwargs):
        raise MemoryError("injected")

    module, kernel = {"adamw": (adamw_module, "_adamw_kernel"), "sgd": (sgd_module, "_sgd_kernel"),
                      "muon": (muon_module, "newton_schulz")}[name]
    monkeypatch.setattr(module, kernel, out_of_memory)
    with pytest.raises(MemoryError):
        opt.update_({"w": torch.randn(4, 3)}, state, params)
    assert int(state.count) == 0
