"""What a step does with the leaves of a batch: which are cut into micro-batches, which travel
whole (``shardfn.Whole``), and the tokens a step counts over the ranks (docs/training.md)."""

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from bounds import ADAMW  # as the other GPT equivalence tests; its tolerance: tests/bounds.py
from shardfn.testing import check_equivalence
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=17, seq_len=4, d_model=8, n_layers=2, n_heads=2)
MASK = torch.tril(torch.ones(4, 4))  # a [S, S] mask: per step, not per row


def _setup():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(CFG))
    return mesh, sf.shard(params, mesh, "FULL_SHARD")


def _rows(rows, seed, mark=False):
    """``rows`` rows of tokens; ``mark``: marked ``sf.Batched`` (at 4 rows of 4 tokens, both dims
    equal the rows: a step with micro-batches refuses them unmarked)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g)
    batch = {"x": x, "y": torch.roll(x, -1, 1)}
    return {k: sf.Batched(v) for k, v in batch.items()} if mark else batch


def _weighted_loss(seen):
    """A loss that reads the whole mask (``mask.sum(0)``); notes what it was given."""

    def loss_fn(apply, params, batch):
        mask = batch["mask"]
        seen.append((type(mask).__name__, tuple(mask.shape), mask is MASK, type(batch["x"]).__name__,
                     tuple(batch["x"].shape)))
        losses = F.cross_entropy(apply(params, batch["x"]).flatten(0, 1), batch["y"].flatten(), reduction="none")
        return (losses.view(-1, CFG.seq_len) * mask.sum(0)).mean()

    return loss_fn


def mask_in_the_batch(how, wrap, mask=MASK):
    """What ``loss_fn`` saw of the mask under ``how``, and the losses; or the error's text."""
    mesh, sharded = _setup()
    seen = []
    loss_fn = _weighted_loss(seen)
    batch = {**_rows(4, mesh.rank, mark=True), "mask": sf.Whole(mask) if wrap else mask}
    losses = []
    try:
        if how == "grad":
            losses.append(float(sf.jit_grad(loss_fn, mesh, micro_batches=2)(sharded, batch)[0]))
        elif how == "micro_batches":
            parts = [{"x": sf.Batched(batch["x"].tensor[a:b]), "y": sf.Batched(batch["y"].tensor[a:b]),
                      "mask": batch["mask"]} for a, b in ((0, 1), (1, 4))]
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
        # and its own rows of the marked batch leaves, as plain tensors.
        rows = [(2, 4), (2, 4)] if how != "micro_batches" else [(1, 4), (3, 4)]
        calls = 2 if how == "graph" else 1  # the graph step's loss_fn runs eagerly once and once recording
        assert seen == [("Tensor", (4, 4), True, "Tensor", r) for r in rows] * calls
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
        sharded, state, metrics = step(sharded, state, {**_rows(4, mesh.rank, mark=True), "mask": sf.Whole(m)})
    return float(metrics["loss"]), step.recordings


@pytest.mark.parametrize("mask, line", [(MASK[:2].clone(), "batch['mask'] of shape (2, 4): dim 0 is 2, not the 4 rows"),
                                        (torch.tensor(3.0), "batch['mask']: a 0-d tensor, which has no rows"),
                                        (MASK, "batch['mask'] of shape (4, 4): ambiguous, dims 0 and 1 both equal the 4 rows")])
def test_a_leaf_that_is_not_a_batch_leaf_is_refused_not_cut(clusters, mask, line):
    # 4 rows; a [2, 4] mask divides by 2 but is not the rows, a 0-d leaf has no rows, and a
    # [4, 4] mask could be rows or one value for the step.
    for out in clusters[2].run(mask_in_the_batch, "step", False, mask):
        assert isinstance(out, str), out
        assert out.startswith("ValueError: jit_step(micro_batches=2): cuts each batch leaf on dim 0 into 2 "
                              "micro-batches, and the batch's rows are 4 (dim 0 of batch['x'], marked shardfn.Batched); "
                              "this leaf cannot be cut as given:\n  " + line + "\nSay what each one is: "), out
        assert "in shardfn.Whole(...)" in out and "with shardfn.Batched(...)" in out


