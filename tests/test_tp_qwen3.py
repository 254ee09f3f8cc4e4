"""A module with parameters inside an attention split by heads (Qwen3's per-head q_norm and
k_norm): refused unless styled ``"replicated_with_grad_allreduce"``, and with that style, as
``tensor_parallel="auto"`` reads from Qwen3's own plan, equal to one process
(shardfn._parallel.tensor [Note: a module that reads split heads])."""

import pathlib
import re
import sys

import torch

import shardfn as sf
import test_tensor_parallel
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch
from test_tp_auto import ATOL, RTOL, batches, loss_fn

HIDDEN, LAYERS, VOCAB, SEQ, HEAD_DIM = 32, 2, 64, 8, 8
ROWS = 4
REPLICATED = "replicated_with_grad_allreduce"
# Qwen3's attention and MLP split by hand, its per-head norms left out of the plan
BY_HAND = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
           "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=16,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg)


def _train(strategy, tensor, micro=1, graph=False):
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(0)
    params, _ = sf.functionalize(qwen3())
    sharded = sf.shard(params, mesh, strategy, tensor_parallel="auto")
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=micro, graph=graph)
    losses, norms, logs = [], [], []
    for batch in batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        logs.append(sorted((c.unit, c.kind.value, c.nbytes) for c in log.select("tensor")))
    return losses, norms, logs, sf.gather(sharded), dict(sharded.layout.tensor)


def _check(results, data_size, micro=1):
    ref_losses, ref_state, ref_norm = test_tensor_parallel._reference(qwen3, loss_fn, batches)
    rows = ROWS // data_size // micro
    nbytes, logits = rows * SEQ * HIDDEN * 4, rows * SEQ * VOCAB * 4  # fp32 hidden states, logits of a micro-batch
    # Llama's per layer and micro-batch (tests/test_tp_auto.py), and once a step the norms'
    # partial gradients, summed in one all-reduce: 2 norms x 2 layers x head_dim fp32
    expect = sorted([(f"model.layers.{i}.{layer}", "all_reduce", nbytes) for i in range(LAYERS)
                     for layer in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
                    * micro + [("lm_head", "all_gather", logits), ("lm_head", "all_reduce", nbytes)] * micro
                    + [(REPLICATED, "all_reduce", 2 * LAYERS * HEAD_DIM * 4)])
    for losses, norms, logs, full, styles in results:
        assert styles["model.layers.1.self_attn.q_norm"] == REPLICATED, styles
        assert styles["model.layers.0.self_attn.k_norm"] == REPLICATED, styles
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        assert abs(norms[0] - ref_norm) <= ATOL + RTOL * ref_norm, (norms[0], ref_norm)
        assert set(full) == {n for n, _ in qwen3().named_parameters()}  # (the rotary buffers are not gathered)
        for name in full:
            ref = ref_state[name]
            diff = (full[name] - ref).abs() - RTOL * ref.abs()
            assert float(diff.max()) <= ATOL, (name, float(diff.max()))
        for log in logs:  # (a graph step's: the recorded collectives, counted as the eager step's)
            assert log == expect, log


def test_auto_qwen3_tensor_two_equals_one_process(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2), 1)


def test_auto_qwen3_shard_two_by_tensor_two_with_micro_batches_equals_one_process(clusters):
    _check(clusters[4].run(_train, "FULL_SHARD", 2, 2), 2, 2)
    _check(clusters[4].run(_train, "SHARD_GRAD_OP", 2), 2)


def test_auto_qwen3_graph_step_equals_one_process(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2, 1, True), 1)


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
    return {n: float((grads[n] - whole[n]).abs().max()) for n in names}, max(float(g.abs().max()) for g in whole.values())


def test_the_norms_gradients_are_summed_over_the_tensor_ranks(clusters):
    for diffs, scale in clusters[2].run(_unsplit_gradient):
        assert scale > 1e-3  # (a gradient that could be seen to be halved)
        assert max(diffs.values()) <= ATOL + RTOL * scale, diffs


def _refusals():
    mesh = sf.Mesh.from_group(tensor=2)
    out = []
    for spec in (BY_HAND,  # the norms read split heads, unstyled
                 {**BY_HAND, "model.layers.*.self_attn.*_norm": REPLICATED, "model.norm": REPLICATED},  # outside one
                 {"model.layers.*.self_attn.q_norm": REPLICATED}):  # an attention not split
        torch.manual_seed(0)
        try:
            sf.shard(sf.functionalize(qwen3())[0], mesh, "FULL_SHARD", tensor_parallel=spec)
        except ValueError as e:
            out.append(str(e))
        else:
            out.append("accepted")
    return out


def test_a_module_reading_split_heads_is_refused_unless_styled(clusters):
    first, second = clusters[2].run(_refusals)
    assert first == second  # every rank raises the same error
    unstyled, outside, unsplit = first
    assert "'model.layers.0.self_attn.k_norm', 'model.layers.0.self_attn.q_norm' inside it have" in unstyled, unstyled
    assert "silently wrong" in unstyled and f"{REPLICATED!r}" in unstyled, unstyled
    assert "'model.norm' is not inside such an attention" in outside, outside
    assert "'model.layers.0.self_attn.q_norm' is not inside such an attention" in unsplit, unsplit


def test_the_coverage_in_the_docs_is_the_tools():
    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tools"))
    import tp_coverage

    version, found = tp_coverage.coverage()
    assert found["qwen3"] == () and found["llama"] == ()  # (Qwen3's per-head norms: REPLICATED)
    assert "moe_tp_experts" in found["mixtral"], found["mixtral"]
    text = " ".join((root / "docs" / "tensor-parallel.md").read_text().split())
    said = re.search(r"with transformers (\S+), \"auto\" takes the plans of (\d+) of the (\d+) model types", text)
    assert said is not None
    taken = sum(1 for missing in found.values() if not missing)
    assert said.groups() == (version, str(taken), str(len(found))), (said.groups(), version, taken, len(found))
