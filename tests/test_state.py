"""The state tree: buffers travel with the parameters through every path.

Step (BatchNorm statistics agree across ranks), eval mode, gather() as a strict state dict,
checkpoints at another world size, resume, old checkpoints, loading from rank 0, deferred
init, integer and boolean buffers. Models: the BatchNorm ConvNet of shardfn.testing.models
and a tiny Hugging Face Llama (rotary buffers, tied embeddings).
"""

import os
import pathlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
from shardfn.testing import full_state, split_batch
from shardfn.testing.models import ConvNet

DATA = pathlib.Path(__file__).parent / "data"


def conv_batches(steps=2, seed=3, rows=12):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(rows, 3, 6, 6, generator=g), "y": torch.randint(0, 5, (rows,), generator=g)}
            for _ in range(steps)]


def conv_loss(apply, params, batch):
    return F.cross_entropy(apply(params, batch["x"]), batch["y"])


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True)


def llama():
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config())


def llama_batches(steps=2, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randint(0, 32, (12, 8), generator=g)} for _ in range(steps)]


def llama_loss(apply, params, batch):
    return apply(params, batch["x"], labels=batch["x"], use_cache=False).loss


MODELS = {"convnet": (ConvNet, conv_loss, conv_batches), "llama": (llama, llama_loss, llama_batches)}


def _train(name, strategy, replicate=None, steps=2, seed=0, micro_batches=1, opt=None):
    model_fn, loss_fn, batches = MODELS[name]
    mesh = sf.Mesh.from_group(replicate=replicate)
    torch.manual_seed(seed)
    params, apply = sf.functionalize(model_fn())
    sharded = sf.shard(params, mesh, strategy)
    opt = opt or sf.optim.adamw(1e-2)
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=micro_batches)
    metrics = None
    for b in batches(steps):
        local = split_batch(b, mesh.rank, mesh.size)
        if micro_batches > 1:  # 6 rows of [3, 6, 6] images at world 2: dims 2 and 3 equal the rows too
            local = {**local, "x": sf.Batched(local["x"])}
        sharded, state, metrics = step(sharded, state, local)
    return mesh, sharded, state, step, apply, metrics


def _buffers(sharded):
    return {n: sharded[n].detach().clone() for n in sharded.layout.buffers}


# -- BatchNorm statistics in a step: equal on every rank, the average of the ranks' own ----------


def bn_after_one_step(strategy, replicate, micro_batches):
    mesh, sharded, _, _, _, metrics = _train("convnet", strategy, replicate, steps=1, micro_batches=micro_batches,
                                             opt=sf.optim.sgd(0.1))
    return _buffers(sharded), metrics["comm_bytes"]


@pytest.mark.parametrize("strategy, replicate, world, micro_batches", [
    ("FULL_SHARD", None, 2, 1), ("SHARD_GRAD_OP", None, 3, 1), ("NO_SHARD", None, 2, 1), ("HYBRID_SHARD", 2, 4, 1),
    ("FULL_SHARD", None, 2, 2),
])
def test_batchnorm_statistics_agree_across_ranks(clusters, strategy, replicate, world, micro_batches):
    # What each rank's own forward does to the statistics: a plain ConvNet in train mode on
    # the rank's slice (micro-batch after micro-batch); the step must leave every rank with
    # the average of those, and num_batches_tracked counting the forwards.
    batch = conv_batches(1)[0]
    per_rank = []
    for r in range(world):
        torch.manual_seed(0)
        model = ConvNet()
        local = split_batch(batch, r, world)
        with torch.no_grad():
            for i in range(micro_batches):
                rows = local["x"].shape[0] // micro_batches
                model(local["x"][i * rows : (i + 1) * rows])
        per_rank.append(dict(model.named_buffers()))
    results = clusters[world].run(bn_after_one_step, strategy, replicate, micro_batches)
    first, comm = results[0]
    for buffers, _ in results[1:]:
        assert all(torch.equal(buffers[n], first[n]) for n in first), "ranks disagree"
    for n, b in first.items():
        if b.is_floating_point():
            expected = torch.stack([p[n] for p in per_rank]).mean(0)
            torch.testing.assert_close(b, expected, rtol=1e-6, atol=1e-7)
        else:
            assert int(b) == micro_batches, n
    # The flags (one fp32 per floating buffer) ride on the metrics all-reduce, and the four
    # changed BatchNorm statistics (2 layers x 6 channels x 2) are averaged in one more.
    floating = [n for n, b in first.items() if b.is_floating_point()]
    axes = 2 if replicate else 1
    assert comm["all_reduce"] >= axes * (8 + 4 * len(floating))
    if strategy == "FULL_SHARD":
        assert comm["all_reduce"] == (8 + 4 * len(floating)) + 4 * sum(first[n].numel() for n in floating)


