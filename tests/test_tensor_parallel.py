"""Tensor parallelism (issue 50): the test GPT's MLPs split colwise / rowwise over a
``tensor`` mesh axis, FSDP over the pieces on ``shard``; equal to one process, the tensor
axis's all-reduces counted exactly, and everything not supported yet refused by name."""

import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import SequenceParallel

import shardfn as sf
from bounds import SGD_MOMENTUM
from shardfn.testing._equivalence import reference_training, split_batch
from shardfn.testing.models import GPT, GPTConfig

PLAN = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
CFG = dict(vocab_size=32, seq_len=8, d_model=16, n_layers=2, n_heads=2)
ROWS, STEPS = 4, 3
# check_equivalence's tolerances, which tests/bounds.py derives for SGD_MOMENTUM ([Note:
# tolerances after training]): a rank's gradient here is the same terms summed in another order.
RTOL, ATOL = 1e-5, 1e-6


def model(vocab=CFG["vocab_size"]):
    return GPT(GPTConfig(**{**CFG, "vocab_size": vocab}))


def loss_fn(apply, params, batch):
    logits = apply(params, batch["x"])
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def batches():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randint(0, CFG["vocab_size"], (ROWS, CFG["seq_len"]), generator=g),
             "y": torch.randint(0, CFG["vocab_size"], (ROWS, CFG["seq_len"]), generator=g)} for _ in range(STEPS)]


def _train(strategy, tensor, replicate=None):
    """3 steps on [replicate x] shard x tensor: losses, grad norms, the tensor axis's and the
    gradient reduction's collectives per step, the gathered params, the local shapes, the mesh."""
    mesh = sf.Mesh.from_group(replicate=replicate, tensor=tensor)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model())
    sharded = sf.shard(params, mesh, strategy, tensor_parallel=PLAN)
    opt = SGD_MOMENTUM()
    state = opt.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=opt)
    losses, norms, logs, reduce = [], [], [], []
    for batch in batches():
        with sf.record_collectives() as log:
            sharded, state, metrics = step(sharded, state, split_batch(batch, mesh.data_rank, mesh.data_size))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
        logs.append([(c.unit, c.kind.value, c.nbytes) for c in log.select("tensor")])
        reduce.append(sorted((c.kind.value, tuple(c.group)) for c in log.select("reduce")))  # (kind, its ranks)
    local = {n: tuple(t.shape) for n, t in sharded.items()}
    return losses, norms, logs, sf.gather(sharded), local, (mesh.axis_names, mesh.shape, mesh.data_size), reduce


def _reference(model_fn=model, loss=loss_fn, make_batches=batches):
    """One process on the global batches: the losses, the final state, the first step's grad norm."""
    losses, state = reference_training(model_fn, loss, make_batches(), SGD_MOMENTUM)
    torch.manual_seed(0)
    params, apply = sf.functionalize(model_fn())
    trainable = {n: t for n, t in params.items() if t.requires_grad}
    grads = torch.autograd.grad(loss(apply, params, make_batches()[0]), list(trainable.values()))
    return losses, state, float(torch.sqrt(sum(g.square().sum() for g in grads)))


def _check(results, data_size):
    ref_losses, ref_state, ref_norm = _reference()
    block_bytes = ROWS // data_size * CFG["seq_len"] * CFG["d_model"] * 4  # fp32 activations of this rank's rows
    for losses, norms, logs, full, *_ in results:
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        assert abs(norms[0] - ref_norm) <= ATOL + RTOL * ref_norm, (norms[0], ref_norm)
        assert set(full) == set(ref_state)
        for name, ref in ref_state.items():
            assert full[name].shape == ref.shape, name
            diff = (full[name] - ref).abs() - RTOL * ref.abs()
            assert float(diff.max()) <= ATOL, (name, float(diff.max()))
        for log in logs:  # per block and step: the rowwise output's all-reduce, the colwise input grad's
            expect = sorted((f"blocks.{b}.mlp.{i}", "all_reduce", block_bytes) for b in range(2) for i in (0, 2))
            assert sorted(log) == expect, log


def test_tensor_two_alone_equals_one_process(clusters):
    results = clusters[2].run(_train, "FULL_SHARD", 2)
    assert results[0][5] == (("shard", "tensor"), (1, 2), 1)
    # each rank holds half of every split leaf, the whole of the others
    assert results[0][4]["blocks.0.mlp.0.weight"] == (32 * 16,) and results[1][4]["blocks.0.mlp.2.bias"] == (16,)
    _check(results, 1)


def test_shard_two_by_tensor_two_equals_one_process(clusters):
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        results = clusters[4].run(_train, strategy, 2)
        assert results[0][5] == (("shard", "tensor"), (2, 2), 2)
        # a split leaf's 64 x 16 / 2 tensor ranks, in pieces over the 2 shard ranks (ranks 0, 2 and 1, 3)
        for t in range(2):
            assert sum(results[s * 2 + t][4]["blocks.1.mlp.0.weight"][0] for s in range(2)) == 32 * 16
        _check(results, 2)


