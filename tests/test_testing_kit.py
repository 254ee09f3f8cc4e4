"""The public testing kit: it passes correct training and catches broken training."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardfn.optim import sgd
from shardfn.testing import ClusterError, check_equivalence, split_batch
from shardfn.testing.models import MLP


def model_fn():
    return MLP([6, 5, 3])


def rank_dependent_model_fn():
    """A classic user bug: ranks initialise differently (seeded by rank)."""
    model = MLP([6, 5, 3])
    if dist.is_initialized() and dist.get_rank() > 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    return model


def loss_fn(apply, params, batch):
    return F.mse_loss(apply(params, batch["x"]), batch["y"])


def rank_dependent_loss_fn(apply, params, batch):
    """Another user bug: a loss weighted by rank (outside a step it would be the same)."""
    scale = 1 + dist.get_rank() if dist.is_initialized() else 1
    return scale * F.mse_loss(apply(params, batch["x"]), batch["y"])


def batches():
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(6, 6, generator=g), "y": torch.randn(6, 3, generator=g)} for _ in range(2)]


OPT = functools.partial(sgd, 0.1)


def test_report_lists_every_leaf_of_every_configuration(clusters):
    report = check_equivalence(model_fn, loss_fn, batches(), optimizer=OPT, world_sizes=[2], clusters=clusters)
    assert set(report.leaves) == {("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2), ("NO_SHARD", 2)}
    for leaves in report.leaves.values():
        assert set(leaves) == {"layers.0.linear.weight", "layers.0.linear.bias", "layers.1.linear.weight", "layers.1.linear.bias"}
        assert all(ratio <= 1.0 for _, ratio in leaves.values())
    assert "world=2" in str(report)


def test_broken_training_is_reported_per_leaf(clusters):
    with pytest.raises(AssertionError) as info:
        check_equivalence(model_fn, rank_dependent_loss_fn, batches(), optimizer=OPT, strategies=["FULL_SHARD"],
                          world_sizes=[2], clusters=clusters)
    msg = str(info.value)
    assert "FULL_SHARD world=2: layers.0.linear.weight: max |diff|" in msg
    assert "loss at step 1" in msg


def test_ranks_that_initialise_differently_are_caught_at_shard(clusters):
    with pytest.raises(ClusterError, match=r"the ranks hold different values for 4 of the 4 tensors"):
        check_equivalence(rank_dependent_model_fn, loss_fn, batches(), optimizer=OPT, strategies=["FULL_SHARD"],
                          world_sizes=[2], clusters=clusters)


def test_split_batch_partitions_and_refuses_uneven():
    batch = {"x": torch.arange(12).view(6, 2), "meta": "kept"}
    parts = [split_batch(batch, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([p["x"] for p in parts]), batch["x"])
    assert all(p["meta"] == "kept" for p in parts)
    with pytest.raises(ValueError, match="6 rows does not split evenly over 4 ranks"):
        split_batch(batch, 0, 4)


def test_the_report_gives_its_margin_and_logs_it(caplog):
    """How close a run came to its bound (issue 38): the largest |diff| / (atol + rtol |ref|) of
    any leaf, shard or loss, and where; check_equivalence logs it for the suite's summary."""
    from shardfn.testing import EquivalenceReport

    report = EquivalenceReport(rtol=1e-5, atol=1e-6)
    report.leaves[("FULL_SHARD", 2)] = {"a": (1e-7, 0.1), "b": (9e-7, 0.9)}
    report.shards[("FULL_SHARD", 2)] = {(1, "a"): (5e-7, 0.5, True)}
    report.losses[("FULL_SHARD", 2)] = [(1.0, 1.0), (2.0 + 3.15e-5, 2.0)]  # 3.15e-5 / (1e-6 + 2e-5) = 1.5
    ratio, where = report.margin()
    assert ratio == pytest.approx(1.5) and where == "FULL_SHARD world=2 loss at step 2"
    assert "worst 1.50x the tolerance (FULL_SHARD world=2 loss at step 2)" in str(report)
    report.losses.clear()
    assert report.margin() == (0.9, "FULL_SHARD world=2 b")
    with caplog.at_level("INFO", logger="shardfn.testing"):
        check_equivalence(model_fn, loss_fn, batches()[:1], optimizer=OPT, strategies=["NO_SHARD"], world_sizes=[1])
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "shardfn.testing"][0].startswith(
        "check_equivalence: worst")
