"""Sharded checkpoints: resharding to any layout, exact resume, atomic saves, exports."""

import os

import pytest
import torch

import shardfn as sf
from shardfn.testing import split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model


def _train(strategy, replicate=None, steps=2, seed=0):
    mesh = sf.Mesh.from_group(replicate=replicate)
    torch.manual_seed(seed)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, strategy)
    opt = sf.optim.adamw(1e-2)
    state = opt.init(sharded)
    step = sf.jit_step(lambda p, b: gpt_loss(apply, p, b), mesh, optimizer=opt)
    for b in gpt_batches(steps):
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    return mesh, sharded, state, step, apply


def _full_state(sharded, state):
    """Full parameters and full AdamW moments, gathered."""
    return {
        "params": sf.gather(sharded),
        "mu": sf.gather(sharded.replace(state.mu)),
        "nu": sf.gather(sharded.replace(state.nu)),
        "count": int(state.count),
    }


def save_after_training(path, strategy, replicate=None):
    _, sharded, state, _, _ = _train(strategy, replicate)
    sf.checkpoint.save(path, sharded, state, extra={"step": 2, "note": "x", "rng": torch.arange(5)})
    return _full_state(sharded, state)


def load_into(path, strategy, replicate=None):
    # A different initialisation (seed 1) and no training: everything must come from the file.
    mesh, sharded, state, _, _ = _train(strategy, replicate, steps=0, seed=1)
    sharded, state, extra = sf.checkpoint.load(path, sharded, state)
    return _full_state(sharded, state), extra


def _assert_same(a, b):
    assert a["count"] == b["count"]
    for part in ("params", "mu", "nu"):
        assert a[part].keys() == b[part].keys()
        for n in a[part]:
            assert torch.equal(a[part][n], b[part][n]), (part, n)


