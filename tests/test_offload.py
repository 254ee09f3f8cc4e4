"""CPU offload (shard(..., offload=Offload(params=True, optimizer=True))): placement,
host <-> device copies counted per step, memory on the compute device, equivalence with one
device for every strategy, and the state paths (gather, checkpoints, deferred init, rank 0).

On this CPU-only machine the compute device is the CPU: the copies are between two CPU
tensors, made and counted by the same code a GPU runs; host memory is told apart by the
marks of shardfn._memory (see [Note: offload])."""

import functools

import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shardfn as sf
from shardfn._memory import is_marked_host
from bounds import ADAMW  # the equivalence tests' AdamW: tests/bounds.py
from shardfn.optim import adamw, sgd
from shardfn.testing import check_equivalence, split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=31, seq_len=8, d_model=16, n_layers=3, n_heads=2)
OFF = sf.Offload(params=True, optimizer=True)
BF16 = sf.Precision(param=torch.bfloat16, reduce=torch.float32)


def gpt_model():
    return GPT(CFG)


def gpt_loss(apply, params, batch):
    return lm_loss(apply(params, batch["x"]), batch["y"])


def gpt_batches(steps=3, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randint(0, 31, (12, 8), generator=g) for k in ("x", "y")} for _ in range(steps)]


@pytest.mark.parametrize("world, strategies", [
    (2, ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")),
    (3, ("FULL_SHARD",)),
    ((2, 2), ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")),
])
def test_offloaded_training_equals_one_device(clusters, world, strategies):
    report = check_equivalence(
        gpt_model, gpt_loss, gpt_batches(), optimizer=ADAMW,
        strategies=[sf.Plan(s, offload=OFF) for s in strategies], world_sizes=[world], clusters=clusters,
    )
    assert len(report.leaves) == len(strategies)


def test_offloaded_with_micro_batches_and_remat_equals_one_device(clusters):
    check_equivalence(
        gpt_model, gpt_loss, gpt_batches(), optimizer=functools.partial(sgd, 0.05, momentum=0.9),
        strategies=[sf.Plan("FULL_SHARD", offload=OFF, remat=sf.Remat())], world_sizes=[2], clusters=clusters,
        step_options={"micro_batches": 2},
    )


class _HostCopies(TorchDispatchMode):
    """Counts copy_ ops from a host-marked storage into an unmarked one, and back."""

    def __init__(self):
        super().__init__()
        self.to_device = self.to_host = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            dst, src = is_marked_host(args[0].untyped_storage()), is_marked_host(args[1].untyped_storage())
            self.to_device += src and not dst
            self.to_host += dst and not src
        return func(*args, **(kwargs or {}))


def offloaded_step(strategy, precision=None, offload=OFF, micro_batches=1):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, strategy, precision=precision, offload=offload)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(sharded)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt, micro_batches=micro_batches)
    batch = split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)
    sharded, state, _ = step(sharded, state, batch)  # the first step, then count a steady one
    def host_bytes(sharded, state):  # the distinct storages of the shards and the optimizer state
        tensors = [*sharded.params().values(), *[t for t in torch.utils._pytree.tree_leaves(state)
                                                 if isinstance(t, torch.Tensor)]]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    with sf.record_collectives() as log, _HostCopies() as ops, sf.track_live_bytes(sharded, state, batch) as mem:
        held = (mem.device_current, mem.host_current, host_bytes(sharded, state))
        sharded, state, metrics = step(sharded, state, batch)
        gc.collect()  # a step's cyclic garbage (one 8-byte host scalar, some steps) freed before the count
    lay = sharded.layout
    gathers = {u.name: (2 if lay.strategy.reshard_after_forward and u.path else 1) for u in lay.units}
    opt_leaves = [t for t in torch.utils._pytree.tree_leaves(state) if isinstance(t, torch.Tensor)]
    return {
        "copies": dict(log.transfer_copies()), "bytes": dict(log.transfer_bytes()), "metric": metrics.get("transfer_bytes", {}),
        "ops": (ops.to_device, ops.to_host),
        # derived from the layout, per micro-batch: one copy per leaf per gather, one per unit's reduction
        "want_copies": {"to_device": micro_batches * sum(g * len(u.leaves) for g, u in zip(gathers.values(), lay.units)),
                        "to_host": micro_batches * sum(1 for u in lay.units if u.grad_numel)},
        "want_bytes": {"to_device": micro_batches * sum(g * u.numel * u.param_dtype.itemsize
                                                        for g, u in zip(gathers.values(), lay.units)),
                       "to_host": micro_batches * sum(u.grad_numel * u.dtype.itemsize for u in lay.units)},
        "shards_host": all(is_marked_host(t.untyped_storage()) for t in sharded.params().values()),
        "state_host": all(is_marked_host(t.untyped_storage()) for t in opt_leaves),
        "devices": {str(t.device) for t in sharded.params().values()},
        "held": held, "after": (mem.device_current, mem.host_current, host_bytes(sharded, state)),
        "device_peak": mem.device_peak,
        "batch": sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in batch.values()}.values()),
        "peak": mem.peak, "loss": metrics["loss"],
    }


@pytest.mark.parametrize("strategy, precision", [("FULL_SHARD", None), ("SHARD_GRAD_OP", None),
                                                 ("FULL_SHARD", BF16), ("NO_SHARD", None)])
