"""Real training loops: token-weighted losses, micro-batches of any size, aux outputs."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardfn as sf
from bounds import ADAMW  # as the other GPT equivalence tests; its tolerance: tests/bounds.py
from shardfn.testing import check_equivalence, reference_training, split_batch
from test_equivalence import GPT_CFG, STRATEGIES, gpt_model

ROWS = 12


def padded_batches(steps=3, seed=5):
    """HF-style language-model batches: labels -100 past each row's own length (1 to 8 tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, GPT_CFG.vocab_size, (ROWS, GPT_CFG.seq_len), generator=g)
        y = torch.randint(0, GPT_CFG.vocab_size, (ROWS, GPT_CFG.seq_len), generator=g)
        lengths = torch.randint(1, GPT_CFG.seq_len + 1, (ROWS,), generator=g)
        y[torch.arange(GPT_CFG.seq_len) >= lengths[:, None]] = -100
        out.append({"x": x, "y": y})
    return out


def token_mean(apply, params, batch):
    logits = apply(params, batch["x"])
    total = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=-100, reduction="sum")
    return sf.Mean(total, (batch["y"] != -100).sum())


def mean_of_means(apply, params, batch):
    logits = apply(params, batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=-100)


def test_the_padding_makes_rank_means_differ_from_the_global_mean():
    # What the tests below rely on: real-token counts differ across ranks, so averaging the
    # ranks' means is not the global mean (a plain loss trains something else).
    for world in (2, 3, 4):
        counts = [int((split_batch(b, r, world)["y"] != -100).sum()) for b in padded_batches() for r in range(world)]
        assert len(set(counts)) > 1, world


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_token_weighted_mean_equals_single_device(clusters, world):
    report = check_equivalence(gpt_model, token_mean, padded_batches(), optimizer=ADAMW, strategies=STRATEGIES,
                               world_sizes=[world], clusters=clusters)
    assert report.failures() == []


@pytest.mark.parametrize("accumulate", ["reduce_each", "local"])
def test_token_weighted_mean_over_micro_batches(clusters, accumulate):
    # 6 rows per rank in 3 micro-batches of 2: every micro-batch has its own token count.
    report = check_equivalence(gpt_model, token_mean, padded_batches(), optimizer=ADAMW,
                               strategies=["FULL_SHARD", "NO_SHARD"], world_sizes=[2], clusters=clusters,
                               step_options={"micro_batches": 3, "accumulate": accumulate})
    assert report.failures() == []


def test_a_plain_mean_of_padded_batches_is_not_the_global_mean(clusters):
    # The contrast: the same data with a per-rank mean trains away from the single-device
    # mean over the global batch (so the tests above can fail).
    report = check_equivalence(gpt_model, mean_of_means, padded_batches(), optimizer=ADAMW, strategies=["NO_SHARD"],
                               world_sizes=[2], clusters=clusters, raise_on_failure=False)
    ref_losses, _ = reference_training(gpt_model, token_mean, padded_batches(), ADAMW)
    ours = [got for got, _ in report.losses[("NO_SHARD", 2)]]
    assert ours[0] != pytest.approx(ref_losses[0], rel=1e-4)  # the equal-weight mean of the ranks' means


# -- micro-batches of any size ------------------------------------------------------------------------


SPLITS = {2: [1, 3, 2], 3: [3, 1]}  # rows of each micro-batch of a rank's slice (6 rows at 2 ranks, 4 at 3)


def micro_batch_run(strategy, accumulate, loss_name):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, strategy)
    opt = ADAMW()
    state = opt.init(sharded)
    loss_fn = {"token_mean": token_mean, "mean_of_means": mean_of_means}[loss_name]
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, accumulate=accumulate)
    losses = []
    for b in padded_batches():
        local = split_batch(b, mesh.rank, mesh.size)
        cuts = torch.tensor(SPLITS[mesh.size]).cumsum(0).tolist()
        parts = [{k: v[start:end] for k, v in local.items()} for start, end in zip([0, *cuts[:-1]], cuts)]
        try:
            with sf.record_collectives() as log:
                sharded, state, m = step(sharded, state, sf.MicroBatches(parts))
        except ValueError as e:
            return str(e)
        losses.append(m["loss"])
    return losses, sf.testing.full_state(sharded), dict(log.counts(purpose="micro_batches"))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("strategy, accumulate", [("FULL_SHARD", "reduce_each"), ("FULL_SHARD", "local"),
                                                  ("NO_SHARD", "reduce_each")])
def test_micro_batches_of_any_size_equal_one_step_on_their_concatenation(clusters, world, strategy, accumulate):
    ref_losses, ref = reference_training(gpt_model, token_mean, padded_batches(), ADAMW)
    for losses, full, counts in clusters[world].run(micro_batch_run, strategy, accumulate, "token_mean"):
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for n, t in ref.items():
            torch.testing.assert_close(full[n], t, rtol=1e-5, atol=1e-6)
        assert counts == {"all_gather": 1}  # ranks compare their numbers of micro-batches: one small collective


def test_micro_batches_of_different_sizes_need_a_mean_loss(clusters):
    for msg in clusters[2].run(micro_batch_run, "FULL_SHARD", "reduce_each", "mean_of_means"):
        assert "micro-batches of different sizes (1 to 3 rows" in msg and "shardfn.Mean(total, count)" in msg


