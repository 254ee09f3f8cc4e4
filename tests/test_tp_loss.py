"""``shardfn.vocab_parallel_cross_entropy``: the loss over a head split by vocabulary, so no
rank holds the whole logits ([Note: the vocabulary-parallel loss] in shardfn/_parallel/loss.py):
equal to one process's ``F.cross_entropy`` of the whole head, two small all-reduces in place
of the logits' all-gather, and a target outside the vocabulary an error on every rank."""

import torch
import torch.nn.functional as F

import shardfn as sf
import test_tensor_parallel
import test_tp_auto
from test_tp_auto import HIDDEN, LAYERS, ROWS, SEQ, VOCAB, llama

IGNORED = 3  # the first targets of every row set to the ignore index, as a prompt's are


def batches():
    # (the same count in every row: a plain loss is a mean over each micro-batch's targets, which
    # the step averages; uneven counts call for shardfn.Mean)
    out = test_tp_auto.batches()
    for b in out:
        b["y"][:, :IGNORED] = -100
    return out


def whole_loss(apply, params, batch):
    return F.cross_entropy(apply(params, batch["x"]).logits.flatten(0, 1), batch["y"].flatten())


def split_loss(apply, params, batch):
    mesh = params.mesh
    return sf.vocab_parallel_cross_entropy(apply(params, batch["x"]).logits, batch["y"], mesh)


def plan():
    return {**test_tp_auto.auto_plan_of_llama(), "lm_head": "colwise"}  # the head's logits stay split


def _train(strategy, tensor, micro=1, graph=False):
    return test_tp_auto._train(strategy, tensor, micro, spec=plan(), loss=split_loss, make=llama, make_batches=batches,
                               graph=graph)


def _check(results, data_size, micro=1):
    ref_losses, ref_state, ref_norm = test_tensor_parallel._reference(llama, whole_loss, batches)
    rows = ROWS // data_size // micro
    nbytes, tokens = rows * SEQ * HIDDEN * 4, rows * SEQ
    # Llama's four per layer (tests/test_tp_auto.py); the head: its input's gradient in
    # backward, and no all-gather of the logits but the loss's two all-reduces, of 1 and 2
    # fp32 numbers per token (the maxima; the sums of exponentials and the target logits)
    expect = sorted(([(f"model.layers.{i}.{layer}", "all_reduce", nbytes) for i in range(LAYERS)
                      for layer in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
                     + [("lm_head", "all_reduce", nbytes), ("vocab_parallel_cross_entropy", "all_reduce", tokens * 4),
                        ("vocab_parallel_cross_entropy", "all_reduce", 2 * tokens * 4)]) * micro)
    for losses, norms, logs, full, styles in results:
        assert styles["lm_head"] == "colwise", styles
        test_tp_auto.assert_trained_alike(losses, norms, full, (ref_losses, ref_state, ref_norm), llama)
        for log in logs:
            assert sorted(log) == expect, sorted(log)


def test_the_split_loss_equals_one_process_at_tensor_two(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2), 1)


def test_the_split_loss_equals_one_process_at_shard_two_by_tensor_two(clusters):
    _check(clusters[4].run(_train, "FULL_SHARD", 2, 2), 2, 2)
    _check(clusters[4].run(_train, "SHARD_GRAD_OP", 2), 2)


def test_the_split_loss_in_a_graph_step_equals_one_process(clusters):
    # (its backward subtracts the targets' one-hot by a scatter: no shape made from values)
    _check(clusters[2].run(_train, "FULL_SHARD", 2, 1, True), 1)


def _outside_the_vocabulary():
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(llama())
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=plan())
    step = sf.jit_step(split_loss, mesh, optimizer=sf.optim.sgd(0.1))
    batch = batches()[0]
    batch["y"][1, 2] = VOCAB  # one past the vocabulary
    try:
        step(sharded, step.init(sharded), batch)
    except FloatingPointError as e:
        return str(e)
    return "trained"


def test_a_target_outside_the_vocabulary_stops_every_rank(clusters):
    first, second = clusters[2].run(_outside_the_vocabulary)
    assert "not finite" in first and "not finite" in second, (first, second)


BIG_VOCAB = 4096  # the logits then outweigh the rest of the activations


def big_vocab_llama(vocab=BIG_VOCAB):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=16, tie_word_embeddings=False))


def _peaks(vocab=BIG_VOCAB):
    """Peak live bytes above what stays, of a forward and backward (jit_grad), the head's
    logits gathered ("auto") and split with this loss; and the bytes of the whole logits."""
    from shardfn._parallel.tensor import auto_plan

    mesh = sf.Mesh.from_group(tensor=2)
    g = torch.Generator().manual_seed(4)
    batch = {k: torch.randint(0, vocab, (ROWS, SEQ), generator=g) for k in ("x", "y")}
    out = []
    for head, loss in (("colwise_gather_output", whole_loss), ("colwise", split_loss)):
        torch.manual_seed(0)
        model = big_vocab_llama(vocab)
        spec = {**auto_plan(model), "lm_head": head}
        sharded = sf.shard(sf.functionalize(model)[0], mesh, "FULL_SHARD", tensor_parallel=spec)
        grad = sf.jit_grad(loss, mesh)
        grad(sharded, batch)  # (what a first call makes once)
        with sf.track_live_bytes() as mem:
            grad(sharded, batch)
        out.append(mem.peak - mem.current)  # (above what the step leaves)
    return out, ROWS * SEQ * vocab * 4


def test_no_rank_holds_the_whole_logits(clusters):
    # The gathered head's step holds, at its peak, the whole [rows, seq, vocab] logits that
    # the split one never makes (this rank's half, and the loss's few numbers per token,
    # instead): at least their bytes less at the peak, on every rank. Measured: 1.5x them
    # (docs/tensor-parallel.md).
    for (gathered, split), logits in clusters[2].run(_peaks):
        assert gathered - split >= logits, (gathered, split, logits)
