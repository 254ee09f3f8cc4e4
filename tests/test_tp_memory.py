"""Tensor parallelism and memory (issue 50): what shard 2 x tensor 2 holds per rank, as
explain predicts it and as a real world-4 run holds it, and the split layers' activations."""

import gc
import importlib
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardfn as sf
from shardfn.testing._equivalence import split_batch
from shardfn.testing.models import GPT, GPTConfig

PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
CFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)
HIDDEN = 4 * CFG.d_model
ROWS = 4  # the global batch
UNITS = sf.Plan("FULL_SHARD", units=sf.by_module_type(nn.Linear))  # each layer its own unit


def loss_fn(apply, params, batch):
    logits = apply(params, batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def batch(rows=ROWS):
    g = torch.Generator().manual_seed(1)
    return {k: torch.randint(0, CFG.vocab_size, (rows, CFG.seq_len), generator=g) for k in ("x", "y")}


def predict(world, tensor=None, rows=ROWS // 2, plan=UNITS):
    with torch.device("meta"):
        model = GPT(CFG)
    return sf.explain(model, world, plan, batch(rows), loss_fn=loss_fn, tensor=tensor,
                      tensor_parallel=PLAN if tensor else None, verbose=False)


def _storage_bytes(*trees):
    """Bytes of the distinct storages of the tensors in ``trees`` (a ShardedParams, an optimizer state)."""
    seen = {}
    for tree in trees:
        tensors = list(tree.kept_tensors()) + list(tree.values()) if isinstance(tree, sf.ShardedParams) \
            else [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        for t in tensors:
            s = t.untyped_storage()
            seen[id(s)] = s.nbytes()
    return sum(seen.values())


def _held(tensor, plan=UNITS, replicate=None):
    """A real run's persistent bytes on this rank (its shards, buffers and AdamW state), before
    and after a step."""
    mesh = sf.Mesh.from_group(tensor=tensor, replicate=replicate)
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, plan, tensor_parallel=PLAN if tensor else None)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    before = _storage_bytes(sharded, state)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    local = split_batch(batch(), mesh.data_rank, mesh.data_size)
    sharded, state, _ = step(sharded, state, local)
    return before, _storage_bytes(sharded, state)


@pytest.mark.parametrize("strategy, mesh, shape", [("FULL_SHARD", 4, (2, 2)), ("NO_SHARD", 4, (2, 2)),
                                                   ("SHARD_OPTIMIZER", 4, (2, 2)), ("HYBRID_SHARD", (2, 1), (2, 1, 2))])
def test_explain_predicts_what_a_tensor_parallel_tree_holds(clusters, strategy, mesh, shape):
    plan = sf.Plan(strategy, units=UNITS.units)
    real = clusters[4].run(_held, 2, plan, mesh[0] if isinstance(mesh, tuple) else None)
    report = predict(mesh, tensor=2, plan=plan)
    assert report.mesh_shape == shape and report.tensor == 2 and len(report.split_layers) == 4
    # no padding here: every rank holds the same bytes; after the step, that is, with
    # SHARD_OPTIMIZER's full parameters, which its step gathers and keeps
    assert len({after for _, after in real}) == 1
    assert all(before == after for before, after in real) or strategy == "SHARD_OPTIMIZER"
    assert report.persistent_bytes == real[0][1]


def test_split_layers_hold_what_world_four_holds_and_the_others_what_world_two_holds():
    tp, four, two = predict(4, tensor=2), predict(4), predict(2)
    by_name = [{u.name: u for u in r.units} for r in (tp, four, two)]
    fields = ("param_bytes", "grad_bytes", "optim_bytes")
    for name, u in by_name[0].items():
        figures = [tuple(getattr(r[name], f) for f in fields) for r in by_name]
        if name.endswith("mlp.0"):  # colwise: weight and bias split, then sharded: 1/4 of them
            assert figures[0] == figures[1], (name, figures)
        elif name.endswith("mlp.2"):  # rowwise: the weight split (1/4), the bias whole on each tensor rank (1/2)
            elements = (CFG.d_model * HIDDEN // 2 + CFG.d_model) // 2
            assert figures[0][0] == figures[0][1] == 4 * elements, (name, figures)
            assert figures[1][0] < figures[0][0] < figures[2][0]
        else:  # outside the plan: sharded over the 2 shard ranks only
            assert figures[0] == figures[2], (name, figures)
    assert {u.name: u.params for u in tp.units} == {u.name: u.params for u in four.units}


def test_autoplan_plans_a_tensor_axis_from_three_and_four_blocks():
    """autoplan with tensor=2 tries what it tries without one (here two strategies, each with
    and without remat and offload), and its figures for a
    6-block model (extended from 3 and 4 blocks) equal explain's at full depth, to the byte."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**{**CFG.__dict__, "n_layers": 6}))
    found = sf.autoplan(model, 4, "1GiB", batch(2), loss_fn=loss_fn, tensor=2, tensor_parallel=PLAN,
                        strategies=("FULL_SHARD", "SHARD_GRAD_OP"), micro_batches=(1,), verbose=False)
    assert found.tried == 8 and found.tensor == 2 and "with a tensor axis of 2" in str(found)
    for c in found.frontier:
        full = sf.explain(model, 4, c.plan, batch(2), loss_fn=loss_fn, tensor=2, tensor_parallel=PLAN, verbose=False)
        assert (c.peak_bytes, c.persistent_bytes) == (full.peak_bytes, full.persistent_bytes), c.label()
        assert c.comm_bytes == sum(b for _, b in full.collectives.values())


class _MlpBytes:
    """The bytes of each block's hidden activations: the outputs of ``mlp.0`` and of its GELU,
    which backward keeps (hooks on ``model``; functionalize's copy of the tree keeps them)."""

    def __init__(self, model):
        self.hidden = []
        for block in model.blocks:
            for layer in (block.mlp[0], block.mlp[1]):
                layer.register_forward_hook(lambda _m, _a, out: self.hidden.append(out.numel() * out.element_size()))


def _activations(tensor):
    """A real forward on this rank, of the whole batch: the hidden activations' bytes, and the
    live tensor bytes it leaves for backward."""
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(0)
    model = GPT(CFG)
    seen = _MlpBytes(model)
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, UNITS, tensor_parallel=PLAN if tensor else None)
    with sf.track_live_bytes() as mem:
        loss = loss_fn(apply, sharded, batch())
        gc.collect()  # count what the graph holds, not garbage awaiting collection
        held = mem.current
    loss.backward()
    return seen.hidden, held


def test_the_split_layers_activations_are_halved(clusters):
    """Per rank, with the same rows: shard 2 x tensor 2 against FULL_SHARD's shard 2 (world 2),
    measured in a real forward and by explain's fake step."""
    hidden = ROWS * CFG.seq_len * HIDDEN * 4  # fp32 bytes of one hidden activation, whole
    tp = clusters[4].run(_activations, 2)[0]
    plain = clusters[2].run(_activations, None)[0]
    assert tp[0] == [hidden // 2] * 4 and plain[0] == [hidden] * 4  # mlp.0 and GELU outputs, 2 blocks
    # What forward leaves for backward differs by exactly the halved hidden activations:
    # everything else (attention, embeddings, the MLP's input and output) is the same.
    assert plain[1] - tp[1] == 2 * CFG.n_layers * hidden // 2, (plain[1], tp[1])
    # The planner: its fake step makes the same halved activations, and the step's peak above
    # the persistent bytes grows with the rows by exactly that much less.
    with torch.device("meta"):
        model = GPT(CFG)
    seen = _MlpBytes(model)
    with_rows = {}
    for rows in (ROWS, 2 * ROWS):
        for tensor, world in ((2, 4), (None, 2)):
            seen.hidden.clear()
            e = sf.explain(model, world, UNITS, batch(rows), loss_fn=loss_fn, tensor=tensor,
                           tensor_parallel=PLAN if tensor else None, verbose=False)
            with_rows[rows, tensor] = e.peak_bytes - e.persistent_bytes
            assert seen.hidden[-4:] == [rows * hidden // ROWS // (tensor or 1)] * 4  # the measured step's
    growth = {t: with_rows[2 * ROWS, t] - with_rows[ROWS, t] for t in (2, None)}
    assert growth[None] - growth[2] == 2 * CFG.n_layers * hidden // 2, growth


def test_gpu_checks_tensor_row_says_it_is_skipped_with_fewer_than_four_gpus(monkeypatch):
    """benchmarks/gpu_check.py's tensor-parallel row (benchmarks/gpu_tensor.py) on a 1-GPU machine:
    one line that says why, and the check still passes."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(root))
    gpu_tensor = importlib.import_module("gpu_tensor")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    lines, ok = gpu_tensor.main({"tensor": "auto", "device": "cuda"})
    assert ok and lines == ["tensor parallel, world 4: shard 2 x tensor 2 against FULL_SHARD: skipped: needs 4 GPUs "
                            "(found 1)"]


def test_step_time_has_a_tensor_pair_and_counts_it_in_shardfns_terms(monkeypatch):
    """benchmarks/step_time.py's shardfn_tensor (shard 2 x tensor 2 at world 4): the ranks of a
    tensor group take the same slice of the batch, and its collectives (the reduce-scatter over
    the 2 shard ranks as gloo's sends, the guard's header all-reduces) read as shardfn records them."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    step_time = importlib.import_module("step_time")
    spec = step_time.SPECS["shardfn_tensor"]
    assert spec.tensor == 2 and [spec.data(r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # One step of the smallest run (d_model 64, 2 layers), rank 0: as recorded, and as dispatched
    recorded = {"all_gather": 569856, "all_reduce": 32784, "reduce_scatter": 303616}
    counted = {"all_reduce": 33344, "all_gather": 569856, "send": 151808, "recv": 151808}
    assert step_time._same_counts(recorded, counted, 2)
    assert not step_time._same_counts({**recorded, "reduce_scatter": 303616 // 2}, counted, 2)
    assert not step_time._same_counts({**recorded, "all_reduce": 32784 - 4096}, counted, 2)
