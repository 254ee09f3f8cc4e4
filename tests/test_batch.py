"""What a step does with the leaves of a batch: which are cut into micro-batches, which travel
whole (``shardfn.Whole``), and the tokens a step counts over the ranks (docs/training.md)."""

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=17, seq_len=4, d_model=8, n_layers=2, n_heads=2)
MASK = torch.tril(torch.ones(4, 4))  # a [S, S] mask: per step, not per row


def _setup():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(CFG))
    return mesh, sf.shard(params, mesh, "FULL_SHARD")


def _rows(rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)
    return {"x": x, "y": torch.roll(x, -1, 1)}


def _weighted_loss(seen):
    """A loss that reads the whole mask (``mask.sum(0)``); notes what it was given."""

    def loss_fn(apply, params, batch):
        mask = batch["mask"]
        seen.append((type(mask).__name__, tuple(mask.shape), mask is MASK, tuple(batch["x"].shape)))
        losses = F.cross_entropy(apply(params, batch["x"]).flatten(0, 1), batch["y"].flatten(), reduction="none")
        return (losses.view(-1, CFG.seq_len) * mask.sum(0)).mean()

    return loss_fn


def mask_in_the_batch(how, wrap, mask=MASK):
    """What ``loss_fn`` saw of the mask under ``how``, and the losses; or the error's text."""
    mesh, sharded = _setup()
    seen = []
    loss_fn = _weighted_loss(seen)
    batch = {**_rows(4, mesh.rank), "mask": sf.Whole(mask) if wrap else mask}
    losses = []
    try:
        if how == "grad":
            losses.append(float(sf.jit_grad(loss_fn, mesh, micro_batches=2)(sharded, batch)[0]))
        elif how == "micro_batches":
            parts = [{"x": batch["x"][a:b], "y": batch["y"][a:b], "mask": batch["mask"]} for a, b in ((0, 1), (1, 4))]
            step = sf.jit_step(lambda apply, p, b: sf.Mean(_weighted_loss(seen)(apply, p, b) * len(b["x"]), len(b["x"])),
                               mesh, optimizer=sf.optim.sgd(0.0))
            losses.append(step(sharded, step.init(sharded), sf.MicroBatches(parts))[2]["loss"])
        else:  # a step: eager, or recorded (its first call eager, the second records, the third replays)
            step = sf.jit_step(loss_fn, mesh, optimizer=sf.optim.sgd(0.0), micro_batches=2,
                               **({"graph": "eager"} if how == "graph" else {}))
            state = step.init(sharded)
            for _ in range(3 if how == "graph" else 1):
                sharded, state, metrics = step(sharded, state, batch)
                losses.append(float(metrics["loss"]))
    except (ValueError, TypeError, IndexError) as e:
        return f"{type(e).__name__}: {e}"
    return seen, losses


@pytest.mark.parametrize("how", ["step", "grad", "graph", "micro_batches"])
def test_a_whole_leaf_reaches_every_micro_batch_as_the_plain_tensor(clusters, how):
    for seen, losses in clusters[2].run(mask_in_the_batch, how, True):
        # Every micro-batch gets the mask itself (not a slice, not a copy, not the wrapper),
        # and its own rows of the batch leaves.
        rows = [(2, 4), (2, 4)] if how != "micro_batches" else [(1, 4), (3, 4)]
        calls = 2 if how == "graph" else 1  # the graph step's loss_fn runs eagerly once and once recording
        assert seen == [("Tensor", (4, 4), True, r) for r in rows] * calls
        assert len(set(losses)) == 1  # the same batch at lr 0: the replay's loss is the eager one


def test_a_whole_leaf_is_an_input_of_the_recorded_program(clusters):
    # A replay reads the mask it is given, not the one it was recorded with.
    other = MASK.flip(1)  # other weights per position (sum(0) reversed)
    recorded = [losses[0] for _, losses in clusters[2].run(mask_in_the_batch, "graph", True)]
    eager = [losses[0] for _, losses in clusters[2].run(mask_in_the_batch, "step", True, other)]
    replayed = clusters[2].run(_replay_with, other)
    assert [r for r, _ in replayed] == eager and eager != recorded
    assert [n for _, n in replayed] == [1, 1]  # the third call replayed the second's program


