"""jit_step(graph=True) on CUDA: the recorded program replayed as one CUDA graph
([Note: capturing a step] in shardfn._program.capture), checked on the CPU with fakes of the pieces of
``torch.cuda`` it uses (tests/fake_cuda.py): a fake graph as strict as CUDA's, whose capture
records the ops and runs nothing and whose replay runs the recorded ops on the captured
memory, never the step's Python, and fake streams that log what waits on what. No GPU is
needed; the GPU run is ``python benchmarks/gpu_check.py --graph``.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import shardfn as sf
from fake_cuda import FakeCuda
from shardfn._program import capture as _capture
from shardfn.testing import split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model
from test_faults import _run
from test_ranks_differ import _outcome


def _program(calls):
    """A stand-in for a recorded program: updates the state in place, returns new 0-d outputs."""

    def fn(state, inputs):
        calls.append(FakeCuda.on[-1].name)
        state[0].add_(inputs[0].sum())
        return [state[0].sum() * 2, inputs[0].mean()]

    return fn


def test_first_use_runs_eagerly_on_a_side_stream_then_captures_once_and_replays():
    fake, calls = FakeCuda(), []
    state = [torch.zeros(3)]
    captured = _capture.Captured(_program(calls), torch.device("cpu"), cuda=fake)
    outs = []
    for i in range(4):
        outs.append(captured(state, [torch.full((2,), float(i + 1))]))
    # 1: eager on the side stream, fenced both ways; 2: captured (recorded, not run), then
    # replayed once for this call's step; 3, 4: replays only.
    # The step's Python runs twice, both on the side stream: eagerly, and once while captured.
    # A replay runs the recorded ops only.
    assert calls == ["side0", "side0"] and FakeCuda.log[:3] == [("wait", "side0", "current"), ("on", "side0"),
                                                                ("wait", "current", "side0")]
    assert len(fake.graphs) == 1 and fake.graphs[0].replays == 3 and captured.captures == 1
    assert [e for e in FakeCuda.log if e[0] in ("capture", "replay")] == [
        ("capture", "side0"), ("replay", "current"), ("replay", "current"), ("replay", "current")]
    # Every call is a real step: the state holds 2 * (1 + 2 + 3 + 4)
    assert state[0].tolist() == [20.0] * 3
    # What a user keeps is not overwritten by the next replay, and each call's own value
    assert [o[1].item() for o in outs] == [1.0, 2.0, 3.0, 4.0]
    assert [o[0].item() for o in outs] == [2 * 3 * 2.0, 2 * 3 * 6.0, 2 * 3 * 12.0, 2 * 3 * 20.0]
    static = fake.graphs[0].outputs
    assert all(t.data_ptr() != s.data_ptr() for o in outs[1:] for t in o for s in static)
    assert captured.clone_bytes == 2 * 4  # two fp32 0-d outputs copied out per replayed call


def _capture_alone(body, fake=None):
    """``body`` captured by a fake graph, as Captured does (on a side stream, into a new pool)."""
    fake = fake or FakeCuda()
    return fake.capture(body, fake.side_stream(None), fake.new_pool(None))


_HOST = "reads a tensor's value on the host while capturing"


@pytest.mark.parametrize("read, why", [
    (lambda t: t.sum().item(), _HOST), (lambda t: bool(t.sum() > 0), _HOST), (lambda t: torch.equal(t, t), _HOST),
    (lambda t: t.nonzero(), _HOST), (lambda t: t.tolist(), r"Tensor.tolist\(\) while capturing"),
    (lambda t: t.numpy(), r"Tensor.numpy\(\) while capturing"),
    (lambda t: torch.get_rng_state(), r"torch.get_rng_state\(\) while capturing"),
    (lambda t: torch.cuda.get_rng_state(), r"torch.cuda.get_rng_state\(\) while capturing"),
    (lambda t: torch.random.set_rng_state(t), r"torch.random.set_rng_state\(\) while capturing"),
    (lambda t: t + torch.tensor([1.0, 2.0, 3.0]), r"lift_fresh reads a \(3,\) tensor allocated while capturing "
                                                 r"outside the graph's pool"),
])
def test_the_fake_refuses_what_a_capture_cannot_hold(read, why):
    from fake_cuda import CaptureError

    t = torch.ones(3)
    with pytest.raises(CaptureError, match=why):
        _capture_alone(lambda: [read(t)])
    assert t.tolist() == [1.0, 1.0, 1.0]  # and nothing is left patched


def test_the_fake_replays_the_captured_ops_on_the_captured_memory():
    calls, state, given = [], torch.zeros(3), torch.ones(3)

    def body():
        calls.append(1)
        state.add_(given)
        return [state * 2, torch.rand(2)]

    rng = torch.get_rng_state()
    graph, (doubled, drawn) = _capture_alone(body)
    # Capture runs nothing: the state and the generator are as before, the outputs garbage
    assert state.tolist() == [0.0] * 3 and torch.equal(torch.get_rng_state(), rng)
    assert doubled.isnan().all() and drawn.isnan().all()
    expected = torch.rand(2)
    torch.set_rng_state(rng)
    graph.replay()
    assert calls == [1] and state.tolist() == [1.0] * 3 and doubled.tolist() == [2.0] * 3
    assert torch.equal(drawn, expected)  # a random op draws from the generator at replay, as eager does
    first = drawn.clone()
    given.fill_(5.0)  # the memory the capture read, changed in place: read by the next replay
    graph.replay()
    assert state.tolist() == [6.0] * 3 and doubled.tolist() == [12.0] * 3 and not torch.equal(drawn, first)
    given = torch.full((3,), 100.0)  # another tensor in the Python name: the graph still reads the old one
    graph.replay()
    assert state.tolist() == [11.0] * 3 and calls == [1]


def test_a_capture_that_raises_leaves_the_memory_as_it_was():
    state = torch.zeros(3)

    def body():
        state.add_(1.0)
        state.mul_(3.0)
        return [state.sum()]

    with pytest.raises(torch.OutOfMemoryError, match=r"op #1, mul"):
        _capture_alone(body, FakeCuda(fail={0: 1}))
    assert state.tolist() == [0.0] * 3


def test_a_replay_reads_the_state_it_is_given():
    fake, calls = FakeCuda(), []
    captured = _capture.Captured(_program(calls), torch.device("cpu"), cuda=fake)
    old = [torch.zeros(3)]
    for _ in range(2):  # eager, then captured on `old`
        captured(old, [torch.ones(2)])
    new = [torch.full((3,), 10.0)]  # another tree of the same shapes: captured again, on it
    outs = captured(new, [torch.ones(2)])
    assert new[0].tolist() == [12.0] * 3 and old[0].tolist() == [4.0] * 3 and outs[0].item() == 2 * 36.0
    assert captured.captures == 2 and fake.graphs[0].destroyed and not fake.graphs[1].destroyed
    alias = [new[0].view(3)]  # another object over the same memory, shape and strides: the same state
    captured(alias, [torch.ones(2)])
    assert new[0].tolist() == [14.0] * 3 and captured.captures == 2
    strided = [torch.zeros(6)[::2]]  # the same shape, other strides: captured again
    captured(strided, [torch.ones(2)])
    assert strided[0].tolist() == [2.0] * 3 and new[0].tolist() == [14.0] * 3 and captured.captures == 3


def test_a_capture_that_raises_runs_nothing_and_the_next_call_captures_again():
    fake, calls = FakeCuda(fail={0: 1}), []
    captured = _capture.Captured(_program(calls), torch.device("cpu"), cuda=fake)
    state = [torch.zeros(3)]
    captured(state, [torch.ones(2)])  # eager
    with pytest.raises(torch.OutOfMemoryError, match="while capturing"):
        captured(state, [torch.ones(2)])
    assert state[0].tolist() == [2.0] * 3 and captured.graph is None and captured.captures == 0
    captured(state, [torch.ones(2)])
    assert state[0].tolist() == [4.0] * 3 and captured.captures == 1 and fake.graphs[-1].replays == 1


def test_each_replay_copies_the_batch_into_the_same_static_buffers():
    fake, calls = FakeCuda(), []
    captured = _capture.Captured(_program(calls), torch.device("cpu"), cuda=fake)
    state = [torch.zeros(3)]
    seen = []
    for i in range(5):
        batch = [torch.full((2,), float(i))]
        captured(state, batch)
        if i >= 1:
            seen.append(captured.static_inputs[0].data_ptr())
            assert captured.static_inputs[0] is not batch[0] and captured.static_inputs[0].tolist() == [float(i)] * 2
    assert len(set(seen)) == 1


def test_close_destroys_the_graph_and_a_later_call_captures_again():
    fake, calls = FakeCuda(), []
    captured = _capture.Captured(_program(calls), torch.device("cpu"), cuda=fake)
    state = [torch.zeros(3)]
    for _ in range(3):
        captured(state, [torch.ones(2)])
    _capture.close_all()  # what runs at exit, before the process group's own teardown
    assert fake.graphs[0].destroyed and captured.graph is None and captured.static_inputs is None
    captured(state, [torch.ones(2)])  # eager again, then a new capture
    captured(state, [torch.ones(2)])
    assert len(fake.graphs) == 2 and not fake.graphs[1].destroyed


def test_nccl_graph_register_is_turned_off_where_segments_expand(monkeypatch):
    for conf, expect in (("expandable_segments:True", "0"), ("max_split_size_mb:64", None)):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
        captured = _capture.Captured(_program([]), torch.device("cpu"), cuda=FakeCuda())
        captured([torch.zeros(1)], [torch.ones(1)])
        assert os.environ.get("NCCL_GRAPH_REGISTER") is None  # not before the first capture
        captured([torch.zeros(1)], [torch.ones(1)])
        assert os.environ.get("NCCL_GRAPH_REGISTER") == expect
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")  # the user's own choice is kept
    captured = _capture.Captured(_program([]), torch.device("cpu"), cuda=FakeCuda())
    for _ in range(2):
        captured([torch.zeros(1)], [torch.ones(1)])
    assert os.environ["NCCL_GRAPH_REGISTER"] == "1"


class _Channel:
    def __init__(self, off, on_stream):
        self.off, self.on_stream = off, on_stream


class _Mesh:
    device = torch.device("cuda", 0)
    rank = 0
    axis_names = ("shard",)

    def __init__(self, channel):
        self._channel = channel

    def channel(self, axis):
        return self._channel


def test_what_a_cuda_graph_cannot_hold_is_refused():
    nccl, gloo, alone = _Channel(False, True), _Channel(False, False), _Channel(True, False)
    _capture.check_capturable(_Mesh(nccl))
    _capture.check_capturable(_Mesh(alone))  # a world of one: no collective
    with pytest.raises(ValueError, match=r"\[rank 0\].*on cuda:0.*'shard'.*gloo.*NCCL"):
        _capture.check_capturable(_Mesh(gloo))


def _host_program(constant=None, host_op=False):
    """A recorded-like program ``(state, batch) -> [state[0] * 2, batch[0] * 3]`` (a host scalar added to the first)."""

    def fn(state, batch):
        out = state[0] * 2
        if constant is not None:
            out = out + constant  # a 0-d host tensor may meet device tensors
        if host_op:
            out = out + torch.ones(4).sum()
        return [out, batch[0] * 3]

    return fn


def test_a_host_tensor_in_a_device_program_is_refused_naming_it():
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardfn._program.host import refuse_host_tensors
    from shardfn._comm.recording import Unrecordable

    cuda = torch.device("cuda", 0)
    names = ["params['w']", "batch leaf 0"]
    with FakeTensorMode():  # CUDA tensors without a GPU (no autograd: a CPU build cannot run it on them)
        state, batch = [torch.zeros(4, device="cuda")], [torch.zeros(2, device="cuda")]
        refuse_host_tensors(make_fx(_host_program())(state, batch), cuda, names)  # all on the device
        refuse_host_tensors(make_fx(_host_program())([torch.zeros(4)], batch), torch.device("cpu"), names)  # the host
        cases = [
            (make_fx(_host_program())([torch.zeros(4)], batch), r"input params\['w'\] is a \(4,\) torch.float32 tensor on cpu"),
            (make_fx(_host_program())(state, [torch.zeros(2)]), r"input batch leaf 0 is a \(2,\) .* on cpu, not on the mesh's cuda:0"),
            (make_fx(_host_program(constant=torch.tensor(1.0)))(state, batch), r"holds a constant \(\) torch.float32 tensor on cpu"),
            (make_fx(_host_program(host_op=True))(state, batch), r"aten\.\w+\.\w+ makes a \(\d*,?\) torch.float32 tensor on cpu, .*cuda:0"),
        ]
        for gm, message in cases:
            with pytest.raises(Unrecordable, match=message) as caught:
                refuse_host_tensors(gm, cuda, names)
            assert "cuda:0" in caught.value.fix


def _with_fakes(fake, run, *args):
    """``run(*args)``, whose graph step captures its programs on the CPU with ``fake`` for
    CUDA's pieces (``GraphStep.graphs``)."""
    return run(*args, graphs=fake)


