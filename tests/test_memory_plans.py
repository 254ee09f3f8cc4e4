"""Finer control of memory: prefetch depth, per-unit reshard after forward, resharding to
a sub-group (hpZ), and keeping units gathered across micro-batches. Counted exactly
(collectives per group, units live at once, bytes), and equal to one device."""

import functools

import pytest
import torch

import shardfn as sf
from bounds import ADAMW  # the equivalence tests' AdamW: tests/bounds.py
from shardfn.optim import adamw
from shardfn.testing import check_equivalence, split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=31, seq_len=8, d_model=16, n_layers=4, n_heads=2)


def gpt_model():
    return GPT(CFG)


def gpt_loss(apply, params, batch):
    return lm_loss(apply(params, batch["x"]), batch["y"])


def gpt_batches(steps=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randint(0, 31, (12, 8), generator=g) for k in ("x", "y")} for _ in range(steps)]


def counted_step(plan, **options):
    """A steady-state step's collectives (kind, purpose, unit, group, bytes), residency and peak,
    each unit alone (``bucket_bytes=0``: the plans here are per unit; [Note: buckets])."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, plan, bucket_bytes=0)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, **options)
    batch = split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)
    sharded, state, _ = step(sharded, state, batch)
    with sf.record_collectives() as log, sf.track_residency() as res, sf.track_live_bytes(sharded, state, batch) as mem:
        sharded, state, metrics = step(sharded, state, batch)
    lay = sharded.layout
    return {
        "calls": [(c.kind.value, c.purpose.value, c.unit, c.group, c.nbytes) for c in log.calls if c.unit],
        "counts": dict(log.counts()), "bytes": dict(log.bytes()),
        "expected": lay.collectives_per_step(), "max_live": res.max_live, "peak": mem.peak,
        "unit_bytes": {u.name: lay.world * u.numel * u.param_dtype.itemsize for u in lay.units},
        "reshard": {u.name: u.reshard for u in lay.units}, "loss": metrics["loss"],
    }


def _gathers(calls):
    return [(purpose, unit) for kind, purpose, unit, _, _ in calls if kind == "all_gather"]


# -- prefetch depth ----------------------------------------------------------------------


def test_prefetch_depth_bounds_the_units_gathered_at_once(clusters):
    runs = {d: clusters[2].run(counted_step, "FULL_SHARD", prefetch=d)[0] for d in (0, 1, 2)}
    block = max(b for name, b in runs[0]["unit_bytes"].items() if name != "<root>")
    for d, r in runs.items():
        assert r["max_live"] == d + 1  # the running unit and d ahead, never more
        assert r["counts"] == runs[0]["counts"] and r["bytes"] == runs[0]["bytes"]  # the same collectives
        assert r["loss"] == runs[0]["loss"]
        # each unit ahead costs at most one gathered block (its output buffer and unpacked leaves)
        assert r["peak"] <= runs[0]["peak"] + d * 2 * block, (d, r["peak"], runs[0]["peak"], block)
    assert runs[0]["peak"] < runs[1]["peak"] < runs[2]["peak"]


def test_prefetch_depth_must_be_a_count():
    mesh = object.__new__(sf.Mesh)
    with pytest.raises(ValueError, match="how many units to gather ahead"):
        sf.jit_step(lambda apply, p, b: 0, mesh, optimizer=adamw(1e-3), prefetch=-1)


# -- per-unit reshard after forward --------------------------------------------------------


@pytest.mark.parametrize("strategy, rule, once", [
    ("FULL_SHARD", {"blocks.3": False}, {"<root>", "blocks.3"}),  # keep the last block into its backward
    ("SHARD_GRAD_OP", {"blocks.0": True}, {"<root>", "blocks.1", "blocks.2", "blocks.3"}),
])
def test_reshard_after_forward_per_unit_in_the_plan(clusters, strategy, rule, once):
    plan = sf.Plan(strategy, reshard_after_forward=rule)
    r = clusters[2].run(counted_step, plan, prefetch=0)[0]
    gathered = _gathers(r["calls"])
    units = set(r["unit_bytes"])
    assert {u for p, u in gathered if p == "gather"} == units
    assert {u for p, u in gathered if p == "regather"} == units - once
    total = sum(r["unit_bytes"].values()) + sum(b for u, b in r["unit_bytes"].items() if u not in once)
    assert r["counts"]["all_gather"] == 2 * len(units) - len(once) and r["bytes"]["all_gather"] == total
    assert {k: v for k, v in r["expected"].items()} == {k: (r["counts"][k], r["bytes"][k]) for k in r["expected"]}


def test_per_unit_reshard_equals_one_device(clusters):
    check_equivalence(
        gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW,
        strategies=[sf.Plan("FULL_SHARD", reshard_after_forward={"blocks.3": False, "blocks.1": False}),
                    sf.Plan("SHARD_GRAD_OP", reshard_after_forward={"blocks.0": True})],
        world_sizes=[2], clusters=clusters)


# -- reshard to a sub-group (hpZ) ----------------------------------------------------------


def test_reshard_to_a_subgroup_keeps_backward_gathers_inside_it(clusters):
    results = clusters[4].run(counted_step, sf.Plan("FULL_SHARD", reshard_after_forward=2), prefetch=1)
    for rank, r in enumerate(results):
        mine = (0, 1) if rank < 2 else (2, 3)
        blocks = {u: b for u, b in r["unit_bytes"].items() if u != "<root>"}
        assert r["reshard"] == {"<root>": False, **{u: 2 for u in blocks}}
        per_group = {}
        for kind, purpose, unit, group, nbytes in r["calls"]:
            if kind == "all_gather":
                per_group.setdefault((purpose, group), []).append((unit, nbytes))
        # forward: every unit over the 4 ranks; backward: every block within this rank's pair
        assert sorted(per_group[("gather", (0, 1, 2, 3))]) == sorted(r["unit_bytes"].items())
        assert sorted(per_group[("regather", mine)]) == sorted(blocks.items())
        assert set(per_group) == {("gather", (0, 1, 2, 3)), ("regather", mine)}
        # the reductions are unchanged: one reduce-scatter per unit over all ranks
        assert [(u, g) for k, _, u, g, _ in r["calls"] if k == "reduce_scatter"] == [
            (u, (0, 1, 2, 3)) for u in ["blocks.3", "blocks.2", "blocks.1", "blocks.0", "<root>"]]
        assert r["expected"]["all_gather"] == (r["counts"]["all_gather"], r["bytes"]["all_gather"])


def test_reshard_to_a_subgroup_equals_one_device(clusters):
    check_equivalence(
        gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW,
        strategies=[sf.Plan("FULL_SHARD", reshard_after_forward=2),
                    sf.Plan("FULL_SHARD", reshard_after_forward={"blocks.0": 2, "blocks.2": False},
                            remat=sf.Remat())],
        world_sizes=[4], clusters=clusters)


def refused(plan):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(CFG))
    try:
        sf.shard(params, mesh, plan)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_bad_reshard_rules_are_refused_with_the_units_and_the_mesh(clusters):
    for plan, words in [
        (sf.Plan("FULL_SHARD", reshard_after_forward=3), "must divide the 4 ranks"),
        (sf.Plan("FULL_SHARD", reshard_after_forward={"blocks.9": False}), "not units of this plan"),
        (sf.Plan("NO_SHARD", reshard_after_forward=False), "NO_SHARD"),
        (sf.Plan("FULL_SHARD", reshard_after_forward=2, remat=sf.Remat(mode="selective")), "selective remat"),
    ]:
        assert all(words in m for m in clusters[4].run(refused, plan)), words
    with pytest.raises(TypeError, match="sub-group size"):
        sf.Plan("FULL_SHARD", reshard_after_forward="node")


# -- keeping units gathered across micro-batches ---------------------------------------------


@pytest.mark.parametrize("accumulate", ["reduce_each", "local"])
def test_keep_gathered_gathers_each_unit_once_per_step(clusters, accumulate):
    k = 3
    plain = clusters[2].run(counted_step, "FULL_SHARD", micro_batches=k, accumulate=accumulate)[0]
    kept = clusters[2].run(counted_step, "FULL_SHARD", micro_batches=k, accumulate=accumulate,
                           keep_gathered=True)[0]
    n_units = len(kept["unit_bytes"])
    assert plain["counts"]["all_gather"] == k * (2 * n_units - 1)
    assert kept["counts"]["all_gather"] == n_units and kept["bytes"]["all_gather"] == sum(kept["unit_bytes"].values())
    assert kept["counts"]["reduce_scatter"] == plain["counts"]["reduce_scatter"] == (k if accumulate == "reduce_each"
                                                                                       else 1) * n_units
    assert kept["max_live"] == n_units - 1  # every non-root unit at once (the root is not tracked)
    assert kept["peak"] > plain["peak"]  # the price: the gathered model
    assert abs(kept["loss"] - plain["loss"]) <= 1e-6 * abs(plain["loss"])


def test_keep_gathered_equals_one_device(clusters):
    check_equivalence(
        gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW,
        strategies=["FULL_SHARD", "SHARD_GRAD_OP"], world_sizes=[2], clusters=clusters,
        step_options={"micro_batches": 3, "keep_gathered": True, "accumulate": "local"})


# -- ZeRO-1: SHARD_OPTIMIZER -----------------------------------------------------------------


def zero1_step(precision=None):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, "SHARD_OPTIMIZER", precision=precision, bucket_bytes=0)  # unit by unit
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    batch = split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)
    with sf.record_collectives() as first:
        sharded, state, _ = step(sharded, state, batch)
    with sf.record_collectives() as log, sf.track_live_bytes(sharded, state, batch) as mem:
        held = mem.current
        sharded, state, _ = step(sharded, state, batch)
    lay = sharded.layout
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*sharded.params().values(), *torch.utils._pytree.tree_leaves(state), *batch.values()]}
    # a shard changed outside the step (in place): the kept replica no longer holds, the next use gathers again
    name = "blocks.0.mlp.0.weight"
    with torch.no_grad():
        sharded[name].mul_(0.5)
    truth = sf.gather(sharded)
    grad_fn = sf.jit_grad(gpt_loss, mesh)
    with sf.record_collectives() as after:
        loss, _, _ = grad_fn(sharded, batch)
    return {
        "first": [(c.kind.value, c.purpose.value) for c in first.calls if c.unit],
        "calls": [(c.kind.value, c.purpose.value, c.unit) for c in log.calls if c.unit],
        "units": [u.name for u in lay.units],
        "held": held, "expected_held": sum(storages.values()) + sum(lay.world * u.numel * u.param_dtype.itemsize
                                                                     for u in lay.units),
        "regathered": [c.unit for c in after.calls if c.kind.value == "all_gather" and c.purpose.value == "gather"],
        "loss_after": float(loss), "fresh_loss": _fresh_loss(truth, mesh, batch),
    }


def _fresh_loss(full, mesh, batch):
    torch.manual_seed(0)
    model = GPT(CFG)
    model.load_state_dict(full)
    params, apply = sf.functionalize(model)
    return float(gpt_loss(apply, params, batch).detach()) if mesh.size == 1 else float(
        sf.jit_grad(gpt_loss, mesh)(sf.shard(params, mesh, "NO_SHARD"), batch)[0])


def test_shard_optimizer_is_zero1_one_reduce_scatter_then_one_all_gather_per_unit(clusters):
    for r in clusters[2].run(zero1_step):
        n = len(r["units"])
        # a steady step: no gather in forward; every unit's reduce-scatter, then (after the
        # update) every unit's updated shards all-gathered, in layout order
        assert [(k, p) for k, p, _ in r["calls"]] == [("reduce_scatter", "reduce")] * n + [("all_gather", "replica")] * n
        assert [u for k, _, u in r["calls"] if k == "all_gather"] == r["units"]
        # the first step also gathers in forward (there is no replica yet)
        assert sum(k == "all_gather" for k, _ in r["first"]) == 2 * n
        # between steps: the shards, the optimizer state, the batch and the full replica
        assert r["held"] == r["expected_held"]
        # a shard changed outside the step: its unit (and only it) is gathered again, and the
        # loss is that of the changed parameters
        assert r["regathered"] == ["blocks.0"]
        assert abs(r["loss_after"] - r["fresh_loss"]) <= 1e-6


def test_shard_optimizer_equals_one_device(clusters):
    for world in (2, 3):
        check_equivalence(
            gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW,
            strategies=["SHARD_OPTIMIZER", sf.Plan("SHARD_OPTIMIZER", offload=sf.Offload(params=True, optimizer=True))],
            world_sizes=[world], clusters=clusters, step_options={"micro_batches": 2})


def zero1_trees(donate):
    """What a SHARD_OPTIMIZER step does to the trees: the returned one holds the new replica;
    the one passed in is never changed, except that a donated one hands its replica over."""
    sharded, state, step, batch = sgd_step("SHARD_OPTIMIZER", donate=donate)
    sharded, state, _ = step(sharded, state, batch)  # a tree with a replica
    before = dict(sharded.replicas)
    new, _, _ = step(sharded, state, batch)
    out = {"new_has_all": sorted(new.replicas) == sorted(before), "new_differs": new is not sharded,
           "old_kept": sharded.replicas is not None and all(sharded.replicas[i] is before[i] for i in before)}
    for attempt in (lambda: setattr(new, "replicas", {}), lambda: new.replicas.__setitem__(0, None)):
        try:
            attempt()
            out.setdefault("changed", True)
        except (AttributeError, TypeError):
            pass
    return out


@pytest.mark.parametrize("donate", [True, False])
def test_a_step_returns_a_new_tree_and_never_changes_one(clusters, donate):
    for r in clusters[2].run(zero1_trees, donate):
        assert r["new_has_all"] and r["new_differs"] and "changed" not in r, r
        assert r["old_kept"] is (not donate), r  # a donated tree was consumed: its replica moved to the new one


def sgd_step(plan, twice=False, **options):
    """The test GPT under ``plan`` with SGD: (sharded, state, step, this rank's batch); the
    loss calls apply twice (two views of the batch) if ``twice``; each unit alone."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, plan, bucket_bytes=0)
    opt = sf.optim.sgd(0.1)

    def loss(apply, p, b):
        return gpt_loss(apply, p, b) + (gpt_loss(apply, p, {"x": b["y"], "y": b["x"]}) if twice else 0)

    step = sf.jit_step(loss, mesh, optimizer=opt, **options)
    return sharded, opt.init(sharded), step, split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)


