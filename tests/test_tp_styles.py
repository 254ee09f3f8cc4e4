"""The transformers styles beyond Llama's plan, each from a model's own plan
(``tensor_parallel="auto"``) and equal to one process:

* ``"replicated_with_grad_allreduce"``: a module with parameters inside an attention split by
  heads (Qwen3's per-head q_norm and k_norm), refused unless so styled
  (shardfn._parallel.tensor [Note: a module that reads split heads]);
* ``"colwise_gather_output"`` q/k/v with a ``"rowwise_split_input"`` o: an attention whose
  heads stay whole on every rank (OLMo 2, whose norms span all the heads);
* ``"moe_tp_experts"`` with ``"packed_colwise"`` and ``"rowwise"`` naming its 3-D weights:
  a mixture of experts split by features (Qwen3-MoE; its own tests: tests/test_tp_moe.py)."""

import pathlib
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
import test_tensor_parallel
from bounds import SGD_MOMENTUM
import test_tp_auto
from shardfn.testing._equivalence import split_batch
from test_tp_auto import ATOL, RTOL, batches, loss_fn

HIDDEN, LAYERS, VOCAB, SEQ, HEAD_DIM = 32, 2, 64, 8, 8
ROWS = 4
REPLICATED = "replicated_with_grad_allreduce"
# Qwen3's attention and MLP split by hand, its per-head norms left out of the plan
BY_HAND = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
           "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}


def olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM

    cfg = Olmo2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    return Olmo2ForCausalLM(cfg)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=16,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg)


EXPERTS, TOP_K, INTERMEDIATE = 4, 2, 16


def qwen3_moe(top_k=TOP_K):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                         num_experts=EXPERTS, num_experts_per_tok=top_k, max_position_embeddings=16,
                         tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


def qwen3_moe_every_expert():
    """Every token routed to every expert: a routing no rounding can change. (In bf16 a token's
    second and third experts' scores can round to the other order in one run and not in
    another; the runs then differ by a whole expert's output, which no rounding bound covers.)"""
    return qwen3_moe(top_k=EXPERTS)


MODELS = {"qwen3": qwen3, "olmo2": olmo2, "qwen3_moe": qwen3_moe}


def _train(name, strategy, tensor, micro=1, graph=False):
    return test_tp_auto._train(strategy, tensor, micro, make=MODELS[name], graph=graph)


def _expected(name, data_size, micro):
    """The tensor axis's collectives in a step: (name, kind, bytes), sorted."""
    rows = ROWS // data_size // micro
    nbytes, logits = rows * SEQ * HIDDEN * 4, rows * SEQ * VOCAB * 4  # fp32 hidden states, logits of a micro-batch
    # per layer and micro-batch, the MLP's as Llama's (tests/test_tp_auto.py): down's output in
    # forward, the input gate and up share in backward; the head's logits gathered in forward,
    # its input's gradient all-reduced in backward. The experts': their output in forward, in
    # backward the gradients of their tokens and of the routing weights (fp32, TOP_K a token)
    if name == "qwen3_moe":
        each = [(f"model.layers.{i}.mlp.experts", "all_reduce", n) for i in range(LAYERS)
                for n in (nbytes, nbytes, rows * SEQ * TOP_K * 4)]
    else:
        each = [(f"model.layers.{i}.mlp.{layer}", "all_reduce", nbytes) for i in range(LAYERS)
                for layer in ("gate_proj", "down_proj")]
    each += [("lm_head", "all_gather", logits), ("lm_head", "all_reduce", nbytes)]
    if name != "olmo2":  # heads split: o's output, and the input q/k/v share in backward; once a
        # step the norms' partial gradients in one all-reduce (2 norms x 2 layers x head_dim fp32)
        each += [(f"model.layers.{i}.self_attn.{layer}", "all_reduce", nbytes) for i in range(LAYERS)
                 for layer in ("q_proj", "o_proj")]
        once = [(REPLICATED, "all_reduce", 2 * LAYERS * HEAD_DIM * 4)]
    else:  # heads whole: q, k and v gathered (k and v: 2 of the 4 heads' width), the input they
        # share all-reduced in backward; o's output all-reduced, its input's gradient gathered
        kv = nbytes // 2
        each += [(f"model.layers.{i}.self_attn.{layer}", kind, n) for i in range(LAYERS)
                 for layer, kind, n in (("q_proj", "all_gather", nbytes), ("k_proj", "all_gather", kv),
                                        ("v_proj", "all_gather", kv), ("q_proj", "all_reduce", nbytes),
                                        ("o_proj", "all_reduce", nbytes), ("o_proj", "all_gather", nbytes))]
        once = []
    return sorted(each * micro + once)


