"""jit_step(graph=True): the whole step recorded once and replayed as one program.

The grid replays the recorded program op by op (``graph="eager"``: the same recording, no
code generation: inductor takes tens of seconds per program on 2 cores); the inductor
program itself is checked at world 2 for the strategies whose graphs differ most, against
single-process training and against the eager step.
"""

import datetime
import functools
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from bounds import ADAMW, SGD_MOMENTUM
from shardfn.testing import check_equivalence, count_ops, split_batch
from shardfn.testing.models import GPT, GPTConfig
from test_equivalence import gpt_batches, gpt_loss, gpt_model
from test_faults import _run
from test_ranks_differ import _outcome

def _decay(lr, count):
    """A learning-rate schedule written with operators only: it takes the count as a number
    (eager) or as a tensor (a recorded step computes it on the device)."""
    return lr * 0.8**count


STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"]
OPTIMIZERS = {
    "adamw": ADAMW,
    "sgd_momentum": SGD_MOMENTUM,
    "adamw_schedule": functools.partial(sf.optim.adamw, functools.partial(_decay, 1e-3), eps=1e-3),
    "torch_sgd": functools.partial(sf.optim.from_torch, torch.optim.SGD, lr=0.05, momentum=0.9),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_recorded_step_matches_single_process(clusters, opt_name):
    report = check_equivalence(gpt_model, gpt_loss, gpt_batches(), optimizer=OPTIMIZERS[opt_name],
                               strategies=STRATEGIES, world_sizes=[2], clusters=clusters,
                               step_options={"graph": "eager"})
    assert report.failures() == []


def test_recorded_step_matches_at_worlds_1_3_and_hybrid(clusters):
    for world, strategies in ((1, ["FULL_SHARD"]), (3, ["FULL_SHARD", "NO_SHARD"]),
                              ((2, 2), ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])):
        report = check_equivalence(gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW, strategies=strategies,
                                   world_sizes=[world], clusters=clusters, step_options={"graph": "eager"})
        assert report.failures() == []


def test_recorded_step_with_remat_precision_and_micro_batches(clusters):
    plans = [sf.Plan("FULL_SHARD", remat=sf.Remat()),
             sf.Plan("FULL_SHARD", precision=sf.Precision(param=torch.bfloat16, reduce=torch.float32)),
             sf.Plan("SHARD_GRAD_OP", placement="rows", bucket_bytes=0)]
    report = check_equivalence(gpt_model, gpt_loss, gpt_batches(), optimizer=SGD_MOMENTUM, strategies=plans[::2],
                               world_sizes=[2], clusters=clusters, step_options={"graph": "eager", "micro_batches": 2})
    assert report.failures() == []
    # bf16 parameters: against the eager bf16 step (the single-process reference is fp32).
    # The recorded update takes its scalars as tensors (eager: Python floats), so the runs
    # may part. Per step and element, whatever the gradients: each ADAMW update moves by at
    # most 1.0014 lr (lr / eps <= 1, tests/bounds.py) plus its decay lr wd |p|, and each
    # run rounds the result to bf16 (half a spacing, 2^-9 |p|): two runs part by at most
    # 2 (1.0014 lr + lr wd |p|) + 2^-8 |p| per step.
    eager, graph = (clusters[2].run(_train, plans[1], g, 3)[0] for g in (False, "eager"))
    assert graph["losses"][0] == eager["losses"][0]  # the same parameters, the same ops
    assert graph["losses"] == pytest.approx(eager["losses"], rel=2**-7)
    for name, p in eager["params"].items():
        top = float(p.abs().max()) + 3 * 1.0014e-3  # |p| over the run
        bound = 3 * (2 * (1.0014e-3 + 1e-3 * 0.01 * top) + 2**-8 * top)
        torch.testing.assert_close(graph["params"][name].float(), p.float(), rtol=0, atol=bound)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_compiled_program_matches_single_process(clusters, strategy):
    report = check_equivalence(gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW, strategies=[strategy],
                               world_sizes=[2], clusters=clusters, step_options={"graph": "inductor"})
    assert report.failures() == []


