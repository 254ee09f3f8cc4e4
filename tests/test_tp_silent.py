"""Tensor parallelism without a silent path (issue 56): what a split layer's output means is
proven, never read from a name; dropout follows one rule on the tensor axis; a tied leaf is
never split; a step reads nothing of the device to agree on the batch."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import reference_training, split_batch
from shardfn.testing.models import GPT, Block, CausalSelfAttention, GPTConfig
from test_tensor_parallel import ATOL, CFG, PLAN, RTOL, _other_batches, batches, loss_fn, split_step


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
    from shardfn._parallel.tensor import STYLES

    # Before: the message offered 'colwise' and 'rowwise' only (and the sequence styles).
    first, second = clusters[2].run(_shard_outcome, {}, {"blocks.*.mlp.0": "colwise_rep"})
    assert first == second and "the style 'colwise_rep'" in first
    assert all(f"'{style}'" in first for style in STYLES), first


# -- what a split layer's output means: proven, never read from a name -----------------------


class _RenamedBlock(Block):
    """The test GPT's block with its attention (``attn``) or its MLP (``mlp``) under another name."""

    def __init__(self, cfg, attn="attn", mlp="mlp"):
        super().__init__(cfg)
        self.names = (attn, mlp)
        setattr(self, attn, self._modules.pop("attn"))
        setattr(self, mlp, self._modules.pop("mlp"))

    def forward(self, x):
        attn, mlp = (getattr(self, n) for n in self.names)
        x = x + attn(self.ln1(x))
        return x + mlp(self.ln2(x))


class _Renamed(GPT):
    def __init__(self, attn="attn", mlp="mlp"):
        super().__init__(GPTConfig(**CFG))
        self.blocks = nn.ModuleList(_RenamedBlock(self.cfg, attn, mlp) for _ in range(self.cfg.n_layers))


class _AttentionAtTop(nn.Module):
    """A model whose root module is the (packed, head-counted) attention: its split layers
    have no parent but the root."""

    def __init__(self):
        super().__init__()
        cfg = GPTConfig(**CFG)
        self.n_heads = cfg.n_heads
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx):
        return self.head(CausalSelfAttention.forward(self, self.tok(idx)))


_MODELS = {
    "mixer": (lambda: _Renamed(attn="mixer"), {"blocks.*.mixer.qkv": "colwise", "blocks.*.mixer.proj": "rowwise"}),
    "sa": (lambda: _Renamed(attn="sa"), {"blocks.*.sa.qkv": "colwise", "blocks.*.sa.proj": "rowwise"}),
    "top": (_AttentionAtTop, {"qkv": "colwise", "proj": "rowwise"}),
    # an MLP under a name that says attention: an MLP all the same
    "attn_mlp": (lambda: _Renamed(mlp="attn_mlp"), {"blocks.*.attn_mlp.0": "colwise", "blocks.*.attn_mlp.2": "rowwise"}),
}


def _tp_outcome(kind, steps=3):
    """3 steps at tensor 2 (SGD with momentum): ``("trained", losses, full state)``, or
    ``("refused", error, whether every leaf is as before)``."""
    make, plan = _MODELS[kind]
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(make())
    try:
        sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=plan)
    except (ValueError, TypeError) as e:
        return "refused", f"{type(e).__name__}: {e}", True
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses = []
    for batch in batches()[:steps]:
        before = {n: t.clone() for n, t in sharded.items()}
        try:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        except (ValueError, TypeError) as e:
            return "refused", f"{type(e).__name__}: {e}", all(torch.equal(before[n], sharded[n]) for n in before)
        losses.append(float(metrics["loss"]))
    return "trained", losses, sf.gather(sharded)


