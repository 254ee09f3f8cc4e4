"""Sequence parallelism: a tiny transformers Llama with its norms run on each tensor rank's
part of the sequence, equal to one process; its all-gathers and reduce-scatters counted; a
region that would read a part of the sequence silently refused ([Note: the sequence region])."""

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
import test_tp_auto as auto
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import split_batch

L = "model.layers.*."
PLAN = {"model.layers.0": "sequence_start", L + "input_layernorm": "sequence",
        L + "self_attn.q_proj": "colwise", L + "self_attn.k_proj": "colwise", L + "self_attn.v_proj": "colwise",
        L + "self_attn.o_proj": "rowwise", L + "post_attention_layernorm": "sequence",
        L + "mlp.gate_proj": "colwise", L + "mlp.up_proj": "colwise", L + "mlp.down_proj": "rowwise",
        "model.norm": "sequence", "lm_head": "sequence_end"}


def torch_plan():
    """PLAN in torch's ParallelStyle objects, as torchtitan writes it (PrepareModuleInput on
    the attention and the MLP included)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    gather = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    plan = {"model.layers.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
            "model.norm": SequenceParallel(), "lm_head": gather, L + "self_attn": gather, L + "mlp": gather}
    for pattern, style in PLAN.items():
        if style == "sequence":
            plan[pattern] = SequenceParallel()
        elif style == "colwise":
            plan[pattern] = ColwiseParallel()
        elif style == "rowwise":
            plan[pattern] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def loss_fn(apply, params, batch):
    # use_cache=False: a transformers model in training otherwise fills a cache that a
    # remat unit's recompute finds full (its keys twice as long)
    logits = apply(params, batch["x"], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def _train(strategy, tensor, micro=1, objects=False, replicate=None):
    return auto._train(strategy, tensor, micro, torch_plan() if objects else PLAN, loss_fn, replicate)


def _expected(data_size, micro=1):
    """Per step: each layer's attention and MLP gather their input (forward) and
    reduce-scatter its gradient (backward); o_proj and down_proj reduce-scatter their output
    and all-gather its gradient; the head gathers the sequence; the first layer's split
    input all-gathers its gradient. Each of the rank's rows x sequence x hidden fp32
    activations. And once a step (not per micro-batch) one all-reduce of the norms' weight
    gradients (their shards: see _check)."""
    whole = auto.ROWS // data_size // micro * auto.SEQ * auto.HIDDEN * 4
    out = []
    for i in range(auto.LAYERS):
        p = f"model.layers.{i}."
        for block, layer in (("self_attn", "o_proj"), ("mlp", "down_proj")):
            out += [(p + block, "all_gather", whole), (p + block, "reduce_scatter", whole),
                    (f"{p}{block}.{layer}", "reduce_scatter", whole), (f"{p}{block}.{layer}", "all_gather", whole)]
    out += [("lm_head", "all_gather", whole), ("model.layers.0", "all_gather", whole)]
    return sorted(out * micro + [("sequence", "all_reduce")])


def _check(results, data_size, micro=1, recomputed=()):
    ref_losses, ref_state, ref_norm = auto._reference()
    expect = sorted(_expected(data_size, micro) + list(recomputed))
    for losses, norms, logs, full, styles in results:
        assert styles["model.layers.1.post_attention_layernorm"] == "sequence", styles
        assert all(abs(a - b) <= auto.ATOL + auto.RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        assert abs(norms[0] - ref_norm) <= auto.ATOL + auto.RTOL * ref_norm, (norms[0], ref_norm)
        assert set(full) == {n for n, _ in auto.llama().named_parameters()}  # (the rotary buffers are not gathered)
        for name in full:
            ref = ref_state[name]
            diff = (full[name] - ref).abs() - auto.RTOL * ref.abs()
            assert float(diff.max()) <= auto.ATOL, (name, float(diff.max()))
        for log in logs:
            # the norms' gradients: one all-reduce a step of their shards, each leaf's slot as
            # long as its longest shard: the 5 whole weights at shard 1, at least half at shard 2
            norms = [b for u, k, b in log if u == "sequence"]
            assert len(norms) == 1 and 5 * auto.HIDDEN * 4 // data_size <= norms[0] <= 5 * auto.HIDDEN * 4, norms
            log = [c[:2] if c[0] == "sequence" else c for c in log]
            assert sorted(log) == expect, (sorted((Counter(log) - Counter(expect)).elements()),
                                           sorted((Counter(expect) - Counter(log)).elements()))


def test_sequence_parallel_llama_tensor_two_equals_one_process(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2), 1)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIMIZER"])
def test_sequence_parallel_llama_shard_two_by_tensor_two_equals_one_process(clusters, strategy):
    _check(clusters[4].run(_train, strategy, 2), 2)


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])
def test_sequence_parallel_llama_replicate_two_by_tensor_two_equals_one_process(clusters, strategy):
    _check(clusters[4].run(_train, strategy, 2, replicate=2), 2)


def test_sequence_parallel_with_micro_batches_and_torch_styles(clusters):
    _check(clusters[2].run(_train, "FULL_SHARD", 2, 2, True), 1, 2)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_sequence_parallel_under_remat_equals_one_process(clusters, mode):
    # A layer's recompute runs in backward, inside the region its forward checked, and makes
    # the collectives before its last saved tensor again: the attention's and the MLP's
    # gathers and o_proj's reduce-scatter (selective remat saves matmuls, not collectives);
    # torch's checkpoint stops at down_proj's input, so down_proj's reduce-scatter is not.
    plan = sf.Plan("FULL_SHARD", units=[f"model.layers.{i}" for i in range(auto.LAYERS)], remat=sf.Remat(mode=mode))
    whole = auto.ROWS * auto.SEQ * auto.HIDDEN * 4
    again = [(f"model.layers.{i}.{m}", kind, whole) for i in range(auto.LAYERS)
             for m, kind in (("self_attn", "all_gather"), ("self_attn.o_proj", "reduce_scatter"), ("mlp", "all_gather"))]
    _check(clusters[2].run(_train, plan, 2), 1, recomputed=again)


class _MLP(nn.Module):
    def __init__(self, d, leak=False):
        super().__init__()
        self.up, self.down, self.leak = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), leak

    def forward(self, x):
        y = self.down(F.gelu(self.up(x)))
        return y + x if self.leak else y  # (leak: reads the gathered input besides its colwise layer)


class _Block(nn.Module):
    def __init__(self, d, leak):
        super().__init__()
        self.ln, self.mlp = nn.LayerNorm(d), _MLP(d, leak)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class Tiny(nn.Module):
    """A model with biases everywhere (the rowwise bias and LayerNorm's bias, whose
    gradients sequence parallelism all-reduces), two blocks."""

    def __init__(self, leak=False, d=8, vocab=16, tied=False):
        super().__init__()
        self.tied = tied
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([_Block(d, leak) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return F.linear(x, self.emb.weight) if self.tied else self.head(x)  # (tied: no module reads the output)


TINY_PLAN = {"layers.0": "sequence_start", "layers.*.ln": "sequence", "layers.*.mlp.up": "colwise",
             "layers.*.mlp.down": "rowwise", "norm": "sequence", "head": "sequence_end"}


def tiny_batches(seq=8):
    g = torch.Generator().manual_seed(4)
    return [{"x": torch.randint(0, 16, (4, seq), generator=g), "y": torch.randint(0, 16, (4, seq), generator=g)}
            for _ in range(3)]


def _tiny(tensor, plan, leak=False, seq=8, tied=False, graph=False, compile=False):
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(0)
    params, _ = sf.functionalize(Tiny(leak, tied=tied))
    opt = SGD_MOMENTUM()
    try:
        units = sf.Plan("FULL_SHARD", units=["layers.0", "layers.1"])  # (compile=True compiles each unit)
        sharded = sf.shard(params, mesh, units, tensor_parallel=plan)
        state = opt.init(sharded)
        step = sf.jit_step(_tiny_loss, mesh, optimizer=opt, graph=graph, compile=compile)
        losses, logs = [], []
        for batch in tiny_batches(seq):
            with sf.record_collectives() as log:
                sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
            losses.append(float(metrics["loss"]))
            logs.append(sorted((c.unit, c.kind.value) for c in log.select("tensor")))
    except ValueError as e:
        return str(e).split("\n")[0]
    return losses, sf.gather(sharded), logs


def _tiny_loss(apply, params, batch):
    return F.cross_entropy(apply(params, batch["x"]).flatten(0, 1), batch["y"].flatten())


@pytest.mark.parametrize("how", ["eager", "graph", "compile"])
def test_sequence_parallel_with_biases_equals_one_process(clusters, how):
    # graph=True (CPU): the region's collectives are recorded ops, counted at each replay
    # (the third call) as the eager step counts them; compile=True compiles each layer after
    # its first call, which runs eagerly with the region's checks
    import test_tensor_parallel

    ref_losses, ref_state, _ = test_tensor_parallel._reference(Tiny, _tiny_loss, tiny_batches)
    for losses, full, logs in clusters[2].run(_tiny, 2, TINY_PLAN, graph=how == "graph", compile=how == "compile"):
        # per block: its MLP's gather and reduce-scatter, down's reduce-scatter and all-gather;
        # the start's all-gather, the end's gather; and once a step the gradients of the norms'
        # weights and biases and of down's biases, all-reduced in one bucket (before: one each, 8)
        block = [("mlp", "all_gather"), ("mlp", "reduce_scatter"), ("mlp.down", "reduce_scatter"),
                 ("mlp.down", "all_gather")]
        expect = sorted([(f"layers.{i}.{m}", k) for i in range(2) for m, k in block]
                        + [("layers.0", "all_gather"), ("head", "all_gather"), ("sequence", "all_reduce")])
        assert all(log == expect for log in logs), logs
        assert all(abs(a - b) <= auto.ATOL + auto.RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for name, ref in ref_state.items():
            diff = (full[name] - ref).abs() - auto.RTOL * ref.abs()
            assert float(diff.max()) <= auto.ATOL, (name, float(diff.max()))


def test_a_region_that_would_read_a_part_silently_is_refused_on_every_rank(clusters):
    cases = {
        "no end": {k: v for k, v in TINY_PLAN.items() if k != "head"},  # the head, not in the plan, reads a part
        "tied output": {k: v for k, v in TINY_PLAN.items() if k != "head"},  # no module reads it: the call's end
        "no start": {k: v for k, v in TINY_PLAN.items() if k != "layers.0"},
        "a layer outside the plan": {k: v for k, v in TINY_PLAN.items() if "mlp" not in k},
        "odd sequence": TINY_PLAN,
        "leak": TINY_PLAN,
        "leak (graph)": TINY_PLAN,  # a graph step's first call, eager, checks for its program
        "leak (compile)": TINY_PLAN,  # so does each compiled unit's first call
        "a split head inside": {**TINY_PLAN, "head": "colwise_gather_output"},
    }
    got = {}
    for name, plan in cases.items():
        first, second = clusters[2].run(_tiny, 2, plan, name.startswith("leak"), 7 if name == "odd sequence" else 8,
                                        name == "tied output", name == "leak (graph)", name == "leak (compile)")
        assert first == second and isinstance(first, str), (name, first, second)  # every rank, the same error
        got[name] = first
    assert "'head' (Linear, with parameters, not in the plan) ran inside the sequence region opened by 'layers.0'" in \
        got["no end"], got
    assert "region opened by 'layers.0' was not closed" in got["tied output"], got
    assert "'layers.0.ln' ('sequence') ran outside the sequence region" in got["no start"], got
    assert "'layers.0.mlp.up' (Linear, with parameters, not in the plan) ran inside" in got["a layer outside the plan"]
    assert "the input of 'layers.0' (shape [4, 7, 8])" in got["odd sequence"], got
    assert "reads the input of 'layers.0.mlp'" in got["leak"] and "add" in got["leak"], got
    assert "reads the input of 'layers.0.mlp'" in got["leak (graph)"], got
    assert "reads the input of 'layers.0.mlp'" in got["leak (compile)"], got
    assert "'head' ('colwise_gather_output') ran inside the sequence region" in got["a split head inside"], got


def _plans_refused():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    mesh = sf.Mesh.from_group(tensor=2)
    out = []
    for plan in ({**TINY_PLAN, "layers.*.mlp.down": RowwiseParallel()},  # all-reduce in a sequence plan
                 {"layers.*.mlp.up": "colwise", "layers.*.mlp.down": RowwiseParallel(output_layouts=Shard(1))},
                 {**TINY_PLAN, "layers.*.mlp.up": SequenceParallel(sequence_dim=0)},
                 {**TINY_PLAN, "layers.*.mlp": "sequence_end"}):
        try:
            sf.shard(sf.functionalize(Tiny())[0], mesh, "FULL_SHARD", tensor_parallel=plan)
            out.append("accepted")
        except ValueError as e:
            out.append(str(e))
    return out


def test_plans_that_disagree_with_themselves_are_refused(clusters):
    first, second = clusters[2].run(_plans_refused)
    assert first == second
    rowwise, no_region, unknown, end = first
    assert "'layers.*.mlp.down'" in rowwise and "has sequence styles" in rowwise, rowwise
    assert "need sequence parallelism" in no_region and "has no sequence styles" in no_region, no_region
    assert "SequenceParallel" in unknown and "no style for" in unknown, unknown
    assert "'layers.0.mlp' holds colwise layers and is styled 'sequence_end'" in end, end


def _generate():
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    model = auto.llama().eval()
    prompt = torch.randint(0, auto.VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))  # 5: odd on purpose
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        want = model.generate(prompt, **kw)
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=PLAN)
    with sf.bind(apply, sharded) as bound, torch.no_grad():
        got = bound.generate(prompt, **kw)
    return want, got


def test_generate_runs_a_sequence_parallel_plan_whole(clusters):
    # A bound block runs the region whole (the same sums; a token at a time has no sequence to split)
    for want, got in clusters[2].run(_generate):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(want)), (got, want)


# -- memory and checkpoints ---------------------------------------------------------------------

MLP_ONLY = {k: v for k, v in TINY_PLAN.items() if "mlp" in k}  # the same layers split, no region
D, SEQ, ROWS = 16, 8, 4


class _NormBytes:
    """The bytes of each norm's output (the region's per-token activations)."""

    def __init__(self, model):
        self.out = []
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_hook(lambda _m, _a, out: self.out.append(out.numel() * out.element_size()))


def _forward_held(plan):
    """A real forward of the whole batch at tensor 2: the norms' output bytes and the live
    bytes it leaves for backward."""
    import gc

    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    model = Tiny(d=D)
    seen = _NormBytes(model)
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=plan)
    b = tiny_batches(SEQ)[0]
    with sf.track_live_bytes() as mem:
        loss = _tiny_loss(apply, sharded, b)
        gc.collect()
        held = mem.current
    loss.backward()
    return seen.out, held


def test_the_regions_activations_are_split_by_the_tensor_size(clusters):
    """At tensor 2, the same rows, the same layers split: with the region, each norm's output
    is half of what it is without, in a real forward and in explain's fake step; the forward
    leaves less for backward, and explain's peak is lower."""
    whole = ROWS * SEQ * D * 4
    sp, tp = (clusters[2].run(_forward_held, plan)[0] for plan in (TINY_PLAN, MLP_ONLY))
    assert sp[0] == [whole // 2] * 3 and tp[0] == [whole] * 3, (sp[0], tp[0])  # 2 blocks' ln, the final norm
    assert sp[1] < tp[1], (sp[1], tp[1])
    with torch.device("meta"):
        model = Tiny(d=D)
    seen = _NormBytes(model)
    peaks = {}
    for name, plan in (("sp", TINY_PLAN), ("tp", MLP_ONLY)):
        seen.out.clear()
        e = sf.explain(model, 2, "FULL_SHARD", tiny_batches(SEQ)[0], loss_fn=_tiny_loss, tensor=2,
                       tensor_parallel=plan, verbose=False)
        peaks[name] = (e.persistent_bytes, e.peak_bytes)
        assert seen.out[-3:] == [whole // (2 if name == "sp" else 1)] * 3, (name, seen.out)
    assert peaks["sp"][0] == peaks["tp"][0] and peaks["sp"][1] < peaks["tp"][1], peaks


def _save_and_load(path, save_plan, load_plan):
    """One step under ``save_plan``, saved; loaded into a tree under ``load_plan`` (the same
    storage: sequence styles change the collectives, not what a rank holds)."""
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    opt = SGD_MOMENTUM()
    sharded = sf.shard(sf.functionalize(Tiny())[0], mesh, "FULL_SHARD", tensor_parallel=save_plan)
    state = opt.init(sharded)
    sharded, state, _ = sf.jit_step(_tiny_loss, mesh, optimizer=opt)(sharded, state, tiny_batches()[0])
    sf.checkpoint.save(path, sharded, state)
    torch.manual_seed(1)
    other = sf.shard(sf.functionalize(Tiny())[0], mesh, "FULL_SHARD", tensor_parallel=load_plan)
    other, other_state, _ = sf.checkpoint.load(path, other, opt.init(other))
    return sf.gather(sharded), sf.gather(other)


def test_checkpoints_move_between_plans_with_and_without_the_region(clusters, tmp_path):
    for i, (save_plan, load_plan) in enumerate(((TINY_PLAN, MLP_ONLY), (MLP_ONLY, TINY_PLAN))):
        for saved, loaded in clusters[2].run(_save_and_load, str(tmp_path / str(i)), save_plan, load_plan):
            assert saved.keys() == loaded.keys()
            assert all(torch.equal(saved[n], loaded[n]) for n in saved)


# -- bf16 -----------------------------------------------------------------------------------------

def test_bf16_sequence_parallel_matches_a_reference_with_the_same_casts(clusters):
    # tests/test_precision.py's bound, 8 eps of bf16 times the sum of the largest updates:
    # the region adds roundings of the kind it derives, each a partial sum rounded to bf16
    # and added in bf16 (a rowwise output's reduce-scatter); a norm's gradient from each
    # tensor rank's tokens is summed in fp32 (the reduce dtype, after the data axes'
    # reduction); its gathers only move values.
    from test_precision import BF16, EPS, reference
    from test_tp_strategies import _bf16_run

    ref_losses, ref_delta, moved = reference(BF16, Tiny, tiny_batches)
    bound = 8 * EPS[torch.bfloat16]
    for losses, delta, _, dtypes in clusters[2].run(_bf16_run, BF16, Tiny, TINY_PLAN, tiny_batches):
        assert dtypes == {"torch.bfloat16", "sequence torch.float32"}, dtypes
        assert losses == pytest.approx(ref_losses, rel=bound)
        worst = max((delta[n] - d).abs().max().item() for n, d in ref_delta.items())
        assert worst <= bound * moved, (worst, bound * moved)


def test_check_equivalence_with_a_sequence_parallel_plan(clusters):
    from shardfn.testing import check_equivalence

    report = check_equivalence(Tiny, _tiny_loss, tiny_batches(), optimizer=SGD_MOMENTUM, strategies=("FULL_SHARD",),
                               world_sizes=({"tensor": 2},), clusters=clusters, tensor_parallel=TINY_PLAN,
                               rtol=auto.RTOL, atol=auto.ATOL)
    assert report.failures() == [] and set(report.leaves) == {("FULL_SHARD", "(tensor=2)")}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_block_that_is_a_remat_unit_keeps_its_gathered_input(clusters, mode):
    # Each MLP its own unit, recomputed in backward: the block gathers its input before the
    # checkpoint, which saves it as its input, so the recompute gathers nothing again; the
    # losses and parameters equal one process's.
    plan = sf.Plan("FULL_SHARD", units=[f"model.layers.{i}.mlp" for i in range(auto.LAYERS)], remat=sf.Remat(mode=mode))
    ref_losses, ref_state, _ = auto._reference()
    for losses, _, logs, full, _ in clusters[2].run(_train, plan, 2):
        for log in logs:
            assert sorted(u for u, kind, _ in log if kind == "all_gather" and u.endswith(".mlp")) == \
                [f"model.layers.{i}.mlp" for i in range(auto.LAYERS)], log
        assert all(abs(a - b) <= auto.ATOL + auto.RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        for name in full:
            diff = (full[name] - ref_state[name]).abs() - auto.RTOL * ref_state[name].abs()
            assert float(diff.max()) <= auto.ATOL, (name, float(diff.max()))


QWEN3_PLAN = {**PLAN, L + "self_attn.q_norm": "replicated_with_grad_allreduce",
              L + "self_attn.k_norm": "replicated_with_grad_allreduce"}


def _qwen3_train():
    import test_tp_styles

    return auto._train("FULL_SHARD", 2, 1, QWEN3_PLAN, loss_fn, make=test_tp_styles.qwen3)


def _qwen3_experts():
    import test_tp_styles

    mesh = sf.Mesh.from_group(tensor=2)
    plan = {**QWEN3_PLAN, L + "mlp.experts": "moe_tp_experts", L + "mlp.experts.gate_up_proj": "packed_colwise",
            L + "mlp.experts.down_proj": "rowwise"}
    plan = {k: v for k, v in plan.items() if not k.endswith(("gate_proj", "up_proj", "down_proj"))}
    try:
        sf.shard(sf.functionalize(test_tp_styles.qwen3_moe())[0], mesh, "FULL_SHARD", tensor_parallel=plan)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_per_head_norms_in_a_sequence_parallel_plan_equal_one_process(clusters):
    # Qwen3's q_norm and k_norm (split heads, "replicated_with_grad_allreduce") beside the
    # region's norms (a part of the sequence, "sequence"): both kinds of partial gradient are
    # summed over the tensor ranks once a step, in one all-reduce (named by the region)
    import test_tensor_parallel
    import test_tp_styles

    reference = test_tensor_parallel._reference(test_tp_styles.qwen3, loss_fn, auto.batches)
    for losses, norms, logs, full, styles in clusters[2].run(_qwen3_train):
        assert styles["model.layers.1.self_attn.q_norm"] == "replicated_with_grad_allreduce", styles
        assert styles["model.layers.1.input_layernorm"] == "sequence", styles
        auto.assert_trained_alike(losses, norms, full, reference, test_tp_styles.qwen3)
        for log in logs:
            sums = sorted(u for u, k, _ in log if u in ("sequence", "replicated_with_grad_allreduce"))
            assert sums == ["sequence"], sums


def test_experts_in_a_sequence_parallel_plan_are_refused_on_every_rank(clusters):
    first, second = clusters[2].run(_qwen3_experts)
    assert first == second
    assert "'model.layers.0.mlp.experts' is styled 'moe_tp_experts' in a plan with sequence parallelism" in first, first