def _train(plan, graph, steps=4, schedule=False, batches=None):
    """Losses, full parameters and, per call, the collectives dispatched, the host reads,
    the guard's header exchanges and the recordings so far."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, plan)
    opt = sf.optim.adamw(lambda c: 1e-3 * 0.8**c) if schedule else ADAMW()
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, graph=graph,
                       **({} if graph else {"on_nonfinite": "raise_next"}))
    state = step.init(sharded)
    out = {"losses": [], "collectives": [], "reads": [], "headers": [], "recordings": [], "comm": []}
    for b in batches or gpt_batches(steps):
        headers = mesh.guard.headers
        verdict = [sharded._verdict.values] if sharded._verdict is not None else []  # read on the host by design
        with sf.record_collectives() as log, count_ops() as ops:
            sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        out["losses"].append(float(metrics["loss"]))
        out["collectives"].append(dict(ops.collectives))
        out["reads"].append(len(ops.device_reads(host=verdict, world=mesh.size)))
        out["headers"].append(mesh.guard.headers - headers)
        out["recordings"].append(getattr(step, "recordings", None))
        out["comm"].append((dict(log.counts()), dict(metrics["comm_bytes"])))
    out["params"] = sf.gather(sharded)
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_replay_issues_the_eager_collectives_and_nothing_on_the_host(clusters, strategy):
    eager = clusters[2].run(_train, sf.Plan(strategy), False, 5)[0]
    graph = clusters[2].run(_train, sf.Plan(strategy), "eager", 5)[0]
    # The first call runs eagerly, the second records, and every later call replays.
    assert graph["recordings"] == [0, 1, 1, 1, 1]
    # The program's collectives, dispatched op by op, are the eager step's, one for one. On
    # gloo a reduce-scatter travels as paired sends eagerly (counted by shardfn's log) and as
    # an all-to-all in the program ([Note: reduce-scatter on gloo]).
    kinds = {"all_gather_into_tensor_out": "all_gather", "all_to_all_single": "reduce_scatter",
             "all_reduce": "all_reduce"}
    for replay, headers, (counts, comm) in zip(graph["collectives"][2:], graph["headers"][2:], eager["comm"][2:]):
        replay = dict(replay)
        assert replay.pop("allreduce_") == headers  # the agreement on the program: a header (below)
        assert {kinds[k]: n for k, n in replay.items()} == counts
    # Bytes per kind, as the eager step reports: the same every call. Under SHARD_OPTIMIZER the
    # first eager call also gathers in its forward (no replica yet); a graph step keeps none,
    # and gathers once in every call, its first included.
    assert graph["comm"][1:] == eager["comm"][1:2] * 4 == eager["comm"][1:]
    if strategy != "SHARD_OPTIMIZER":
        assert graph["comm"][0] == eager["comm"][0] == eager["comm"][1]
    # A replay reads nothing on the host and exchanges one header, whatever the world: the
    # ranks agree on the program ([Note: agreeing on the key]), then it runs unguarded.
    assert graph["reads"][2:] == [0, 0, 0]
    assert graph["headers"][2:] == [1, 1, 1]
    assert eager["headers"][1] > 0
    torch.testing.assert_close(torch.tensor(graph["losses"]), torch.tensor(eager["losses"]), rtol=1e-6, atol=0)
    for name, p in eager["params"].items():
        torch.testing.assert_close(graph["params"][name], p, rtol=1e-5, atol=1e-6)


# Units that outweigh the activations, and no buckets: each unit's gathered parameters and
# gradients come and go on their own, so what a program holds shows when it frees them.
_BIG_UNITS = GPTConfig(vocab_size=29, seq_len=4, d_model=64, n_layers=6)


class _GatherInputs(TorchDispatchMode):
    """The storage each all-gather reads, in order."""

    def __init__(self):
        super().__init__()
        self.ptrs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__.startswith("all_gather_into_tensor"):
            self.ptrs.append(args[0].untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def _memory(strategy, graph, steps=5):
    """Per call: the live bytes at most beyond the state and the batch, the bytes of the
    state after it and its storages, the workspace the step reports and the storages the
    all-gathers send; and one block's parameter bytes."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(_BIG_UNITS))
    sharded = sf.shard(params, mesh, sf.Plan(strategy, bucket_bytes=0))
    step = sf.jit_step(gpt_loss, mesh, optimizer=ADAMW(), graph=graph, **({} if graph else {"on_nonfinite": "raise_next"}))
    state = step.init(sharded)
    out = {"peak": [], "persistent": [], "state": [], "workspace": [], "gathers": []}
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        b = {k: torch.randint(0, 29, (2, 4), generator=g) for k in ("x", "y")}
        b = split_batch(b, mesh.rank, mesh.size)
        with sf.track_live_bytes(sharded, state, b) as mem, _GatherInputs() as gathers:
            held = mem.current
            sharded, state, metrics = step(sharded, state, b)
            del metrics
        out["peak"].append(mem.peak - held)
        out["gathers"].append(gathers.ptrs)
        with sf.track_live_bytes(sharded, state) as trees:
            out["persistent"].append(trees.current)
        out["state"].append([t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((sharded, state))])
        out["workspace"].append(step.workspace_bytes if graph else None)
    out["block"] = sum(p.numel() * p.element_size() for k, p in params.items() if k.startswith("blocks.0."))
    return out