def _refusals():
    mesh = sf.Mesh.from_group(tensor=2)
    torch.manual_seed(0)
    params, _ = sf.functionalize(model(vocab=33))  # the head's 33 rows do not split over 2 tensor ranks
    out = []

    def refused(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            out.append(str(e))
        else:
            out.append("accepted")

    # (a packed attention's split is refused where its output is read: tests/test_tp_silent.py)
    for spec in ({"blocks.*.mlp.9": "colwise"}, {"blocks.*.mlp": "colwise"}, {"head": "colwise"}, "auto", {"blocks.*.mlp.0": "sequence_parallel"},
                 {"blocks.*.mlp.0": SequenceParallel(sequence_dim=0)}):
        refused(sf.shard, params, mesh, "FULL_SHARD", tensor_parallel=spec)
    refused(sf.shard, params, mesh, sf.Plan("FULL_SHARD", optional=["blocks.1"]), tensor_parallel=PLAN)
    sharded = sf.shard(params, mesh, "FULL_SHARD", tensor_parallel=PLAN)
    matrices = sf.optim.partition({"muon": sf.optim.from_torch(torch.optim.Muon, lr=0.01), "sgd": sf.optim.sgd(0.1)},
                                  lambda name, shape: "muon" if len(shape) >= 2 else "sgd")
    refused(matrices.init, sharded)
    return out


def test_refusals_name_the_cause_and_the_fix(clusters):
    first, second = clusters[2].run(_refusals)
    assert first == second  # every rank raises the same error
    (no_match, not_linear, indivisible, auto, sequence, style_object, optional, muon) = first
    assert "'blocks.*.mlp.9' matches no module" in no_match
    assert "'blocks.0.mlp' (matched by 'blocks.*.mlp') is a Sequential" in not_linear
    assert "'head.weight' of shape [33, 16]" in indivisible and "33 % 2 = 1" in indivisible
    assert "tensor_parallel='auto'): GPT has no base_model_tp_plan" in auto  # (tests/test_tp_auto.py: HF's plan)
    assert "the style 'sequence_parallel'" in sequence and "'sequence_start'" in sequence  # (a transformers name)
    assert "'blocks.*.mlp.0' is given SequenceParallel(" in style_object and "no style for" in style_object
    assert "'blocks.1.mlp.0' is split over the mesh's 'tensor' axis inside the optional unit 'blocks.1'" in optional
    assert "split over the mesh's 'tensor' axis (blocks.0.mlp.0.weight, blocks.0.mlp.2.weight" in muon


def split_step(tensor=2, **options):
    """The split GPT at ``tensor``, its SGD state and a step with ``options``: (mesh, sharded, state, step)."""
    mesh = sf.Mesh.from_group(tensor=tensor)
    torch.manual_seed(0)
    sharded = sf.shard(sf.functionalize(model())[0], mesh, "FULL_SHARD", tensor_parallel=PLAN)
    opt = SGD_MOMENTUM()
    return mesh, sharded, opt.init(sharded), sf.jit_step(loss_fn, mesh, optimizer=opt, **options)


def _other_batches(tensor, calls=2, **options):
    """``calls`` calls; at the second, rank 1 of each tensor group gets another batch: the outcome per call."""
    mesh, sharded, state, step = split_step(tensor, **options)
    out = []
    for k, batch in enumerate(batches()[:calls]):
        local = split_batch(batch, mesh.data_rank, mesh.data_size)
        if k == 1 and mesh.axis_rank("tensor") == 1:
            local = {**local, "x": local["x"].flip(0)}  # the same rows, in another order
        before = {n: t.clone() for n, t in sharded.items()}
        try:
            sharded, state, _ = step(sharded, state, local)
            out.append("ok")
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out.append(f"{type(e).__name__}: {e}")
            out.append(all(torch.equal(before[n], sharded[n]) for n in before))
    return out


def test_ranks_of_a_tensor_group_that_get_other_batches_all_raise(clusters):
    # Without the check both steps ran ("ok", "ok"): each rank's partial sums of another
    # input were added together, a wrong step without a word. At world 4 both tensor groups
    # ({0, 1} and {2, 3}) differ, and each names its own ranks.
    for world in (2, 4):
        for rank, out in enumerate(clusters[world].run(_other_batches, 2)):
            group = [rank - rank % 2, rank - rank % 2 + 1]
            assert out[0] == "ok" and out[2] is True, (world, rank, out)  # the state is as before the step
            assert out[1].startswith(f"DivergenceError: [rank {rank}] shardfn: the ranks of tensor group {group} got "
                                     "different batches"), (world, rank, out[1])
            assert "split_batch(batch, mesh.data_rank, mesh.data_size)" in out[1]