def _check(name, results, data_size, micro=1):
    ref_losses, ref_state, ref_norm = test_tensor_parallel._reference(MODELS[name], loss_fn, batches)
    expect = _expected(name, data_size, micro)
    for losses, norms, logs, full, styles in results:
        if name != "olmo2":
            assert styles["model.layers.1.self_attn.q_norm"] == REPLICATED, styles
            assert styles["model.layers.0.self_attn.k_norm"] == REPLICATED, styles
        if name == "qwen3_moe":
            assert styles["model.layers.1.mlp.experts"] == "moe_tp_experts", styles
            assert styles["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise", styles
            assert styles["model.layers.0.mlp.experts.down_proj"] == "rowwise", styles
        elif name == "olmo2":
            assert styles["model.layers.1.self_attn.o_proj"] == "rowwise_split_input", styles
            assert styles["model.layers.0.self_attn.k_proj"] == "colwise_gather_output", styles
        test_tp_auto.assert_trained_alike(losses, norms, full, (ref_losses, ref_state, ref_norm), MODELS[name])
        for log in logs:  # (a graph step's: the recorded collectives, counted as the eager step's)
            assert sorted(log) == expect, sorted(log)


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_tensor_two_equals_one_process(clusters, name):
    _check(name, clusters[2].run(_train, name, "FULL_SHARD", 2), 1)


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_shard_two_by_tensor_two_with_micro_batches_equals_one_process(clusters, name):
    _check(name, clusters[4].run(_train, name, "FULL_SHARD", 2, 2), 2, 2)
    _check(name, clusters[4].run(_train, name, "SHARD_GRAD_OP", 2), 2)


@pytest.mark.parametrize("name", ["qwen3", "olmo2"])  # (the experts' routing cannot be recorded: test_tp_moe.py)
def test_auto_graph_step_equals_one_process(clusters, name):
    _check(name, clusters[2].run(_train, name, "FULL_SHARD", 2, 1, True), 1)


@pytest.mark.parametrize("name, strategy", [("qwen3_moe", "NO_SHARD"), ("qwen3_moe", "SHARD_OPTIMIZER"),
                                            ("qwen3_moe", "HYBRID_SHARD"), ("olmo2", "HYBRID_SHARD_ZERO2")])
def test_the_other_strategies_equal_one_process(clusters, name, strategy):
    # the data axis is shard (NO_SHARD, SHARD_OPTIMIZER) or replicate (the hybrids) x tensor 2;
    # the tensor axis's collectives are the same as under FULL_SHARD
    replicate = 2 if strategy.startswith("HYBRID") else None
    _check(name, clusters[4].run(test_tp_auto._train, strategy, 2, make=MODELS[name], replicate=replicate), 2)


def no_cache_loss(apply, params, batch):
    # (no key/value cache in training: a recompute would find the forward's keys in it, as
    # with transformers' own gradient checkpointing, which turns the cache off)
    logits = apply(params, batch["x"], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_auto_with_remat_equals_one_process(clusters, mode):
    # each layer a unit, recomputed in backward with its tensor collectives (their counts
    # then differ from the eager step's: only the training is compared)
    plan = sf.Plan("FULL_SHARD", units=[f"model.layers.{i}" for i in range(LAYERS)], remat=sf.Remat(mode=mode))
    for name in MODELS:
        reference = test_tensor_parallel._reference(MODELS[name], no_cache_loss, batches)
        for losses, norms, _, full, _ in clusters[2].run(test_tp_auto._train, plan, 2, loss=no_cache_loss,
                                                         make=MODELS[name]):
            test_tp_auto.assert_trained_alike(losses, norms, full, reference, MODELS[name])


def _generate(name):
    return test_tp_auto._generate(2, MODELS[name])


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_on_the_shards_equals_the_full_model(clusters, name):
    for want, got in clusters[2].run(_generate, name):
        assert torch.equal(got, want), (got, want)


def _unsplit_gradient():
    """The norms' gradients: one process's, and a tensor-2 step's with their style. With
    partial gradients each rank's would be about half (two of the four heads)."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, apply = sf.functionalize(qwen3())
    batch = batches()[0]
    names = [n for n in params if n.endswith("_norm.weight") and ".self_attn." in n]
    whole = dict(zip(names, torch.autograd.grad(loss_fn(apply, params, batch), [params[n] for n in names])))
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel="auto")
    _, grads, _ = sf.jit_grad(loss_fn, mesh)(sharded, batch)
    diffs = {n: float((grads[n] - whole[n]).abs().max()) for n in names}
    return diffs, max(float(g.abs().max()) for g in whole.values())


def test_the_norms_gradients_are_summed_over_the_tensor_ranks(clusters):
    for diffs, scale in clusters[2].run(_unsplit_gradient):
        assert scale > 1e-3  # (a gradient that could be seen to be halved)
        assert max(diffs.values()) <= ATOL + RTOL * scale, diffs


def refusals(make, specs):
    """What ``shard`` says of ``make()`` at tensor 2 under each plan of ``specs``: its error, or "accepted"."""
    mesh = sf.Mesh.from_group(tensor=2)
    out = []
    for spec in specs:
        torch.manual_seed(0)
        try:
            sf.shard(sf.functionalize(make())[0], mesh, "FULL_SHARD", tensor_parallel=spec)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("accepted")
    return out


def _refusals():
    return refusals(qwen3, (
        BY_HAND,  # the norms read split heads, unstyled
        {**BY_HAND, "model.layers.*.self_attn.*_norm": REPLICATED, "model.norm": REPLICATED},  # outside one
        {"model.layers.*.self_attn.q_norm": REPLICATED},  # an attention not split
        {**BY_HAND, "model.layers.*.self_attn.k_proj": "colwise_gather_output"}))  # heads whole and split


def test_a_module_reading_split_heads_is_refused_unless_styled(clusters):
    first, second = clusters[2].run(_refusals)
    assert first == second  # every rank raises the same error
    unstyled, outside, unsplit, mixed = first
    assert "'model.layers.0.self_attn.k_norm', 'model.layers.0.self_attn.q_norm' inside it have" in unstyled, unstyled
    assert "silently wrong" in unstyled and f"{REPLICATED!r}" in unstyled, unstyled
    assert "'model.norm' is not inside such an attention" in outside, outside
    assert "'model.layers.0.self_attn.q_norm' is not inside such an attention" in unsplit, unsplit
    assert "'model.layers.0.self_attn.k_proj' is inside the attention module 'model.layers.0.self_attn'" in mixed, mixed
    assert "leaves its heads whole, while other layers of it split them" in mixed, mixed


def test_the_coverage_in_the_docs_is_the_tools():
    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tools"))
    import tp_coverage

    version, found = tp_coverage.coverage()
    assert found["qwen3"] == found["llama"] == found["olmo2"] == found["qwen3_moe"] == found["mixtral"] == ()
    assert found["deepseek_v2"] == ("mla_kv_a_proj",), found["deepseek_v2"]
    text = " ".join((root / "docs" / "tensor-parallel.md").read_text().split())
    said = re.search(r"with transformers (\S+), \"auto\" takes the plans of (\d+) of the (\d+) model types", text)
    assert said is not None
    taken = sum(1 for missing in found.values() if not missing)
    assert said.groups() == (version, str(taken), str(len(found))), (said.groups(), version, taken, len(found))


def _export(name, directory):
    """One step of the model with "auto" at tensor 2, then save_pretrained; the gathered
    parameters (every rank: the same)."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(MODELS[name]())
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel="auto")
    step = sf.jit_step(loss_fn, mesh, optimizer=sf.optim.sgd(0.5))
    sharded, _, _ = step(sharded, step.init(sharded), batches()[0])
    sf.save_pretrained(sharded, directory)
    return sf.gather(sharded)


@pytest.mark.parametrize("name", list(MODELS))
def test_save_pretrained_loads_in_transformers_with_the_same_logits(clusters, tmp_path, name):
    from transformers import AutoModelForCausalLM

    trained = clusters[2].run(_export, name, str(tmp_path))[0]
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    torch.manual_seed(0)
    untrained = MODELS[name]().eval()
    missing, unexpected = model.load_state_dict(trained, strict=False)
    assert unexpected == [] and all(k.endswith("rotary_emb.inv_freq") for k in missing), (missing, unexpected)
    x = batches()[1]["x"]
    with torch.no_grad():
        want, got, before = model(x).logits, loaded(x).logits, untrained(x).logits
    assert type(loaded) is type(model)
    assert torch.equal(got, want)
    assert not torch.equal(want, before)  # (the step moved the weights)


def _saved_and_loaded(name, path, tensor_save, tensor_load):
    """Two SGD-momentum steps in the layout of ``tensor_save`` (a tensor axis of 2 with "auto",
    or None: FULL_SHARD over the ranks), saved; loaded into the other layout from another
    seed. Both as gathered parameters and momentum."""

    def build(tensor, seed):
        mesh = sf.Mesh.from_group(tensor=tensor)
        torch.manual_seed(seed)
        sharded = sf.shard(sf.functionalize(MODELS[name]())[0], mesh, "FULL_SHARD",
                           tensor_parallel="auto" if tensor else None)
        return mesh, sharded, SGD_MOMENTUM().init(sharded)

    def full(sharded, state):
        return sf.gather(sharded), sf.gather(sharded.replace(state.momentum_buffer))

    mesh, sharded, state = build(tensor_save, 0)
    step = sf.jit_step(loss_fn, mesh, optimizer=SGD_MOMENTUM())
    for batch in batches()[:2]:
        sharded, state, _ = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
    sf.checkpoint.save(path, sharded, state)
    _, other, other_state = build(tensor_load, 1)
    other, other_state, _ = sf.checkpoint.load(path, other, other_state)
    return full(sharded, state), full(other, other_state)


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoints_move_between_the_styles_layout_and_plain_fsdp(clusters, tmp_path, name):
    for i, (save, load) in enumerate(((2, None), (None, 2))):
        for saved, loaded in clusters[2].run(_saved_and_loaded, name, str(tmp_path / str(i)), save, load):
            for before, after in zip(saved, loaded):  # parameters, then momentum
                assert before.keys() == after.keys()
                for n in before:
                    assert torch.equal(before[n], after[n]), n


BF16_MODELS = {"qwen3": qwen3, "olmo2": olmo2, "qwen3_moe": qwen3_moe_every_expert}


@pytest.mark.parametrize("name", list(BF16_MODELS))
def test_bf16_matches_a_reference_with_the_same_casts(clusters, name):
    # test_tp_strategies' bound: test_precision's (8 eps of bf16 times the largest updates'
    # sum), derived there for a rank's slice summed in bf16; each split layer adds one rounding
    # of the same kind, its partial sums rounded to bf16 and added by the tensor all-reduce.
    from test_precision import BF16, EPS, reference
    from test_tp_strategies import _bf16_run

    ref_losses, ref_delta, moved = reference(BF16, BF16_MODELS[name], batches, lambda out: out.logits)
    bound = 8 * EPS[torch.bfloat16]
    for losses, delta, shard_dtypes, tensor_dtypes in clusters[2].run(_bf16_run, BF16, BF16_MODELS[name], "auto",
                                                                       batches, loss_fn):
        assert shard_dtypes == {"torch.float32"}, shard_dtypes
        # the split layers' collectives move bf16; the norms' gradients are summed in reduce's dtype
        norms = {f"{REPLICATED} torch.float32"} if name != "olmo2" else set()
        assert tensor_dtypes == {"torch.bfloat16"} | norms, tensor_dtypes
        assert losses == pytest.approx(ref_losses, rel=bound)
        worst = max((delta[n] - d).abs().max().item() for n, d in ref_delta.items())
        assert worst <= bound * moved, (worst, bound * moved)



def olmo2_dropping():
    """OLMo 2 with attention dropout: its heads whole on every tensor rank, each drawing the mask
    one process draws ([Note: randomness on the tensor axis])."""
    model = olmo2()
    model.config.attention_dropout = 0.3
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    return model


def _dropping(steps):
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(olmo2_dropping())
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel="auto")
    torch.manual_seed(1000 + mesh.rank)  # a per-rank seed, for other reasons
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses = []
    for batch in batches()[:steps]:
        sharded, state, metrics = step(sharded, state, batch)
        losses.append(float(metrics["loss"]))
    return losses, sf.gather(sharded)


