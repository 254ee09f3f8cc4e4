"""Real training features, each equivalent to single-process training on the global batch."""

import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from bounds import ADAMW  # the equivalence tests' AdamW: tests/bounds.py
from shardfn.optim import adamw, chain, clip_by_global_norm, sgd
from shardfn.testing import check_equivalence, split_batch
from shardfn.testing.models import GPT, MLP, GPTConfig
from test_equivalence import STRATEGIES, gpt_batches, gpt_loss, mlp_batches, mlp_loss, mlp_model

WORLDS = st.integers(1, 4)
STRATS = st.sampled_from(STRATEGIES)
SGD = functools.partial(sgd, 0.05, momentum=0.9)


# -- gradient accumulation -------------------------------------------------------------------


@settings(max_examples=8)
@given(world=WORLDS, strategy=STRATS, k=st.sampled_from([2, 3]), mode=st.sampled_from(["reduce_each", "local"]),
       width=st.integers(3, 9))
def test_accumulation_equals_one_big_batch(clusters, world, strategy, k, mode, width):
    # 12 rows per global batch, so a rank's batch (12 / world) must split into k micro-batches.
    if (12 // world) % k:
        k = 12 // world
    # At world 1, x is [12, 12]: both dims equal the rows, so it is marked (docs/training.md).
    batches = [{**b, "x": sf.Batched(b["x"])} for b in mlp_batches()]
    report = check_equivalence(
        functools.partial(mlp_model, (12, width, 5)), mlp_loss, batches, optimizer=SGD, strategies=[strategy],
        world_sizes=[world], clusters=clusters, step_options={"micro_batches": k, "accumulate": mode},
    )
    assert report.failures() == []


def accumulation_counts(mode, k):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(MLP([6, 6, 6, 6]))
    sharded = sf.shard(params, mesh, "FULL_SHARD", bucket_bytes=0)  # 3 units, each alone: layers.0, .1, .2
    opt = sgd(0.1)
    step = sf.jit_step(mlp_loss, mesh, optimizer=opt, micro_batches=k, accumulate=mode)
    batch = {"x": sf.Batched(torch.randn(2 * k, 6)), "y": sf.Batched(torch.randn(2 * k, 6))}  # [6, 6] at k = 3
    with sf.record_collectives() as log:
        _, _, metrics = step(sharded, opt.init(sharded), batch)
    return dict(log.counts()), metrics["comm_bytes"]


def test_accumulation_modes_count_reduce_scatters(clusters):
    each, each_bytes = clusters[2].run(accumulation_counts, "reduce_each", 3)[0]
    local, local_bytes = clusters[2].run(accumulation_counts, "local", 3)[0]
    # FULL_SHARD, 3 units, per micro-batch: 3 gathers in forward, and 2 in backward: the
    # first layer's weight is not needed there (its input needs no gradient), so autograd
    # saved no handle for it and it is not gathered again.
    assert each["all_gather"] == local["all_gather"] == 3 * (3 + 2)
    assert each["reduce_scatter"] == 3 * 3  # every micro-batch
    assert local["reduce_scatter"] == 3  # once per unit and step
    assert each_bytes["reduce_scatter"] == 3 * local_bytes["reduce_scatter"]


# -- clipping and metrics --------------------------------------------------------------------


@settings(max_examples=8)
@given(world=WORLDS, strategy=STRATS, max_norm=st.sampled_from([0.05, 0.5, 100.0]))
def test_clip_by_global_norm_across_shards(clusters, world, strategy, max_norm):
    report = check_equivalence(
        mlp_model, mlp_loss, mlp_batches(), optimizer=functools.partial(_clipped_sgd, max_norm), strategies=[strategy],
        world_sizes=[world], clusters=clusters,
    )
    assert report.failures() == []


def _clipped_sgd(max_norm):
    return chain(clip_by_global_norm(max_norm), sgd(0.1))


def step_metrics(strategy, replicate):
    mesh = sf.Mesh.from_group(replicate=replicate)
    torch.manual_seed(0)
    params, apply = sf.functionalize(mlp_model())
    sharded = sf.shard(params, mesh, strategy)
    opt = adamw(lambda count: 0.01 / (1 + count), eps=1e-2, weight_decay=0.0)  # lr / eps <= 1: tests/bounds.py
    step = sf.jit_step(mlp_loss, mesh, optimizer=opt)
    state = opt.init(sharded)
    out = []
    for batch in mlp_batches():
        with sf.record_collectives() as log:
            sharded, state, m = step(sharded, state, split_batch(batch, mesh.rank, mesh.size))
        out.append((m, dict(log.bytes())))
    return out


@pytest.mark.parametrize("strategy, replicate, world", [("FULL_SHARD", None, 3), ("NO_SHARD", None, 2),
                                                         ("HYBRID_SHARD", 2, 4)])
def test_metrics_loss_norm_learning_rate_tokens_bytes(clusters, strategy, replicate, world):
    torch.manual_seed(0)
    model = mlp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, eps=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda c: 1 / (1 + c))
    expected = []
    for batch in mlp_batches():
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        expected.append((loss.item(), norm.item(), opt.param_groups[0]["lr"]))
        opt.step()
        sched.step()
    for per_rank in clusters[world].run(step_metrics, strategy, replicate):
        for (m, recorded), (loss, norm, lr) in zip(per_rank, expected):
            assert m["loss"] == pytest.approx(loss, rel=1e-5)
            assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
            assert m["learning_rate"] == pytest.approx(lr, rel=1e-12)
            assert m["tokens"] == 12  # float inputs: rows of the global batch
            assert m["comm_bytes"] == recorded and recorded["all_reduce"] >= 8


