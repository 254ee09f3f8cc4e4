"""Tensor parallelism and checkpoints (issue 50): a tree whose MLPs are split over a ``tensor``
axis saved with ``checkpoint.save`` and loaded into another layout (and back), parameters and
SGD momentum, exactly; the next step equal to one from a tree that never went through the
checkpoint."""

import os

import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch
from test_tensor_parallel import PLAN, batches, loss_fn, model


def _build(strategy, tensor, seed, values=None):
    """A tree at this world (``tensor``: the tensor axis's size, or None), from ``model()``
    seeded by ``seed``, or holding ``values`` (name -> full tensor); ``strategy`` may end in
    ``/rows`` (row placement; flat otherwise)."""
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(seed)
    params, _ = sf.functionalize(model())
    if values is not None:
        with torch.no_grad():
            for n, t in params.items():
                t.copy_(values[n])
    name, _, placement = strategy.partition("/")
    plan = sf.Plan(name, placement=placement or "flat")
    return mesh, sf.shard(params, mesh, plan, tensor_parallel=PLAN if tensor else None)


def _full(sharded, state):
    return {"params": sf.gather(sharded), "momentum": sf.gather(sharded.replace(state.momentum_buffer)),
            "count": int(state.count)}


def _step(mesh, sharded, state, batch):
    step = sf.jit_step(loss_fn, mesh, optimizer=SGD_MOMENTUM())
    sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
    return float(metrics["loss"]), _full(sharded, state)


def save_after_training(path, strategy, tensor):
    mesh, sharded = _build(strategy, tensor, seed=0)
    state = SGD_MOMENTUM().init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=SGD_MOMENTUM())
    for batch in batches()[:2]:
        sharded, state, _ = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
    sf.checkpoint.save(path, sharded, state, extra={"step": 2})
    return _full(sharded, state)


def load_and_step(path, strategy, tensor, saved):
    """Loads into a tree of another seed, then one step from it and one from a tree built from
    ``saved``'s values (never through the checkpoint): what was loaded, and both steps."""
    mesh, sharded = _build(strategy, tensor, seed=1)
    opt = SGD_MOMENTUM()
    sharded, state, extra = sf.checkpoint.load(path, sharded, opt.init(sharded))
    return (_full(sharded, state), extra, *_next_steps(mesh, strategy, tensor, saved, sharded, state))


def _next_steps(mesh, strategy, tensor, saved, sharded, state):
    """The next step from ``sharded`` and from a tree of the same layout built from ``saved``'s
    values (never through a checkpoint or reshard)."""
    _, ref = _build(strategy, tensor, seed=2, values=saved["params"])
    _, mom = _build(strategy, tensor, seed=2, values={**saved["params"], **saved["momentum"]})
    ref_state = SGD_MOMENTUM().init(ref)
    ref_state = ref_state._replace(count=torch.full_like(ref_state.count, saved["count"]),
                                   momentum_buffer={n: mom[n].clone() for n in ref_state.momentum_buffer})
    batch = batches()[2]
    return _step(mesh, sharded, state, batch), _step(mesh, ref, ref_state, batch)


def _same(a, b):
    assert a["count"] == b["count"]
    for part in ("params", "momentum"):
        assert a[part].keys() == b[part].keys(), part
        for n in a[part]:
            assert torch.equal(a[part][n], b[part][n]), (part, n)


