"""A reusable world of spawned CPU processes joined by a gloo process group.

[Note: talking to workers] One duplex Pipe per rank, carrying plain ``pickle`` bytes,
not multiprocessing's ForkingPickler: torch registers reducers there that send a tensor
as a handle to its shared storage, and the receiver can take that storage over only
while the sender is alive, which a worker about to exit may no longer be. Results
become numpy arrays on the worker, so what arrives owns its bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection  # imports multiprocessing.util: see Cluster.__init__
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

__all__ = ["Cluster", "ClusterError", "free_port"]

_POLL_S = 0.1  # how often a waiting parent checks that its workers are alive
_ERROR_GRACE_S = 1.0  # after a first failure, how long the other ranks get to report
_KILL_GRACE_S = 1.0  # SIGTERM -> SIGKILL
_STOP_JOIN_S = 10.0  # close(): how long workers get to leave on their own
_MIN_START_S = 60.0  # starting is slow under load; a short task timeout must not fail it
_GO, _STOP = b"go", b"stop"  # not valid pickles, so they cannot be mistaken for a task


class ClusterError(RuntimeError):
    """A task failed on some rank; the cluster was torn down. `failures` maps each
    failing rank to its traceback text (or how it died)."""

    __module__ = "shardfn.testing"  # the name users import it by, in tracebacks too

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago. Another process may
    take it before the caller binds it, so callers should retry on EADDRINUSE."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_numpy(x):
    if not isinstance(x, torch.Tensor):
        return x
    t = x.detach().cpu().resolve_conj().resolve_neg()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()  # numpy lacks bf16


def _from_numpy(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _worker(rank: int, world_size: int, port: int, timeout: float, conn) -> None:
    # Ctrl-C reaches the whole process group; the parent handles it and tears us down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the cores; more threads oversubscribe them
    try:
        # Rendezvous only once every rank has imported torch: under load, imports can
        # differ by more than a short gloo timeout.
        conn.send_bytes(pickle.dumps(("ok", None)))
        conn.recv_bytes()  # go
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        conn.send_bytes(pickle.dumps(("ok", None)))
        while (data := conn.recv_bytes()) != _STOP:
            try:
                fn, args, kwargs = pickle.loads(data)
                reply = pickle.dumps(("ok", tree_map(_to_numpy, fn(*args, **kwargs))))
            except BaseException:  # SystemExit from user code is a failure too
                reply = pickle.dumps(("err", traceback.format_exc()))
            conn.send_bytes(reply)
        dist.destroy_process_group()
    except BaseException:  # EOFError included: the parent is gone
        with contextlib.suppress(BaseException):
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
        _leave(1)
    _leave(0)


def _leave(code: int) -> None:
    # A spawned worker that used gloo sometimes dies with SIGABRT ("terminate called
    # without an active exception") during a normal interpreter shutdown; leaving with
    # os._exit after destroy_process_group avoided it. os._exit skips the interpreter's
    # own flushing, so flush what the user printed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _World:
    """The live processes of one start of a Cluster, and their pipes."""

    def __init__(self, world_size: int, timeout: float, env: dict[str, str]):
        ctx = mp.get_context("spawn")
        self.port = free_port()
        self.procs, self.conns = [], []
        # Children inherit the environment at exec, before they import anything: the only
        # moment some variables count (glibc reads MALLOC_* at startup).
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                self.conns.append(parent_end)
                p = ctx.Process(target=_worker, name=f"shardfn-rank{rank}",
                                args=(rank, world_size, self.port, timeout, child_end))
                p.start()
                self.procs.append(p)
                child_end.close()  # so that a worker's death reads as EOF here
        except BaseException:
            self.kill()
            raise
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    def send(self, data: bytes) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a dead worker is reported by collect()
                conn.send_bytes(data)

    def stop(self) -> None:  # asks every worker to leave; kills whoever stays too long
        self.send(_STOP)
        deadline = time.monotonic() + _STOP_JOIN_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + _KILL_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []

    def collect(self, timeout: float, what: str) -> list:
        """Waits for one reply per rank. Kills the world and raises ClusterError if a
        rank fails, dies, or stays silent for `timeout` seconds."""
        n = len(self.procs)
        results, failures, pending = [None] * n, {}, set(range(n))
        deadline = time.monotonic() + timeout
        try:
            while pending and time.monotonic() < deadline:
                ready = mp.connection.wait([self.conns[r] for r in pending], _POLL_S)
                for r in sorted(pending):
                    conn, p = self.conns[r], self.procs[r]
                    if conn in ready:
                        try:
                            status, value = pickle.loads(conn.recv_bytes())
                        except EOFError:  # it died without answering
                            p.join(_KILL_GRACE_S)
                            status, value = "err", _death(p)
                        except Exception:  # e.g. the result cannot be unpickled here
                            status, value = "err", traceback.format_exc()
                    elif not p.is_alive() and not conn.poll():  # EOF may never come if a
                        status, value = "err", _death(p)  # grandchild holds the pipe
                    else:
                        continue
                    pending.discard(r)
                    if status == "ok":
                        results[r] = value
                    else:
                        failures[r] = value
                        # The others may be stuck waiting for this rank: report soon.
                        deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        except BaseException:  # e.g. KeyboardInterrupt: the world's state is unknown
            self.kill()
            raise
        if not failures and not pending:
            return results
        self.kill()
        lines = [f"{what} failed on {len(failures) or len(pending)} of {n} ranks:"]
        lines += [f"[rank {r}] {failures[r].rstrip()}" for r in sorted(failures)]
        if pending:
            lines.append(f"ranks {sorted(pending)} " + (
                "had not answered yet" if failures else f"did not answer within {timeout:g}"
                " s (timeout; likely a deadlock: a rank waits in a collective that the "
                "others never joined)"))
        raise ClusterError("\n".join(lines + ["The cluster was torn down."]), failures)


def _death(p) -> str:
    code = p.exitcode
    why = f" (signal {signal.strsignal(-code)})" if code is not None and code < 0 else ""
    return f"worker process {p.pid} died with exit code {code}{why}"


def _stop_worlds(worlds: list) -> None:
    while worlds:
        worlds.pop().stop()


class Cluster:
    """World of `world_size` spawned CPU processes with a gloo process group, started
    once (lazily, on the first `run`: starting costs seconds) and reused for many tasks.
    Any failure tears the whole world down, as a survivor may be stuck in a collective;
    the next `run` starts a fresh one.

    Args:
        world_size: number of ranks.
        timeout: seconds a task may take before the cluster gives up on it; also gloo's
            collective timeout. Starting the world gets at least 60 s.
        env: extra environment variables, set in each worker from its first
            instruction on (e.g. ``MALLOC_*``).

    Example:
        >>> def rank_sum(x):  # at module level of a script: workers import it by reference
        ...     t = torch.tensor([x + dist.get_rank()])
        ...     dist.all_reduce(t)
        ...     return t
        >>> if __name__ == "__main__":  # the workers import the script: only the parent runs this
        ...     with Cluster(2) as c:
        ...         assert c.run(rank_sum, 10) == [torch.tensor([21])] * 2
    """

    def __init__(self, world_size: int, *, timeout: float = 120.0,
                 env: dict[str, str] | None = None):
        if world_size < 1:
            raise ValueError(f"Cluster(world_size={world_size}): world_size must be >= 1")
        self.world_size = world_size
        self.timeout = timeout
        self.env = dict(env or {})
        self._worlds: list[_World] = []  # the live world, if any; shared with the finalizer
        self._finalizer = weakref.finalize(self, _stop_worlds, self._worlds)
        # Explicitly too: atexit runs hooks last-in, first-out, and multiprocessing.util
        # (imported above) registered one that joins non-daemonic children, which would
        # wait forever for our idle workers if it ran before the finalizer.
        atexit.register(self._finalizer)

    def __repr__(self) -> str:
        state = "running" if self._worlds else "not started"
        return f"Cluster(world_size={self.world_size}, timeout={self.timeout:g}, {state})"

    def run(self, fn, *args, **kwargs) -> list:
        """Runs ``fn(*args, **kwargs)`` on every rank.

        Returns:
            The per-rank results in rank order; tensors (also inside lists, tuples,
            dicts, NamedTuples) come back as CPU tensors, bfloat16 as float32.

        Raises:
            ClusterError: a rank raised, died or timed out; the cluster was torn down
                and the next `run` starts a fresh world.
        """
        payload = pickle.dumps((fn, args, kwargs))  # an unpicklable task fails here
        world = self._worlds[0] if self._worlds else self._start()
        try:
            world.send(payload)
            results = world.collect(self.timeout, f"run({getattr(fn, '__name__', fn)})")
        except BaseException:  # collect() has killed the world, unless interrupted before
            world.kill()
            self._worlds.clear()
            raise
        return [tree_map(_from_numpy, r) for r in results]

    def _start(self) -> _World:
        start_timeout = max(self.timeout, _MIN_START_S)
        what = f"starting {self.world_size} ranks"
        for attempt in range(2):
            world = _World(self.world_size, self.timeout, self.env)
            try:
                world.collect(start_timeout, what)  # every rank has imported torch
                world.send(_GO)
                world.collect(start_timeout, what)  # the process group is up
                self._worlds.append(world)
                return world
            except BaseException as e:
                world.kill()  # a no-op where collect() has done it
                # free_port() cannot reserve its port: another process may take it first.
                if attempt == 0 and isinstance(e, ClusterError) and "EADDRINUSE" in str(e):
                    continue
                raise
        raise AssertionError("shardfn internal error: Cluster start retried past its attempts")

    def close(self) -> None:
        """Stops the workers, killing stragglers. Idempotent; a later `run` starts a
        fresh world."""
        _stop_worlds(self._worlds)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