def test_placement_and_host_device_copies_per_step_are_counted(clusters, strategy, precision):
    for r in clusters[2].run(offloaded_step, strategy, precision):
        assert r["shards_host"] and r["state_host"] and r["devices"] == {"cpu"}
        assert r["copies"] == r["want_copies"] and r["bytes"] == r["want_bytes"] == r["metric"]
        # the events are the copy ops themselves: host storage -> device storage and back
        assert r["ops"] == (r["copies"]["to_device"], r["copies"]["to_host"])
        # between steps the compute device holds nothing of the model (GPT has no buffers),
        # only the batch; the host holds exactly the shards and the optimizer state
        assert r["held"][0] == r["after"][0] == r["batch"]
        assert r["held"][1] == r["held"][2] and r["after"][1] == r["after"][2]


def test_micro_batches_copy_each_reduction_back(clusters):
    r = clusters[2].run(offloaded_step, "FULL_SHARD", None, OFF, 2)[0]
    assert r["copies"] == r["want_copies"] and r["bytes"] == r["want_bytes"]


def test_offload_lowers_the_device_peak_by_the_persistent_state(clusters):
    plain = clusters[2].run(offloaded_step, "FULL_SHARD", None, sf.Offload())[0]
    off = clusters[2].run(offloaded_step, "FULL_SHARD", None, OFF)[0]
    assert plain["loss"] == off["loss"]
    # the same bytes, moved to the host
    assert plain["held"][1] == 0 and plain["held"][0] - plain["batch"] == off["held"][1]
    # the device no longer holds the shards, gradients and optimizer state (everything the
    # optimizer touches); what it holds at the peak is the gathered units and activations
    assert off["device_peak"] <= plain["device_peak"] - (plain["held"][0] - plain["batch"])


def state_paths(tmp):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    plain = sf.shard(params, mesh, "FULL_SHARD")
    off = sf.shard(params, mesh, "FULL_SHARD", offload=OFF)
    with torch.device("meta"):
        meta_params, _ = sf.functionalize(GPT(CFG))
    deferred = sf.shard(meta_params, mesh, "FULL_SHARD", offload=OFF, seed=3)
    deferred_plain = sf.shard(meta_params, mesh, "FULL_SHARD", seed=3)
    src = params if mesh.rank == 0 else meta_params
    loaded = sf.shard(src, mesh, "FULL_SHARD", offload=OFF, src_rank=0)
    opt = sf.optim.adamw(1e-3)
    state = opt.init(off)
    step = sf.jit_step(gpt_loss, mesh, optimizer=opt)
    off, state, _ = step(off, state, split_batch(gpt_batches(1)[0], mesh.rank, mesh.size))
    sf.checkpoint.save(f"{tmp}/ck", off, state)
    fresh = sf.shard(params, mesh, "FULL_SHARD", offload=OFF)
    fresh_state = opt.init(fresh)
    fresh, fresh_state, _ = sf.checkpoint.load(f"{tmp}/ck", fresh, fresh_state)
    host = lambda s: all(is_marked_host(t.untyped_storage()) for t in s.params().values())  # noqa: E731
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    return {
        "gather": same(sf.gather(plain), sf.gather(sf.shard(params, mesh, "FULL_SHARD", offload=OFF))),
        "deferred": same(deferred.params(), deferred_plain.params()) and host(deferred),
        "src_rank": same(loaded.params(), plain.params()) and host(loaded),
        "checkpoint": same(fresh.params(), off.params()) and host(fresh) and same(sf.gather(fresh), sf.gather(off)),
        "reshard": host(sf.reshard(plain, None, sf.Plan("SHARD_GRAD_OP", offload=OFF))[0]),
        "plain_not_host": not any(is_marked_host(t.untyped_storage()) for t in plain.params().values()),
    }


def outside_a_step():
    """apply under the user's own autograd, and a step that returns new tensors (donate=False)."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    batch = split_batch(gpt_batches(1)[0], mesh.rank, mesh.size)
    grads, new = {}, {}
    for name, off in (("plain", None), ("offload", OFF)):
        sharded = sf.shard(params, mesh, "FULL_SHARD", offload=off)
        gpt_loss(apply, sharded, batch).backward()
        grads[name] = {n: t.grad for n, t in sharded.params().items()}
        opt = sf.optim.adamw(1e-3)
        step = sf.jit_step(gpt_loss, mesh, optimizer=opt, donate=False)
        new[name], _, _ = step(sharded, opt.init(sharded), batch)
    return {
        "grads_equal": all(torch.equal(grads["plain"][n], grads["offload"][n]) for n in grads["plain"]),
        "grads_host": all(is_marked_host(g.untyped_storage()) for g in grads["offload"].values()),
        "new_equal": all(torch.equal(new["plain"][n], new["offload"][n]) for n in new["plain"]),
        "new_host": all(is_marked_host(t.untyped_storage()) and t.requires_grad for t in new["offload"].params().values()),
    }


def test_apply_outside_a_step_and_undonated_steps_keep_the_state_on_the_host(clusters):
    for r in clusters[2].run(outside_a_step):
        assert r == {k: True for k in r}, r


def test_gather_checkpoints_deferred_init_and_rank0_loading_work_offloaded(clusters, tmp_path):
    for r in clusters[2].run(state_paths, str(tmp_path)):
        assert r == {k: True for k in r}, r


def test_offload_both_or_neither():
    with pytest.raises(ValueError, match="both live in host memory or neither"):
        sf.Offload(params=True)
    with pytest.raises(TypeError, match="a bool"):
        sf.Offload(params=1, optimizer=1)
    with pytest.raises(TypeError, match="shardfn.Offload"):
        sf.Plan("FULL_SHARD", offload=True)
    assert "offload=Offload(params=True, optimizer=True)" in repr(sf.Plan("FULL_SHARD", offload=OFF))
