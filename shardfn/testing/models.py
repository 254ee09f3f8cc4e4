"""Small reference models for tests, examples and users' own experiments.

Every model here is deterministic: no dropout, and no randomness outside PyTorch's
default ``reset_parameters`` initialisers, so ``torch.manual_seed(s)`` before
construction fixes all weights. All of them can be built on the meta device.

Example:
    >>> _ = torch.manual_seed(0)
    >>> model = GPT(GPTConfig(n_layers=1))
    >>> idx = torch.randint(0, 256, (2, 16))
    >>> lm_loss(model(idx), idx).shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

__all__ = ["MLP", "Layer", "GPTConfig", "GPT", "Block", "CausalSelfAttention", "ConvBlock", "ConvNet", "MoE",
           "MoEBlock", "lm_loss"]


class Layer(nn.Module):
    """One ``nn.Linear``, optionally followed by GELU.

    Args:
        d_in: Input features.
        d_out: Output features.
        bias: Whether the linear layer has a bias.
        activation: Whether to apply GELU after the linear layer.
    """

    def __init__(self, d_in: int, d_out: int, bias: bool = True, activation: bool = True):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return F.gelu(x) if self.activation else x

    def extra_repr(self) -> str:
        return f"activation={self.activation}"


class MLP(nn.Module):
    """A stack of ``Layer`` modules with GELU between layers (not after the last).

    Args:
        sizes: Feature sizes ``[d_in, h_1, ..., d_out]``; at least two entries.
        bias: Whether the linear layers have biases.

    Example:
        >>> MLP([4, 8, 2])(torch.zeros(3, 4)).shape
        torch.Size([3, 2])
    """

    def __init__(self, sizes: Sequence[int], bias: bool = True):
        super().__init__()
        sizes = list(sizes)
        if len(sizes) < 2:
            raise ValueError(f"MLP(sizes={sizes}): needs at least an input and an output size")
        n = len(sizes) - 1
        self.layers = nn.ModuleList(
            Layer(d_in, d_out, bias=bias, activation=i < n - 1)
            for i, (d_in, d_out) in enumerate(zip(sizes[:-1], sizes[1:]))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a small decoder-only transformer. There is deliberately no dropout.

    Attributes:
        vocab_size: Number of token ids (256 for byte-level text).
        seq_len: Maximum sequence length (size of the position embedding).
        d_model: Residual stream width; must be divisible by ``n_heads``.
        n_layers: Number of transformer blocks.
        n_heads: Attention heads per block.
        mlp_ratio: Hidden width of each block's MLP, as a multiple of ``d_model``.
        tie_embeddings: Share one parameter between the token embedding and the output head.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig(d_model={self.d_model}, n_heads={self.n_heads}): d_model is not divisible by n_heads; "
                f"choose n_heads among the divisors of d_model"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused ``qkv`` projection.

    Args:
        cfg: Model configuration.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        # No bias: the key bias has an exactly-zero gradient (softmax ignores a constant
        # shift per row), so Adam would turn its rounding noise into full-size updates.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.n_heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Args:
        cfg: Model configuration.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.d_model
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, hidden), nn.GELU(), nn.Linear(hidden, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small GPT: token and learned position embeddings, ``Block`` stack, final LayerNorm, head.

    Args:
        cfg: Model configuration.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(tie_embeddings=True))
        >>> model.head.weight is model.tok.weight
        True
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Maps token ids ``[B, T]`` (``T <= cfg.seq_len``) to logits ``[B, T, vocab_size]``."""
        t = idx.shape[-1]
        if t > self.cfg.seq_len:
            raise ValueError(
                f"GPT.forward(idx): sequence length {t} exceeds cfg.seq_len={self.cfg.seq_len}; "
                f"truncate the input or build the model with a larger seq_len"
            )
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ConvBlock(nn.Module):
    """``relu(batch_norm(conv3x3(x)))``: a block with running statistics (buffers).

    Args:
        c_in: Input channels.
        c_out: Output channels.
    """

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class ConvNet(nn.Module):
    """A small CNN with BatchNorm: ``ConvBlock`` stack, global average pool, linear head.

    Its BatchNorm layers carry buffers (``running_mean``, ``running_var`` and the integer
    ``num_batches_tracked``) that a training step updates.

    Args:
        channels: ``(c_in, c_1, ..., c_k)``, one block per consecutive pair.
        classes: Output logits.

    Example:
        >>> ConvNet()(torch.zeros(2, 3, 6, 6)).shape
        torch.Size([2, 5])
    """

    def __init__(self, channels: Sequence[int] = (3, 6, 6), classes: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in zip(channels[:-1], channels[1:]))
        self.head = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


class MoEBlock(nn.Module):
    """A mixture-of-experts block: a router picks one expert MLP per token (top-1), and
    only the experts some token chose run, so which experts a rank runs depends on its
    data (as in real MoE layers)."""

    def __init__(self, d: int, n_experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                     for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gates = self.router(h).softmax(-1)
        weight, choice = gates.max(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]) * weight[rows, None])
        return x + out


class MoE(nn.Module):
    """Tokens (rows of a ``[n, d_in]`` input) through ``n_blocks`` :class:`MoEBlock` s of
    ``n_experts`` experts each, then a linear head to ``d_out``."""

    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4, n_blocks: int = 2, n_experts: int = 4):
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(MoEBlock(d, n_experts) for _ in range(n_blocks))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of every sequence.

    Args:
        logits: ``[..., vocab]`` unnormalised scores.
        targets: Token ids with the shape of ``logits`` minus its last dimension.

    Returns:
        A scalar tensor.
    """
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