def test_attention_dropout_with_whole_heads_draws_one_process_masks(clusters):
    # the reference: one process whose generator starts where the tensor group's stream does
    # (tensor rank 0's seed); with dropout 0.3 its losses differ from a run without dropout
    from shardfn.testing._equivalence import reference_training

    def model_then_seed():
        model = olmo2_dropping()
        torch.manual_seed(1000)
        return model

    ref_losses, ref_state = reference_training(model_then_seed, loss_fn, batches(), SGD_MOMENTUM)
    plain = test_tensor_parallel._reference(olmo2, loss_fn, batches)[0]
    assert all(abs(a - b) > 1e-3 for a, b in zip(ref_losses, plain)), (ref_losses, plain)  # (the masks matter)
    for losses, full in clusters[2].run(_dropping, len(ref_losses)):
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for name in full:
            ref = ref_state[name]
            assert float(((full[name] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, name


def test_auto_leaves_an_embedding_tied_to_the_head_whole():
    # a base plan's "embedding_rowwise" (17 families with transformers 5.24) on an embedding
    # tied to the head: whole on every rank, as a tied head is (splitting it is refused)
    from shardfn._parallel.tensor import resolve_tensor_parallel

    plan = {"embed_tokens": "embedding_rowwise", "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    for tied in (True, False):
        torch.manual_seed(0)
        model = test_tp_auto.llama(plan=plan, tied=tied)
        styles, splits = resolve_tensor_parallel("auto", model, dict(model.state_dict()), 2)
        assert (dict(styles).get("model.embed_tokens") == "embedding_rowwise") == (not tied), styles
        assert ("model.embed_tokens.weight" in {s.leaf for s in splits}) == (not tied), splits
