"""python -m shardfn.convert: a checkpoint to a from_pretrained directory and back, in one process."""

import os
import subprocess
import sys

import pytest
import torch

import shardfn as sf
from shardfn.testing.models import ConvNet
from test_pretrained import build, from_pretrained, tokens

pytestmark = pytest.mark.slow


def convert(*args):
    return subprocess.run([sys.executable, "-m", "shardfn.convert", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def train_and_save(path):
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(build("gpt2"))
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = sf.optim.adamw(1e-2)
    state = opt.init(sharded)
    step = sf.jit_step(lambda apply, p, b: apply(p, b, labels=b).loss, mesh, optimizer=opt)
    for _ in range(2):
        sharded, state, _ = step(sharded, state, tokens()[mesh.rank : mesh.rank + 1])
    sf.checkpoint.save(path, sharded, state, extra={"step": 2})
    with torch.no_grad():
        return apply(sharded, tokens()).logits


def test_checkpoint_to_from_pretrained_directory(clusters, tmp_path):
    logits = clusters[2].run(train_and_save, str(tmp_path / "ckpt"))[0]
    assert (tmp_path / "ckpt" / "config.json").exists()  # save keeps a Hugging Face model's config
    done = convert(tmp_path / "ckpt", tmp_path / "hf", "--max-shard-size", "20KB")
    assert done.returncode == 0, done.stderr
    assert "optimizer state and extra values are not part of a model directory" in done.stdout
    assert len([n for n in os.listdir(tmp_path / "hf") if n.endswith(".safetensors")]) > 1
    _, reloaded = from_pretrained("gpt2", tmp_path / "hf")
    torch.testing.assert_close(reloaded, logits, rtol=0, atol=0)


def load_converted(path, kind):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(1)  # other values than the converted ones
    model = build(kind) if kind != "convnet" else ConvNet()
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    sharded, _, extra = sf.checkpoint.load(path, sharded)
    full = sf.gather(sharded)  # before a forward in train mode moves the running statistics
    if kind == "convnet":
        return None, extra, full
    with torch.no_grad():
        return apply(sharded, tokens()).logits, extra, full


def test_from_pretrained_directory_to_checkpoint_loads_at_any_world(clusters, tmp_path):
    model = build("llama")
    model.save_pretrained(tmp_path / "hf", max_shard_size="10KB")
    done = convert(tmp_path / "hf", tmp_path / "ckpt")
    assert done.returncode == 0, done.stderr
    with torch.no_grad():
        expected = model(tokens()).logits
    for logits, extra, _ in clusters[3].run(load_converted, str(tmp_path / "ckpt"), "llama"):
        torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
        assert extra["converted_from"] == str(tmp_path / "hf")


def test_buffers_survive_the_round_trip(clusters, tmp_path):
    from safetensors.torch import save_model

    torch.manual_seed(0)
    model = ConvNet()
    model.train()(torch.randn(8, 3, 6, 6))  # running statistics that are not the initial ones
    save_model(model, str(tmp_path / "conv.safetensors"))
    assert convert(tmp_path / "conv.safetensors", tmp_path / "ckpt").returncode == 0
    _, _, full = clusters[2].run(load_converted, str(tmp_path / "ckpt"), "convnet")[0]
    assert full.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(full[k], v), k
    assert convert(tmp_path / "ckpt", tmp_path / "back").returncode == 0
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == model.state_dict().keys() and all(torch.equal(back[k], v) for k, v in
                                                            model.state_dict().items())


def test_a_damaged_checkpoint_is_refused(clusters, tmp_path):
    clusters[2].run(train_and_save, str(tmp_path / "ckpt"))
    data = sorted(n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".distcp"))[0]
    with open(tmp_path / "ckpt" / data, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    done = convert(tmp_path / "ckpt", tmp_path / "hf")
    assert done.returncode == 1 and data in done.stderr and "damaged" in done.stderr
    assert not (tmp_path / "hf").exists()