# -- eval mode ----------------------------------------------------------------------------------


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        for b in self.blocks:
            x = self.drop(F.gelu(b(x)))
        return self.bn(x)


def eval_and_train():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    model = DropNet()
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    before = _buffers(sharded)
    returned = apply.eval()
    with torch.no_grad():
        a, b = apply(sharded, x), apply(sharded, x)
    kept = all(torch.equal(sharded[n], before[n]) for n in before)
    model.eval()
    with torch.no_grad():
        plain = model(x)
    trained = apply.train()
    with torch.no_grad():
        c = apply(sharded, x)
    return {
        "returns_apply": returned is apply and trained is apply,
        "deterministic": torch.equal(a, b),
        "equals_module_eval": torch.allclose(a, plain, rtol=1e-6, atol=1e-6),
        "eval_keeps_statistics": kept,
        "train_updates_statistics": not torch.equal(sharded["bn.running_mean"], before["bn.running_mean"]),
        "train_drops_out": not torch.equal(c, a),
        "mode": apply.training,
    }


def test_eval_mode_turns_dropout_off_and_keeps_statistics(clusters):
    for r in clusters[2].run(eval_and_train):
        assert r == {"returns_apply": True, "deterministic": True, "equals_module_eval": True,
                     "eval_keeps_statistics": True, "train_updates_statistics": True, "train_drops_out": True,
                     "mode": True}


# -- gather(): exactly model.state_dict(), loadable with strict=True -------------------------------