def test_a_replay_holds_no_more_than_the_eager_step_and_says_how_much(clusters):
    eager = clusters[2].run(_memory, "FULL_SHARD", False)[0]
    graph = clusters[2].run(_memory, "FULL_SHARD", "eager")[0]
    kept = clusters[2].run(_memory, "SHARD_GRAD_OP", "eager")[0]
    # The workspace a graph step reports is what a replay holds at most: exactly so at world
    # 1. With collectives, a measured replay can hold more for a while: the process group's
    # thread lets go of a collective's buffers, now and then after the next ops have run.
    alone = clusters[1].run(_memory, "FULL_SHARD", "eager")[0]
    # (the first call runs eagerly, the second records: calls 3 to 5 replay)
    assert alone["peak"][2:] == alone["workspace"][2:] and alone["workspace"][2] > 0
    assert graph["workspace"][2:] == graph["workspace"][2:3] * 3 and graph["workspace"][2] <= min(graph["peak"][2:])
    # FULL_SHARD's program holds at most what the eager step holds. It frees each unit after
    # its forward and gathers it again for the backward: SHARD_GRAD_OP's program, which
    # keeps every unit gathered from its forward to its backward, holds more, by at least
    # one block's parameters.
    assert graph["workspace"][2] <= min(eager["peak"][1:])
    assert graph["workspace"][2] + graph["block"] <= kept["workspace"][2]
    # The state is as large as the eager step's: the program keeps no copy of it.
    assert graph["persistent"] == eager["persistent"]
    assert graph["state"][1:] == graph["state"][:1] * 4  # every replay updates the same tensors in place
    # Every replay's all-gathers send the state's own shard buffers, the same ones each time
    # (as the eager step does: no packing copy).
    assert graph["gathers"][3:] == graph["gathers"][2:3] * 2 and set(graph["gathers"][2]) <= set(graph["state"][2])