def _graph_step_captured(steps):
    """A graph step on a world-1 CPU mesh, captured by the fakes. Losses and per-program captures."""
    fake = FakeCuda()
    out = _with_fakes(fake, _graph_step, steps)
    step = out.pop("step")
    out["captured"] = [p.fn for p in step.programs.values()]
    out["captures"] = [c.captures for c in out["captured"]]
    out["graphs"] = len(fake.graphs)
    step.close()
    out["destroyed"] = [g.destroyed for g in fake.graphs]
    out["held"] = [c.graph for c in out.pop("captured")]
    return out


def _graph_step(steps, graphs=None):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = sf.optim.adamw(1e-3)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, graph="eager")
    if graphs is not None:
        step.graphs = graphs
    state = opt.init(sharded)
    losses, kept = [], []
    for batch in steps:
        sharded, state, metrics = step(sharded, state, batch)
        kept.append(metrics["loss"])
        losses.append(float(metrics["loss"]))
    return {"losses": losses, "kept": [float(t) for t in kept], "step": step}


def _graph_step_plain(steps):
    """The same graph step, its program replayed uncaptured."""
    out = _graph_step(steps)
    out.pop("step").close()
    return out


def test_a_graph_step_captures_each_program_once(clusters):
    batches = gpt_batches(5)
    short = [{k: v[:, :4] for k, v in b.items()} for b in gpt_batches(3, seed=3)]
    steps = batches + short  # a new batch shape: a new program, a new Captured
    got = clusters[1].run(_graph_step_captured, steps)[0]
    plain = clusters[1].run(_graph_step_plain, steps)[0]
    assert got["losses"] == plain["losses"]  # the same program on the same batches, bit for bit
    assert got["kept"] == got["losses"]  # each call's loss still reads the same after later replays
    # programs recorded at calls 2 and 6, run eagerly at calls 3 and 7, captured at 4 and 8
    assert got["captures"] == [1, 1] and got["graphs"] == 2
    assert got["destroyed"] == [True, True] and got["held"] == [None, None]  # step.close() dropped them


