"""on_nonfinite="raise_next" and graph steps: a step's verdict (its global loss and gradient
norm, on their way to the host) is read by a later call only when the device is done with it,
and every rank raises at the same call when any rank read one that is not finite.

CPU values are ready at once, so the device's progress is played by fake events, patched into
``Verdict``: ``query()`` says what the test wants per rank, ``synchronize()`` counts the waits.
"""

import contextlib

import pytest
import torch

import shardfn as sf
from shardfn._state.verdict import Verdict
from shardfn.testing import split_batch
from test_ranks_differ import Stack, _outcome, _setup


class _Event:
    def __init__(self, done):
        self.done, self.waits = done, 0

    def query(self):
        return self.done

    def synchronize(self):  # a wait, unless the device is done
        self.waits += not self.done
        self.done = True


@contextlib.contextmanager
def _fake_events(done):
    """Every Verdict made in the block gets an _Event(done); yields the list of them."""
    made = []
    init = Verdict.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.event = _Event(done)
        made.append(self.event)

    Verdict.__init__ = patched
    try:
        yield made
    finally:
        Verdict.__init__ = init


def _loss(apply, params, batch):
    return (apply(params, batch["x"]) ** 2).mean() * batch["scale"]


def _run(graph, done, scales, directory=None, replicate=None):
    """Calls with ``scales`` (a NaN makes that step's global loss NaN; a scale per rank may
    be given as a pair) and events whose ``query()`` is ``done``. Per call: the outcome, the
    waits so far; then a checkpoint.save's outcome and the waits after it; whether the
    raising call left the shards as they were."""
    torch.manual_seed(0)
    if replicate is None:
        mesh, _, sharded = _setup(Stack())
    else:  # a 2-D mesh: the flag must cross from one axis's header to the other's
        mesh = sf.Mesh.from_group(replicate=replicate)
        sharded = sf.shard(sf.functionalize(Stack())[0], mesh, "HYBRID_SHARD", bucket_bytes=0)
    step = sf.jit_step(_loss, mesh, optimizer=sf.optim.sgd(0.01), graph=graph,
                       **({} if graph else {"on_nonfinite": "raise_next"}))
    state = step.init(sharded)
    x = split_batch(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), mesh.rank, mesh.size)
    out = {"calls": [], "waits": [], "unchanged": True}
    with _fake_events(done[mesh.rank] if isinstance(done, tuple) else done) as made:
        for scale in scales:
            scale = scale[mesh.rank] if isinstance(scale, tuple) else scale
            before = {k: v.clone() for k, v in sharded.items()}
            try:
                sharded, state, _ = step(sharded, state, {"x": x, "scale": torch.tensor(scale)})
                out["calls"].append("ok")
            except FloatingPointError as e:
                out["calls"].append(str(e))
                out["unchanged"] &= all(torch.equal(before[k].nan_to_num(), sharded[k].nan_to_num()) for k in before)
            out["waits"].append(sum(e.waits for e in made))
        if directory is not None:
            saved = _outcome(lambda: sf.checkpoint.save(f"{directory}/r", sharded, state))
            out["save"] = saved["error"] or "saved"
            out["waits_after_save"] = sum(e.waits for e in made)
    return out


NAN = float("nan")


@pytest.mark.parametrize("graph", [False, "eager"], ids=["eager", "graph"])
def test_a_step_reads_a_verdict_when_it_is_ready_and_waits_only_beyond_two(clusters, graph, tmp_path):
    # The device never finishes on its own: a call waits only for a verdict that would
    # leave more than two unread (the oldest), and a save waits for the rest.
    for out in clusters[2].run(_run, graph, False, [1.0] * 6, str(tmp_path)):
        assert out["calls"] == ["ok"] * 6
        assert out["waits"] == [0, 0, 0, 1, 2, 3], out["waits"]
        assert out["save"] == "saved" and out["waits_after_save"] == 6, out


@pytest.mark.parametrize("graph", [False, "eager"], ids=["eager", "graph"])
def test_ranks_that_read_a_bad_verdict_at_different_times_raise_at_the_same_call(clusters, graph):
    # Rank 0's device is done at once, rank 1's never on its own. Step 3's loss is NaN: at
    # call 4 rank 0 reads it, rank 1 cannot yet; both raise there, the same error, and change
    # nothing (rank 1 waits for its values only then, to name them).
    outs = clusters[2].run(_run, graph, (True, False), [1.0, 1.0, (1.0, NAN), 1.0, 1.0])
    for rank, out in enumerate(outs):
        assert out["calls"][:3] == ["ok"] * 3, out["calls"]
        assert all(c.startswith(f"[rank {rank}] step: the last step on these shards had a global loss (nan)")
                   for c in out["calls"][3:]), out["calls"]
        assert out["unchanged"]
    assert outs[1]["waits"][:3] == [0, 0, 0], outs[1]["waits"]
    assert [c.split("]", 1)[1] for c in outs[0]["calls"][3:]] == [c.split("]", 1)[1] for c in outs[1]["calls"][3:]]


@pytest.mark.parametrize("graph", [False, "eager"], ids=["eager", "graph"])
def test_at_world_1_a_bad_verdict_raises_once_read_and_a_save_waits_for_it(clusters, graph, tmp_path):
    # Not ready: the call after the NaN step goes on (the verdict stays pending); the save waits, reads and raises.
    out = clusters[1].run(_run, graph, False, [1.0, 1.0, NAN, 1.0], str(tmp_path))[0]
    assert out["calls"] == ["ok"] * 4 and out["waits"] == [0, 0, 0, 1], out
    assert out["save"] == "FloatingPointError", out
    # Ready at once (CPU values, as before): the next call raises.
    out = clusters[1].run(_run, graph, True, [1.0, NAN, 1.0, 1.0])[0]
    assert out["calls"][:2] == ["ok", "ok"] and all("global loss (nan)" in c for c in out["calls"][2:]), out
    assert out["waits"] == [0] * 4 and out["unchanged"]


@pytest.mark.parametrize("graph", [False, "eager"], ids=["eager", "graph"])
def test_on_a_2d_mesh_one_rank_reading_a_bad_verdict_stops_all_four(clusters, graph):
    # 2 replicas x 2 shards. Only rank 3 (the other replica, the other shard) has a device
    # done at once; step 3's loss is NaN. At call 4 only rank 3 can read it: its flag must
    # reach rank 0 through both axes' headers, and all four raise the same error there.
    outs = clusters[4].run(_run, graph, (False, False, False, True), [1.0, 1.0, (1.0, 1.0, 1.0, NAN), 1.0, 1.0],
                           None, 2)
    for rank, out in enumerate(outs):
        assert out["calls"][:3] == ["ok"] * 3, (rank, out["calls"])
        assert all(c.startswith(f"[rank {rank}] step: the last step on these shards had a global loss (nan)")
                   for c in out["calls"][3:]), (rank, out["calls"])
        assert out["unchanged"]
    assert len({c.split("]", 1)[1] for out in outs for c in out["calls"][3:4]}) == 1
