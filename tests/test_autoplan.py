"""shardfn.autoplan: the plans that fit a budget, from explain's fake step; checked against
explain at full depth and against a real run."""

import pytest
import torch

import shardfn as sf
from shardfn._planning.autoplan import _figures
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

SMALL = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_layers=5, n_heads=4)  # 5 blocks: extended from 3 and 4
BIG = GPTConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_layers=32, n_heads=32)  # 6.7B parameters


def loss_fn(apply, params, batch):
    return lm_loss(apply(params, batch[0]), batch[1])


def test_extended_figures_equal_explain_at_full_depth():
    """The 7B model planned from 3 and 4 blocks equals explain's simulation of all 32, to the byte."""
    with torch.device("meta"):
        model = GPT(BIG)
    tokens = torch.zeros(1, BIG.seq_len, dtype=torch.long)
    plan = sf.Plan("FULL_SHARD", remat=sf.Remat())
    extended = _figures(model, 64, plan, 1, (tokens, tokens), loss_fn, None)
    full = sf.explain(model, 64, plan, (tokens, tokens), loss_fn=loss_fn, verbose=False)
    assert extended.peak_bytes == full.peak_bytes and extended.persistent_bytes == full.persistent_bytes
    assert extended.comm_bytes == sum(b for _, b in full.collectives.values())


@pytest.mark.parametrize("world", [8, 64])
def test_a_seven_billion_parameter_gpt_is_planned_for_40_and_80_gib(world, capsys):
    with torch.device("meta"):
        model = GPT(BIG)
    tokens = torch.zeros(1, BIG.seq_len, dtype=torch.long)
    found = {b: sf.autoplan(model, world, f"{b}GiB", (tokens, tokens), loss_fn=loss_fn) for b in (40, 80)}
    printed = capsys.readouterr().out
    for budget, r in found.items():
        assert r.frontier and all(c.peak_bytes <= budget * 2**30 for c in r.frontier)
        assert f"budget {budget:.2f} GiB" in printed
        # nothing on the frontier is beaten on every count by another plan of it
        for a in r.frontier:
            for b in r.frontier:
                ka = (a.peak_bytes, a.moved(), a.remat, a.micro_batches)
                kb = (b.peak_bytes, b.moved(), b.remat, b.micro_batches)
                assert not (all(x <= y for x, y in zip(kb, ka)) and kb != ka), (b.label(), a.label())
        # the recommended plan gives up the least: no offload or remat when a plan fits without
        assert r.chosen is r.frontier[0]
        assert (r.chosen.offload, r.chosen.remat) == min((c.offload, c.remat) for c in r.frontier)
    # a larger budget recommends a plan that moves no more bytes
    assert found[80].chosen.moved() <= found[40].chosen.moved()
    # the fp32 7B model's optimizer state alone (12 bytes per parameter) does not fit unsharded
    assert all(c.plan.strategy is not sf.Strategy.NO_SHARD for r in found.values() for c in r.frontier)


def measured_peak(plan, micro_batches):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(SMALL))
    sharded = sf.shard(params, mesh, plan)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=micro_batches)
    g = torch.Generator().manual_seed(mesh.rank)
    batch = tuple(torch.randint(0, SMALL.vocab_size, (4, SMALL.seq_len), generator=g) for _ in range(2))
    sharded, state, _ = step(sharded, state, batch)
    with sf.track_live_bytes(sharded, state) as mem:
        sharded, state, _ = step(sharded, state, batch)
    return mem.device_peak


def test_the_chosen_plans_measured_peak_is_within_ten_percent_of_its_prediction(clusters):
    with torch.device("meta"):
        model = GPT(SMALL)
    batch = (torch.zeros(4, SMALL.seq_len, dtype=torch.long),) * 2
    search = {"loss_fn": loss_fn, "strategies": ("FULL_SHARD", "SHARD_GRAD_OP"), "micro_batches": (1, 2),
              "verbose": False}  # 16 candidates, to keep the test short
    everything = sf.autoplan(model, 2, 2**40, batch, **search)
    assert everything.tried == 16
    peaks = sorted(c.peak_bytes for c in everything.frontier)
    # a budget between the smallest and the largest peak: some plans fit, some do not
    budget = (peaks[0] + peaks[-1]) // 2
    found = sf.autoplan(model, 2, budget, batch, **search)
    assert found.chosen is not None and len(found.frontier) < len(everything.frontier)
    for c in (found.chosen, found.frontier[-1]):  # the recommended plan, and the last of the frontier
        real = clusters[2].run(measured_peak, c.plan, c.micro_batches)[0]  # rank 0: the largest shards
        assert abs(real - c.peak_bytes) <= 0.10 * real, (c.label(), real, c.peak_bytes)


def test_a_budget_must_be_bytes():
    with pytest.raises(ValueError, match="'40GiB'"):
        sf.autoplan(GPT(SMALL), 2, "forty", (torch.zeros(1, 4, dtype=torch.long),) * 2, verbose=False)


def test_the_cache_answers_only_for_the_same_loss_and_stays_bounded(monkeypatch):
    """Figures are cached by the loss function itself, not by its id(): an id is recycled
    once the function is freed, and would answer for another one. The entry keeps its
    function alive instead, and the cache keeps only the most recent entries."""
    import weakref

    from shardfn._planning import autoplan as _autoplan

    _autoplan._CACHE.clear()
    monkeypatch.setattr(_autoplan._CACHE, "size", 2)
    with torch.device("meta"):
        model = GPT(SMALL)
    tokens = torch.zeros(1, SMALL.seq_len, dtype=torch.long)
    plan = sf.Plan("FULL_SHARD")

    def make(forwards):
        def loss(apply, params, batch):
            return sum(lm_loss(apply(params, batch[0]), batch[1]) for _ in range(forwards))
        return loss

    once = make(1)
    peak_once = _figures(model, 2, plan, 1, (tokens, tokens), once, None).peak_bytes
    alive = weakref.ref(once)
    del once
    assert alive() is not None  # held by its entry: its id cannot be given to another function
    twice = make(2)
    peak_twice = _figures(model, 2, plan, 1, (tokens, tokens), twice, None).peak_bytes
    assert peak_twice == sf.explain(model, 2, plan, (tokens, tokens), loss_fn=twice, verbose=False).peak_bytes
    assert peak_twice > peak_once
    _figures(model, 2, sf.Plan("SHARD_GRAD_OP"), 1, (tokens, tokens), twice, None)
    assert len(_autoplan._CACHE) == 2 and alive() is None  # the oldest entry, and its function, went