def unequal_numbers_of_micro_batches():
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = ADAMW()
    state = opt.init(sharded)
    before = sf.gather(sharded)
    step = sf.jit_step(token_mean, mesh, optimizer=opt)
    local = split_batch(padded_batches(1)[0], mesh.rank, mesh.size)
    parts = [local] if dist.get_rank() == 0 else [{k: v[:3] for k, v in local.items()}, {k: v[3:] for k, v in local.items()}]
    try:
        step(sharded, state, sf.MicroBatches(parts))
    except ValueError as e:
        after = sf.gather(sharded)
        return str(e), all(torch.equal(before[n], after[n]) for n in before)
    return "no error", None


def test_ranks_with_different_numbers_of_micro_batches_all_raise(clusters):
    for rank, (msg, unchanged) in enumerate(clusters[2].run(unequal_numbers_of_micro_batches)):
        assert f"[rank {rank}]" in msg and "different numbers of micro-batches ([1, 2] by rank)" in msg
        assert unchanged


def no_elements():
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = ADAMW()
    step = sf.jit_step(token_mean, mesh, optimizer=opt)
    batch = split_batch(padded_batches(1)[0], mesh.rank, mesh.size)
    batch["y"][:] = -100
    try:
        step(sharded, opt.init(sharded), batch)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_step_without_any_element_raises_on_every_rank(clusters):
    for rank, msg in enumerate(clusters[2].run(no_elements)):
        assert f"[rank {rank}]" in msg and "count 0 elements on every rank" in msg


# -- aux outputs -------------------------------------------------------------------------------------


def with_aux(apply, params, batch):
    logits = apply(params, batch["x"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
    accuracy = (logits.argmax(-1) == batch["y"]).float().mean()
    return loss, {"accuracy": accuracy, "logit_mean": logits.detach().mean(-1).mean(0)}


def aux_run(mean_aux, micro_batches):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = ADAMW()
    step = sf.jit_step(with_aux, mesh, optimizer=opt, aux="mean" if mean_aux else "rank",
                       micro_batches=micro_batches)
    batch = split_batch(padded_batches(1)[0], mesh.rank, mesh.size)
    batch["y"] = batch["y"].clamp(min=0)
    _, _, m = step(sharded, opt.init(sharded), batch)
    return m["aux"], m["comm_bytes"]


def expected_aux(world, micro_batches):
    torch.manual_seed(0)
    params, apply = sf.functionalize(gpt_model())
    batch = padded_batches(1)[0]
    batch["y"] = batch["y"].clamp(min=0)
    per = []
    with torch.no_grad():
        for r in range(world):
            local = split_batch(batch, r, world)
            rows = local["x"].shape[0] // micro_batches
            for i in range(micro_batches):
                _, aux = with_aux(apply, params, {k: v[i * rows : (i + 1) * rows] for k, v in local.items()})
                per.append((r, aux))
    return per


def test_aux_is_this_ranks_or_the_mean_over_ranks_and_micro_batches(clusters):
    per = expected_aux(2, 2)
    results = clusters[2].run(aux_run, False, 2)
    for rank, (aux, _) in enumerate(results):  # this rank's, one per micro-batch
        mine = [a for r, a in per if r == rank]
        assert isinstance(aux, list) and len(aux) == 2
        for got, want in zip(aux, mine):
            torch.testing.assert_close(got["accuracy"], want["accuracy"])
            torch.testing.assert_close(got["logit_mean"], want["logit_mean"], rtol=1e-5, atol=1e-6)
    averaged = clusters[2].run(aux_run, True, 2)
    plain_bytes = results[0][1]["all_reduce"]
    for aux, comm in averaged:
        torch.testing.assert_close(aux["accuracy"], torch.stack([a["accuracy"] for _, a in per]).mean())
        torch.testing.assert_close(aux["logit_mean"], torch.stack([a["logit_mean"] for _, a in per]).mean(0),
                                   rtol=1e-5, atol=1e-6)
        # The aux rides on the metrics all-reduce: 4 bytes per element more, no collective more.
        assert comm["all_reduce"] == plain_bytes + 4 * (1 + GPT_CFG.seq_len)


def metrics_bytes(use_mean):
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = ADAMW()
    step = sf.jit_step(lambda apply, p, b: (token_mean if use_mean else mean_of_means)(apply, p, b), mesh, optimizer=opt)
    batch = split_batch(padded_batches(1)[0], mesh.rank, mesh.size)
    with sf.record_collectives() as log:
        step(sharded, opt.init(sharded), batch)
    return [(c.purpose.value, c.nbytes) for c in log.select(purpose="metrics")], dict(log.counts())


def test_the_count_rides_on_the_metrics_all_reduce(clusters):
    plain, plain_counts = clusters[2].run(metrics_bytes, False)[0]
    mean, mean_counts = clusters[2].run(metrics_bytes, True)[0]
    # loss and norm; with Mean also the count and the tokens summed over the ranks (two fp32
    # words: [Note: tokens over the ranks])
    assert plain == [("metrics", 2 * 4)] and mean == [("metrics", 5 * 4)]
    assert mean_counts == plain_counts  # no collective more
