"""A mixture of experts split by features over the tensor axis ("moe_tp_experts",
"packed_colwise", "rowwise" on 3-D weights, shardfn._parallel.experts): a packed weight's
pieces, and the probe that refuses a split its forward would not keep exact ([Note: experts
proven by a probe]). Qwen3-MoE's equivalence to one process, its graph step, remat,
generate, save_pretrained and checkpoints: tests/test_tp_styles.py, with the other styles."""

import pytest
import torch

import shardfn as sf
import test_tp_styles

MOE = "moe_tp_experts"
EXPERTS_BY_HAND = {"model.layers.*.mlp.experts": MOE, "model.layers.*.mlp.experts.down_proj": "rowwise"}
EXPERTS, INTERMEDIATE, HIDDEN, LAYERS = (test_tp_styles.EXPERTS, test_tp_styles.INTERMEDIATE, test_tp_styles.HIDDEN,
                                        test_tp_styles.LAYERS)
qwen3_moe = test_tp_styles.qwen3_moe


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
    return test_tp_styles.refusals(qwen3_moe, (
        {**EXPERTS_BY_HAND, "model.layers.*.mlp.experts.gate_up_proj": "colwise"},  # gate, then up: wrong
        EXPERTS_BY_HAND,  # gate_up_proj unstyled
        {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"},  # no experts module styled
        {"model.layers.*.self_attn.q_proj": "packed_colwise"}))  # a Linear, packed


def test_a_split_the_experts_forward_would_not_keep_is_refused(clusters):
    first, second = clusters[2].run(_refusals)
    assert first == second  # every rank raises the same error
    unpacked, unstyled, outside, linear = first
    assert "'model.layers.0.mlp.experts' (Qwen3MoeExperts) is styled 'moe_tp_experts'" in unpacked, unpacked
    assert "the output differs from the whole module's by" in unpacked, unpacked
    assert "'model.layers.0.mlp.experts.gate_up_proj' have no style" in unstyled, unstyled
    assert "a style that names a parameter is taken inside a module styled 'moe_tp_experts' only" in outside, outside
    assert "'model.layers.0.self_attn.q_proj'" in linear and "packed weights" in linear, linear


def _graph():
    try:
        test_tp_styles._train("qwen3_moe", "FULL_SHARD", 2, 1, True)
    except ValueError as e:
        return str(e)
    return "recorded"


def test_a_graph_step_refuses_the_experts_routing_by_name(clusters):
    # which tokens go to which expert is a shape that depends on values: a recorded program would
    # replay one step's routing as a constant, so graph=True refuses it on every rank
    for rank, said in enumerate(clusters[2].run(_graph)):
        assert said.startswith(f"[rank {rank}] jit_step(graph=True): this step cannot be recorded"), said
        assert "makes a tensor whose shape depends on values" in said and "graph=False" in said, said


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


def _read(directory, placement):
    with torch.device("meta"):
        model = qwen3_moe()
    params, _ = sf.functionalize(model)
    mesh = sf.Mesh.from_group(tensor=2)
    sharded = sf.shard(params, mesh, "FULL_SHARD", weights=directory, init_fn=model._init_weights,
                       placement=placement, tensor_parallel="auto")
    return sf.gather(sharded)


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_a_pretrained_mixture_of_experts_read_into_its_plan_equals_the_original(clusters, tmp_path, placement):
    # each rank reads its rows of each part of a packed weight from the file (shard 2 x tensor 2)
    from safetensors.torch import save_file

    torch.manual_seed(5)
    model = qwen3_moe()
    # the fused 3-D weights, as sf.save_pretrained writes them (transformers' own save_pretrained
    # writes one expert at a time, which shard(weights=) refuses by name: below)
    model.config.save_pretrained(str(tmp_path))
    state = {n: t.contiguous() for n, t in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    for full in clusters[4].run(_read, str(tmp_path), placement):
        assert set(full) == set(state)
        for name, t in state.items():
            assert torch.equal(full[name], t), name


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("parts", [1, 2])
def test_a_splits_pieces_runs_and_places_agree(dim, parts):
    # [Note: packed splits]: piece() cuts what at() and runs() say, for every tensor rank
    from shardfn._parallel.ops import Split

    whole = torch.arange(8 * 12).reshape(8, 12)
    split, tensor = Split("w", dim, tuple(whole.shape), parts), 2
    pieces = [split.piece(whole, tensor, t) for t in range(tensor)]
    block = whole.shape[dim] // tensor
    seen = []
    for t, piece in enumerate(pieces):
        assert piece.shape[dim] == block
        index = torch.arange(block)
        assert torch.equal(piece, whole.index_select(dim, split.at(index, t, block)))
        for lo, hi in ((0, block), (1, block - 1), (block // 2, block)):
            runs = split.runs(lo, hi, t, block)
            assert sum(k for _, _, k in runs) == hi - lo
            for mine, at, k in runs:
                assert torch.equal(piece.narrow(dim, mine, k), whole.narrow(dim, at, k))
        seen += split.at(index, t, block).tolist()
    assert sorted(seen) == list(range(whole.shape[dim]))  # the pieces tile the whole once
    if parts == 2:  # each rank holds a block of the first half and the same block of the second
        assert split.at(0, 1, block) == block // 2 and split.at(block // 2, 0, block) == whole.shape[dim] // 2


def _read_per_expert(directory):
    try:
        _read(directory, "flat")
    except ValueError as e:
        return str(e)
    return "read"


def test_weights_saved_one_expert_at_a_time_are_refused_with_the_way_in(clusters, tmp_path):
    torch.manual_seed(5)
    qwen3_moe().save_pretrained(str(tmp_path))  # transformers writes experts.0.gate_proj.weight, ...
    for said in clusters[2].run(_read_per_expert, str(tmp_path)):
        assert "missing from the file (4):" in said and "model.layers.0.mlp.experts.gate_up_proj" in said, said
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in said, said
        assert "The file holds experts one at a time" in said and "from_pretrained" in said, said
