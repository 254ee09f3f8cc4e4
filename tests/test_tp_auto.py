"""Tensor parallelism from a Hugging Face model's own plan (``tensor_parallel="auto"``): a
tiny transformers Llama with its attention and MLP split, equal to one process; one
all-reduce per shared input; what cannot be split exactly refused by name."""

import torch
import torch.nn.functional as F

import shardfn as sf
import test_tensor_parallel
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch

HIDDEN, LAYERS, VOCAB, SEQ = 32, 2, 64, 8
ROWS, STEPS = 4, 3
# check_equivalence's tolerances, which tests/bounds.py derives for SGD_MOMENTUM ([Note:
# tolerances after training]): a rank's gradient here is the same terms summed in another order.
RTOL, ATOL = 1e-5, 1e-6


def llama(heads=4, kv_heads=2, hidden=HIDDEN, plan=None, tied=False, pad=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=16,
                      tie_word_embeddings=tied, pad_token_id=pad)
    if plan is not None:
        cfg.base_model_tp_plan = plan
    return LlamaForCausalLM(cfg)


def loss_fn(apply, params, batch):
    logits = apply(params, batch["x"]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def batches():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g),
             "y": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)} for _ in range(STEPS)]


def _train(strategy, tensor, micro=1, spec="auto", loss=loss_fn, replicate=None, pad=None, make=None, graph=False,
           make_batches=None):
    """Three steps of ``make()`` (default: the tiny Llama): losses, norms, the tensor axis's
    collectives of each step, the gathered parameters and the layout's styles."""
    mesh = sf.Mesh.from_group(tensor=tensor, replicate=replicate)
    torch.manual_seed(0)
    params, _ = sf.functionalize(make() if make is not None else llama(pad=pad))
    sharded = sf.shard(params, mesh, strategy, tensor_parallel=spec)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss, mesh, optimizer=opt, micro_batches=micro, graph=graph)
    losses, norms, logs = [], [], []
    for batch in (make_batches or batches)():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        logs.append([(c.unit, c.kind.value, c.nbytes) for c in log.select("tensor")])
    return losses, norms, logs, sf.gather(sharded), dict(sharded.layout.tensor)


def _reference(pad=None):
    return test_tensor_parallel._reference(lambda: llama(pad=pad), loss_fn, batches)


def _check(results, data_size, micro=1, embedding=None):
    ref_losses, ref_state, ref_norm = _reference(embedding)
    nbytes = ROWS // data_size // micro * SEQ * HIDDEN * 4  # fp32 hidden states of a micro-batch's rows
    # Per layer and step: o_proj's and down_proj's outputs in forward; in backward the
    # gradient of the input that q/k/v share (named by q_proj) and of the one gate/up share.
    # And the head (the model class's own plan, "colwise_gather_output"): its logits
    # all-gathered in forward, its input's gradient all-reduced in backward.
    logits = ROWS // data_size // micro * SEQ * VOCAB * 4
    expect = sorted([(f"model.layers.{i}.{layer}", "all_reduce", nbytes) for i in range(LAYERS)
                     for layer in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
                    + [("lm_head", "all_gather", logits), ("lm_head", "all_reduce", nbytes)]
                    + ([("model.embed_tokens", "all_reduce", nbytes)] if embedding is not None else [])) * micro
    expect.sort()
    for losses, norms, logs, full, styles in results:
        assert styles["model.layers.1.self_attn.k_proj"] == "colwise", styles
        assert len(styles) == 7 * LAYERS + 1 + (embedding is not None), styles
        assert styles["lm_head"] == "colwise_gather_output", styles
        assert_trained_alike(losses, norms, full, (ref_losses, ref_state, ref_norm), llama)
        for log in logs:
            assert sorted(log) == expect, sorted(log)


def assert_trained_alike(losses, norms, full, reference, make):
    """A run's losses, first gradient norm and gathered parameters against one process's
    (``reference``: ``test_tensor_parallel._reference``'s), within bounds.py's tolerances."""
    ref_losses, ref_state, ref_norm = reference
    assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert abs(norms[0] - ref_norm) <= ATOL + RTOL * ref_norm, (norms[0], ref_norm)
    assert set(full) == {n for n, _ in make().named_parameters()}  # (the rotary buffers are not gathered)
    for name in full:
        ref = ref_state[name]
        assert full[name].shape == ref.shape, name
        diff = (full[name] - ref).abs() - RTOL * ref.abs()
        assert float(diff.max()) <= ATOL, (name, float(diff.max()))


def test_auto_llama_tensor_two_equals_one_process(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2), 1)