# -- a replay reads the state it is given (issue 56) -----------------------------------

_CHANGE_AT = 4  # the steps run before a scenario's change: eager, recorded, run eagerly, captured


def _dropout_loss(apply, params, batch):
    """gpt_loss with dropout on the logits: a random op in the program."""
    return gpt_loss(lambda p, x: torch.nn.functional.dropout(apply(p, x), 0.2), params, batch)


def _scenario(name, directory, graph="eager", steps=8, graphs=None):
    """``steps`` steps of the test GPT at world 1 (FULL_SHARD, AdamW, ``graph="eager"``) with the
    change ``name`` before step :data:`_CHANGE_AT`: the losses, the final full parameters and
    the captures of each program (none when nothing is captured)."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    plan = {"remat": sf.Plan("FULL_SHARD", remat=sf.Remat()),
            "bf16": sf.Plan("FULL_SHARD", precision=sf.Precision(param=torch.bfloat16, reduce=torch.float32)),
            }.get(name, sf.Plan("FULL_SHARD"))
    opt = {"schedule": sf.optim.adamw(lambda count: 1e-3 * 0.8**count),
           "clipping": sf.optim.chain(sf.optim.clip_by_global_norm(0.05), sf.optim.adamw(1e-3)),
           }.get(name, sf.optim.adamw(1e-3))
    step = sf.jit_step(_dropout_loss if name == "dropout" else gpt_loss, mesh, optimizer=opt, graph=graph,
                       micro_batches=2 if name == "micro_batches" else 1)
    if graphs is not None:
        step.graphs = graphs
    sharded = sf.shard(params, mesh, plan)
    state = opt.init(sharded)
    path = os.path.join(directory, "ckpt")
    torch.manual_seed(1)  # the dropout's draws, alike in every run from here
    losses = []
    for i, batch in enumerate(gpt_batches(steps)):
        if i == 2 and name.startswith("load"):
            sf.checkpoint.save(path, sharded, state)
        if i == _CHANGE_AT:
            if name == "reset_optimizer":
                state = opt.init(sharded)
            elif name == "reshard":  # the same model's parameters sharded again, a new optimizer state
                sharded = sf.shard(params, mesh, plan)
                state = opt.init(sharded)
            elif name.startswith("load_fresh"):  # a checkpoint loaded into a fresh tree: of this model, or a new one
                model_params = params if name == "load_fresh" else sf.functionalize(gpt_model())[0]
                fresh = sf.shard(model_params, mesh, plan)
                sharded, state, _ = sf.checkpoint.load(path, fresh, opt.init(fresh))
            elif name == "load_same":
                sharded, state, _ = sf.checkpoint.load(path, sharded, state)
        if name == "eval" and i in (_CHANGE_AT, steps - 1):  # eval for a few steps (a program of its own), then train
            apply.eval() if i == _CHANGE_AT else apply.train()
        sharded, state, metrics = step(sharded, state, batch)
        losses.append(float(metrics["loss"]))
    captures = [p.fn.captures for p in getattr(step, "programs", {}).values() if isinstance(p.fn, _capture.Captured)]
    getattr(step, "close", lambda: None)()
    return {"losses": losses, "params": sf.gather(sharded), "captures": captures}


def _scenario_captured(name, directory):
    return _with_fakes(FakeCuda(), _scenario, name, directory)


def _compare(got, plain):
    """The captured run against the uncaptured one, bit for bit, with the figures when they part."""
    moved = {n: float((got["params"][n].float() - p.float()).abs().max()) for n, p in plain["params"].items()
             if not torch.equal(got["params"][n], p)}
    most = max(abs(a - b) for a, b in zip(got["losses"], plain["losses"]))
    assert got["losses"] == plain["losses"] and not moved, (
        f"captured losses {got['losses'][_CHANGE_AT - 1:]} != uncaptured {plain['losses'][_CHANGE_AT - 1:]} "
        f"(from step {_CHANGE_AT - 1}; largest difference {most:.3g}); {len(moved)} parameters differ, "
        f"by up to {max(moved.values(), default=0):.3g}")


@pytest.mark.parametrize("name", ["reset_optimizer", "reshard", "load_fresh"])
def test_a_replay_reads_a_new_tree_it_is_given(clusters, tmp_path, name):
    """Issue 56: a new tree of the same structure and shapes (a reset optimizer state, the
    parameters sharded again, a checkpoint loaded into a fresh tree) is what the next call
    steps, not the tree the graph was captured with."""
    got = clusters[1].run(_scenario_captured, name, str(tmp_path / "captured"))[0]
    plain = clusters[1].run(_scenario, name, str(tmp_path / "plain"))[0]
    unchanged = clusters[1].run(_scenario, "none", str(tmp_path / "none"))[0]
    # The uncaptured program takes the state as its inputs: it steps the new tree, which
    # trains differently from the old one (a new optimizer state shows from the second step)
    assert plain["losses"][:_CHANGE_AT] == unchanged["losses"][:_CHANGE_AT]
    assert all(a != b for a, b in zip(plain["losses"][_CHANGE_AT + 1:], unchanged["losses"][_CHANGE_AT + 1:]))
    _compare(got, plain)
    assert got["captures"] == [2], "captured again, once, for the new tree"


@pytest.mark.parametrize("name", ["load_same", "load_fresh_model", "schedule", "eval", "micro_batches", "remat", "dropout", "clipping",
                                  "bf16"])
def test_a_replay_on_the_same_tree_matches_the_uncaptured_program(clusters, tmp_path, name):
    got = clusters[1].run(_scenario_captured, name, str(tmp_path / "captured"))[0]
    plain = clusters[1].run(_scenario, name, str(tmp_path / "plain"))[0]
    _compare(got, plain)
    # a new model is a new program ([Note: a program's key]); the same tree is never captured again
    assert got["captures"] == ([1, 1] if name in ("eval", "load_fresh_model") else [1])


# -- a capture that fails on one rank (issue 56, item 7) -------------------------------

_STEP_TIMEOUT = 2.0
_PG_TIMEOUT = 8.0  # gloo's own timeout in the world below


def _one_rank_fails_to_capture(rank, world, port, captured, queue):
    """Calls 1-3 on batches 0-2: eager, recorded, the program run eagerly. ``captured``: call 4
    captures on batch 3, and rank 1's capture runs out of memory at its 10th op; then two
    calls step batches 3 and 4. Uncaptured: two calls step batches 3 and 4."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=_PG_TIMEOUT))
    if captured:  # (gloo stands in for NCCL: its functional collectives are what the fake graph records)
        _capture.check_capturable = lambda mesh: None
    try:
        out = _fail_to_capture(rank, world, FakeCuda(fail={0: 10} if rank == 1 else None) if captured else None)
    except Exception as e:  # noqa: BLE001 - the test reads it
        out = {"setup": f"{type(e).__name__}: {e}"}
    queue.put((rank, out))
    queue.close()
    queue.join_thread()
    os._exit(0)