# -- frozen parameters (LoRA-style, frozen and trainable in one unit) ---------------------------


class LoRALinear(nn.Module):
    def __init__(self, d, r=2):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Parameter(torch.randn(r, d) * 0.3)
        self.b = nn.Parameter(torch.randn(d, r) * 0.3)

    def forward(self, x):
        return F.gelu(self.base(x) + (x @ self.a.t()) @ self.b.t())


class LoRANet(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        self.blocks = nn.ModuleList(LoRALinear(d) for _ in range(layers))
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def lora_model(d=12, layers=2):
    model = LoRANet(d, layers)
    for blk in model.blocks:
        blk.base.requires_grad_(False)
    return model


@settings(max_examples=8)
@given(world=WORLDS, strategy=STRATS, d=st.sampled_from([12]), layers=st.integers(1, 3))
def test_frozen_and_trainable_in_one_unit(clusters, world, strategy, d, layers):
    report = check_equivalence(
        functools.partial(lora_model, d, layers), mlp_loss, mlp_batches(12, 5), optimizer=ADAMW,
        strategies=[strategy], world_sizes=[world], clusters=clusters,
    )
    assert report.failures() == []


def lora_bytes():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(lora_model(12, 2))
    frozen = {n: p.clone() for n, p in params.items() if not p.requires_grad}
    sharded = sf.shard(params, mesh, "FULL_SHARD", bucket_bytes=0)  # unit by unit
    opt = adamw(1e-2)
    state = opt.init(sharded)
    step = sf.jit_step(mlp_loss, mesh, optimizer=opt)
    batch = split_batch(mlp_batches(12, 5)[0], mesh.rank, mesh.size)
    with sf.record_collectives() as log:
        sharded, state, _ = step(sharded, state, batch)
    full = sf.gather(sharded)
    unchanged = all(torch.equal(full[n], p) for n, p in frozen.items())
    rs = sum(c.nbytes for c in log.select(purpose="reduce") if c.kind == "reduce_scatter" and c.unit.startswith("blocks"))
    ag = sum(c.nbytes for c in log.select(purpose="gather") if c.kind == "all_gather" and c.unit.startswith("blocks"))
    return rs, ag, sorted(state.mu), unchanged, sorted(frozen)


def test_frozen_parameters_cost_no_reduce_traffic_or_state(clusters):
    rs, ag, state_keys, unchanged, frozen = clusters[2].run(lora_bytes)[0]
    # Per block: base 12x12 + 12 (frozen), a 2x12 + b 12x2 (trainable); 2 ranks, 6 rows each.
    assert ag == 2 * (144 + 12 + 24 + 24) * 4  # the forward gathers everything
    assert rs == 2 * (24 + 24) * 4  # but reduce-scatters only a and b
    saved = 2 * (144 + 12) * 4
    assert saved == 1248  # bytes of reduce-scatter per step that freezing saves here
    assert not any(k in frozen for k in state_keys) and len(state_keys) == 2 * 2 + 2
    assert unchanged


# -- tied parameters --------------------------------------------------------------------------


def tied_gpt():
    return GPT(GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=True))


@pytest.mark.parametrize("units", [None, sf.by_prefix("tok", "head", "blocks.0")], ids=["default", "tie_across_units"])
@pytest.mark.parametrize("world", [2, 3])
def test_tied_embeddings(clusters, units, world):
    report = check_equivalence(tied_gpt, gpt_loss, gpt_batches(), optimizer=ADAMW,
                               world_sizes=[world], units=units, clusters=clusters)
    assert report.failures() == []


