"""Tensor parallelism without a silent path (issue 56): what a split layer's output means is
proven, never read from a name; dropout follows one rule on the tensor axis; a tied leaf is
never split; a step reads nothing of the device to agree on the batch."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
from shardfn.testing.models import GPT, GPTConfig
from test_tensor_parallel import CFG, PLAN, loss_fn


def gpt(**over):
    return GPT(GPTConfig(**{**CFG, **over}))


def _shard_outcome(cfg, plan):
    """What ``shard`` says of ``plan`` on the test GPT built with ``cfg``: 'accepted' or the error."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt(**cfg))
    try:
        sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=plan)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_a_tied_embedding_split_by_vocabulary_is_refused_naming_the_tie(clusters):
    # Before: accepted; the first step then failed with "IndexError: Target 23 is out of
    # bounds" (a device-side assert on CUDA): the tied head multiplied by a vocabulary block.
    first, second = clusters[2].run(_shard_outcome, {"tie_embeddings": True}, {"tok": "embedding_rowwise"})
    assert first == second
    assert first.startswith("ValueError: shard(tensor_parallel=...): 'tok.weight' is tied to 'head.weight'"), first
    assert "untie it" in first and "leave 'tok' out of the plan" in first


def _layout_text():
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(gpt())
    whole = sum(t.numel() for t in params.values() if isinstance(t, nn.Parameter) or t.requires_grad)
    return str(sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=PLAN).layout), whole


def test_the_printed_layout_says_what_is_split_and_counts_the_whole_model(clusters):
    # Before: "5,536 params" (one tensor rank's), and no word of which layers are split.
    text, whole = clusters[2].run(_layout_text)[0]
    assert f"{whole:,} params (5,536 on each tensor rank: 6 leaves split over the 'tensor' axis)" in text, text
    assert "params/tensor rank" in text
    assert "split over the mesh's 'tensor' axis: blocks.*.mlp.0 colwise (2 layers), blocks.*.mlp.2 rowwise (2 layers)" \
        in text, text


def test_an_unknown_style_is_refused_listing_every_style_there_is(clusters):
    from shardfn._tensor import STYLES

    # Before: the message offered 'colwise' and 'rowwise' only (and the sequence styles).
    first, second = clusters[2].run(_shard_outcome, {}, {"blocks.*.mlp.0": "colwise_rep"})
    assert first == second and "the style 'colwise_rep'" in first
    assert all(f"'{style}'" in first for style in STYLES), first