def twice_gathers(plan):
    """All-gathers per unit in a step whose loss calls apply twice (two views of the batch)."""
    sharded, state, step, batch = sgd_step(plan, twice=True, prefetch=0)
    with sf.record_collectives() as log:
        step(sharded, state, batch)
    return {u.name: len([c for c in log.calls if c.kind.value == "all_gather" and c.unit == u.name])
            for u in sharded.layout.units}


def test_a_kept_unit_used_twice_is_gathered_once(clusters):
    counts = clusters[2].run(twice_gathers, sf.Plan("FULL_SHARD", reshard_after_forward={"blocks.0": False}))[0]
    # kept: gathered by the first call, reused by the second and by both backwards
    assert counts["blocks.0"] == 1
    # resharded: each call gathers it and each call's backward gathers it again
    assert counts["blocks.1"] == 4


def disagreeing_plans():
    """Rank 0 asks for offload and a sub-group reshard, the others do not."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, _ = sf.functionalize(GPT(CFG))
    mine = sf.Plan("FULL_SHARD", offload=sf.Offload(params=True, optimizer=True), reshard_after_forward=2) \
        if mesh.rank == 0 else sf.Plan("FULL_SHARD")
    try:
        sf.shard(params, mesh, mine)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_ranks_that_disagree_on_offload_or_resharding_all_raise_before_making_groups(clusters):
    # every rank raises the same error at the layout agreement, before any sub-group is created
    # (creating one is collective: a rank that asked for it alone would wait there)
    for message in clusters[4].run(disagreeing_plans):
        assert "ranks disagree about the layout" in message and "ranks [1, 2, 3] differ" in message, message


def keep_gathered_on_rank0_only():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    opt = sf.optim.sgd(0.1)
    state = opt.init(sharded)
    before = {n: t.clone() for n, t in sharded.params().items()}
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, micro_batches=2,
                       keep_gathered=mesh.rank == 0)
    try:
        step(sharded, state, split_batch(gpt_batches(1)[0], mesh.rank, mesh.size))
    except sf.DivergenceError as e:
        return {"error": type(e).__name__, "unchanged": all(torch.equal(before[n], sharded[n]) for n in before)}
    return {"error": None}


def test_keep_gathered_on_one_rank_only_raises_on_every_rank_before_the_update(clusters):
    for r in clusters[2].run(keep_gathered_on_rank0_only):
        assert r == {"error": "DivergenceError", "unchanged": True}, r


# -- the life of a unit ------------------------------------------------------------------------


def _life_events(plan, **options):
    """The residency events of a steady-state step, and the states every unit of the step's
    runtime was left in (a step's runtime ends with Runtime.finish)."""
    from shardfn._run import runtime as _runtime

    ended = []
    finish = _runtime.Runtime.finish

    def spy(self):
        order = finish(self)
        ended.extend((u.unit.name, u.state.value, u.full is None, not u.group.in_flight(u), u.secondary is None)
                     for u in self.units())
        return order

    sharded, state, step, batch = sgd_step(plan, **options)
    sharded, state, _ = step(sharded, state, batch)
    _runtime.Runtime.finish = spy
    try:
        with sf.track_residency() as res:
            step(sharded, state, batch)
    finally:
        _runtime.Runtime.finish = finish
    return [tuple(map(str, e)) for e in res.events], ended


# The transitions of [Note: the life of a unit], as residency events (a cancelled prefetch
# emits none: it may only be followed by another prefetch or a gather, or end the step).
_MOVES = {("sharded", "prefetch"): "in flight", ("sharded", "gather"): "gathered",
          ("sharded", "regather"): "gathered", ("in flight", "gather"): "gathered",
          ("in flight", "regather"): "gathered", ("gathered", "free"): "sharded",
          ("in flight", "prefetch"): "in flight"}


@pytest.mark.parametrize("plan, options, kept", [
    ("FULL_SHARD", {}, set()), ("FULL_SHARD", {"prefetch": 2}, set()), ("SHARD_GRAD_OP", {}, "all"),
    (sf.Plan("FULL_SHARD", remat=sf.Remat()), {"prefetch": 1}, set()),
    (sf.Plan("SHARD_GRAD_OP", remat=sf.Remat(mode="selective")), {}, "all"),
    (sf.Plan("FULL_SHARD", reshard_after_forward={"blocks.1": False}), {"micro_batches": 2}, {"blocks.1"}),
    ("FULL_SHARD", {"micro_batches": 2, "keep_gathered": True}, "pinned"),
])
def test_every_unit_moves_by_the_states_of_its_life_and_ends_sharded(clusters, plan, options, kept):
    events, ended = clusters[2].run(_life_events, plan, **options)[0]
    states = {}
    for event, unit in events:
        move = (states.get(unit, "sharded"), event)
        assert move in _MOVES, (unit, move, events)
        states[unit] = _MOVES[move]
    assert set(states.values()) <= {"sharded", "in flight"}, states  # nothing gathered after the step
    assert len(ended) == len(CFG_UNITS) and all(e[1:] == ("sharded", True, True, True) for e in ended), ended
    regathered = {unit for event, unit in events if event == "regather"}
    if kept == "pinned":  # held from the first gather to the step's end: one gather, one free each
        for u in states:
            assert [e for e in events if e[1] == u and e[0] != "prefetch"] == [("gather", u), ("free", u)], events
    elif kept == "all":  # SHARD_GRAD_OP: held from forward to backward, never regathered
        assert not regathered, events
    else:  # resharded after each forward: gathered again in backward, except the kept ones
        assert regathered == set(states) - kept, events


CFG_UNITS = ["<root>", *(f"blocks.{i}" for i in range(CFG.n_layers))]
