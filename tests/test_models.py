"""Reference models in shardfn.testing.models and the data helpers of examples/train_lm.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from shardfn.testing.models import GPT, MLP, Block, GPTConfig, Layer, lm_loss

SMALL = GPTConfig(vocab_size=32, seq_len=16, d_model=16, n_layers=2, n_heads=2)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"


@pytest.fixture(scope="module")
def train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mlp_shapes_and_activations():
    mlp = MLP([5, 7, 3, 2])
    assert mlp(torch.randn(4, 5)).shape == (4, 2)
    assert all(isinstance(layer, Layer) for layer in mlp.layers)
    assert [layer.activation for layer in mlp.layers] == [True, True, False]
    assert [layer.linear.out_features for layer in mlp.layers] == [7, 3, 2]


def test_mlp_without_bias_and_last_layer_is_linear():
    torch.manual_seed(0)
    mlp = MLP([3, 4], bias=False)
    assert all(n.endswith("weight") for n, _ in mlp.named_parameters())
    x = torch.randn(6, 3)
    # One layer only: no GELU, so the output may be negative and equals x @ W^T.
    torch.testing.assert_close(mlp(x), x @ mlp.layers[0].linear.weight.T)


def test_mlp_rejects_too_few_sizes():
    with pytest.raises(ValueError, match="at least"):
        MLP([3])


def test_gpt_shapes_and_structure():
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (3, SMALL.seq_len))
    assert model(idx).shape == (3, SMALL.seq_len, SMALL.vocab_size)
    assert model(idx[:, :5]).shape == (3, 5, SMALL.vocab_size)
    assert len(model.blocks) == SMALL.n_layers and all(isinstance(b, Block) for b in model.blocks)
    assert isinstance(model.pos, nn.Embedding) and model.head.bias is None
    assert model.blocks[0].attn.qkv.out_features == 3 * SMALL.d_model
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())


def test_gpt_rejects_too_long_sequence():
    with pytest.raises(ValueError, match="seq_len"):
        GPT(SMALL)(torch.zeros(1, SMALL.seq_len + 1, dtype=torch.long))


def test_config_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig(d_model=10, n_heads=4)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    changed = idx.clone()
    t = 9
    changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_tied_embeddings_share_one_parameter():
    model = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": True}))
    assert model.head.weight is model.tok.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok.weight" in names and "head.weight" not in names
    assert len(names) == len(set(id(p) for p in model.parameters()))
    untied = GPT(SMALL)
    assert untied.head.weight is not untied.tok.weight
    assert len(list(untied.parameters())) == len(names) + 1


def test_tied_gradient_accumulates_from_both_uses():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": True}))
    idx = torch.randint(0, SMALL.vocab_size, (2, 8))
    lm_loss(model(idx), idx).backward()
    # Rows of tokens absent from the input get gradient only through the head.
    unused = torch.ones(SMALL.vocab_size, dtype=torch.bool)
    unused[idx.flatten()] = False
    assert unused.any() and model.tok.weight.grad[unused].abs().sum() > 0


@pytest.mark.parametrize("tie", [False, True])
def test_meta_device_construction(tie):
    cfg = GPTConfig(tie_embeddings=tie)
    with torch.device("meta"):
        model = GPT(cfg)
        mlp = MLP([4, 8, 2])
    assert all(p.is_meta for p in model.parameters()) and all(p.is_meta for p in mlp.parameters())
    real = GPT(cfg)
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}


def test_deterministic_under_seed():
    def build():
        torch.manual_seed(123)
        return GPT(SMALL), MLP([4, 8, 2])

    (g1, m1), (g2, m2) = build(), build()
    for a, b in ((g1, g2), (m1, m2)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    torch.manual_seed(124)
    g3 = GPT(SMALL)
    assert not torch.equal(g1.tok.weight, g3.tok.weight)
    idx = torch.randint(0, SMALL.vocab_size, (2, SMALL.seq_len))
    torch.testing.assert_close(g1(idx), g2(idx), rtol=0, atol=0)


def test_lm_loss_matches_mean_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    manual = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(lm_loss(logits, targets), manual)


def test_load_corpus(train_lm):
    corpus = train_lm.load_corpus()
    assert isinstance(corpus, bytes) and len(corpus) > 100_000
    assert corpus == train_lm.load_corpus()
    train, val = train_lm.split_corpus(corpus)
    assert train.dtype == torch.uint8 and len(train) + len(val) == len(corpus)
    assert len(train) == int(0.9 * len(corpus))
    assert bytes(torch.cat([train, val]).tolist()) == corpus


def test_get_batch_shifted_and_seeded(train_lm):
    data = torch.arange(200, dtype=torch.uint8)  # token i sits at position i
    batch = train_lm.get_batch(data, 8, 10, torch.Generator().manual_seed(0))
    x, y = batch["x"], batch["y"]
    assert x.shape == y.shape == (8, 10) and x.dtype == y.dtype == torch.long
    torch.testing.assert_close(y, x + 1)
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    again = train_lm.get_batch(data, 8, 10, torch.Generator().manual_seed(0))
    assert torch.equal(again["x"], x)
    # The last possible window is reachable and none runs past the end.
    full = train_lm.get_batch(data[:11], 4, 10, torch.Generator().manual_seed(0))
    assert torch.equal(full["y"][:, -1], torch.full((4,), 10))
    with pytest.raises(ValueError, match="too few"):
        train_lm.get_batch(data[:10], 1, 10, torch.Generator())