def _program_shape(strategy):
    """Of the recorded program: for each all-gather, whether a matmul runs between it and
    its wait (it was issued ahead, as prefetch issues it); and its inputs' storages."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(_BIG_UNITS))
    sharded = sf.shard(params, mesh, sf.Plan(strategy, bucket_bytes=0))
    step = sf.jit_step(gpt_loss, mesh, optimizer=ADAMW(), graph="eager")
    state = step.init(sharded)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        b = {k: torch.randint(0, 29, (2, 4), generator=g) for k in ("x", "y")}
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    (program,) = step.programs.values()
    nodes = list(program.gm.graph.nodes)
    ahead = []
    for i, n in enumerate(nodes):
        if "all_gather" in str(n.target):
            wait = next(j for j, m in enumerate(nodes) if "wait_tensor" in str(m.target) and m.args[0] is n)
            ahead.append(any(str(m.target) in ("aten.mm.default", "aten.addmm.default") for m in nodes[i:wait]))
    inputs = step._last[2]
    return ahead, len(inputs), len({t.untyped_storage().data_ptr() for t in inputs}), len(sharded.layout.units)


def test_the_program_prefetches_and_takes_the_flat_buffers(clusters):
    ahead, inputs, storages, units = clusters[2].run(_program_shape, "FULL_SHARD")[0]
    # The recording follows the forward order the first (eager) call learned: each block's
    # all-gather is issued before the compute of the block before it, in the forward and in
    # the backward's regathers. Only the first gathers of each pass wait at once: the root
    # and the first block in the forward, the last block in the backward.
    assert len(ahead) == 2 * units - 1 and ahead.count(False) == 3, ahead
    # Its inputs are the flat buffers, one storage each: none aliases another.
    assert inputs == storages


def test_a_new_batch_shape_is_recorded_again(clusters):
    batches = gpt_batches(5)
    batches[2] = {k: v[:, :5] for k, v in batches[2].items()}  # shorter sequences, once
    graph = clusters[2].run(_train, sf.Plan("FULL_SHARD"), "eager", batches=batches)[0]
    eager = clusters[2].run(_train, sf.Plan("FULL_SHARD"), False, batches=batches)[0]
    assert graph["recordings"] == [0, 1, 2, 2, 2]  # the old shape replays its program again
    assert graph["headers"][3:] == [1, 1]  # the agreement on the program only
    torch.testing.assert_close(torch.tensor(graph["losses"]), torch.tensor(eager["losses"]), rtol=1e-6, atol=0)


def _with_fingerprint(offset):
    """A graph step whose rank 1 records another program (its fingerprint moved)."""
    from shardfn._program import graph as _graph

    mesh = sf.Mesh.from_group()
    original = _graph._fingerprint
    if mesh.rank == 1:
        _graph._fingerprint = lambda nodes, axes: original(nodes, axes) + offset
    try:
        torch.manual_seed(0)
        sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, "FULL_SHARD")
        step = sf.jit_step(gpt_loss, mesh, optimizer=SGD_MOMENTUM(), graph="eager")
        state = step.init(sharded)
        try:
            for b in gpt_batches(2):  # the second call records
                sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        except sf.DivergenceError as e:
            return str(e)
        return "replayed"
    finally:
        _graph._fingerprint = original


def test_ranks_that_recorded_different_programs_all_raise(clusters):
    assert clusters[2].run(_with_fingerprint, 0) == ["replayed", "replayed"]
    out = clusters[2].run(_with_fingerprint, 7)
    assert all("the recorded program of jit_step(graph=True)" in e for e in out), out


_PG_TIMEOUT = 8.0  # gloo's own timeout in the world below


def _one_rank_records_again(rank, world, port, scenario, queue):
    """Rank 1's batch changes shape at the third call, where rank 0 replays; then both call
    again with the old shape."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=_PG_TIMEOUT))
    mesh = sf.Mesh.from_group(step_timeout=2.0)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, "FULL_SHARD")
    step = sf.jit_step(gpt_loss, mesh, optimizer=SGD_MOMENTUM(), graph="eager")
    state = step.init(sharded)
    batches = [split_batch(b, rank, world) for b in gpt_batches(3)]
    if rank == 1:
        batches[2] = {k: v[:, :5] for k, v in batches[2].items()}
    for b in batches[:2]:
        sharded, state, _ = step(sharded, state, b)
    out = _outcome(lambda: step(sharded, state, batches[2]))
    out["again"] = _outcome(lambda: step(sharded, state, batches[0]))
    queue.put((rank, out))
    queue.close()
    queue.join_thread()
    os._exit(0)


def test_a_rank_whose_batch_changes_shape_alone_stops_every_rank_and_training_goes_on():
    results = _run("records again", worker=_one_rank_records_again)
    # The ranks agree on the program before it runs ([Note: agreeing on the key]): both raise
    # at once, naming rank 1's shapes; the process group stays usable, so the old shape replays.
    for out in results.values():
        assert out["error"] == "DivergenceError" and "rank 1's batch changed shape" in out["message"], out
        assert out["seconds"] < 2.0
        assert out["again"]["error"] is None, out