def _replay_with(mask):
    mesh, sharded = _setup()
    step = sf.jit_step(_weighted_loss([]), mesh, optimizer=sf.optim.sgd(0.0), micro_batches=2, graph="eager")
    state = step.init(sharded)
    for m in (MASK, MASK, mask):  # eager, recorded, replayed with another mask
        sharded, state, metrics = step(sharded, state, {**_rows(4, mesh.rank), "mask": sf.Whole(m)})
    return float(metrics["loss"]), step.recordings


@pytest.mark.parametrize("mask, path", [(MASK[:2].clone(), "['mask']"), (torch.tensor(3.0), "['mask']")])
def test_a_leaf_that_is_not_a_batch_leaf_is_refused_not_cut(clusters, mask, path):
    # 4 rows; a [2, 4] mask divides by 2 but is not the rows, and a 0-d leaf has no rows.
    for out in clusters[2].run(mask_in_the_batch, "step", False, mask):
        assert isinstance(out, str), out
        assert out.startswith("ValueError: jit_step(micro_batches=2): the leaf batch" + path), out
        assert "wrap it in shardfn.Whole(...)" in out


def test_whole_takes_a_tensor_and_rows_and_tokens_skip_it():
    from shardfn._batch import count_tokens, rows

    with pytest.raises(TypeError, match=r"shardfn.Whole\(tensor\): expected a tensor"):
        sf.Whole([1, 2])
    ids = torch.zeros(3, 5, dtype=torch.long)
    batch = {"a": sf.Whole(torch.zeros(7, 2, dtype=torch.long)), "ids": ids}
    assert rows(batch) == 3 and count_tokens(batch) == 15
    assert count_tokens({"a": sf.Whole(ids), "f": torch.zeros(2, 4)}) == 2
    assert repr(sf.Whole(ids)) == "Whole(tensor of shape (3, 5), torch.int64)"


# -- tokens: summed over the ranks ----------------------------------------------------------------


def _token_mean(apply, params, batch):
    logits = apply(params, batch["x"])
    total = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="sum")
    return sf.Mean(total, batch["y"].numel())


def tokens_of_unequal_ranks(how):
    """Rank 0 gives 8 rows, rank 1 gives 4 (a Mean loss weighs them exactly): ``metrics["tokens"]``
    on each call, and the collectives of the last one."""
    mesh, sharded = _setup()
    batch = _rows(8 if mesh.rank == 0 else 4, mesh.rank)
    out = []
    if how == "grad":
        grad_fn = sf.jit_grad(_token_mean, mesh)
        calls = [lambda: grad_fn(sharded, batch)[2]] * 2
    else:
        options = {"graph": "eager"} if how == "graph" else {"on_nonfinite": "raise_next"} if how == "raise_next" else {}
        step = sf.jit_step(_token_mean, mesh, optimizer=sf.optim.sgd(0.0), **options)
        state = [step.init(sharded), sharded]

        def call():
            state[1], state[0], metrics = step(state[1], state[0], batch)
            return metrics

        calls = [call] * 3
        if how == "micro_batches":
            batch = sf.MicroBatches([{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}])
    for call in calls:
        with sf.record_collectives() as log:
            metrics = call()
        tokens = metrics["tokens"]
        out.append((type(tokens).__name__, int(tokens)))
    return out, dict(log.counts())


@pytest.mark.parametrize("how", ["step", "raise_next", "grad", "micro_batches", "graph"])
def test_tokens_are_summed_over_ranks_of_different_batches(clusters, how):
    (rank0, counts0), (rank1, counts1) = clusters[2].run(tokens_of_unequal_ranks, how)
    total = (8 + 4) * CFG.seq_len
    # An int where the step reads its metrics anyway; a 0-d device tensor where it reads nothing.
    kind = "Tensor" if how in ("raise_next", "graph") else "int"
    assert rank0 == rank1 == [(kind, total)] * len(rank0)
    # No collective more: the count rides on the metrics all-reduce (a replay issues the program's).
    assert counts0 == counts1
    if how != "graph":
        assert counts0["all_reduce"] == 1


