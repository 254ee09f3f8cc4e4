"""The step's runtime: apply called any number of times, one reduction per unit, explicit state."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
from bounds import ADAMW  # its tolerance: tests/bounds.py
from shardfn.optim import sgd
from shardfn.testing import check_equivalence, split_batch
from shardfn.testing.models import GPT, lm_loss
from test_equivalence import GPT_CFG, STRATEGIES, gpt_batches, gpt_model, mlp_batches, mlp_model
from test_precision import FP16


def two_views_mlp(apply, params, batch):
    """A consistency loss: the model on the batch and on a scaled copy (per row, so slices agree)."""
    return F.mse_loss(apply(params, batch["x"]), batch["y"]) + F.mse_loss(apply(params, batch["x"] * 0.5), batch["y"])


def two_views_gpt(apply, params, batch):
    return lm_loss(apply(params, batch["x"]), batch["y"]) + 0.5 * lm_loss(apply(params, batch["x"].roll(1, 1)), batch["y"])


@pytest.mark.parametrize("world", [2, 3])
def test_apply_twice_in_one_loss_fn_equals_single_process(clusters, world):
    # Overlapped reductions and prefetch are on (the defaults): each unit reduces once,
    # after the backward of its last use, whatever the number of uses.
    for model_fn, loss_fn, batches in [(mlp_model, two_views_mlp, mlp_batches), (gpt_model, two_views_gpt, gpt_batches)]:
        report = check_equivalence(model_fn, loss_fn, batches(), optimizer=ADAMW, strategies=STRATEGIES,
                                   world_sizes=[world], clusters=clusters)
        assert report.failures() == []


@pytest.mark.parametrize("options", [{"micro_batches": 3, "accumulate": "local"},
                                     {"micro_batches": 3, "accumulate": sf.Accumulate.REDUCE_EACH}], ids=["local", "each"])
def test_apply_twice_with_accumulation_and_hybrid(clusters, options):
    for strategies, world in [(["FULL_SHARD", "NO_SHARD"], 2), (["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"], (2, 2))]:
        report = check_equivalence(gpt_model, two_views_gpt, gpt_batches(), optimizer=ADAMW, strategies=strategies,
                                   world_sizes=[world], clusters=clusters, step_options=options)
        assert report.failures() == []


@pytest.mark.parametrize("mode", list(sf.RematMode))
def test_apply_twice_with_remat(clusters, mode):
    # The recompute's GatherUnit node never runs backward: it is not counted as a use.
    plans = [sf.Plan(s, remat=sf.Remat(mode=mode)) for s in ("FULL_SHARD", "SHARD_GRAD_OP")]
    report = check_equivalence(gpt_model, two_views_gpt, gpt_batches(), optimizer=ADAMW, strategies=plans,
                               world_sizes=[2], clusters=clusters)
    assert report.failures() == []


def counts_with_two_applies(strategy):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(GPT_CFG))
    sharded = sf.shard(params, mesh, strategy, **({} if strategy == "NO_SHARD" else {"bucket_bytes": 0}))
    opt = sgd(0.1)
    state = opt.init(sharded)
    step = sf.jit_step(two_views_gpt, mesh, optimizer=opt)
    batch = split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)
    sharded, state, _ = step(sharded, state, batch)
    with sf.record_collectives() as log:
        step(sharded, state, batch)
    per_unit = {}
    for c in log.calls:
        per_unit.setdefault((c.kind.value, c.purpose.value, c.unit), 0)
        per_unit[(c.kind.value, c.purpose.value, c.unit)] += 1
    return per_unit, [u.name for u in sharded.layout.units], [sharded.layout.bucket_name(b) for b in sharded.layout.buckets]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_applies_reduce_each_unit_once(clusters, strategy):
    per_unit, units, buckets = clusters[2].run(counts_with_two_applies, strategy)[0]
    blocks = [u for u in units if u != "<root>"]
    kind = "all_reduce" if strategy == "NO_SHARD" else "reduce_scatter"
    assert sorted(key[2] for key in per_unit if key[:2] == (kind, "reduce")) == sorted(buckets)
    for bucket in buckets:  # a unit alone under the sharded strategies; NO_SHARD's units together ([Note: buckets])
        assert per_unit[(kind, "reduce", bucket)] == 1, bucket
    assert (strategy == "NO_SHARD") == (buckets == ["<root>..blocks.1"])
    if strategy == "FULL_SHARD":  # each call gathers each block for forward and again for backward
        assert all(per_unit[("all_gather", "gather", b)] == 2 and per_unit[("all_gather", "regather", b)] == 2
                   for b in blocks)
        assert per_unit[("all_gather", "gather", "<root>")] == 2  # the root: once per call
    if strategy == "SHARD_GRAD_OP":  # kept from the first call's forward to the last backward
        assert all(per_unit[("all_gather", "gather", b)] == 1 for b in blocks)
        assert not any(key[1] == "regather" for key in per_unit)


class TwoHeads(nn.Module):
    """The head ``aux`` runs in forward but its output never reaches the loss."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(12, 12), nn.Linear(12, 12)])
        self.aux = nn.Linear(12, 3)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        for b in self.blocks:
            x = F.gelu(b(x))
        return self.head(x), self.aux(x)