def _chunks_cover_once(path, saved):
    """Every parameter and momentum tensor is recorded by its global shape, its chunks
    covering it exactly once (a whole leaf written once, not once per tensor rank)."""
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for part, prefix in (("params", "params/"), ("momentum", "opt/.momentum_buffer['")):
        for n, t in saved[part].items():
            key = prefix + n + ("']" if part == "momentum" else "")
            assert tuple(md[key].size) == tuple(t.shape), (key, md[key].size, t.shape)
            cover = torch.zeros(t.shape, dtype=torch.int32)
            for c in md[key].chunks:
                cover[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
            assert bool((cover == 1).all()), (key, [(c.offsets, c.sizes) for c in md[key].chunks])


def _check(clusters, path, saved, world, strategy, tensor):
    for loaded, extra, (loss, after), (ref_loss, ref_after) in clusters[world].run(load_and_step, path, strategy,
                                                                                   tensor, saved):
        _same(loaded, saved)
        assert extra["step"] == 2
        assert loss == ref_loss, (world, tensor, loss, ref_loss)
        _same(after, ref_after)


def test_save_shard_two_by_tensor_two_load_into_other_layouts(clusters, tmp_path):
    path = str(tmp_path / "tp")
    saved = clusters[4].run(save_after_training, path, "FULL_SHARD", 2)[0]
    _chunks_cover_once(path, saved)
    for world, strategy, tensor in ((4, "FULL_SHARD", None), (1, "FULL_SHARD", None), (2, "SHARD_GRAD_OP", 2),
                                    (4, "SHARD_GRAD_OP/rows", 2)):
        _check(clusters, path, saved, world, strategy, tensor)


def test_load_at_shard_two_by_tensor_two_from_other_layouts(clusters, tmp_path):
    for world, strategy in ((4, "FULL_SHARD/rows"), (1, "FULL_SHARD")):
        path = str(tmp_path / f"plain{world}")
        saved = clusters[world].run(save_after_training, path, strategy, None)[0]
        _check(clusters, path, saved, 4, "FULL_SHARD", 2)
    # and a tree saved at shard 2 x tensor 2 in rows, loaded at shard 2 x tensor 2 flat
    saved = clusters[4].run(save_after_training, str(tmp_path / "rows"), "FULL_SHARD/rows", 2)[0]
    _chunks_cover_once(str(tmp_path / "rows"), saved)
    _check(clusters, str(tmp_path / "rows"), saved, 4, "FULL_SHARD", 2)


def export(directory, tensor):
    """save_pretrained of the test GPT as initialised (seed 0) at this world; rank 0: the files' bytes."""
    _, sharded = _build("FULL_SHARD", tensor, seed=0)
    files = sf.save_pretrained(sharded, directory, max_shard_size="20KB")
    return {f: open(os.path.join(directory, f), "rb").read() for f in files}


def test_save_pretrained_from_shard_two_by_tensor_two_equals_the_original_model(clusters, tmp_path):
    written = clusters[4].run(export, str(tmp_path / "tp"), 2)
    assert all(w == {} for w in written[1:])  # rank 0 writes
    torch.manual_seed(0)
    original = model().state_dict()
    got = {}
    for name, data in written[0].items():
        got.update(safetensors.torch.load(data))
    assert got.keys() <= original.keys() and len(got) > 0
    for key, t in got.items():
        assert torch.equal(t, original[key]), key
    # byte for byte the files the same model writes at one rank, without a tensor axis
    assert written[0] == clusters[1].run(export, str(tmp_path / "one"), None)[0]
    assert len(written[0]) > 1, list(written[0])  # several files, an index


def reshard_out_and_back():
    """Trained at shard 2 x tensor 2, resharded to shard 4 (no tensor axis) and back."""
    mesh, sharded = _build("FULL_SHARD", 2, seed=0)
    state = SGD_MOMENTUM().init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=SGD_MOMENTUM())
    for batch in batches()[:2]:
        sharded, state, _ = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
    before = _full(sharded, state)
    plain_mesh = sf.Mesh.from_group()
    plain, plain_state = sf.reshard(sharded, state, mesh=plain_mesh)
    out = (plain.mesh.axis_names, plain.layout.splits, _full(plain, plain_state))
    back, back_state = sf.reshard(plain, plain_state, mesh=mesh, tensor_parallel=PLAN)
    same = [n for n in sharded if not torch.equal(back[n], sharded[n])]
    same += [n for n in state.momentum_buffer if not torch.equal(back_state.momentum_buffer[n], state.momentum_buffer[n])]
    kept, kept_state = sf.reshard(sharded, state, "SHARD_GRAD_OP")  # the same mesh: the same layers split
    same += [n for n, *_ in sharded.layout.splits if kept.layout.splits != sharded.layout.splits]
    _same(_full(kept, kept_state), before)
    return before, out, same, _next_steps(plain_mesh, "FULL_SHARD", None, before, plain, plain_state)


def test_reshard_out_of_and_into_a_tensor_mesh(clusters):
    for before, (axes, splits, full), differ, ((loss, after), (ref_loss, ref_after)) in clusters[4].run(
            reshard_out_and_back):
        assert axes == ("shard",) and splits == ()
        _same(full, before)
        assert differ == []  # back at shard 2 x tensor 2: every local shard bitwise as it was
        assert loss == ref_loss
        _same(after, ref_after)
