"""Sharded checkpoints: resharding to any layout, exact resume, atomic saves, exports."""

import json
import os
import shutil
import warnings
from pathlib import Path

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
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
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
    from shardfn._io import checkpoint as _checkpoint

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
    sf.save_pretrained(sharded, path)
    x = gpt_batches(1)[0]["x"][:2]
    with torch.no_grad():
        sharded_out = apply(sharded, x)
    if mesh.rank != 0:
        return len(full), None
    from safetensors.torch import load_file

    model = gpt_model()
    model.load_state_dict(full)
    exported = load_file(os.path.join(path, "model.safetensors"))
    with torch.no_grad():
        plain_out = model(x)
    same_export = exported.keys() == full.keys() and all(torch.equal(exported[n], full[n]) for n in full)
    return len(full), (torch.equal(plain_out, sharded_out), same_export)


def test_full_state_dict_loads_into_the_plain_module(clusters, tmp_path):
    results = clusters[3].run(full_state_dict_and_safetensors, str(tmp_path / "exported"))
    assert results[1][0] == 0 and results[2][0] == 0  # rank0_only
    n, (same_output, same_export) = results[0]
    assert n > 0 and same_output and same_export


class _Evil:
    def __reduce__(self):
        return (os.getpid, ())


def tampered_load(path):
    import pickle

    from shardfn._io import checkpoint as _checkpoint

    _, sharded, state, _, _ = _train("FULL_SHARD", steps=0)
    sf.checkpoint.save(path, sharded, state)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Evil(), f)
    errors = []
    for forge in (False, True):
        if forge:  # the digests are no secret: whoever can write the files can record new ones
            meta = json.loads(Path(path, "shardfn.json").read_text())
            meta["digests"][".metadata"] = _checkpoint._digest(os.path.join(path, ".metadata"))
            meta["meta_digest"] = _checkpoint._meta_digest(meta)
            Path(path, "shardfn.json").write_text(json.dumps(meta))
        try:
            sf.checkpoint.load(path, sharded, state)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_tampered_metadata_is_refused_not_unpickled(clusters, tmp_path):
    caught, forged = clusters[1].run(tampered_load, str(tmp_path / "t"))[0]
    assert "damaged" in caught and ".metadata: changed since it was saved" in caught
    assert "refusing to load it" in forged and "getpid" in forged


# -- crash recovery and latest() ---------------------------------------------------------


def save_two(good, new):
    """A checkpoint after one step (step 1) and one after two (step 2); their full states."""
    mesh, sharded, state, step, _ = _train("FULL_SHARD", steps=1)
    sf.checkpoint.save(good, sharded, state, extra={"step": 1, "rng": torch.arange(3)})
    first = _full_state(sharded, state)
    sharded, state, _ = step(sharded, state, split_batch(gpt_batches(2)[1], mesh.rank, mesh.size))
    sf.checkpoint.save(new, sharded, state, extra={"step": 2, "rng": torch.arange(4)})
    return first, _full_state(sharded, state)


