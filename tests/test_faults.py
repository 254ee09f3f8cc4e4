"""Faults end cleanly: a stopped, busy or killed peer fails the others within the step
timeout, naming it; the process group is then refused with the same error."""

import datetime
import multiprocessing as mp
import os
import signal
import time

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.optim import adamw
from shardfn.testing import free_port
from test_ranks_differ import Stack, _outcome

STEP_TIMEOUT = 2.0
# gloo's own timeout in these worlds. A fault that the step timeout did not end would wait
# this long, so "ended by the step timeout" reads: at least STEP_TIMEOUT, less than PG_TIMEOUT.
# Bounds on behaviour, not speed: they hold on a machine many times slower than CI's.
PG_TIMEOUT = 60.0


def _training(mesh, stop_in_loss=False):
    torch.manual_seed(0)
    params, apply = sf.functionalize(Stack())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = adamw(1e-2)

    def loss_fn(apply, p, b):
        h = apply(p, b)
        if stop_in_loss and b.shape[0] == 5:  # the faulty step: rank 1 stops halfway through it
            dist.distributed_c10d._get_default_store().set("pid1", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return h.pow(2).mean()

    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    return sharded, opt.init(sharded), step


def _worker(rank, world, port, scenario, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT))
    mesh = sf.Mesh.from_group(step_timeout=STEP_TIMEOUT)
    sharded, state, step = _training(mesh, stop_in_loss=rank == 1 and scenario == "stopped_mid_step")
    store = dist.distributed_c10d._get_default_store()
    x = torch.randn(4, 8)
    for _ in range(4 if scenario == "stopped_mid_step" else 1):  # good steps first (from the 4th: pipelined)
        step(sharded, state, x)
    result = {}
    if rank == 1 and scenario == "stopped":
        store.set("pid1", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 continues us once it has failed
        result = {"error": None, "message": "continued"}
    elif rank == 1 and scenario == "busy":
        time.sleep(STEP_TIMEOUT + 4)  # away from shardfn longer than the step timeout
        result = _outcome(lambda: step(sharded, state, x))  # it finds nobody either
    elif rank == 1 and scenario == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    elif rank == 1 and scenario == "stopped_mid_step":
        # stops in loss_fn; continued after rank 0 has given up, it finds nobody
        result = _outcome(lambda: step(sharded, state, torch.randn(5, 8)))
    elif scenario == "stopped_mid_step":
        result = _outcome(lambda: step(sharded, state, torch.randn(5, 8)))
        os.kill(int(store.get("pid1")), signal.SIGCONT)
    else:
        if scenario == "stopped":
            pid = int(store.get("pid1"))
            time.sleep(0.5)
        result = _outcome(lambda: step(sharded, state, x))
        # Afterwards the process group is refused at once, with the same story.
        result["again"] = _outcome(lambda: step(sharded, state, x))
        if scenario == "stopped":
            os.kill(pid, signal.SIGCONT)
    queue.put((rank, result))
    queue.close()
    queue.join_thread()
    os._exit(0)


def _run(scenario, world=2, timeout=120.0, worker=None):
    """Each rank's result of ``worker(rank, world, port, scenario, queue)`` (default: this
    module's), every process ended afterwards."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker or _worker, args=(r, world, port, scenario, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            if scenario == "killed" and len(results) == world - 1:
                break
            try:
                rank, result = queue.get(timeout=0.5)
                results[rank] = result
            except Exception:  # noqa: BLE001 - queue.Empty: keep waiting
                pass
    finally:
        for p in procs:
            p.join(2)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def test_a_stopped_peer_fails_the_others_within_the_step_timeout():
    results = _run("stopped")
    out = results[0]
    assert out["error"] == "CommError", out
    assert "no answer from rank 1 within the step timeout (2 s)" in out["message"]
    assert STEP_TIMEOUT <= out["seconds"] < PG_TIMEOUT
    assert out["again"]["error"] == "CommError" and "unusable" in out["again"]["message"]
    assert out["again"]["seconds"] < STEP_TIMEOUT  # refused at once: it does not wait for anyone again
    assert results[1]["message"] == "continued"


def test_a_peer_stopped_in_the_middle_of_a_pipelined_step_is_named():
    results = _run("stopped_mid_step")
    out = results[0]
    # rank 0 waits in a collective of the step's forward, not in a header
    assert out["error"] == "CommError" and "no answer from rank 1 within the step timeout (2 s)" in out["message"], out
    assert "header" not in out["message"] and "start of a step" not in out["message"]
    assert STEP_TIMEOUT <= out["seconds"] < PG_TIMEOUT
    assert results[1]["error"] == "CommError", results[1]


def test_a_peer_busy_elsewhere_fails_both_and_nobody_hangs():
    results = _run("busy")
    assert results[0]["error"] == "CommError" and "no answer from rank 1" in results[0]["message"]
    # Rank 1 comes back to a rank that has given up: it times out too, naming rank 0.
    assert results[1]["error"] == "CommError", results[1]
    assert results[1]["seconds"] < PG_TIMEOUT


def test_a_killed_peer_is_named_at_once():
    results = _run("killed")
    out = results[0]
    assert out["error"] == "CommError", out
    assert "rank 1 closed the connection" in out["message"]
    # The message says how it was found (the closed connection, then the guard's 3 s roll call
    # of who is left); the bound: no timeout of gloo's was waited for.
    assert out["seconds"] < PG_TIMEOUT