def test_auto_llama_shard_two_by_tensor_two_equals_one_process(clusters):
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        _check(clusters[4].run(_train, strategy, 2), 2)


def test_auto_llama_micro_batches_each_reduce_their_own_inputs(clusters):
    # Each micro-batch's forward makes its own shared copies: a copy kept from the first
    # would give the second the first's input (and one all-reduce too few per layer).
    _check(clusters[2].run(_train, "FULL_SHARD", 2, 2), 1, 2)


def _refusals():
    mesh = sf.Mesh.from_group(tensor=2)
    out = []

    def refused(model, spec="auto"):
        try:
            sf.shard(sf.functionalize(model)[0], mesh, "FULL_SHARD", tensor_parallel=spec)
        except (ValueError, TypeError) as e:
            out.append(str(e))
        else:
            out.append("accepted")

    torch.manual_seed(0)
    refused(llama(heads=6, kv_heads=3, hidden=36))  # 3 key/value heads over 2 tensor ranks
    refused(llama(plan={"layers.*.mlp.gate_proj": "colwise_rep"}))  # a transformers style shardfn lacks
    refused(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # no plan
    # q_proj alone: its heads would be halved and k/v's not, and grouped attention would pair
    # them wrongly without an error
    refused(llama(), {"model.layers.*.self_attn.q_proj": "colwise"})
    return out


def test_auto_refusals_name_the_cause_and_the_fix(clusters):
    first, second = clusters[2].run(_refusals)
    assert first == second  # every rank raises the same error
    kv, style, no_plan, alone = first
    assert "num_key_value_heads=3" in kv and "num_attention_heads=6" in kv and "'tensor' axis's 2 ranks" in kv, kv
    assert "'model.layers.0.self_attn'" in kv and "3 % 2 = 1" in kv, kv
    assert "'layers.*.mlp.gate_proj'" in style and "'colwise_rep'" in style and "base_model_tp_plan" in style, style
    assert "Sequential has no base_model_tp_plan" in no_plan and "pass a mapping" in no_plan, no_plan
    assert "'model.layers.0.self_attn'" in alone and "'model.layers.0.self_attn.k_proj'" in alone, alone
    assert "split all of them" in alone, alone


def gpt():
    from shardfn.testing.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2))


def gpt_off_on_ranks():
    """The test GPT, with the last row of blocks.0.mlp.0.weight (tensor rank 1's half) moved
    in the sharded runs only: a difference the report must find."""
    model = gpt()
    if torch.distributed.is_initialized():
        with torch.no_grad():
            model.blocks[0].mlp[0].weight[-1] += 1e-3
    return model


def gpt_loss(apply, params, batch):
    logits = apply(params, batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def gpt_batches():
    g = torch.Generator().manual_seed(2)
    return [{"x": torch.randint(0, 32, (ROWS, 8), generator=g), "y": torch.randint(0, 32, (ROWS, 8), generator=g)}
            for _ in range(2)]


GPT_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}


