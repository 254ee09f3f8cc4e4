"""Which waits a step makes, as a CUDA mesh would make them (issue 48).

On NCCL, ``work.wait(timeout)`` blocks the host until the collective has finished, while
``work.wait()`` only makes the current stream wait. So on a channel whose data group runs
NCCL, shardfn waits for its data collectives on the stream, and only the guard's header
exchanges (on the gloo control group beside it) block the host, bounded by the step
timeout. This machine has no GPU: the test builds the channel a CUDA mesh builds (a gloo
control group beside the data group) over a data group whose backend reads "nccl", runs
real steps at world 2 on gloo, and records every ``wait`` shardfn makes with its argument.
"""

import datetime

import torch
import torch.distributed as dist

import shardfn as sf
from shardfn._comm import guard as G
from shardfn._comm.communicator import EAGER
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, lm_loss
from test_counts import CFG

STEP_TIMEOUT = 7.0  # a value no default has, so a wait that passes it was given this mesh's
DATA_PER_STEP = 2 * 3 + 1 + 4 + 1  # FULL_SHARD, no buckets: tests/test_counts.py pins these
STEPS = 5  # three checked, then pipelined ([Note: the pipelined guard]; as in tests/test_faults.py)


class Recorder:
    """A work handle that notes each ``wait`` (what it was, the group, the argument)."""

    def __init__(self, work, what, group, log):
        self.work, self.what, self.group, self.log = work, what, group, log

    def wait(self, *args, **kwargs):
        timeout = args[0] if args else kwargs.get("timeout")
        self.log.append((self.what, self.group, timeout))
        return self.work.wait(*args, **kwargs)

    def is_completed(self):
        return self.work.is_completed()


def _nccl_channel(mesh):
    """The shard axis's channel rebuilt as on a CUDA mesh (shardfn._mesh._add_channels): its
    headers on a gloo group of the same ranks, its data group's backend read as "nccl"."""
    group = mesh.group("shard")
    control = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
    real = dist.get_backend
    dist.get_backend = lambda g=None: "nccl" if g is group else real(g)
    try:
        mesh.guard.channels["shard"] = mesh.guard.channel(group, "shard", control)
    finally:
        dist.get_backend = real
    return group, control


def _recording(log):
    """Patches the places shardfn's waited work handles come from (the eager communicator,
    which the play-out shares, and the guard's rounds); returns the undo."""
    saved = [(EAGER, "all_gather"), (EAGER, "reduce_scatter"), (EAGER, "all_reduce"), (G, "_rounds")]
    saved = [(m, n, getattr(m, n)) for m, n in saved]
    originals = {n: f for _, n, f in saved}

    def data(name):
        real = originals[name]

        def issue(*args):
            group = args[1 if name == "all_reduce" else 2].group  # (t, ch, op) or (out, inp, ch, ...)
            out = real(*args)
            if name == "reduce_scatter":
                return Recorder(out[0], "data", group, log), out[1]
            return Recorder(out, "data", group, log)

        return issue

    real_rounds = originals["_rounds"]

    def rounds(ch, mine):
        gen = real_rounds(ch, mine)
        work = next(gen)
        while True:
            yield Recorder(work, "header", ch.control, log)
            try:
                work = next(gen)
            except StopIteration as done:
                return done.value

    for owner, name, _ in saved:
        setattr(owner, name, rounds if name == "_rounds" else data(name))

    def undo():
        for owner, name, f in saved:
            if owner is EAGER:
                delattr(owner, name)  # the class's method again
            else:
                setattr(owner, name, f)

    return undo


def waits_per_step(nccl):
    """Each step's waits, as ``(what, on the data group / the control group / other, timeout)``,
    and each step's collectives (``record_collectives``) and header exchanges."""
    mesh = sf.Mesh.from_group(step_timeout=STEP_TIMEOUT)
    group, control = _nccl_channel(mesh) if nccl else (mesh.group("shard"), mesh.group("shard"))
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, "FULL_SHARD", bucket_bytes=0)
    opt = sf.optim.sgd(0.1)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=opt)
    g = torch.Generator().manual_seed(0)
    batch = split_batch({k: torch.randint(0, 31, (12, 8), generator=g) for k in ("x", "y")}, mesh.rank, mesh.size)
    steps = []
    for _ in range(STEPS):
        log, headers = [], mesh.guard.headers
        undo = _recording(log)
        try:
            with sf.record_collectives() as calls:
                sharded, state, _ = step(sharded, state, batch)
        finally:
            undo()
        where = {id(control): "control group", id(group): "data group"}  # on gloo, one group: "data group"
        steps.append({"waits": [(what, where.get(id(grp), "other"), t) for what, grp, t in log],
                      "collectives": len(calls.calls), "headers": mesh.guard.headers - headers})
    return {"steps": steps, "separate_control": control is not group}


BOUNDED = datetime.timedelta(seconds=STEP_TIMEOUT)


def _check(steps, data_wait, header_group):
    """Every step: one wait per data collective on the data group, as ``data_wait``; one
    bounded wait per header exchange, on ``header_group``; a pipelined step two headers."""
    for i, s in enumerate(steps):
        assert s["collectives"] == DATA_PER_STEP, (i, s["collectives"])
        data = [w for w in s["waits"] if w[0] == "data"]
        headers = [w for w in s["waits"] if w[0] == "header"]
        assert len(data) + len(headers) == len(s["waits"])
        assert data == [("data", "data group", data_wait)] * DATA_PER_STEP, (i, data)
        assert headers == [("header", header_group, BOUNDED)] * s["headers"], (i, headers)
    # checked steps: the opening header, then one per collective; pipelined: opening and metrics
    assert [s["headers"] for s in steps] == [1 + DATA_PER_STEP] * 3 + [2] * (STEPS - 3)


def test_on_nccl_data_collectives_wait_on_the_stream_and_headers_on_the_host(clusters):
    for r in clusters[2].run(waits_per_step, True):
        assert r["separate_control"]
        _check(r["steps"], None, "control group")


def test_on_gloo_every_wait_is_bounded_by_the_step_timeout(clusters):
    for r in clusters[2].run(waits_per_step, False):
        assert not r["separate_control"]  # on the CPU the headers travel on the group itself
        _check(r["steps"], BOUNDED, "data group")