def test_whole_takes_a_tensor_and_rows_and_tokens_skip_it():
    from shardfn._run.batch import count_tokens, rows

    with pytest.raises(TypeError, match=r"shardfn.Whole\(tensor\): expected a tensor"):
        sf.Whole([1, 2])
    ids = torch.zeros(3, 5, dtype=torch.long)
    batch = {"a": sf.Whole(torch.zeros(7, 2, dtype=torch.long)), "ids": ids}
    assert rows(batch) == 3 and count_tokens(batch) == 15
    assert count_tokens({"a": sf.Whole(ids), "f": torch.zeros(2, 4)}) == 2
    assert repr(sf.Whole(ids)) == "Whole(tensor of shape (3, 5), torch.int64)"


def test_batched_takes_a_tensor_with_rows_and_rows_and_tokens_read_it_first():
    from shardfn._run.batch import count_tokens, rows

    with pytest.raises(TypeError, match=r"shardfn.Batched\(tensor\): expected a tensor"):
        sf.Batched([1, 2])
    with pytest.raises(ValueError, match=r"shardfn.Batched\(tensor\): a 0-d tensor has no rows; wrap .* shardfn.Whole"):
        sf.Batched(torch.tensor(1))
    ids, pad = torch.zeros(6, 6, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long)
    assert repr(sf.Batched(ids)) == "Batched(tensor of shape (6, 6), torch.int64)"
    # A marked leaf defines the rows and holds the tokens, wherever it is in the batch.
    assert (rows({"pad": pad, "ids": sf.Batched(ids)}), count_tokens({"pad": pad, "ids": sf.Batched(ids)})) == (6, 36)
    assert (rows({"pad": pad, "ids": ids}), count_tokens({"pad": pad, "ids": ids})) == (2, 10)


def test_split_cuts_marked_leaves_keeps_whole_ones_and_checks_only_when_it_cuts():
    from shardfn._run.batch import split

    x, mask = torch.arange(256).view(16, 16), torch.tril(torch.ones(16, 16))
    parts = split({"x": sf.Batched(x), "mask": sf.Whole(mask), "n": 3}, 2)
    assert [type(p["x"]) for p in parts] == [torch.Tensor] * 2
    assert torch.equal(torch.cat([p["x"] for p in parts]), x) and [p["x"].shape for p in parts] == [(8, 16)] * 2
    assert all(p["mask"] is mask and p["n"] == 3 for p in parts)
    # Without micro-batches nothing is cut, so nothing is ambiguous: the leaves come unwrapped.
    (whole,) = split({"x": x, "mask": mask, "m": sf.Batched(x)}, 1)
    assert whole["x"] is x and whole["mask"] is mask and whole["m"] is x


def test_every_ambiguous_leaf_is_named_at_once_with_its_shape_the_rows_and_both_fixes():
    from shardfn._run.batch import split

    x, feats = torch.zeros(16, 16, dtype=torch.long), torch.zeros(16, 3, 16)
    batch = {"x": x, "y": x, "feats": feats, "pos": torch.zeros(4, 16), "ok": torch.zeros(16, 4)}
    with pytest.raises(ValueError) as e:
        split(batch, 2, "jit_grad")
    assert str(e.value).splitlines()[:5] == [
        "jit_grad(micro_batches=2): cuts each batch leaf on dim 0 into 2 micro-batches, and the batch's rows are 16 "
        "(dim 0 of batch['x'], its first batch leaf); 4 leaves cannot be cut as given:",
        "  batch['x'] of shape (16, 16): ambiguous, dims 0 and 1 both equal the 16 rows",
        "  batch['y'] of shape (16, 16): ambiguous, dims 0 and 1 both equal the 16 rows",
        "  batch['feats'] of shape (16, 3, 16): ambiguous, dims 0 and 2 both equal the 16 rows",
        "  batch['pos'] of shape (4, 16): dim 0 is 4, not the 16 rows"]
    fix = str(e.value).splitlines()[5]
    assert "wrap a per-step value" in fix and "shardfn.Whole(...)" in fix and "shardfn.Batched(...)" in fix
    # Marked, the same leaves are cut; a marked leaf whose dim 0 is not the rows is refused.
    parts = split({**batch, "x": sf.Batched(x), "y": sf.Batched(x), "feats": sf.Batched(feats),
                   "pos": sf.Whole(batch["pos"])}, 2)
    assert [tuple(v.shape) for v in parts[1].values()] == [(8, 16), (8, 16), (8, 3, 16), (4, 16), (8, 4)]
    with pytest.raises(ValueError, match=r"\n  batch\['pos'\] \(shardfn.Batched\) of shape \(4, 16\): dim 0 is 4, "
                                         r"not the 16 rows\n"):
        split({"x": sf.Batched(x), "pos": sf.Batched(batch["pos"])}, 2)


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


