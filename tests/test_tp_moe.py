"""A mixture of experts from its own plan (``tensor_parallel="auto"``): Qwen3-MoE's packed
experts split by features over the tensor axis ("moe_tp_experts", "packed_colwise",
"rowwise" on 3-D weights, shardfn._parallel.experts), equal to one process; the probe that
refuses a split its forward would not keep exact ([Note: experts proven by a probe])."""

import pytest
import torch

import shardfn as sf
import test_tensor_parallel
import test_tp_auto
import test_tp_styles
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch
from test_tp_auto import batches, loss_fn

HIDDEN, LAYERS, VOCAB, SEQ, HEAD_DIM, EXPERTS, TOP_K, INTERMEDIATE = 32, 2, 64, 8, 8, 4, 2, 16
ROWS = 4
MOE = "moe_tp_experts"
EXPERTS_BY_HAND = {"model.layers.*.mlp.experts": MOE, "model.layers.*.mlp.experts.down_proj": "rowwise"}


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=16,
                         tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


def _expected(data_size, micro):
    """The tensor axis's collectives in a step: (name, kind, bytes), sorted."""
    rows = ROWS // data_size // micro
    nbytes, logits = rows * SEQ * HIDDEN * 4, rows * SEQ * VOCAB * 4
    weights = rows * SEQ * TOP_K * 4  # the routing weights, fp32
    # per layer and micro-batch: the attention's as Qwen3's (tests/test_tp_styles.py); the
    # experts' output in forward, in backward the gradients of their tokens and routing weights
    each = [(f"model.layers.{i}.{layer}", "all_reduce", n) for i in range(LAYERS)
            for layer, n in (("self_attn.q_proj", nbytes), ("self_attn.o_proj", nbytes), ("mlp.experts", nbytes),
                             ("mlp.experts", nbytes), ("mlp.experts", weights))]
    each += [("lm_head", "all_gather", logits), ("lm_head", "all_reduce", nbytes)]
    once = [("replicated_with_grad_allreduce", "all_reduce", 2 * LAYERS * HEAD_DIM * 4)]
    return sorted(each * micro + once)


def _train(strategy, tensor, micro=1, graph=False):
    return test_tp_auto._train(strategy, tensor, micro, make=qwen3_moe, graph=graph)


def _check(results, data_size, micro=1):
    reference = test_tensor_parallel._reference(qwen3_moe, loss_fn, batches)
    expect = _expected(data_size, micro)
    for losses, norms, logs, full, styles in results:
        assert styles["model.layers.1.mlp.experts"] == MOE, styles
        assert styles["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise", styles
        assert styles["model.layers.0.mlp.experts.down_proj"] == "rowwise", styles
        test_tp_auto.assert_trained_alike(losses, norms, full, reference, qwen3_moe)
        for log in logs:
            assert sorted(log) == expect, sorted(log)


def test_moe_tensor_two_equals_one_process(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2), 1)


def test_moe_shard_two_by_tensor_two_with_micro_batches_equals_one_process(clusters):
    _check(clusters[4].run(_train, "FULL_SHARD", 2, 2), 2, 2)
    _check(clusters[4].run(_train, "SHARD_GRAD_OP", 2), 2)


def _pieces():
    """Rank 0's and rank 1's piece of a packed expert weight, and the whole weight."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(qwen3_moe())
    name = "model.layers.0.mlp.experts.gate_up_proj"
    whole = params[name].detach().clone()
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel="auto")
    return whole, sf.gather(sharded)[name], sharded.layout.leaves[name].shape


def test_a_packed_weight_holds_each_ranks_rows_of_every_part(clusters):
    # [Note: packed splits]: rank t holds rows t*4:(t+1)*4 of the gate (rows 0:8) and of the up
    # projection (rows 8:16) of each expert's [16, 32] gate_up_proj, and the gathered whole is the weight
    for whole, gathered, piece in clusters[2].run(_pieces):
        assert torch.equal(gathered, whole)
        assert tuple(piece) == (EXPERTS, INTERMEDIATE, HIDDEN)  # half of 2 * INTERMEDIATE


def _refusals():
    mesh = sf.Mesh.from_group(tensor=2)
    out = []
    for spec in ({**EXPERTS_BY_HAND, "model.layers.*.mlp.experts.gate_up_proj": "colwise"},  # gate, then up: wrong
                 EXPERTS_BY_HAND,  # gate_up_proj unstyled
                 {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"},  # no experts module styled
                 {"model.layers.*.self_attn.q_proj": "packed_colwise"}):  # a Linear, packed
        torch.manual_seed(0)
        try:
            sf.shard(sf.functionalize(qwen3_moe())[0], mesh, "FULL_SHARD", tensor_parallel=spec)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("accepted")
    return out


def test_a_split_the_experts_forward_would_not_keep_is_refused(clusters):
    first, second = clusters[2].run(_refusals)
    assert first == second  # every rank raises the same error
    unpacked, unstyled, outside, linear = first
    assert "'model.layers.0.mlp.experts' (Qwen3MoeExperts) is styled 'moe_tp_experts'" in unpacked, unpacked
    assert "the output differs from the whole module's by" in unpacked, unpacked
    assert "'model.layers.0.mlp.experts.gate_up_proj' have no style" in unstyled, unstyled
    assert "a style that names a parameter is taken inside a module styled 'moe_tp_experts' only" in outside, outside
    assert "'model.layers.0.self_attn.q_proj'" in linear and "packed weights" in linear, linear


@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm"])
def test_the_probe_accepts_each_of_transformers_experts_implementations(implementation):
    # every implementation reads the packed weight by chunks: each proves exact split so
    from shardfn._parallel.tensor import resolve_tensor_parallel

    torch.manual_seed(0)
    model = qwen3_moe()
    model.config._experts_implementation = implementation
    styles, splits = resolve_tensor_parallel("auto", model, dict(model.state_dict()), 2)
    packed = [s for s in splits if s.leaf.endswith("gate_up_proj")]
    assert [(s.dim, s.parts) for s in packed] == [(1, 2)] * LAYERS, packed