def _refusal(case):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    plan = {"offload": sf.Plan("FULL_SHARD", offload=sf.Offload(params=True, optimizer=True)),
            "muon_schedule": sf.Plan("NO_SHARD")}.get(case, "FULL_SHARD")
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, plan)
    loss = gpt_loss
    opt = SGD_MOMENTUM()
    options = {"graph": True}
    if case == "item":
        def loss(apply, params, batch):
            out = gpt_loss(apply, params, batch)
            return out * 2 if out.item() > 100 else out
    elif case == "tolist":
        def loss(apply, params, batch):
            return gpt_loss(apply, params, batch) * (1 + 0 * batch["x"].float().mean().tolist())
    elif case == "nonzero":
        def loss(apply, params, batch):
            return gpt_loss(apply, params, batch) + _data_dependent(batch)
    elif case == "host_schedule":
        opt = sf.optim.sgd(lambda c: 0.1 * math.cos(c / 100))
    elif case == "adafactor":
        opt = sf.optim.adafactor(1e-2)
    elif case == "muon_schedule":
        opt = sf.optim.partition({"muon": sf.optim.muon(lambda c: 0.01), "adamw": sf.optim.adamw(1e-3)},
                                 lambda name, shape: "muon" if len(shape) == 2 else "adamw")
    elif case in ("compile", "donate", "raise", "loss_scale"):
        options.update({"compile": {"compile": True}, "donate": {"donate": False}, "raise": {"on_nonfinite": "raise"},
                        "loss_scale": {"loss_scale": sf.DynamicLossScale()}}[case])
    try:
        step = sf.jit_step(loss, mesh, optimizer=opt, **options)
        state = step.init(sharded)
        step(sharded, state, split_batch(gpt_batches(1)[0], mesh.rank, mesh.size))
    except (ValueError, TypeError) as e:
        return str(e)
    return "accepted"


def _data_dependent(batch):
    return (batch["x"] > 3).nonzero().sum() * 0.0


@pytest.mark.parametrize("case, why", [
    ("item", "_local_scalar_dense reads a tensor's value on the host, at tests/test_graph.py"),
    ("tolist", "Tensor.tolist() reads a tensor's values on the host, at tests/test_graph.py"),
    ("nonzero", "nonzero makes a tensor whose shape depends on values, at tests/test_graph.py"),
    ("host_schedule", "_local_scalar_dense reads a tensor's value on the host, at tests/test_graph.py"),
    ("adafactor", "reads a tensor's value on the host, at shardfn/optim/_adafactor.py"),
    ("muon_schedule", "a learning-rate schedule of an optimizer that takes its learning rate as a number (muon)"),
    ("offload", "offloaded shards are copied between host and device by the step's Python"),
    ("compile", "jit_step(graph=True): compile=... compiles parts of an eager step"),
    ("donate", "jit_step(graph=True): donate=False returns new tensors"),
    ("raise", "jit_step(graph=True): on_nonfinite='raise' reads the loss on the host"),
    ("loss_scale", "jit_step(graph=True): a loss scale decides on the host whether to skip each step"),
])
def test_what_cannot_be_one_program_is_refused_with_where_and_the_fix(clusters, case, why):
    out = clusters[2].run(_refusal, case)
    frozen = case in ("item", "tolist", "nonzero", "host_schedule", "adafactor", "muon_schedule")
    for message in out:
        assert why in message, message
        assert "graph=False" in message
        # a value the program would freeze is called so; another cause (offload, a build option) is not
        assert ("would replay that value as a constant" in message) == frozen, message


def _nonfinite():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(gpt_model())[0], mesh, "FULL_SHARD")

    def loss(apply, params, batch):
        return gpt_loss(apply, params, batch) * batch["scale"]

    step = sf.jit_step(loss, mesh, optimizer=SGD_MOMENTUM(), graph="eager")
    state = step.init(sharded)
    seen = []
    for scale in (1.0, 1.0, float("nan") if mesh.rank == 1 else 1.0, 1.0):
        b = split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)
        b["scale"] = torch.tensor(scale)
        try:
            sharded, state, metrics = step(sharded, state, b)
            seen.append("ok")
        except FloatingPointError as e:
            seen.append("raised" if "not finite" in str(e) else str(e))
    return seen


