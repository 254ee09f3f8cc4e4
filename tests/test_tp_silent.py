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
