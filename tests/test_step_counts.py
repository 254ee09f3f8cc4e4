"""The optimizers' step counts (issue 48): on the params' device, read on the host through a
mirror that never drifts ([Note: step counts] in shardfn.optim._count), and the learning rate
of a recorded step computed by its program; a from_torch optimizer's host hyperparameters
in the program's key."""

import functools
import warnings

import pytest
import torch
import torch.nn as nn

import shardfn as sf
from shardfn import optim
from shardfn.testing import count_ops, split_batch


class _MLP(nn.Module):
    """Matrices only (muon takes no biases)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _mse(apply, params, batch):
    return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(8, 8, generator=g), "y": torch.randn(8, 4, generator=g)} for _ in range(n)]


def _decay(lr, count):
    """Operators only: the count as a number (eager) or a tensor (a recorded step). Products
    and differences are one correctly rounded float64 operation either way, so both give the
    same float (a number divided by a tensor would not: torch multiplies by its reciprocal)."""
    return lr * (1.0 - 0.0625 * count)


OPTIMIZERS = {
    "adamw": functools.partial(optim.adamw, functools.partial(_decay, 1e-2)),
    "sgd": functools.partial(optim.sgd, functools.partial(_decay, 0.1), momentum=0.9),
    "muon": functools.partial(optim.muon, functools.partial(_decay, 0.02)),
    "adafactor": functools.partial(optim.adafactor, functools.partial(_decay, 1e-2)),
}


# -- 1. the count lives on the params' device ---------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_optimizer_makes_its_count_on_the_params_device(name):
    for device in ("meta", "cpu"):
        params = {"w": torch.zeros(4, 6, device=device, requires_grad=True),
                  "v": torch.zeros(6, 4, device=device, requires_grad=True)}
        count = OPTIMIZERS[name]().init(params).count
        assert (count.device, count.dtype, count.shape) == (torch.device(device), torch.int64, ()), name
    # no trainable params: the device of the params given all the same, written, not guessed
    count = optim.adamw(1e-3).init({"frozen": torch.zeros(2, device="meta")}).count
    assert count.device == torch.device("meta")


# -- 2. no host read of a count in eager steps ----------------------------------------------------


def _built(mesh, name, strategy, **options):
    """A step of the test MLP with optimizer ``name``, its shards and its optimizer state."""
    torch.manual_seed(0)
    params, _ = sf.functionalize(_MLP())
    sharded = sf.shard(params, mesh, strategy)
    step = sf.jit_step(_mse, mesh, optimizer=OPTIMIZERS[name](), **options)
    return step, sharded, step.init(sharded)


def _count_reads(name, donate):
    """Per eager step, the reads of a step count (a 0-d int64 tensor) by the host."""
    mesh = sf.Mesh.from_group()
    step, sharded, state = _built(mesh, name, "NO_SHARD", donate=donate)
    reads, lrs = [], []
    for b in _batches(4):
        with count_ops() as ops:
            sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        reads.append(sum(1 for _, t in ops.reads if t.dtype == torch.int64 and t.dim() == 0))
        lrs.append(metrics["learning_rate"])
    return reads, lrs, int(state.count)


@pytest.mark.parametrize("name,donate", [(n, True) for n in OPTIMIZERS] + [("adamw", False), ("sgd", False)])
def test_eager_steps_read_no_count_on_the_host(clusters, name, donate):
    for reads, lrs, count in clusters[1].run(_count_reads, name, donate):
        assert reads[1:] == [0, 0, 0], reads
        assert lrs == [_decay(OPTIMIZERS[name].args[0].args[0], c) for c in range(4)] and count == 4


def _replay_without_a_trace(replay):
    """``GraphStep._replay`` writing the state as a CUDA graph does: into the same memory,
    without bumping the tensors' ``_version`` (``.data`` shares the storage, not the counter)."""

    def run(self, program, state, inputs, *rest):
        return replay(self, program, [t.data for t in state], inputs, *rest)

    return run


def _mixed(path):
    """Steps 0-1 eager, then a checkpoint; 2-5 a graph step (its first call eager, then a
    recording and replays that leave no trace in ``_version``); 6 eager again; then the
    checkpoint loaded and 2-7 eager. The learning rates and the final parameters, and a plain
    eager run's."""
    from shardfn._program.graph import GraphStep

    mesh = sf.Mesh.from_group()
    batches = [split_batch(b, mesh.rank, mesh.size) for b in _batches(8)]

    def fresh():
        torch.manual_seed(0)
        params, _ = sf.functionalize(_MLP())
        return sf.shard(params, mesh, "FULL_SHARD")

    opt = OPTIMIZERS["adamw"]()
    eager = sf.jit_step(_mse, mesh, optimizer=opt)
    graph = sf.jit_step(_mse, mesh, optimizer=opt, graph="eager")
    plain = fresh()
    plain_state = eager.init(plain)
    plain_lrs = []
    for b in batches:
        plain, plain_state, m = eager(plain, plain_state, b)
        plain_lrs.append(m["learning_rate"])
    sharded = fresh()
    state = eager.init(sharded)
    lrs, replay = [], GraphStep._replay
    GraphStep._replay = _replay_without_a_trace(replay)
    try:
        for i, b in enumerate(batches[:7]):
            sharded, state, m = (graph if 2 <= i <= 5 else eager)(sharded, state, b)
            lrs.append(float(m["learning_rate"]))
            if i == 1:
                sf.checkpoint.save(path, sharded, state)
        sharded, state, _ = sf.checkpoint.load(path, sharded, state)
        for b in batches[2:]:
            sharded, state, m = eager(sharded, state, b)
            lrs.append(m["learning_rate"])
    finally:
        GraphStep._replay = replay
    return lrs, plain_lrs, sf.gather(sharded), sf.gather(plain), graph.recordings


