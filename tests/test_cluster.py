"""Tests for the multi-process CPU harness, shardfn.testing._cluster.

Task functions live at module level: workers unpickle them by reference, which also
checks that spawned workers see this test module on their sys.path.
"""

import multiprocessing
import os
import pickle
import socket
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from shardfn.testing import _cluster
from shardfn.testing._cluster import Cluster, ClusterError, free_port


class Pair(NamedTuple):
    x: torch.Tensor
    note: str


def _describe(scale):
    rank = dist.get_rank()
    env = tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                        "LOCAL_WORLD_SIZE", "MASTER_ADDR"))
    return {
        "rank": rank,
        "env": env,
        "threads": torch.get_num_threads(),
        "f32": torch.arange(3.0) * scale + rank,
        "bf16": torch.tensor([1.5, rank], dtype=torch.bfloat16),
        "nested": [Pair(torch.full((2, 2), rank), "hi"), (torch.tensor(rank),)],
        "grad": torch.ones(2, requires_grad=True) * 2,  # non-leaf, requires grad
    }


def _scaled(x):
    return x * (dist.get_rank() + 1)


def _all_reduce_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return "fine"


def _exit_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    return "fine"


def _deadlock():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return "left"


def _sleep_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(60)
    return "awake"


def _initial_environ():
    # /proc/self/environ is the environment at exec, which is what glibc's MALLOC_* see.
    with open("/proc/self/environ", "rb") as f:
        return [kv.decode() for kv in f.read().split(b"\0") if kv.startswith(b"SHARDFN_T")]


def _assert_gone(pids):
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # a zombie (not joined) would still answer
    assert not set(pids) & {p.pid for p in multiprocessing.active_children()}


@pytest.fixture(scope="module")
def fragile():
    """A world of 2 for the tests that break it (the session's `clusters` stay whole)."""
    with Cluster(2, timeout=60) as c:
        yield c


def test_results_in_rank_order_round_trip_tensors(clusters):
    out = clusters[2].run(_describe, scale=2.0)
    assert [o["rank"] for o in out] == [0, 1]
    for rank, o in enumerate(out):
        assert o["env"] == (str(rank), "2", str(rank), "2", "127.0.0.1")
        assert o["threads"] == 1
        torch.testing.assert_close(o["f32"], torch.arange(3.0) * 2 + rank)
        assert o["bf16"].dtype == torch.float32
        torch.testing.assert_close(o["bf16"], torch.tensor([1.5, float(rank)]))
        pair, (scalar,) = o["nested"]
        assert type(pair) is Pair and pair.note == "hi"
        torch.testing.assert_close(pair.x, torch.full((2, 2), rank))
        assert isinstance(scalar, torch.Tensor) and scalar.item() == rank
        torch.testing.assert_close(o["grad"], torch.full((2,), 2.0))
        assert not o["grad"].requires_grad


def test_large_arguments_and_results_pass_through_pipes(clusters):
    x = torch.randn(1 << 21)  # 8 MB each way, far beyond a pipe's buffer
    out = clusters[2].run(_scaled, x)
    torch.testing.assert_close(out[0], x, rtol=0, atol=0)
    torch.testing.assert_close(out[1], 2 * x, rtol=0, atol=0)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_sums_over_ranks(clusters, world_size):
    expected = float(sum(range(1, world_size + 1)))
    assert clusters[world_size].run(_all_reduce_sum) == [expected] * world_size


def test_failure_reports_traceback_and_next_run_gets_fresh_world(fragile):
    old = fragile.run(os.getpid)
    with pytest.raises(ClusterError) as info:
        fragile.run(_fail_on_rank_one)
    msg = str(info.value)
    assert "[rank 1]" in msg and "[rank 0]" not in msg
    assert "ValueError: boom on rank one" in msg
    assert 'raise ValueError("boom on rank one")' in msg  # the traceback's source line
    assert set(info.value.failures) == {1}
    _assert_gone(old)
    new = fragile.run(os.getpid)
    assert not set(new) & set(old)
    assert fragile.run(_all_reduce_sum) == [3.0, 3.0]


def test_worker_death_is_reported_with_exit_code(fragile):
    old = fragile.run(os.getpid)
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"\[rank 1\].*exit code 3"):
        fragile.run(_exit_on_rank_one)
    assert time.monotonic() - start < fragile.timeout / 2  # detected by the exit, not by the 60 s timeout
    _assert_gone(old)


def test_deadlock_times_out_and_leaves_no_process():
    with Cluster(2, timeout=3) as c:
        pids = c.run(os.getpid)
        start = time.monotonic()
        with pytest.raises(ClusterError) as info:
            c.run(_deadlock)
        # Ended by a 3 s timeout, not left hanging: nothing else could end it (a bound on that,
        # with room for a loaded machine to tear the world down, not a speed).
        assert time.monotonic() - start < c.timeout + 30
        # Either gloo's own timeout on rank 0 or the cluster's: whichever fires first.
        msg = str(info.value)
        assert "[rank 0]" in msg or "ranks [0] did not answer" in msg
        assert 1 not in info.value.failures  # rank 1 answered
        _assert_gone(pids)


def test_silent_rank_is_named_after_timeout():
    with Cluster(1, timeout=2) as c:
        pids = c.run(os.getpid)
        start = time.monotonic()
        with pytest.raises(ClusterError, match=r"ranks \[0\] did not answer within 2 s"):
            c.run(_sleep_on_rank_zero)
        assert 2 <= time.monotonic() - start < c.timeout + 30  # named after the timeout, not hanging
        _assert_gone(pids)


def test_close_leaves_no_children_and_env_reaches_workers_from_exec():
    assert "SHARDFN_TEST_VAR" not in os.environ
    c = Cluster(2, env={"SHARDFN_TEST_VAR": "x"})
    assert not c._worlds  # constructing starts nothing
    assert c.run(_initial_environ) == [["SHARDFN_TEST_VAR=x"]] * 2
    assert "SHARDFN_TEST_VAR" not in os.environ  # the parent's environment is restored
    pids = c.run(os.getpid)
    c.close()
    _assert_gone(pids)
    c.close()  # idempotent


def test_closed_cluster_restarts_and_finalizer_stops_workers():
    c = Cluster(1)
    pids = c.run(os.getpid)
    c.close()
    _assert_gone(pids)
    assert c.run(_all_reduce_sum) == [1.0]  # a closed cluster starts again on demand
    pids = c.run(os.getpid)
    del c  # dropping the last reference stops the world
    _assert_gone(pids)


def test_unpicklable_task_fails_in_parent_without_starting():
    c = Cluster(2)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        c.run(lambda: 1)
    assert not c._worlds


def test_start_retries_once_when_the_port_is_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        monkeypatch.setattr(_cluster, "free_port", lambda: next(ports))
        with Cluster(1, timeout=30) as c:
            assert c.run(_all_reduce_sum) == [1.0]
        assert next(ports, None) is None  # both ports were used


def test_free_port_is_bindable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