def _fail_to_capture(rank, world, graphs):
    mesh = sf.Mesh.from_group(step_timeout=_STEP_TIMEOUT)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, "FULL_SHARD")
    opt = sf.optim.adamw(1e-3)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, graph="eager")
    if graphs is not None:
        step.graphs = graphs
    state = opt.init(sharded)
    batches = [split_batch(b, rank, world) for b in gpt_batches(5)]
    for b in batches[:3]:
        sharded, state, _ = step(sharded, state, b)
    out = {}
    if graphs is not None:
        before = [t.clone() for t in [*sharded.values(), *torch.utils._pytree.tree_leaves(state)]]
        out = _outcome(lambda: _with_notes(step, sharded, state, batches[3]))
        after = [*sharded.values(), *torch.utils._pytree.tree_leaves(state)]
        out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after))
        out["broken"] = mesh.guard.broken
    losses = []
    for b in batches[3:]:
        outcome = _outcome(lambda: losses.append(float(step(sharded, state, b)[2]["loss"])))
        if outcome["error"]:
            losses.append(f"{outcome['error']}: {outcome['message'][:300]}")
    out["losses"] = losses
    return out


def _with_notes(fn, *args):
    """``fn(*args)``; an error it raises is raised again with its notes in its message."""
    try:
        return fn(*args)
    except Exception as e:
        e.args = ("\n".join([str(e), *getattr(e, "__notes__", [])]),)
        raise