def gathered_into_plain(name):
    mesh, sharded, _, _, apply, _ = _train(name, "FULL_SHARD", steps=1)
    full = sf.gather(sharded, rank0_only=True, device="cpu")
    x = MODELS[name][2](1)[0]["x"][:2]
    apply.eval()
    with torch.no_grad():
        out = apply(sharded, x)
    if mesh.rank != 0:
        return len(full), None
    model = MODELS[name][0]()
    keys_match = list(full) == list(model.state_dict())
    model.load_state_dict(full, strict=True)
    model.eval()
    with torch.no_grad():
        plain = model(x)
    logits = (lambda o: o.logits if hasattr(o, "logits") else o)
    return len(full), (keys_match, torch.equal(logits(plain), logits(out)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gather_is_a_strict_state_dict(clusters, name):
    results = clusters[3].run(gathered_into_plain, name)
    assert results[1] == (0, None) and results[2] == (0, None)  # rank0_only
    _, (keys_match, same_output) = results[0]
    assert keys_match and same_output


def exported(path, name):
    mesh, sharded, _, _, _, _ = _train(name, "FULL_SHARD", steps=1)
    sf.save_pretrained(sharded, path)
    full = sf.gather(sharded, rank0_only=True)
    if mesh.rank != 0:
        return None
    from safetensors.torch import load_file

    written = load_file(os.path.join(path, "model.safetensors"))
    missing, unexpected = MODELS[name][0]().load_state_dict(written, strict=False)
    return sorted(written), sorted(full), missing, unexpected, all(torch.equal(written[k], full[k]) for k in written)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_safetensors_export_holds_buffers_and_each_tensor_once(clusters, tmp_path, name):
    written, full, missing, unexpected, same = clusters[2].run(exported, str(tmp_path / "m"), name)[0]
    assert same and unexpected == []
    if name == "convnet":  # parameters and the BatchNorm statistics
        assert written == full and "blocks.0.bn.num_batches_tracked" in written and missing == []
    else:  # the tied head is the embedding: written once, under its first name
        assert written == sorted(set(full) - {"lm_head.weight"}) and missing == ["lm_head.weight"]


# -- checkpoints: buffers saved, loaded bitwise at another world size, strategy or mesh ----------


def save_trained(path, name):
    _, sharded, state, _, _, _ = _train(name, "FULL_SHARD")
    sf.checkpoint.save(path, sharded, state)
    return full_state(sharded)


def load_trained(path, name, strategy, replicate):
    _, sharded, state, _, _, _ = _train(name, strategy, replicate, steps=0, seed=1)  # other values everywhere
    sharded, state, _ = sf.checkpoint.load(path, sharded, state)
    return full_state(sharded), sorted(n for n, b in sharded.layout.buffers.items() if b.persistent)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_buffers_survive_a_checkpoint_at_another_world_size(clusters, tmp_path, name):
    path = str(tmp_path / name)
    saved = clusters[2].run(save_trained, path, name)[0]
    targets = [(3, "SHARD_GRAD_OP", None), (1, "FULL_SHARD", None)]
    if name == "convnet":
        targets += [(4, "HYBRID_SHARD", 2), (2, "NO_SHARD", None)]
    for world, strategy, replicate in targets:
        for loaded, persistent in clusters[world].run(load_trained, path, name, strategy, replicate):
            assert loaded.keys() == saved.keys()
            for n in saved:
                assert loaded[n].dtype == saved[n].dtype and torch.equal(loaded[n], saved[n]), (world, n)
            if name == "convnet":  # the statistics really came from the file (seed 1 and no training otherwise)
                assert persistent == sorted(n for n in saved if ".bn.running" in n or "num_batches" in n)
                assert int(loaded["blocks.0.bn.num_batches_tracked"]) == 2


def resume(path, k):
    mesh, sharded, state, step, _, _ = _train("convnet", "FULL_SHARD", steps=0)
    batches = conv_batches(2 * k)
    for b in batches[:k]:
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    sf.checkpoint.save(path, sharded, state)
    _, sharded2, state2, step2, _, _ = _train("convnet", "FULL_SHARD", steps=0, seed=7)
    sharded2, state2, _ = sf.checkpoint.load(path, sharded2, state2)
    for b in batches[k:]:
        sharded2, state2, _ = step2(sharded2, state2, split_batch(b, mesh.rank, mesh.size))
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    return full_state(sharded2), full_state(sharded)


def test_resume_is_bitwise_exact_with_batchnorm_statistics(clusters, tmp_path):
    for resumed, straight in clusters[2].run(resume, str(tmp_path / "r"), 2):
        assert resumed.keys() == straight.keys() and "blocks.1.bn.running_var" in straight
        for n in straight:
            assert torch.equal(resumed[n], straight[n]), n


def save_load_without_optimizer_state(path):
    _, sharded, _, _, _, _ = _train("convnet", "FULL_SHARD", steps=1)
    sf.checkpoint.save(path, sharded)
    _, fresh, _, _, _, _ = _train("convnet", "FULL_SHARD", steps=0, seed=1)
    fresh, opt_state, _ = sf.checkpoint.load(path, fresh)
    a, b = full_state(sharded), full_state(fresh)
    return opt_state, all(torch.equal(a[n], b[n]) for n in a)


def test_checkpoint_without_optimizer_state(clusters, tmp_path):
    for opt_state, same in clusters[2].run(save_load_without_optimizer_state, str(tmp_path / "p")):
        assert opt_state is None and same


def load_old_format():
    _, sharded, state, _, _, _ = _train("convnet", "FULL_SHARD", steps=0, seed=5)
    before = _buffers(sharded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded, state, extra = sf.checkpoint.load(str(DATA / "checkpoint-v1"), sharded, state)
    return {
        "warnings": [str(w.message) for w in caught],
        "params": sf.gather(sharded),
        "mu": sf.gather(sharded.replace(state.mu)),
        "nu": sf.gather(sharded.replace(state.nu)),
        "count": int(state.count),
        "extra": extra,
        "buffers_kept": all(torch.equal(sharded[n], before[n]) for n in before),
    }


@pytest.mark.parametrize("world", [1, 3])
def test_a_checkpoint_from_before_buffers_loads_with_a_warning(clusters, world):
    expected = torch.load(DATA / "checkpoint-v1-expected.pt", weights_only=True)
    for r in clusters[world].run(load_old_format):
        (message,) = r["warnings"]
        assert "no values for 6 persistent buffers" in message and "blocks.1.bn.running_var" in message
        assert "format 1" in message
        for part in ("params", "mu", "nu"):
            params = {n: t for n, t in r[part].items() if n in expected[part]}
            assert params.keys() == expected[part].keys()
            assert all(torch.equal(params[n], expected[part][n]) for n in params), part
        assert r["count"] == expected["count"] and r["extra"] == {"step": 1} and r["buffers_kept"]


# -- loading from rank 0, deferred init: buffers too ------------------------------------------------


class Flags(nn.Module):
    """Buffers of every kind: float statistics, an int64 counter, a bool mask."""

    def __init__(self):
        super().__init__()
        self.net = ConvNet()
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.ones(5, dtype=torch.bool))
        self.register_buffer("scale", torch.full((5,), 0.9))  # (0.9 + 0.9 + 0.9) / 3 != 0.9 in fp32

    def forward(self, x):
        self.seen += 1
        return self.net(x) * self.mask * self.scale


def from_rank0(replicate):
    mesh = sf.Mesh.from_group(replicate=replicate)
    if dist.get_rank() == 0:
        torch.manual_seed(5)
        model = Flags()
        with torch.no_grad():
            model.net.blocks[0].bn.running_mean.copy_(torch.arange(6.0))
            model.net.blocks[1].bn.num_batches_tracked.fill_(7)
            model.mask[1] = False
            model.seen.fill_(3)
        expected = {n: b.clone() for n, b in model.named_buffers()}
    else:
        with torch.device("meta"):
            model = Flags()
        expected = None
    params, _ = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD" if replicate is None else "HYBRID_SHARD", src_rank=0)
    return _buffers(sharded), expected


@pytest.mark.parametrize("world, replicate", [(3, None), (4, 2)])
def test_buffers_of_every_dtype_come_from_rank0(clusters, world, replicate):
    results = clusters[world].run(from_rank0, replicate)
    expected = results[0][1]
    assert {"seen", "mask", "scale", "net.blocks.1.bn.num_batches_tracked"} <= expected.keys()
    for buffers, _ in results:
        assert buffers.keys() == expected.keys()
        for n, b in expected.items():
            assert buffers[n].dtype == b.dtype and torch.equal(buffers[n], b), n


def deferred(name, world_size_hint):
    mesh = sf.Mesh.from_group()
    with torch.device("meta"):
        model = MODELS[name][0]()
    params, _ = sf.functionalize(model)
    init_fn = model._init_weights if name == "llama" else None
    sharded = sf.shard(params, mesh, "FULL_SHARD", seed=11, init_fn=init_fn)
    return full_state(sharded)


@pytest.mark.parametrize("name, world", [("convnet", 2), ("convnet", 3), ("llama", 2)])
def test_deferred_init_materialises_buffers_as_on_one_device(clusters, name, world):
    with torch.device("meta"):
        model = MODELS[name][0]()
    reference = sf.materialize(model, seed=11, init_fn=model._init_weights if name == "llama" else None)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    if name == "llama":  # the rotary tables equal a model built on the CPU
        assert torch.equal(expected["model.rotary_emb.inv_freq"], llama().model.rotary_emb.inv_freq)
    else:
        assert torch.equal(expected["blocks.0.bn.running_var"], torch.ones(6))
    for full in clusters[world].run(deferred, name, world):
        assert full.keys() == expected.keys()
        for n, t in expected.items():
            assert torch.equal(full[n], t.detach()), n


def deferred_without_init_fn():
    mesh = sf.Mesh.from_group()
    with torch.device("meta"):
        model = llama()
    params, _ = sf.functionalize(model)
    try:
        sf.shard(params, mesh, "FULL_SHARD", seed=11)
    except ValueError as e:
        return str(e)
    return "no error"


def test_deferred_init_refuses_tensors_nothing_initialised(clusters):
    # LlamaRMSNorm has no reset_parameters and the rotary tables are computed in __init__:
    # without init_fn they would be uninitialised memory, different on every rank.
    for msg in clusters[2].run(deferred_without_init_fn):
        assert "were never written" in msg and "init_fn=model._init_weights" in msg
        assert "model.norm.weight" in msg or "model.rotary_emb.inv_freq" in msg


# -- integer and boolean buffers through steps ------------------------------------------------------


def flags_after_steps(donate):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(Flags())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    initial = _buffers(sharded)
    opt = sf.optim.sgd(0.1)
    state = opt.init(sharded)
    step = sf.jit_step(conv_loss, mesh, optimizer=opt, donate=donate)
    for b in conv_batches(2):
        new, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
        if not donate:
            assert all(torch.equal(sharded[n], initial[n]) for n in initial)  # the input tree is untouched
        sharded, initial = new, _buffers(new)
    return _buffers(sharded)


@pytest.mark.parametrize("donate", [True, False], ids=["donate", "keep"])
def test_integer_and_boolean_buffers_are_kept_not_averaged(clusters, donate):
    results = clusters[3].run(flags_after_steps, donate)
    for buffers in results:
        assert buffers["seen"].dtype == torch.int64 and int(buffers["seen"]) == 2  # counted, not averaged
        assert buffers["mask"].dtype == torch.bool and bool(buffers["mask"].all())
        # A float buffer no forward changed is not averaged: averaging three equal values
        # would round it.
        assert torch.equal(buffers["scale"], torch.full((5,), 0.9))
        assert all(torch.equal(buffers[n], results[0][n]) for n in buffers)


# -- remat of units that hold buffers ------------------------------------------------------------------


def remat_with_batchnorm(mode):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(ConvNet())
    remat = None if mode is None else sf.Remat(mode=mode, save=("convolution",) if mode == "selective" else ("mm",))
    sharded = sf.shard(params, mesh, "FULL_SHARD", remat=remat)
    opt = sf.optim.sgd(0.1)
    state = opt.init(sharded)
    step = sf.jit_step(conv_loss, mesh, optimizer=opt)
    for b in conv_batches(2):
        sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    return full_state(sharded)


def test_remat_of_units_with_batchnorm_equals_no_remat(clusters):
    # The recompute runs on copies of the unit's buffers as the forward found them: it neither
    # sees the module tree's meta buffers nor updates the running statistics a second time.
    plain = clusters[2].run(remat_with_batchnorm, None)[0]
    for mode in ("full", "selective"):
        rematted = clusters[2].run(remat_with_batchnorm, mode)[0]
        assert int(rematted["blocks.0.bn.num_batches_tracked"]) == 2  # one update per forward, not two
        for n in plain:
            assert torch.equal(rematted[n], plain[n]), (mode, n)
