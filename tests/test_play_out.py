"""A pipelined step whose failing rank cannot play out the schedule (issue 56, item 7).

A rank whose pipelined step raises plays out the rest of the schedule with scratch buffers,
so that its peers' collectives complete ([Note: the pipelined guard]). Here that fails too
(faked: no memory for the scratch, or a collective of the play-out that raises), which leaves
the peers in a collective the rank never issues. Every rank must still raise within the step
timeout, the peers naming the rank and the cause, and the mesh must refuse later steps.
"""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from shardfn._comm import pipelined as P
from shardfn._comm.communicator import EAGER
from shardfn.optim import adamw
from test_faults import PG_TIMEOUT, STEP_TIMEOUT, _run
from test_ranks_differ import Stack
from test_waits import _nccl_channel

FAKE_OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (a fake, on rank 1)"
_FACTORIES = {"empty", "zeros", "ones", "full", "empty_strided", "new_empty", "new_zeros", "new_full", "empty_like",
              "zeros_like"}


class _NoMemory(TorchDispatchMode):
    """Every new tensor fails as an allocation on a full GPU does."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in _FACTORIES:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate the play-out's scratch (a fake)")
        return func(*args, **(kwargs or {}))


def _fail_play_out(fake):
    """On this rank, the play-out fails: ``"allocation"``, no memory for anything it allocates;
    ``"collective"``, its second collective raises (after the first one completed)."""
    if fake == "allocation":
        real = P.Run.play_out

        def play_out(self):
            with _NoMemory():
                return real(self)

        P.Run.play_out = play_out
        return
    issued, playing = [0], [False]

    def failing(real):
        def issue(*args):
            if playing[0]:
                issued[0] += 1
                if issued[0] == 2:
                    raise torch.OutOfMemoryError("NCCL: out of memory for the collective (a fake)")
            return real(*args)
        return issue

    real_play_out = P.Run.play_out

    def play_out(self):
        playing[0] = True
        try:
            return real_play_out(self)
        finally:
            playing[0] = False

    P.Run.play_out = play_out
    for name in ("all_gather", "reduce_scatter", "all_reduce"):  # the play-out's, through the eager communicator
        setattr(EAGER, name, failing(getattr(EAGER, name)))


class _OnStream:
    """A work handle whose plain ``wait()`` returns at once, as NCCL's does on the host (it
    makes the stream wait); with a timeout it blocks, as NCCL's does."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs) if args or kwargs else True

    def is_completed(self):
        return self.work.is_completed()


def _run_ahead():
    """From here on, data collectives are waited for on the "stream", as on NCCL: the host
    runs ahead of them. (Only for the failing step: nothing there reads a result on the host
    before the metrics header, where a GPU would wait for its stream.)"""
    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        real = getattr(EAGER, name)

        def issue(*args, _real=real, _name=name):
            out = _real(*args)
            return (_OnStream(out[0]), out[1]) if _name == "reduce_scatter" else _OnStream(out)

        setattr(EAGER, name, issue)


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "message": "", "notes": [], "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test inspects it
        return {"error": type(e).__name__, "message": str(e), "notes": list(getattr(e, "__notes__", [])),
                "seconds": time.monotonic() - t0}