def plain_tokens(graph):
    mesh, sharded = _setup()
    step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=sf.optim.sgd(0.0),
                       graph=graph)
    state, out = step.init(sharded), []
    for _ in range(3 if graph else 1):
        sharded, state, metrics = step(sharded, state, _rows(3, mesh.rank))
        out.append(metrics["tokens"])
    return out


@pytest.mark.parametrize("graph", [False, "eager"])
def test_a_plain_loss_counts_tokens_on_the_host(clusters, graph):
    # A plain mean loss needs equal batches on every rank (their headers agree, also when a
    # program is recorded): the count is this rank's times the ranks, an int.
    assert clusters[2].run(plain_tokens, graph) == [[2 * 3 * CFG.seq_len] * (3 if graph else 1)] * 2


# -- a leaf whose size equals the rows (issue 56, item 5) -----------------------------------------

SEQ = 16  # at world 2, a global batch of 32 gives each rank 16 rows: as many as the positions
SQUARE = GPTConfig(vocab_size=17, seq_len=SEQ, d_model=8, n_layers=2, n_heads=2)


def square_batches(steps=2, seed=3):
    """Global batches of 32 rows of 16 tokens, each with the ``[16, 16]`` causal mask, unmarked."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, SQUARE.vocab_size, (32, SEQ), generator=g)
        out.append({"x": x, "y": torch.roll(x, -1, 1), "mask": torch.tril(torch.ones(SEQ, SEQ))})
    return out


def position_weighted(apply, params, batch):
    """A newcomer's loss: reads the mask without checking its shape (a mask cut to [8, 16] still
    gives 16 weights, other ones), each position weighted by the mask rows that see it."""
    weights = batch["mask"].sum(0)
    losses = F.cross_entropy(apply(params, batch["x"]).flatten(0, 1), batch["y"].flatten(), reduction="none")
    return (losses.view(-1, SEQ) * (weights / weights.mean())).mean()


def newcomer_step(micro_batches):
    """The newcomer's step at ``micro_batches``: its loss, or the error's text and whether
    every shard and the optimizer state are as before."""
    from bounds import ADAMW

    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(SQUARE))
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    step = sf.jit_step(position_weighted, mesh, optimizer=ADAMW(), micro_batches=micro_batches)
    state = step.init(sharded)
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((sharded, state)) if isinstance(t, torch.Tensor)]
    global_batch = square_batches()[0]
    batch = {k: v[16 * mesh.rank : 16 * (mesh.rank + 1)] if k != "mask" else v for k, v in global_batch.items()}
    try:
        _, _, metrics = step(sharded, state, batch)
    except ValueError as e:
        after = [t for t in torch.utils._pytree.tree_leaves((sharded, state)) if isinstance(t, torch.Tensor)]
        return f"{type(e).__name__}: {e}", all(torch.equal(a, b) for a, b in zip(after, before))
    return float(metrics["loss"])


def test_a_square_mask_at_as_many_rows_is_refused_on_every_rank(clusters):
    # The newcomer's case: 16 rows per rank, sequence 16, an unwrapped [16, 16] mask. Cut into
    # [8, 16] halves, it would give other weights, and the step would train something else.
    whole = clusters[2].run(newcomer_step, 1)
    for rank, out in enumerate(clusters[2].run(newcomer_step, 2)):
        assert isinstance(out, tuple), (f"rank {rank}: the step ran with the mask cut: loss {out} at "
                                        f"micro_batches=2, {whole[rank]} at micro_batches=1")
        message, unchanged = out
        assert message.startswith("ValueError: jit_step(micro_batches=2): "), message
        assert "batch['mask']" in message and "shardfn.Whole" in message, message
        assert unchanged
