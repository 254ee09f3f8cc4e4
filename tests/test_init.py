"""Deferred (meta-device) init unit by unit, and loading weights held by rank 0 only."""

import weakref

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from shardfn.testing.models import GPT, GPTConfig

CFGS = {
    "gpt": GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layers=3, n_heads=2),
    "gpt_tied": GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=True),
}


def meta_model(name):
    with torch.device("meta"):
        return GPT(CFGS[name])


def deferred(name, strategy, replicate=None):
    """Deferred init of a meta model; also checks one unit of full values at a time."""
    from shardfn._state import materialize as _materialize

    mesh = sf.Mesh.from_group(replicate=replicate)
    params, _ = sf.functionalize(meta_model(name))
    live, overlaps = [], []
    real = _materialize.unit_values

    def spy(*args, **kwargs):
        for unit, full in real(*args, **kwargs):
            # A previous unit's values count if still alive with real storage (moving a
            # module back to meta may keep the Parameter object but frees its storage).
            overlaps.append(sum(1 for refs in live if any(r() is not None and not r().is_meta for r in refs)))
            live.append([weakref.ref(t) for t in full.values()])
            yield unit, full
            del full

    _materialize.unit_values = spy
    try:
        sharded = sf.shard(params, mesh, strategy, seed=1234)
    finally:
        _materialize.unit_values = real
    return sf.gather(sharded), max(overlaps), len(overlaps)


@settings(max_examples=8)
@given(world=st.integers(1, 4), strategy=st.sampled_from(["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]),
       name=st.sampled_from(sorted(CFGS)))
def test_deferred_init_equals_single_device_at_every_world_size(clusters, world, strategy, name):
    reference = sf.materialize(meta_model(name), seed=1234).state_dict()  # gather() returns these keys
    for full, overlap, units in clusters[world].run(deferred, name, strategy):
        assert overlap == 0  # the previous unit's full values were gone before the next was made
        assert units == len({n.split(".")[1] for n in full if n.startswith("blocks.")}) + 1
        assert full.keys() == reference.keys()
        for n, p in reference.items():
            assert torch.equal(full[n], p.detach()), n


def test_deferred_init_on_a_hybrid_mesh(clusters):
    reference = sf.materialize(meta_model("gpt"), seed=1234).state_dict()
    full = clusters[4].run(deferred, "gpt", "HYBRID_SHARD", 2)[0][0]
    assert all(torch.equal(full[n], p.detach()) for n, p in reference.items())


def test_materialize_is_seeded_and_initialised():
    a = dict(sf.materialize(meta_model("gpt"), seed=1).named_parameters())
    b = dict(sf.materialize(meta_model("gpt"), seed=1).named_parameters())
    c = dict(sf.materialize(meta_model("gpt"), seed=2).named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    assert torch.equal(a["blocks.0.ln1.weight"], torch.ones(16))  # reset_parameters ran
    assert a["blocks.0.attn.qkv.weight"].std() > 0.05


def from_rank0(strategy, replicate=None, meta_on_src=False):
    mesh = sf.Mesh.from_group(replicate=replicate)
    if dist.get_rank() == 0 and not meta_on_src:
        torch.manual_seed(5)
        model = GPT(CFGS["gpt"])  # "pretrained" weights, on rank 0 only
    else:
        model = meta_model("gpt")
    params, _ = sf.functionalize(model)
    try:
        with sf.record_collectives() as log:
            sharded = sf.shard(params, mesh, strategy, src_rank=0)
    except ValueError as e:
        return str(e)
    return sf.gather(sharded), sorted({c.kind.value for c in log.calls if c.purpose == "load"})


@pytest.mark.parametrize("strategy, replicate, world", [("FULL_SHARD", None, 3), ("NO_SHARD", None, 2),
                                                         ("HYBRID_SHARD", 2, 4), ("SHARD_GRAD_OP", None, 1)])
def test_load_weights_held_by_rank0_only(clusters, strategy, replicate, world):
    torch.manual_seed(5)
    expected = dict(GPT(CFGS["gpt"]).named_parameters())
    kinds = set()
    for full, rank_kinds in clusters[world].run(from_rank0, strategy, replicate):
        assert all(torch.equal(full[n], p.detach()) for n, p in expected.items())
        kinds |= set(rank_kinds)
    if world > 1:  # (under HYBRID only the source's shard row takes part in the scatters)
        assert kinds == {"FULL_SHARD": {"all_reduce", "scatter"}, "NO_SHARD": {"all_reduce", "broadcast"},
                         "HYBRID_SHARD": {"all_reduce", "broadcast", "scatter"}}[strategy]


def test_missing_weights_fail_on_every_rank_without_hanging(clusters):
    for rank, msg in enumerate(clusters[2].run(from_rank0, "FULL_SHARD", None, True)):
        assert f"[rank {rank}]" in msg and "rank 0 must hold the real values" in msg


def meta_without_source():
    mesh = sf.Mesh.from_group()
    model = GPT(CFGS["gpt"]) if dist.get_rank() == 0 else meta_model("gpt")
    params, _ = sf.functionalize(model)
    try:
        sf.shard(params, mesh, "FULL_SHARD")
    except ValueError as e:
        return str(e)
    return "no error"


def test_meta_params_without_seed_or_source_fail_on_every_rank(clusters):
    msgs = clusters[2].run(meta_without_source)
    assert "ranks disagree" in msgs[0] and "meta device" in msgs[1] and "src_rank" in msgs[1]




def seeds_differ():
    mesh = sf.Mesh.from_group()
    params, _ = sf.functionalize(meta_model("gpt"))
    try:
        sf.shard(params, mesh, "FULL_SHARD", seed=dist.get_rank())  # each rank its own seed
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_pass_different_seeds_fail_on_every_rank(clusters):
    # Each rank's shards would be pieces of a different model: silent unless the seed is agreed.
    for rank, msg in enumerate(clusters[2].run(seeds_differ)):
        assert "ranks disagree" in msg and f"shard(seed={rank})" in msg and "same seed on every rank" in msg, msg