def test_a_count_read_through_the_mirror_never_drifts(clusters, tmp_path):
    for lrs, plain, params, plain_params, recordings in clusters[1].run(_mixed, str(tmp_path / "c")):
        assert recordings == 1
        # each call's learning rate is the plain run's ([_decay]: equal floats); an eager call
        # reads the count through the mirror, for its learning rate and bias corrections alike
        assert lrs == plain[:7] + plain[2:]
        for n, p in plain_params.items():  # the same steps from the checkpoint on, the same ops
            assert torch.equal(params[n], p), n


def _load_old_count():
    """The checkpoint of format 1 (written before counts moved: a CPU count of 1) loaded into
    a state made now: the count tensor itself, its device, and the learning rate the
    optimizer reports before and after the load."""
    from test_state import DATA, _train

    _, sharded, _, _, _, _ = _train("convnet", "FULL_SHARD", steps=0, seed=5)
    opt = optim.adamw(functools.partial(_decay, 1e-2))
    state = opt.init(sharded)
    count, before = state.count, optim.hyperparams(opt, state)["learning_rate"]  # the mirror: 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (format 1: no buffers, no digests)
        sharded, state, _ = sf.checkpoint.load(str(DATA / "checkpoint-v1"), sharded, state)
    device = next(iter(sharded.values())).device
    return state.count is count, count.device == device, before, optim.hyperparams(opt, state)["learning_rate"]


@pytest.mark.parametrize("world", [1, 2])
def test_an_old_checkpoint_count_loads_into_the_count_and_past_its_mirror(clusters, world):
    for same, on_device, before, after in clusters[world].run(_load_old_count):
        # DCP copies the saved value into the state's own count (copy_: any device), which
        # bumps its version, so the mirror's 0 is not used after the load
        assert same and on_device
        assert (before, after) == (_decay(1e-2, 0), _decay(1e-2, 1))


# -- 3. the learning rate of a graph step -------------------------------------------------------


def _graph_lrs(name):
    """Per call of a graph step (op by op): the learning rate and the host reads of the count;
    and an eager run's learning rates."""
    mesh = sf.Mesh.from_group()
    out = {}
    for graph in (False, "eager"):
        step, sharded, state = _built(mesh, name, "FULL_SHARD", graph=graph)
        lrs, reads = [], []
        for b in _batches(7):
            with count_ops() as ops:
                sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
            reads.append(sum(1 for _, t in ops.reads if t is state.count))
            lrs.append(float(m["learning_rate"]))
        out[graph] = lrs, reads
    return out


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_graph_step_reports_the_eager_learning_rate_without_reading_the_count(clusters, name):
    for out in clusters[2].run(_graph_lrs, name):
        (eager, _), (graph, reads) = out[False], out["eager"]
        assert graph == eager  # [_decay]: the same float at every one of 7 calls, 5 of them replays
        assert reads == [0] * 7, reads


# -- 4. a from_torch optimizer's host hyperparameters ---------------------------------------------


def _torch_lr_changed(graph):
    """from_torch(SGD) with its lr changed between calls 3 and 4: losses and parameters."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(_MLP())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    step = sf.jit_step(_mse, mesh, optimizer=optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.5), graph=graph)
    state = step.init(sharded)
    losses, lrs = [], []
    for i, b in enumerate(_batches(6)):
        if i == 3:
            state.optimizer.param_groups[0]["lr"] = 0.01
        sharded, state, m = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        losses.append(float(m["loss"]))
        lrs.append(float(m["learning_rate"]))
    return losses, lrs, sf.gather(sharded), getattr(step, "recordings", None)


def test_a_changed_torch_learning_rate_records_a_new_program(clusters):
    eager = clusters[2].run(_torch_lr_changed, False)
    graph = clusters[2].run(_torch_lr_changed, "eager")
    for (losses, lrs, params, _), (g_losses, g_lrs, g_params, recordings) in zip(eager, graph):
        assert g_lrs == lrs == [0.1] * 3 + [0.01] * 3
        # the recorded program replays torch's SGD op by op: the same ops, the same floats
        assert g_losses == losses
        assert all(torch.equal(g_params[n], p) for n, p in params.items())
        assert recordings == 2  # lr 0.1's program, then lr 0.01's


def test_a_rank_whose_param_groups_changed_is_named():
    from shardfn._program.key import group_values, what_changed

    sgd = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1, momentum=0.5)
    last = ("state", "bspec", (), (), group_values([sgd]))
    sgd.param_groups[0]["lr"] = 0.01
    key = ("state", "bspec", (), (), group_values([sgd]))
    assert what_changed(1, key, last, True, None) == (
        "rank 1's optimizer hyperparameters changed (param_groups[0]['lr']: 0.1 -> 0.01)")