def _worker(rank, world, port, scenario, queue):
    fake, backend, rank_1, cause = scenario
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    mesh = sf.Mesh.from_group(step_timeout=STEP_TIMEOUT)
    if backend == "nccl":  # its headers on a gloo group beside the data group, as on CUDA
        _nccl_channel(mesh)
    torch.manual_seed(0)
    params, _ = sf.functionalize(Stack())
    sharded = sf.shard(params, mesh, "FULL_SHARD", bucket_bytes=0)
    opt = adamw(1e-2)
    failing = [False]

    def loss_fn(apply, p, b):
        if failing[0] and rank == 1 and cause == "leaves the schedule":  # skips layers.1: plays out from there
            return apply(p, b, skip=(1,)).pow(2).mean()
        loss = apply(p, b).pow(2).mean()
        if failing[0] and rank == 1:  # after the forward's all-gathers: the backward's are left to play out
            raise torch.OutOfMemoryError(FAKE_OOM)
        return loss

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    state = opt.init(sharded)
    x = torch.randn(4, 8)
    for _ in range(4):  # checked steps, then pipelined ones
        sharded, state, _ = step(sharded, state, x)
    result = {"pipelined": step.grad.schedule.pipelined}
    if backend == "nccl":
        _run_ahead()
    if rank == 1:
        _fail_play_out(fake)
    failing[0] = True
    result.update(_outcome(lambda: step(sharded, state, x)))
    failing[0] = False
    result["again"] = _outcome(lambda: step(sharded, state, x))
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("rank 0 is done", "1")
    elif rank_1 == "lives on":  # its process (and sockets) stay until rank 0 is done: rank 0 must not wait for gloo
        try:
            store.wait(["rank 0 is done"], datetime.timedelta(seconds=PG_TIMEOUT))
        except dist.DistNetworkError:  # rank 0, the store's host, set it and exited before the reply reached us
            pass
    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    os._exit(0)


@pytest.mark.parametrize("fake, backend, rank_1, cause", [
    ("allocation", "gloo", "lives on", "raises"), ("collective", "gloo", "lives on", "raises"),
    ("allocation", "gloo", "exits", "raises"), ("allocation", "gloo", "lives on", "leaves the schedule"),
    # "nccl": the channel of a CUDA mesh and NCCL's waits on the host, emulated on gloo
    ("allocation", "nccl", "lives on", "raises"), ("collective", "nccl", "lives on", "raises"),
])
def test_a_play_out_that_fails_ends_every_rank_and_the_mesh(fake, backend, rank_1, cause):
    results = _run((fake, backend, rank_1, cause), worker=_worker)
    assert sorted(results) == [0, 1], results  # no rank died (gloo aborts a process on mismatched collectives)
    mine, peer = results[1], results[0]
    assert mine["pipelined"] and peer["pipelined"], results
    # Rank 1 raises its own error (its loss_fn's, or the play-out's when it left the schedule),
    # with a note that its play-out failed and what that leaves.
    assert mine["error"] == "OutOfMemoryError", mine
    assert (FAKE_OOM if cause == "raises" else "(a fake)") in mine["message"], mine
    note = "\n".join(mine["notes"])
    assert note.startswith("[rank 1] shardfn:") and "could not play out" in note and "unusable" in note, mine
    # Rank 0 raises CommError naming rank 1, what it did and its failed play-out, not "no answer".
    assert peer["error"] == "CommError", peer
    story = "rank 1 raised in a pipelined step" if cause == "raises" else "rank 1 left its pipelined step's schedule"
    assert story in peer["message"] and "could not play out" in peer["message"], peer
    assert cause != "raises" or FAKE_OOM in peer["message"], peer
    assert "no answer" not in peer["message"], peer
    assert peer["seconds"] < PG_TIMEOUT  # ended by shardfn (the step timeout, or a header), not by gloo
    if backend == "nccl":  # told at the metrics header, on the gloo group beside the data group
        assert peer["message"].startswith("[rank 0] shardfn: all_reduce (metrics) on ranks [0, 1] cannot complete")
    # Afterwards the process group is refused on every rank, at once, with the same story.
    for out in results.values():
        again = out["again"]
        assert again["error"] == "CommError" and "unusable" in again["message"], again
        assert "could not play out" in again["message"], again
        assert again["seconds"] < STEP_TIMEOUT, again  # refused: it waits for no one
    # The error rank 0 raised is the one that made the group unusable: once a wait ended so,
    # its step waited for no other collective (each would have taken another step timeout).
    assert results[0]["again"]["message"].endswith(peer["message"]), results[0]