def test_a_capture_that_fails_on_one_rank_raises_on_every_rank():
    got = _run(True, worker=_one_rank_fails_to_capture)
    plain = _run(False, worker=_one_rank_fails_to_capture)
    assert set(got) == set(plain) == {0, 1}, (got, plain)  # every rank reported, none hung
    # Rank 1 raises its own error, saying that nothing ran; rank 0 raises PeerError naming it
    assert got[1]["error"] == "OutOfMemoryError", got[1]
    assert "[rank 1] jit_step(graph=True): capturing the recorded program as a CUDA graph failed on this rank. " \
           "No rank replayed it" in got[1]["message"], got[1]
    assert got[0]["error"] == "PeerError" and "rank 1 raised" in got[0]["message"], got[0]
    assert "OutOfMemoryError: fake CUDA: out of memory while capturing" in got[0]["message"], got[0]
    for out in got.values():  # at once, before anything changed, the process group usable
        assert out["seconds"] < _STEP_TIMEOUT and out["unchanged"] and out["broken"] is None, out
    # The next calls capture again, on both ranks, and step as the uncaptured program does
    assert [got[r]["losses"] for r in (0, 1)] == [plain[r]["losses"] for r in (0, 1)]
    assert all(isinstance(loss, float) for r in (0, 1) for loss in got[r]["losses"])