def square_gpt():
    return GPT(SQUARE)


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


def _marked(batches):
    return [{"x": sf.Batched(b["x"]), "y": sf.Batched(b["y"]), "mask": sf.Whole(b["mask"])} for b in batches]


@pytest.mark.parametrize("accumulate", ["reduce_each", "local"])
def test_the_newcomers_batch_marked_trains_as_one_process(clusters, accumulate):
    # The mask wrapped, the token leaves marked: micro_batches=2 over 2 ranks equals one process
    # on the global batch, 2 AdamW steps (tolerance: tests/bounds.py, summation order only).
    report = check_equivalence(square_gpt, position_weighted, _marked(square_batches()), optimizer=ADAMW,
                               strategies=["FULL_SHARD"], world_sizes=[2], clusters=clusters,
                               step_options={"micro_batches": 2, "accumulate": accumulate})
    assert report.failures() == []


def test_the_mask_cut_with_the_rows_trains_something_else(clusters):
    # The negative control: the same check with the mask marked Batched (so it is cut with the
    # rows, as it was before the rule) fails: the comparison above can tell.
    batches = [{**b, "mask": sf.Batched(b["mask"].tensor.repeat(2, 1))} for b in _marked(square_batches())]
    report = check_equivalence(square_gpt, position_weighted, batches, optimizer=ADAMW,
                               strategies=["FULL_SHARD"], world_sizes=[2], clusters=clusters,
                               step_options={"micro_batches": 2}, raise_on_failure=False)
    assert report.failures() != []


def replayed_rows(graph):
    """The losses of three calls at lr 0 on marked rows A, A, B, and the programs recorded (a
    graph step: eager, recorded, replayed)."""
    mesh, sharded = _setup()
    step = sf.jit_step(_weighted_loss([]), mesh, optimizer=sf.optim.sgd(0.0), micro_batches=2,
                       **({"graph": "eager"} if graph else {}))
    state, losses = step.init(sharded), []
    for seed in (0, 0, 1):
        batch = {**_rows(4, 2 * seed + mesh.rank, mark=True), "mask": sf.Whole(MASK)}
        sharded, state, metrics = step(sharded, state, batch)
        losses.append(float(metrics["loss"]))
    return losses, getattr(step, "recordings", 0)


def test_a_batched_leaf_is_an_input_of_the_recorded_program(clusters):
    # A replay cuts the rows it is given, not the ones it was recorded with.
    for (eager, _), (replayed, recordings) in zip(clusters[2].run(replayed_rows, False),
                                                  clusters[2].run(replayed_rows, True)):
        assert replayed == eager and eager[2] != eager[0] and recordings == 1


def ambiguous_on_rank_0():
    """Rank 0 gives 16 rows of 16 tokens (ambiguous), rank 1 8 rows (not): a Mean loss allows
    that. What each raised, and whether its state is as before."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(SQUARE))
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    step = sf.jit_step(_token_mean, mesh, optimizer=ADAMW(), micro_batches=2)
    state = step.init(sharded)
    before = [t.clone() for t in torch.utils._pytree.tree_leaves((sharded, state)) if isinstance(t, torch.Tensor)]
    x = square_batches()[0]["x"][: 16 if mesh.rank == 0 else 8]
    try:
        step(sharded, state, {"x": x, "y": torch.roll(x, -1, 1)})
    except (ValueError, sf.PeerError) as e:
        after = [t for t in torch.utils._pytree.tree_leaves((sharded, state)) if isinstance(t, torch.Tensor)]
        return type(e).__name__, str(e), all(torch.equal(a, b) for a, b in zip(after, before))
    return None


def test_an_ambiguous_leaf_on_one_rank_stops_every_rank_before_anything_changes(clusters):
    (kind0, text0, unchanged0), (kind1, text1, unchanged1) = clusters[2].run(ambiguous_on_rank_0)
    assert kind0 == "ValueError" and "batch['x'] of shape (16, 16): ambiguous" in text0
    assert kind1 == "PeerError" and text1.startswith("[rank 1] shardfn: rank 0 raised"), text1
    assert unchanged0 and unchanged1