def unused_output():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(TwoHeads())
    sharded = sf.shard(params, mesh, "FULL_SHARD", units=sf.by_prefix("blocks.0", "blocks.1", "aux"), bucket_bytes=0)
    before = sf.gather(sharded)
    opt = sgd(0.1)
    step = sf.jit_step(lambda apply, p, b: F.mse_loss(apply(p, b["x"])[0], b["y"]), mesh, optimizer=opt)
    batch = split_batch(mlp_batches(12, 5, steps=1)[0], mesh.rank, mesh.size)
    with sf.record_collectives() as log:
        sharded, _, _ = step(sharded, opt.init(sharded), batch)
    after = sf.gather(sharded)
    return {
        "aux_unchanged": torch.equal(after["aux.weight"], before["aux.weight"]),
        "head_changed": not torch.equal(after["head.weight"], before["head.weight"]),
        "reductions": sorted(c.unit for c in log.select(purpose="reduce")),
    }


def test_a_unit_whose_output_is_unused_reduces_zeros_on_every_rank(clusters):
    # Its GatherUnit node never runs backward; the step still reduces it (zero gradients)
    # so every rank issues the same reductions, and SGD leaves it unchanged.
    for r in clusters[2].run(unused_output):
        assert r == {"aux_unchanged": True, "head_changed": True, "reductions": ["<root>", "aux", "blocks.0", "blocks.1"]}


class SkipsAux(TwoHeads):
    """``aux`` is never called: its unit builds no graph node and reduces nothing."""

    def forward(self, x):
        for b in self.blocks:
            x = F.gelu(b(x))
        return self.head(x), x


def skipped_unit_in_a_bucket(bucket_bytes, micro_batches):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(SkipsAux())
    sharded = sf.shard(params, mesh, "NO_SHARD", units=sf.by_prefix("blocks.0", "blocks.1", "aux"),
                       bucket_bytes=bucket_bytes)
    opt = sgd(0.1, momentum=0.9)
    step = sf.jit_step(lambda apply, p, b: F.mse_loss(apply(p, b["x"])[0], b["y"]), mesh, optimizer=opt,
                       micro_batches=micro_batches, accumulate="local" if micro_batches > 1 else "reduce_each")
    state = opt.init(sharded)
    with sf.record_collectives() as log:
        for b in mlp_batches(12, 5, steps=2):
            sharded, state, _ = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    return sf.gather(sharded), sorted({c.unit for c in log.select(purpose="reduce")})


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_a_bucket_whose_unit_never_ran_reduces_the_others_exactly(clusters, micro_batches):
    """[Note: buckets]: a bucket one of whose units never ran still reduces the others, once,
    after the backward, to the same values as without buckets; the skipped unit stays as it was."""
    alone, alone_units = clusters[2].run(skipped_unit_in_a_bucket, 0, micro_batches)[0]
    bucketed, units = clusters[2].run(skipped_unit_in_a_bucket, None, micro_batches)[0]
    assert alone_units == ["<root>", "blocks.0", "blocks.1"] and units == ["<root>..aux"]
    assert alone.keys() == bucketed.keys() and all(torch.equal(alone[n], bucketed[n]) for n in alone)


# -- the testing kit compares every rank's shard, padding included ---------------------------------


class _DriftOnRank1:
    """SGD, plus a small push on rank 1's copy only in the last of 3 steps: NO_SHARD replicas
    drift apart while rank 0's copy (what gather returns) stays right."""

    def init(self, params):
        return 0

    def update(self, grads, state, params):
        last_on_rank1 = state == 2 and dist.is_initialized() and dist.get_rank() == 1  # the reference runs in no group
        return {k: -0.1 * g + (1e-3 if last_on_rank1 else 0.0) for k, g in grads.items()}, state + 1


class _DirtyPadding:
    """SGD that also writes into the padding rows of every shard."""

    def init(self, params):
        return ()

    def update(self, grads, state, params):
        return {k: -0.1 * g + 1.0 for k, g in grads.items()}, state


def test_the_kit_sees_a_rank_whose_shard_differs(clusters):
    report = check_equivalence(mlp_model, _mse, mlp_batches(),
                               optimizer=_DriftOnRank1, strategies=["NO_SHARD"], world_sizes=[2], clusters=clusters,
                               raise_on_failure=False)
    failures = report.failures()
    assert failures and all("rank 1's shard of" in f for f in failures)  # rank 0's gathered copy is right