def load_recording(path):
    """Loads ``path`` into fresh shards: (full state, extra, warnings, latest of its directory)."""
    _, sharded, state, _, _ = _train("FULL_SHARD", steps=0, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded, state, extra = sf.checkpoint.load(path, sharded, state)
    return _full_state(sharded, state), extra, [str(w.message) for w in caught], sf.checkpoint.latest(Path(path).parent)


def _crash_states(tmp_path):
    """The directory states a save of step 2 to ``c`` leaves when killed at each point."""
    good, new = tmp_path / "good", tmp_path / "new"
    states = {}
    for point in ("during DCP's write", "after the first rename", "before removing .old", "partial only"):
        d = tmp_path / point.replace(" ", "_").replace("'", "")
        d.mkdir()
        if point == "during DCP's write":  # the previous checkpoint, and some of the new files
            shutil.copytree(good, d / "c")
            (d / "c.partial").mkdir()
            shutil.copy(new / "__0_0.distcp", d / "c.partial")
        elif point == "after the first rename":  # the new one is complete, still at .partial
            shutil.copytree(good, d / "c.old")
            shutil.copytree(new, d / "c.partial")
        elif point == "before removing .old":
            shutil.copytree(good, d / "c.old")
            shutil.copytree(new, d / "c")
        else:  # the first save ever, killed after writing its metadata
            shutil.copytree(new, d / "c.partial")
        states[point] = d
    return states


def test_a_save_killed_at_any_point_leaves_the_last_good_checkpoint_where_load_looks(clusters, tmp_path):
    good, new = clusters[2].run(save_two, str(tmp_path / "good"), str(tmp_path / "new"))[0]
    expected = {"during DCP's write": (good, 1), "after the first rename": (good, 1), "before removing .old": (new, 2)}
    for point, d in _crash_states(tmp_path).items():
        if point == "partial only":
            assert sf.checkpoint.latest(d) is None
            continue
        want, step = expected[point]
        for full, extra, caught, latest in clusters[2].run(load_recording, str(d / "c")):  # every rank
            _assert_same(full, want)
            assert extra["step"] == step and torch.equal(extra["rng"], torch.arange(2 + step)), point
            assert latest == str(d / "c"), point
            if point == "after the first rename":
                (message,) = caught
                assert f"{d / 'c'}'): no checkpoint there, but '{d / 'c.old'}' holds one" in message
            else:
                assert caught == [], point


def save_over(path):
    _, sharded, state, _, _ = _train("FULL_SHARD", steps=0, seed=4)
    sf.checkpoint.save(path, sharded, state, extra={"step": 3})
    return sf.gather(sharded)


def test_the_next_save_replaces_a_recovered_checkpoint(clusters, tmp_path):
    clusters[2].run(save_two, str(tmp_path / "good"), str(tmp_path / "new"))
    d = _crash_states(tmp_path)["after the first rename"]
    saved = clusters[2].run(save_over, str(d / "c"))[0]
    assert sorted(os.listdir(d)) == ["c"]
    full, extra, caught, _ = clusters[2].run(load_recording, str(d / "c"))[0]
    assert extra["step"] == 3 and caught == [] and all(torch.equal(full["params"][n], saved[n]) for n in saved)


def _fake(path, step=None, meta=True):
    path.mkdir(parents=True)
    if meta:
        extra = {} if step is None else {"step": step}
        (path / "shardfn.json").write_text(json.dumps({"format": "shardfn-checkpoint-3", "extra": extra}))


def test_latest_orders_by_step_and_skips_incomplete_saves(tmp_path):
    assert sf.checkpoint.latest(tmp_path / "nothing-here") is None
    _fake(tmp_path / "step-000009")
    _fake(tmp_path / "step-000010")
    assert sf.checkpoint.latest(tmp_path) == str(tmp_path / "step-000010")  # 10 > 9, not by text
    _fake(tmp_path / "step-000012", meta=False)  # no shardfn.json: not a checkpoint
    _fake(tmp_path / "step-000013.partial", step=13)  # complete but never published
    _fake(tmp_path / "plain")  # no step at all: before every numbered one
    assert sf.checkpoint.latest(tmp_path) == str(tmp_path / "step-000010")
    _fake(tmp_path / "last", step=11)  # the recorded step, whatever the name
    assert sf.checkpoint.latest(tmp_path) == str(tmp_path / "last")
    _fake(tmp_path / "step-000014.old")  # a save to step-000014 died between its renames
    assert sf.checkpoint.latest(tmp_path) == str(tmp_path / "step-000014")
    _fake(tmp_path / "step-000015.old", step=15)  # the .old of a published checkpoint: not another one
    _fake(tmp_path / "step-000015", step=16)
    assert sf.checkpoint.latest(tmp_path) == str(tmp_path / "step-000015")
    only = tmp_path / "only"
    _fake(only / "b")
    _fake(only / "a")
    assert sf.checkpoint.latest(only) == str(only / "b")  # no steps: by name, deterministically


# -- digests --------------------------------------------------------------------------------


def load_each(paths):
    _, sharded, state, _, _ = _train("FULL_SHARD", steps=0, seed=1)
    out = []
    for path in paths:
        try:
            sf.checkpoint.load(path, sharded, state)
            out.append("loaded")
        except ValueError as e:
            out.append(str(e))
    return out


def flip_each(src, root):
    """Copies of checkpoint ``src``, each with one bit flipped in one file: at its start, middle and
    end, and in a .distcp file also in the middle of its largest tensor. Returns (copy, file, offset)s."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(src).read_metadata().storage_data.values()
    flips = []
    for name in sorted(os.listdir(src)):
        size = os.path.getsize(os.path.join(src, name))
        offsets = [0, size // 2, size - 1]
        tensors = [info for info in stored if info.relative_path == name]
        if tensors:
            largest = max(tensors, key=lambda info: info.length)
            offsets.insert(1, largest.offset + largest.length // 2)
        for offset in offsets:
            d = os.path.join(root, f"flip-{len(flips)}")
            shutil.copytree(src, d)
            data = bytearray(Path(d, name).read_bytes())
            data[offset] ^= 0x01
            Path(d, name).write_bytes(bytes(data))
            flips.append((d, name, offset))
    return flips


def test_every_flipped_bit_is_caught_on_every_rank(clusters, tmp_path):
    clusters[2].run(save_two, str(tmp_path / "good"), str(tmp_path / "new"))
    assert sorted(os.listdir(tmp_path / "new")) == [".metadata", "__0_0.distcp", "__1_0.distcp", "shardfn.json"]
    flips = flip_each(str(tmp_path / "new"), str(tmp_path))
    results = clusters[2].run(load_each, [d for d, _, _ in flips])
    named = [[f"{os.path.join(d, name)}: changed since it was saved" in r[i] and "latest(directory)" in r[i]
              for r in results] for i, (d, name, _) in enumerate(flips)]
    print(f"flipped bits caught on both ranks: {sum(all(n) for n in named)} of {len(flips)}")
    assert named == [[True, True]] * len(flips), [r[i] for r in results for i in range(len(flips))]


def to_format_2(path):
    meta = json.loads(Path(path, "shardfn.json").read_text())
    del meta["digests"], meta["meta_digest"]
    meta["format"] = "shardfn-checkpoint-2"
    Path(path, "shardfn.json").write_text(json.dumps(meta))


def test_a_format_2_checkpoint_loads_unverified_with_one_warning(clusters, tmp_path):
    good, _ = clusters[2].run(save_two, str(tmp_path / "good"), str(tmp_path / "new"))[0]
    to_format_2(tmp_path / "good")
    for full, extra, caught, _ in clusters[2].run(load_recording, str(tmp_path / "good")):
        _assert_same(full, good)
        (message,) = caught
        assert "Format 2 records no digests: the checkpoint is loaded unverified" in message


def load_per_rank(paths):
    """Rank r loads paths[r]; returns what each raised (type name, first line)."""
    mesh, sharded, state, _, _ = _train("FULL_SHARD", steps=0, seed=1)
    try:
        sf.checkpoint.load(paths[mesh.rank], sharded, state)
    except (ValueError, sf.DivergenceError, sf.PeerError) as e:
        return type(e).__name__, str(e)
    return "loaded", ""


def test_ranks_that_load_different_checkpoints_all_raise(clusters, tmp_path):
    good, new = str(tmp_path / "good"), str(tmp_path / "new")
    clusters[2].run(save_two, good, new)
    results = clusters[2].run(load_per_rank, [good, new])
    assert [kind for kind, _ in results] == ["DivergenceError", "DivergenceError"], results
    for _, message in results:
        assert "about to load different checkpoints" in message and "rank 0: barrier (checkpoint), 0 bytes, " \
            "checkpoint " in message, message
    # a rank whose load fails before any collective: the other learns it, naming the rank
    results = clusters[2].run(load_per_rank, [good, str(tmp_path / "missing")])
    assert results[1][0] == "ValueError" and "missing" in results[1][1]
    assert results[0][0] == "PeerError" and "rank 1 raised" in results[0][1] and "ValueError" in results[0][1], results