def test_check_equivalence_with_a_tensor_parallel_plan(clusters):
    from shardfn.testing import check_equivalence

    kw = dict(optimizer=SGD_MOMENTUM, strategies=("FULL_SHARD",), world_sizes=({"tensor": 2},), clusters=clusters,
              tensor_parallel=GPT_PLAN, rtol=RTOL, atol=ATOL)
    report = check_equivalence(gpt, gpt_loss, gpt_batches(), **kw)
    assert set(report.leaves) == {("FULL_SHARD", "(tensor=2)")} and report.failures() == []
    # each rank's shard of a split leaf is compared with its own half of the reference
    assert {rank for rank, name in report.shards[("FULL_SHARD", "(tensor=2)")] if name == "blocks.0.mlp.0.weight"} == {0, 1}
    bad = check_equivalence(gpt_off_on_ranks, gpt_loss, gpt_batches(), raise_on_failure=False, **kw).failures()
    assert any(f.startswith("FULL_SHARD world=(tensor=2): blocks.0.mlp.0.weight: max |diff|") for f in bad), bad
    assert any(f.startswith("FULL_SHARD world=(tensor=2): rank 1's shard of blocks.0.mlp.0.weight") for f in bad), bad
    assert not any("rank 0's shard of blocks.0.mlp.0.weight" in f for f in bad), bad


def _generate(tensor, make=llama):
    """Greedy tokens of the full model ``make()`` and of its shards under ``bind`` ("auto")."""
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(0)
    model = make().eval()
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        want = model.generate(prompt, **kw)
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel="auto")
    with sf.bind(apply, sharded) as bound, torch.no_grad():
        got = bound.generate(prompt, **kw)
    return want, got


def test_generate_on_tensor_parallel_shards_equals_the_full_model(clusters):
    for want, got in clusters[2].run(_generate, 2):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), (got, want)


def _head_styles():
    """The styles "auto" gives the head: split when its weight is its own, whole when tied to
    the embeddings; and torch's ColwiseParallel with both layouts Replicate() is the same style."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    out = []
    for model, spec in ((llama(), "auto"), (llama(tied=True), "auto"),
                        (llama(), {"lm_head": ColwiseParallel(output_layouts=Replicate())})):
        sharded = sf.shard(sf.functionalize(model)[0], mesh, "FULL_SHARD", tensor_parallel=spec)
        out.append(dict(sharded.layout.tensor).get("lm_head"))
    return out


def test_auto_splits_the_head_unless_it_is_tied(clusters):
    for styles in clusters[2].run(_head_styles):
        assert styles == ["colwise_gather_output", None, "colwise_gather_output"], styles


EMBEDDING_PAD = 40  # a padding row in tensor rank 1's half of the vocabulary (its gradient stays zero)


def _embedding_spec(objects):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    style = RowwiseParallel(input_layouts=Replicate()) if objects else "embedding_rowwise"
    return {**auto_plan_of_llama(), "model.embed_tokens": style}


def auto_plan_of_llama():
    from shardfn._parallel.tensor import auto_plan

    return auto_plan(llama())


def _train_embedding(strategy, tensor, objects=False):
    return _train(strategy, tensor, spec=_embedding_spec(objects), pad=EMBEDDING_PAD)


def test_the_embedding_split_by_vocabulary_rows_equals_one_process(clusters):
    # "embedding_rowwise" (torch: RowwiseParallel(input_layouts=Replicate()) on an
    # nn.Embedding): each tensor rank looks up the ids in its rows, zeros elsewhere, and one
    # all-reduce per step sums them; the padding row, on tensor rank 1, keeps a zero gradient.
    _check(clusters[2].run(_train_embedding, "FULL_SHARD", 2), 1, embedding=EMBEDDING_PAD)
    _check(clusters[2].run(_train_embedding, "FULL_SHARD", 2, True), 1, embedding=EMBEDDING_PAD)
    _check(clusters[4].run(_train_embedding, "SHARD_GRAD_OP", 2), 2, embedding=EMBEDDING_PAD)


def _out_of_vocabulary():
    """An id past the vocabulary: the split lookup raises as the whole one does."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, apply = sf.functionalize(llama())
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel={"model.embed_tokens": "embedding_rowwise"})
    try:
        apply(sharded, torch.tensor([[1, VOCAB]]))
    except Exception as e:  # noqa: BLE001 - which error is what the test checks
        return type(e).__name__
    return "accepted"


def test_an_id_outside_the_vocabulary_raises_on_every_rank(clusters):
    assert clusters[2].run(_out_of_vocabulary) == ["IndexError", "IndexError"]