def test_the_kit_sees_dirty_padding_rows(clusters):
    # (12, 10, 7, 5) at world 3: 10, 7 and 5 rows are padded to 12, 9 and 6. (A flat shard has no
    # padding an optimizer could write: its unit's padding lies outside every leaf.)
    report = check_equivalence(mlp_model, _mse, mlp_batches(), optimizer=_DirtyPadding,
                               strategies=[sf.Plan("FULL_SHARD", placement="rows")],
                               world_sizes=[3], clusters=clusters, raise_on_failure=False)
    assert any("padding rows are not zero" in f for f in report.failures())


def _mse(apply, params, batch):
    return F.mse_loss(apply(params, batch["x"]), batch["y"])


# -- state the step returns: the fp16 loss scale -----------------------------------------------------


def fp16_resume(path, k):
    mesh = sf.Mesh.from_group()

    def build(seed):
        torch.manual_seed(seed)
        params, apply = sf.functionalize(gpt_model())
        sharded = sf.shard(params, mesh, "FULL_SHARD", precision=FP16)
        step = sf.jit_step(lambda apply, p, b: lm_loss(apply(p, b["x"]), b["y"]), mesh, optimizer=sgd(0.05),
                           loss_scale=sf.DynamicLossScale(init_scale=2.0**24, growth_interval=2))
        return sharded, step.init(sharded), step

    batches = [split_batch(b, mesh.rank, mesh.size) for b in gpt_batches(2 * k)]
    sharded, state, step = build(0)
    scales = []
    for b in batches[:k]:
        sharded, state, m = step(sharded, state, b)
        scales.append(m["loss_scale"])
    sf.checkpoint.save(path, sharded, state)
    resumed, rstate, rstep = build(3)
    resumed, rstate, _ = sf.checkpoint.load(path, resumed, rstate)
    straight, resumed_scales = [], []
    for b in batches[k:]:
        sharded, state, m = step(sharded, state, b)
        straight.append(m["loss_scale"])
        resumed, rstate, m = rstep(resumed, rstate, b)
        resumed_scales.append(m["loss_scale"])
    return scales, straight, resumed_scales, sf.gather(sharded), sf.gather(resumed)


def test_the_loss_scale_is_state_a_checkpoint_resumes(clusters, tmp_path):
    for scales, straight, resumed, a, b in clusters[2].run(fp16_resume, str(tmp_path / "fp16"), 3):
        assert scales[0] == 2.0**24 and len(set(scales + straight)) > 1  # the scale moved
        assert resumed == straight  # not back to init_scale
        assert all(torch.equal(a[n], b[n]) for n in a)


def plain_state_to_a_loss_scaled_step():
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(mlp_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = sgd(0.1)
    step = sf.jit_step(_mse, mesh, optimizer=opt, loss_scale=sf.DynamicLossScale())
    try:
        step(sharded, opt.init(sharded), mlp_batches(steps=1)[0])
    except TypeError as e:
        return str(e)
    return "no error"


def test_a_loss_scaled_step_needs_its_state(clusters):
    msg = clusters[1].run(plain_state_to_a_loss_scaled_step)[0]
    assert "LossScaleState, got AdamWState" in msg or "LossScaleState, got SgdState" in msg
    assert "opt_state = step.init(sharded)" in msg


# -- small contracts ----------------------------------------------------------------------------------


def test_internal_invariants_name_the_rank():
    from shardfn._group.context import invariant

    with pytest.raises(AssertionError, match=r"^\[rank 0\] shardfn internal error: two reductions in flight"):
        invariant(False, "two reductions in flight")


def test_selective_remat_refuses_unknown_ops():
    with pytest.raises(ValueError, match=r"\['not_an_op'\] are not ops of torch.ops.aten"):
        sf.Remat(mode="selective", save=("mm", "not_an_op"))
    assert sf.Remat(mode="selective").mode is sf.RematMode.SELECTIVE
    assert "_scaled_dot_product_efficient_attention" in sf.Remat().save  # CUDA's attention too


def test_accumulate_is_an_enum_that_also_takes_its_names():
    assert sf.Accumulate.parse("local") is sf.Accumulate.LOCAL is sf.Accumulate.parse("LOCAL")
    assert sf.Accumulate.parse(sf.Accumulate.REDUCE_EACH) is sf.Accumulate.REDUCE_EACH
    with pytest.raises(ValueError, match=r"'sometimes' is not one of 'reduce_each', 'local' \(or Accumulate.<NAME>\)"):
        sf.Accumulate.parse("sometimes")
