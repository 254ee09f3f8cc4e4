"""reshard: strategy, units, precision or mesh changed in memory; the state bitwise the same."""

import pytest
import torch

import shardfn as sf
from shardfn.testing import full_state, split_batch
from test_equivalence import gpt_batches, gpt_loss, gpt_model
from test_state import conv_batches, conv_loss
from shardfn.testing.models import ConvNet

MODELS = {"gpt": (gpt_model, gpt_loss, gpt_batches), "convnet": (ConvNet, conv_loss, conv_batches)}


def _everything(sharded, state):
    """Full parameters and buffers, full AdamW moments and the count: the whole state."""
    names = list(state.mu)
    return {
        "state": full_state(sharded),
        "mu": {n: t for n, t in sf.gather(sharded.replace(state.mu)).items() if n in names},
        "nu": {n: t for n, t in sf.gather(sharded.replace(state.nu)).items() if n in names},
        "count": int(state.count),
    }


def reshard_run(name, source, target, replicate_target, units_target, fields=None):
    model_fn, loss_fn, batches = MODELS[name]
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(model_fn())
    sharded = sf.shard(params, mesh, source)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    data = [split_batch(b, mesh.rank, mesh.size) for b in batches(3)]
    for b in data[:2]:
        sharded, state, _ = step(sharded, state, b)
    before = _everything(sharded, state)
    target_mesh = sf.Mesh.from_group(replicate=replicate_target) if replicate_target else mesh
    with sf.record_collectives() as log:
        moved, moved_state = sf.reshard(sharded, state, target, mesh=target_mesh, units=units_target, **(fields or {}))
    after = _everything(moved, moved_state)
    # Training goes on under the new layout, as it would have under the old one (to rounding:
    # the reductions add the same numbers in another order).
    new_step = sf.jit_step(loss_fn, target_mesh, optimizer=opt)
    moved, moved_state, m_new = new_step(moved, moved_state, split_batch(batches(3)[2], target_mesh.rank, target_mesh.size))
    sharded, state, m_old = step(sharded, state, data[2])
    return {
        "before": before, "after": after, "layout": repr(moved.layout), "plan": repr(moved.layout.plan),
        "losses": (m_new["loss"], m_old["loss"]),
        "continued": (full_state(moved), full_state(sharded)),
        "reshard_collectives": sorted({(c.kind.value, c.purpose.value) for c in log.calls}),
    }


CASES = [
    ("gpt", 4, "FULL_SHARD", "SHARD_GRAD_OP", None, None),
    ("gpt", 4, "FULL_SHARD", "NO_SHARD", None, None),
    ("gpt", 3, "FULL_SHARD", "FULL_SHARD", None, sf.by_prefix("blocks.0")),
    ("gpt", 4, "FULL_SHARD", "HYBRID_SHARD", 2, None),
    ("gpt", 2, "NO_SHARD", "FULL_SHARD", None, None),
    ("convnet", 3, "SHARD_GRAD_OP", sf.Plan("FULL_SHARD", remat=sf.Remat()), None, None),
    ("gpt", 2, "FULL_SHARD", sf.Plan("SHARD_GRAD_OP", precision=sf.Precision(param=torch.bfloat16)), None, None),
]


@pytest.mark.parametrize("name, world, source, target, replicate, units", CASES,
                         ids=[f"{c[0]}-w{c[1]}-{c[2]}-to-{getattr(c[3], 'strategy', c[3])}{'-units' if c[5] else ''}"
                              for c in CASES])
def test_reshard_keeps_the_state_bitwise(clusters, name, world, source, target, replicate, units):
    for r in clusters[world].run(reshard_run, name, source, target, replicate, units):
        before, after = r["before"], r["after"]
        assert before["count"] == after["count"] == 2
        for part in ("state", "mu", "nu"):
            assert after[part].keys() == before[part].keys()
            for n in before[part]:
                assert torch.equal(after[part][n], before[part][n]), (part, n)
        strategy = target.strategy if isinstance(target, sf.Plan) else sf.Strategy.parse(target)
        assert r["layout"].startswith(f"Layout({strategy.value}")
        if source != "NO_SHARD":
            assert ("all_gather", "reshard") in r["reshard_collectives"]
        new_loss, old_loss = r["losses"]
        assert new_loss == pytest.approx(old_loss, rel=1e-6 if isinstance(target, str) else 1e-2)
        if isinstance(target, str) or target.precision == sf.Precision():  # (bf16 compute differs by design)
            moved, kept = r["continued"]
            for n in kept:
                torch.testing.assert_close(moved[n], kept[n], rtol=1e-5, atol=1e-6)


def test_reshard_takes_every_field_of_a_plan(clusters):
    """The fields shard() takes, reshard() takes: here placement, offload and the reshard rule."""
    fields = {"placement": "rows", "offload": sf.Offload(params=True, optimizer=True),
              "reshard_after_forward": {"blocks.1": False}}
    for r in clusters[2].run(reshard_run, "gpt", "FULL_SHARD", None, None, None, fields):
        for part in ("state", "mu", "nu"):
            for n in r["before"][part]:
                assert torch.equal(r["after"][part][n], r["before"][part][n]), (part, n)
        assert "placement='rows'" in r["plan"] and "offload=" in r["plan"], r["plan"]
        assert "reshard_after_forward={'blocks.1': False}" in r["plan"], r["plan"]
        new_loss, old_loss = r["losses"]
        assert new_loss == pytest.approx(old_loss, rel=1e-6)


def reshard_errors():
    mesh = sf.Mesh.from_group()
    params, _ = sf.functionalize(gpt_model())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    torch_state = sf.optim.from_torch(torch.optim.Adam, lr=1e-3).init(sharded)
    out = {}
    for what, fn in {"torch_state": lambda: sf.reshard(sharded, torch_state, "NO_SHARD"),
                     "hybrid_on_1d": lambda: sf.reshard(sharded, None, "HYBRID_SHARD")}.items():
        try:
            fn()
            out[what] = "no error"
        except (TypeError, ValueError) as e:
            out[what] = str(e)
    return out


def test_reshard_errors_name_the_problem(clusters):
    for out in clusters[2].run(reshard_errors):
        assert "cannot be resharded" in out["torch_state"] and "opt.init(new_sharded)" in out["torch_state"]
        assert "HYBRID_SHARD shards over the 'shard' axis" in out["hybrid_on_1d"]