def test_a_non_finite_replay_raises_on_every_rank_at_the_next_call(clusters):
    assert clusters[2].run(_nonfinite) == [["ok", "ok", "ok", "raised"]] * 2


def test_muon_partition_and_clipping_record(clusters):
    import test_muon as M

    ref_losses, _ = M.reference()
    report = check_equivalence(M.model, M.loss_fn, M.batches(), optimizer=functools.partial(M.optimizer, torch.float32),
                               strategies=[sf.Plan("FULL_SHARD", placement=sf.whole(M.matrices)), "NO_SHARD"],
                               world_sizes=[2], clusters=clusters, raise_on_failure=False,
                               step_options={"graph": "eager"})
    M._against_torch(report, ref_losses)
    report = check_equivalence(gpt_model, gpt_loss, gpt_batches(), optimizer=_clipped, strategies=["FULL_SHARD"],
                               world_sizes=[2], clusters=clusters, step_options={"graph": "eager"})
    assert report.failures() == []


def _clipped():
    return sf.optim.chain(sf.optim.clip_by_global_norm(0.5), SGD_MOMENTUM())


def _hf(kind):
    from test_pretrained import build

    return build(kind)


def _hf_loss(apply, params, batch):
    logits = apply(params, batch["x"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["y"].reshape(-1))


def _hf_batches(vocab):
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randint(0, vocab, (4, 12), generator=g), "y": torch.randint(0, vocab, (4, 12), generator=g)}
            for _ in range(3)]


@pytest.mark.parametrize("kind, vocab", [("gpt2", 61), ("llama", 40)])
def test_hugging_face_models_record(clusters, kind, vocab):
    report = check_equivalence(functools.partial(_hf, kind), _hf_loss, _hf_batches(vocab), optimizer=ADAMW,
                               strategies=["FULL_SHARD"], world_sizes=[2], clusters=clusters,
                               step_options={"graph": "eager"})
    assert report.failures() == []


def _convnet(graph, steps=3):
    from test_state import conv_batches, conv_loss
    from shardfn.testing.models import ConvNet

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(ConvNet())[0], mesh, "FULL_SHARD")
    step = sf.jit_step(conv_loss, mesh, optimizer=SGD_MOMENTUM(), graph=graph,
                       **({} if graph else {"on_nonfinite": "raise_next"}))
    state = step.init(sharded)
    for b in conv_batches(steps):
        sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    return {n: sharded[n].detach().clone() for n in sharded.layout.buffers}, sf.gather(sharded)


def test_batchnorm_statistics_are_averaged_in_the_program(clusters):
    # The program compares the buffers on the device and averages those some rank changed:
    # every rank ends with the eager step's statistics and parameters.
    eager, graph = (clusters[2].run(_convnet, g) for g in (False, "eager"))
    for (eb, ep), (gb, gp) in zip(eager, graph):
        for n, b in eb.items():
            torch.testing.assert_close(gb[n], b, rtol=1e-6, atol=1e-7)
        for n, p in ep.items():
            torch.testing.assert_close(gp[n], p, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(graph[0][0][n], graph[1][0][n]) for n in graph[0][0])


def _kept(graph):
    """Each step's loss and norm as read right after it, and the same tensors read at the end."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, sf.Plan("FULL_SHARD"))

    def loss_fn(apply, params, batch):
        loss = gpt_loss(apply, params, batch)
        return loss, {"twice": 2 * loss.detach()}

    step = sf.jit_step(loss_fn, mesh, optimizer=ADAMW(), graph=graph, aux="mean")
    state = step.init(sharded)
    kept, read = [], []
    for b in gpt_batches(5):
        sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        kept.append((metrics["loss"], metrics["grad_norm"], metrics["aux"]["twice"]))
        read.append([float(t) for t in kept[-1]])
    return read, [[float(t) for t in k] for k in kept]


@pytest.mark.parametrize("graph", ["eager", "inductor"])
def test_what_a_step_returned_still_reads_the_same_after_later_replays(clusters, graph):
    for read, later in clusters[2].run(_kept, graph):
        assert later == read
        assert len({r[0] for r in read}) == 5  # five different steps