def _equal_to_one_process(kind, losses, full):
    ref_losses, ref_state = reference_training(_MODELS[kind][0], loss_fn, batches()[:len(losses)], SGD_MOMENTUM)
    assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (kind, losses, ref_losses)
    for name, ref in ref_state.items():
        if name in full:
            assert float(((full[name] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, (kind, name)


@pytest.mark.parametrize("kind", ["mixer", "sa", "top"])
def test_an_attention_under_any_name_is_refused_when_its_split_cannot_be_proven(clusters, kind):
    # Before: accepted under 'mixer', 'sa' and at the top level, and trained silently wrong
    # (the packed qkv read by head count: one rank's half as the whole).
    outcomes = clusters[2].run(_tp_outcome, kind)
    assert outcomes[0][:2] == outcomes[1][:2]  # the same on every rank
    what, message, unchanged = outcomes[0]
    if what == "trained":
        _equal_to_one_process(kind, message, unchanged)  # (fails: the split is not exact)
    assert what == "refused" and unchanged, outcomes[0]
    layer = {"mixer": "blocks.0.mixer.qkv", "sa": "blocks.0.sa.qkv", "top": "qkv"}[kind]
    assert f"the output of the colwise layer {layer!r}" in message, message
    assert "only elementwise operations" in message and "leave" in message, message


def test_an_mlp_named_like_an_attention_trains_exactly(clusters):
    # Before: refused by its name ("inside an attention module that shardfn cannot tell
    # splits exactly"), though it is an MLP.
    for what, losses, full in clusters[2].run(_tp_outcome, "attn_mlp"):
        assert what == "trained", losses
        _equal_to_one_process("attn_mlp", losses, full)


# -- dropout: one rule for the tensor axis -------------------------------------------------

DROPOUT_PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.3": "rowwise"}
DROP_STEPS = 10


class _DropoutGPT(GPT):
    """The test GPT with dropout in each MLP: on the split hidden activation (between the
    colwise and the rowwise layer) and on the replicated output (after the rowwise one)."""

    def __init__(self):
        super().__init__(GPTConfig(**CFG))
        for block in self.blocks:
            first, act, last = block.mlp
            block.mlp = nn.Sequential(first, act, nn.Dropout(0.3), last, nn.Dropout(0.3))


def _drop_batches():
    g = torch.Generator().manual_seed(2)
    return [{"x": torch.randint(0, CFG["vocab_size"], (4, CFG["seq_len"]), generator=g),
             "y": torch.randint(0, CFG["vocab_size"], (4, CFG["seq_len"]), generator=g)} for _ in range(DROP_STEPS)]


def _dropout_run(tensor, how="eager"):
    """10 steps at ``tensor``, each rank seeded on its own after the model is built (as for
    data order): the losses, the replicated leaves' local values, the gathered state.
    ``how``: "eager", "remat" (the blocks rematerialised), "micro" (micro_batches=2) or
    "bf16" (Precision(param=bf16, reduce=fp32))."""
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(0)
    params, _ = sf.functionalize(_DropoutGPT())
    plan = sf.Plan("FULL_SHARD", remat=sf.by_module_type(Block) if how == "remat" else None,
                   precision=sf.Precision(param=torch.bfloat16, reduce=torch.float32) if how == "bf16" else None)
    sharded = sf.shard(params, mesh, plan, tensor_parallel=DROPOUT_PLAN)
    torch.manual_seed(1000 + mesh.rank)  # a per-rank seed, for other reasons
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=2 if how == "micro" else 1)
    losses = []
    for batch in _drop_batches():
        sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
    split = {leaf for leaf, *_ in sharded.layout.splits}
    replicated = {n: t.detach().clone() for n, t in sharded.items() if n not in split}
    return losses, replicated, sf.gather(sharded)


@pytest.mark.parametrize("how", ["eager", "remat"])
def test_dropout_keeps_replicated_leaves_equal_across_tensor_ranks_and_equals_one_process(clusters, how):
    # Before: the tensor ranks drew their own masks (their per-rank seeds) on replicated
    # activations, and the unsplit leaves drifted apart without an error (eager: by up to
    # 1.1e-3 after 10 steps).
    (losses, mine, full), (losses1, theirs, _) = clusters[2].run(_dropout_run, 2, how)
    drift = {n: float((mine[n] - theirs[n]).abs().max()) for n in mine}
    assert all(d == 0 for d in drift.values()), drift  # bit for bit, after 10 steps
    assert losses == losses1
    # The reference: one process whose default generator starts where the tensor group's
    # stream starts (tensor rank 0's seed, [Note: randomness on the tensor axis]): the same
    # masks, the split activation's cut in blocks. SGD with momentum over 10 steps moves a
    # parameter by at most sgd_bound(0.05, 0.9, 10, dg=6e-8) = 1.2e-7 < ATOL (tests/bounds.py).
    from bounds import sgd_bound

    assert sgd_bound(0.05, 0.9, DROP_STEPS, 6e-8) < ATOL

    def model_then_seed():
        model = _DropoutGPT()
        torch.manual_seed(1000)
        return model

    ref_losses, ref_state = reference_training(model_then_seed, loss_fn, _drop_batches(), SGD_MOMENTUM)
    assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    for name, ref in ref_state.items():
        assert float(((full[name] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, name


@pytest.mark.parametrize("how", ["micro", "bf16"])
def test_dropout_keeps_tensor_ranks_alike_with_micro_batches_and_bf16(clusters, how):
    # Each micro-batch draws its own masks (one process drawing for the whole batch draws
    # others: no reference here), and bf16 rounds: what must hold is the rule, bit for bit.
    (losses, mine, _), (losses1, theirs, _) = clusters[2].run(_dropout_run, 2, how)
    assert losses == losses1 and not [n for n in mine if not torch.equal(mine[n], theirs[n])]


def test_dropout_at_shard_two_by_tensor_two_keeps_each_tensor_group_alike(clusters):
    results = clusters[4].run(_dropout_run, 2)
    for a, b in ((0, 1), (2, 3)):  # the tensor groups
        differ = [n for n in results[a][1] if not torch.equal(results[a][1][n], results[b][1][n])]
        assert not differ, (a, b, differ)


def _first_step(make_model, plan, loss, batch, **options):
    """The first step at tensor 2 (each rank seeded on its own after the model is built):
    ``(error, whether the state is as before)``, or ``("accepted", None)``."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(make_model())[0], mesh, "FULL_SHARD", tensor_parallel=plan)
    torch.manual_seed(1000 + mesh.rank)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss, mesh, optimizer=opt, **options)
    before = {n: t.clone() for n, t in sharded.items()}
    try:
        step(sharded, state, batch)
    except ValueError as e:
        return str(e), all(torch.equal(before[n], sharded[n]) for n in before)
    return "accepted", None


def _dropout_in_a_program(how):
    """The first step of _DropoutGPT in a step that records or compiles."""
    return _first_step(_DropoutGPT, DROPOUT_PLAN, loss_fn, _drop_batches()[0], **{how: True})


@pytest.mark.parametrize("how", ["graph", "compile"])
def test_dropout_between_split_layers_in_a_program_is_refused(clusters, how):
    # A recorded or compiled forward holds plain tensors: its dropout would draw the rank's
    # block of the mask alone, the same on every tensor rank (before: trained on, silently).
    for message, unchanged in clusters[2].run(_dropout_in_a_program, how):
        assert "dropout of the output of the colwise layer 'blocks.0.mlp.0'" in message, message
        assert "move the dropout after the rowwise layer" in message and unchanged


def _llama_with_attention_dropout():
    from test_tp_auto import llama

    model = llama()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1  # as LlamaConfig(attention_dropout=0.1) sets it
    mesh = sf.Mesh.from_group(tensor=2)
    try:
        sf.shard(sf.functionalize(model)[0], mesh, "FULL_SHARD", tensor_parallel="auto")
    except ValueError as e:
        return str(e)
    return "accepted"


def test_attention_dropout_on_heads_split_over_the_tensor_axis_is_refused(clusters):
    # Before: accepted; each tensor rank drew one mask for its own heads, the same pattern on
    # every rank (one process draws one for all the heads).
    first, second = clusters[2].run(_llama_with_attention_dropout)
    assert first == second and "'model.layers.0.self_attn' drops attention weights (attention_dropout=0.1)" in first
    assert "attention_dropout to 0.0" in first, first


class _DropBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.ln, self.mlp = block.ln, block.mlp

    def forward(self, x):
        return x + F.dropout(self.mlp(self.ln(x)), 0.1, self.training)  # on activations split on the sequence


def _tiny_with_dropout():
    from test_tp_sequence import Tiny

    model = Tiny()
    model.layers = nn.ModuleList(_DropBlock(b) for b in model.layers)
    return model


def _sequence_dropout():
    from test_tp_sequence import TINY_PLAN, _tiny_loss, tiny_batches

    return _first_step(_tiny_with_dropout, TINY_PLAN, _tiny_loss, tiny_batches()[0])


def test_dropout_inside_a_sequence_region_is_refused(clusters):
    # Before: accepted; each tensor rank drew one mask for its part of the sequence, the same
    # pattern on every rank, unlike one process's mask for the whole sequence.
    for message, unchanged in clusters[2].run(_sequence_dropout):
        assert "a random op (dropout, noise) ran inside the sequence region between 'layers.0' and 'head'" in message
        assert unchanged, message


# -- host work per step: no read of the device, bounded headers, one bucket --------------------


def _steady_steps(on_nonfinite, steps=5):
    """Steps of the split GPT at tensor 2: per step, the reads of device values by the host
    (those of the verdict, host memory by design, left out), the header exchanges and the
    tensor axis's collectives."""
    from shardfn.testing._ops import count_ops

    mesh, sharded, state, step = split_step(on_nonfinite=on_nonfinite)
    out = []
    for batch in (batches() * 2)[:steps]:
        verdict = [sharded._verdict.values] if getattr(sharded._verdict, "values", None) is not None else []
        headers = mesh.guard.headers
        with count_ops() as ops, sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        out.append((len(ops.device_reads(host=verdict, world=mesh.size)), mesh.guard.headers - headers,
                    [(c.kind.value, c.nbytes) for c in log.select("batch")]))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_raise_next_step_with_a_tensor_axis_reads_nothing_of_the_device(clusters, world):
    # Before: every step copied the batch to the host for its digest (a read per leaf and
    # step, 2 here), and the digest had a header exchange of its own.
    for out in clusters[world].run(_steady_steps, "raise_next"):
        reads, headers, tensor = zip(*out)
        assert reads == (0,) * 5, reads
        # once pipelined (from the third step): the opening and the metrics header on each
        # mesh axis with more than one rank ([Note: the pipelined guard]): 2 at tensor 2, 4 at
        # shard 2 x tensor 2, whatever the number of layers
        assert headers[2:] == (world, world, world), headers
        # the batch's digests travel in one all-gather on the tensor axis: an int64 from each rank
        assert all(t == [("all_gather", 2 * 8)] for t in tensor), tensor


def test_a_checked_step_with_a_tensor_axis_reads_the_device_once(clusters):
    for out in clusters[2].run(_steady_steps, "raise"):
        reads, headers, _ = zip(*out)
        assert reads == (1,) * 5, reads  # the loss, norm and batch verdict, in one copy
        assert headers[2:] == (2, 2, 2), headers


def test_a_raise_next_step_on_other_batches_raises_at_the_next_call_on_every_rank(clusters):
    # The check reads nothing of the device: the digests ride on the step's collectives, and
    # the verdict tells the next call, before it changes anything.
    for rank, out in enumerate(clusters[2].run(_other_batches, 2, 3, on_nonfinite="raise_next")):
        assert out[:2] == ["ok", "ok"], out
        error, unchanged = out[2:]
        assert error.startswith(f"DivergenceError: [rank {rank}] step: in the last step on these shards, the ranks "
                                "of a tensor group got different batches"), error
        assert unchanged