def test_save_at_4_full_shard_load_anywhere(clusters, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = clusters[4].run(save_after_training, path, "FULL_SHARD")[0]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # published, nothing left beside it
    targets = [(2, "SHARD_GRAD_OP", None), (1, "FULL_SHARD", None), (3, "NO_SHARD", None), (4, "HYBRID_SHARD", 2),
               (3, "FULL_SHARD", None)]
    for world, strategy, replicate in targets:
        for full, extra in clusters[world].run(load_into, path, strategy, replicate):
            _assert_same(full, saved)
            assert extra["step"] == 2 and extra["note"] == "x" and torch.equal(extra["rng"], torch.arange(5))


def test_save_hybrid_load_single_rank(clusters, tmp_path):
    path = str(tmp_path / "hybrid")
    saved = clusters[4].run(save_after_training, path, "HYBRID_SHARD_ZERO2", 2)[0]
    full, _ = clusters[1].run(load_into, path, "FULL_SHARD")[0]
    _assert_same(full, saved)


def resume(path, k):
    mesh, sharded, state, step, _ = _train("FULL_SHARD", steps=0)
    batches = gpt_batches(2 * k)
    for b in batches[:k]:
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    sf.checkpoint.save(path, sharded, state)
    # A fresh process state: new shards from another seed, new optimizer state, new step.
    mesh, sharded2, state2, step2, _ = _train("FULL_SHARD", steps=0, seed=7)
    sharded2, state2, _ = sf.checkpoint.load(path, sharded2, state2)
    for b in batches[k:]:
        sharded2, state2, _ = step2(sharded2, state2, split_batch(b, mesh.rank, mesh.size))
    for b in batches[k:]:
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    return sf.gather(sharded2), sf.gather(sharded)


def test_resume_is_bitwise_exact(clusters, tmp_path):
    for resumed, straight in clusters[2].run(resume, str(tmp_path / "r"), 2):
        for n in straight:
            assert torch.equal(resumed[n], straight[n]), n


def interrupted_save(path):
    """A first good save, then a save that dies after writing its data."""
    from shardfn import _checkpoint

    mesh, sharded, state, step, _ = _train("FULL_SHARD", steps=1)
    sf.checkpoint.save(path, sharded, state, extra={"step": 1})
    good = sf.gather(sharded)
    sharded, state, _ = step(sharded, state, split_batch(gpt_batches(1)[0], mesh.rank, mesh.size))
    real = _checkpoint.dcp.save

    def dying(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("killed")

    _checkpoint.dcp.save = dying
    try:
        sf.checkpoint.save(path, sharded, state, extra={"step": 2})
    except RuntimeError:
        pass
    finally:
        _checkpoint.dcp.save = real
    _, fresh, fresh_state, _, _ = _train("FULL_SHARD", steps=0, seed=3)
    fresh, _, extra = sf.checkpoint.load(path, fresh, fresh_state)
    errors = {}
    for name, target in [("partial", path + ".partial"), ("nowhere", path + ".nope")]:
        try:
            sf.checkpoint.load(target, fresh, fresh_state)
        except ValueError as e:
            errors[name] = str(e)
    return good, sf.gather(fresh), extra, errors, sorted(os.listdir(os.path.dirname(path)))


def test_a_save_that_dies_leaves_the_last_good_checkpoint(clusters, tmp_path):
    good, loaded, extra, errors, listing = clusters[2].run(interrupted_save, str(tmp_path / "c"))[0]
    assert extra == {"step": 1}
    assert all(torch.equal(good[n], loaded[n]) for n in good)
    assert listing == ["c", "c.partial"]
    assert "not a complete shardfn checkpoint" in errors["partial"] and "shardfn.json" in errors["partial"]
    assert "missing" in errors["nowhere"] and ".metadata" in errors["nowhere"]


def mismatched_load(path):
    from shardfn.testing.models import GPT, GPTConfig

    _, sharded, state, _, _ = _train("FULL_SHARD", steps=0)
    sf.checkpoint.save(path, sharded, state)
    params, _ = sf.functionalize(GPT(GPTConfig(vocab_size=30, seq_len=8, d_model=16, n_layers=3, n_heads=2)))
    other = sf.shard(params, sharded.mesh, "FULL_SHARD")
    try:
        sf.checkpoint.load(path, other, sf.optim.adamw(1e-3).init(other))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_load_names_the_leaves(clusters, tmp_path):
    msg = clusters[2].run(mismatched_load, str(tmp_path / "m"))[0]
    assert "tok.weight: checkpoint shape (29, 16), these params (30, 16)" in msg
    assert "blocks.2.attn.qkv.weight: missing from the checkpoint" in msg


def full_state_dict_and_safetensors(path):
    mesh, sharded, _, _, apply = _train("FULL_SHARD", steps=1)
    full = sf.gather(sharded, rank0_only=True, device="cpu")
    sf.checkpoint.export_safetensors(path, sharded)
    x = gpt_batches(1)[0]["x"][:2]
    with torch.no_grad():
        sharded_out = apply(sharded, x)
    if mesh.rank != 0:
        return len(full), None
    from safetensors.torch import load_file

    model = gpt_model()
    model.load_state_dict(full)
    exported = load_file(path)
    with torch.no_grad():
        plain_out = model(x)
    same_export = exported.keys() == full.keys() and all(torch.equal(exported[n], full[n]) for n in full)
    return len(full), (torch.equal(plain_out, sharded_out), same_export)


def test_full_state_dict_loads_into_the_plain_module(clusters, tmp_path):
    results = clusters[3].run(full_state_dict_and_safetensors, str(tmp_path / "model.safetensors"))
    assert results[1][0] == 0 and results[2][0] == 0  # rank0_only
    n, (same_output, same_export) = results[0]
    assert n > 0 and same_output and same_export


class _Evil:
    def __reduce__(self):
        return (os.getpid, ())


def tampered_load(path):
    import pickle

    _, sharded, state, _, _ = _train("FULL_SHARD", steps=0)
    sf.checkpoint.save(path, sharded, state)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    try:
        sf.checkpoint.load(path, sharded, state)
    except ValueError as e:
        return str(e)
    return "no error"


def test_tampered_metadata_is_refused_not_unpickled(clusters, tmp_path):
    msg = clusters[1].run(tampered_load, str(tmp_path / "t"))[0]
    assert "refusing to load it" in msg and "getpid" in msg