def test_tie_across_units_goes_to_the_root_unit():
    params, _ = sf.functionalize(tied_gpt())
    from shardfn._state.layout import build_layout
    from shardfn._state.tree import tree_info

    layout = build_layout(sf.Plan("FULL_SHARD"), (2,), 2, 1, params, ["tok", "head", "blocks.0"],
                          tree_info(params.module))
    assert layout.unit_of("tok.weight").path == ""
    assert [u.path for u in layout.units] == ["", "blocks.0"]  # "tok" and "head" hold only the tied weight


# -- buffers ------------------------------------------------------------------------------------


class Centered(nn.Module):
    """A running mean of the inputs (updated in place in training), and a constant mask."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("mask", (torch.arange(d) % 3 != 0).float())
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        out = self.lin((x - self.mean) * self.mask)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return out


class BufferNet(nn.Module):
    def __init__(self, d=12):
        super().__init__()
        self.blocks = nn.ModuleList([Centered(d), Centered(d)])
        self.head = nn.Linear(d, 5)

    def forward(self, x):
        for b in self.blocks:
            x = F.gelu(b(x))
        return self.head(x)


@settings(max_examples=6)
@given(world=WORLDS, strategy=STRATS)
def test_buffers_updated_in_place_stay_equal_across_ranks(clusters, world, strategy):
    report = check_equivalence(BufferNet, mlp_loss, mlp_batches(12, 5), optimizer=SGD, strategies=[strategy],
                               world_sizes=[world], clusters=clusters)
    leaves = report.leaves[(strategy, world)]
    assert {"blocks.0.mean", "blocks.1.mask"} <= set(leaves)
    assert report.failures() == []


# -- custom optimizers: psum, schedules, masking ------------------------------------------------


class TrustRatioSGD:
    """A LAMB-style optimizer written by a user: per-parameter trust ratio via psum."""

    def __init__(self, lr=0.1):
        self.lr = lr

    def init(self, params):
        return ()

    def update(self, grads, state, params):
        from shardfn.optim import psum

        updates = {}
        for name, g in grads.items():
            p_norm = psum(params[name].detach().square().sum()).sqrt()
            g_norm = psum(g.square().sum()).sqrt()
            ratio = torch.where((p_norm > 0) & (g_norm > 0), p_norm / g_norm, torch.ones(()))
            updates[name] = -self.lr * ratio * g
        return updates, state


def _schedule(count):
    return 1e-2 * math.cos(0.3 * count)


def _no_decay(name):
    return not name.endswith("bias")


CUSTOM = {
    "trust_ratio_psum": TrustRatioSGD,
    # lr / eps <= 1, so a gradient's rounding moves a parameter by a few times it (tests/bounds.py)
    "schedule": functools.partial(adamw, _schedule, eps=1e-2),
    "masked_decay": functools.partial(adamw, 1e-2, eps=1e-2, weight_decay=0.5, mask=_no_decay),
}


@settings(max_examples=9)
@given(world=WORLDS, strategy=STRATS, name=st.sampled_from(sorted(CUSTOM)))
def test_custom_optimizers(clusters, world, strategy, name):
    report = check_equivalence(mlp_model, mlp_loss, mlp_batches(), optimizer=CUSTOM[name], strategies=[strategy],
                               world_sizes=[world], clusters=clusters)
    assert report.failures() == []


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"])
def test_blocking_reductions_equal_overlapped_ones(clusters, strategy):
    world = (2, 2) if strategy == "HYBRID_SHARD" else 2
    for overlap in (True, False):
        report = check_equivalence(mlp_model, mlp_loss, mlp_batches(), optimizer=SGD, strategies=[strategy],
                                   world_sizes=[world], clusters=clusters, step_options={"overlap": overlap})
        assert report.failures() == []


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"])
def test_prefetch_off_equals_single_process(clusters, strategy, world):
    """Prefetch is the default (every other equivalence test runs it); this checks the option off."""
    from test_equivalence import gpt_batches, gpt_loss, gpt_model

    world = (2, 2) if strategy == "HYBRID_SHARD" else world
    for plan in (sf.Plan(strategy), sf.Plan(strategy, remat=sf.Remat(every=2))):
        report = check_equivalence(gpt_model, gpt_loss, gpt_batches(4), optimizer=SGD, strategies=[plan],
                                   world_sizes=[world], clusters=clusters, step_options={"prefetch": False})
        assert report.failures() == []
