"""Tensor-parallel trees made without the full values on every rank (issue 50): deferred
init (``shard(seed=...)``) and a safetensors checkpoint (``shard(weights=...)``), each rank
making or reading only its own piece of a split leaf; both equal to the same init without a
tensor axis, bit for bit."""

import pytest
import torch

import shardfn as sf
from test_tensor_parallel import PLAN, model


def _meta():
    with torch.device("meta"):
        return sf.functionalize(model())[0]


def _seeded(tensor, placement):
    mesh = sf.Mesh.from_group(tensor=tensor)
    sharded = sf.shard(_meta(), mesh, "FULL_SHARD", seed=7, placement=placement,
                       tensor_parallel=PLAN if tensor > 1 else None)
    return sf.gather(sharded), {n: tuple(t.shape) for n, t in sharded.items()}


def _read(path, tensor, placement):
    mesh = sf.Mesh.from_group(tensor=tensor)
    sharded = sf.shard(_meta(), mesh, "FULL_SHARD", weights=path, placement=placement, tensor_parallel=PLAN)
    return sf.gather(sharded)


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_deferred_init_on_a_tensor_mesh_equals_it_without_one(clusters, placement):
    whole, _ = clusters[1].run(_seeded, 1, placement)[0]
    for world in (2, 4):
        for full, local in clusters[world].run(_seeded, 2, placement):
            assert local["blocks.0.mlp.0.weight"][0] < 64 * 16  # a piece of a piece, not the whole
            assert set(full) == set(whole)
            for name, t in whole.items():
                assert torch.equal(full[name], t), (world, name)


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_weights_read_on_a_tensor_mesh_equal_the_file(clusters, tmp_path, placement):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    state = {n: t.detach().contiguous() for n, t in model().state_dict().items()}
    path = str(tmp_path / "model.safetensors")
    save_file(state, path, metadata={"format": "pt"})
    for world in (2, 4):
        for full in clusters[world].run(_read, path, 2, placement):
            assert set(full) == set(state)
            for name, t in state.items():
                assert torch.equal(full[name], t), (world, name)


def _read_llama(directory):
    from test_tp_auto import llama

    with torch.device("meta"):
        model = llama()
    params, _ = sf.functionalize(model)
    mesh = sf.Mesh.from_group(tensor=2)
    sharded = sf.shard(params, mesh, "FULL_SHARD", weights=directory, init_fn=model._init_weights,
                       tensor_parallel="auto")
    return sf.gather(sharded)


def test_a_pretrained_llama_read_into_its_own_plan_equals_the_original(clusters, tmp_path):
    from test_tp_auto import llama

    torch.manual_seed(5)
    model = llama()
    model.save_pretrained(str(tmp_path))
    state = model.state_dict()
    for full in clusters[4].run(_read_llama, str(tmp_path)):  # attention and MLP split, shard 2 x tensor 2
        assert set(full) == set(state)
        for name, t in state.items():
            assert torch.equal(full[name], t), name
