"""shard(ignored=...): parameters outside the plan, as FSDP's ignored modules ([Note: ignored
parameters] in shardfn/_state/resolve.py): whole on every rank, in no unit, their gradients
all-reduced once a step; the step equals one process, and checkpoints move them in and out
of the plan."""

import pytest
import torch

import shardfn as sf
import shardfn.checkpoint as ck
from shardfn.testing import split_batch
from shardfn.testing.models import GPT, GPTConfig, lm_loss

from bounds import SGD_MOMENTUM

CFG = GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layers=2, n_heads=2)
RTOL, ATOL = 1e-5, 1e-6  # SGD with momentum over 3 steps: tests/bounds.py's sgd_bound, well inside atol
STEPS, CLIP = 3, 0.5  # (clipping acts: the gradient's norm is above 0.5 at every step)


def loss_fn(apply, params, batch):
    return lm_loss(apply(params, batch[0]), batch[1])


def batches():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randint(0, CFG.vocab_size, (12, CFG.seq_len), generator=g) for _ in range(STEPS)]
    return [(x, torch.roll(x, -1, 1)) for x in xs]


def optimizer():
    return sf.optim.chain(sf.optim.clip_by_global_norm(CLIP), SGD_MOMENTUM())


def model(frozen=()):
    torch.manual_seed(0)
    m = GPT(CFG)
    for n, p in m.named_parameters():
        p.requires_grad_(not n.startswith(tuple(frozen)))
    return m


def reference(frozen=()):
    """One process on the global batches: the losses, the gradient norms, the final state."""
    params, apply = sf.functionalize(model(frozen))
    state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    opt = optimizer()
    opt_state, losses, norms = opt.init(state), [], []
    for b in batches():
        loss = loss_fn(apply, state, b)
        names = [n for n, t in state.items() if t.requires_grad]
        grads = dict(zip(names, torch.autograd.grad(loss, [state[n] for n in names])))
        norms.append(float(torch.stack([g.detach().square().sum() for g in grads.values()]).sum().sqrt()))
        updates, opt_state = opt.update(grads, opt_state, state)
        state = {n: t.detach().requires_grad_(t.requires_grad) for n, t in sf.optim.apply_updates(state, updates).items()}
        losses.append(float(loss.detach()))
    return losses, norms, {n: t.detach() for n, t in state.items()}


def sharded(strategy, ignored, replicate=None, frozen=(), micro_batches=1):
    mesh = sf.Mesh.from_group(replicate=replicate)
    params, _ = sf.functionalize(model(frozen))
    tree = sf.shard(params, mesh, strategy, ignored=ignored)
    opt = optimizer()
    state, step = opt.init(tree), sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=micro_batches)
    losses, norms, reduced = [], [], []
    for b in batches():
        with sf.record_collectives() as log:
            tree, state, m = step(tree, state, split_batch(b, mesh.data_rank, mesh.data_size))
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        reduced.append([(c.kind.value, c.nbytes) for c in log.select("reduce", "")])
    units = {n for u in tree.layout.units for n in u.leaves}
    whole = {n: tree[n].detach().clone() for n in tree.layout.ignored}
    return {"losses": losses, "norms": norms, "state": sf.gather(tree), "whole": whole, "reduced": reduced,
            "in_units": sorted(units & set(tree.layout.ignored)), "ignored": sorted(tree.layout.ignored)}


IGNORED = ["blocks.0.mlp", "head.weight"]  # a module path (its 4 parameters) and a parameter name
NAMES = ["blocks.0.mlp.0.bias", "blocks.0.mlp.0.weight", "blocks.0.mlp.2.bias", "blocks.0.mlp.2.weight", "head.weight"]


@pytest.mark.parametrize("strategy, world, replicate, micro_batches", [
    ("FULL_SHARD", 2, None, 1), ("SHARD_GRAD_OP", 2, None, 1), ("NO_SHARD", 2, None, 1), ("HYBRID_SHARD", 4, 2, 1),
    ("FULL_SHARD", 2, None, 3),  # (their gradients summed over the micro-batches, then all-reduced once)
])
def test_a_step_with_ignored_parameters_equals_one_process(clusters, strategy, world, replicate, micro_batches):
    ref_losses, ref_norms, ref_state = reference()
    runs = clusters[world].run(sharded, strategy, IGNORED, replicate, (), micro_batches)
    elements = sum(ref_state[n].numel() for n in NAMES)
    for run in runs:
        assert run["ignored"] == NAMES and run["in_units"] == []
        for got, want in zip(run["losses"] + run["norms"], ref_losses + ref_norms):
            assert abs(got - want) <= ATOL + RTOL * abs(want), (run["losses"], ref_losses, run["norms"], ref_norms)
        for n, want in ref_state.items():
            assert float(((run["state"][n] - want).abs() - RTOL * want.abs()).max()) <= ATOL, n
        for n, t in run["whole"].items():  # whole on every rank, and the same on every rank
            assert t.shape == ref_state[n].shape and torch.equal(t, runs[0]["whole"][n]), n
        # their gradients: one fp32 all-reduce a step, of all of them laid end to end (per mesh axis)
        axes = 2 if replicate else 1
        assert all(r == [("all_reduce", 4 * elements)] * axes for r in run["reduced"]), run["reduced"]


def test_frozen_ignored_parameters_take_no_collective(clusters):
    frozen = ("blocks.0.mlp",)
    _, _, ref_state = reference(frozen)
    for run in clusters[2].run(sharded, "FULL_SHARD", ["blocks.0.mlp"], None, frozen):
        assert run["reduced"] == [[]] * STEPS
        for n, want in ref_state.items():
            assert float(((run["state"][n] - want).abs() - RTOL * want.abs()).max()) <= ATOL, n


def grads(ignored):
    mesh = sf.Mesh.from_group()
    params, _ = sf.functionalize(model())
    tree = sf.shard(params, mesh, "FULL_SHARD", ignored=ignored)
    _, g, _ = sf.jit_grad(loss_fn, mesh)(tree, split_batch(batches()[0], mesh.rank, mesh.size))
    return {n: g[n] for n in tree.layout.ignored}


def test_jit_grad_gives_the_whole_gradient_of_an_ignored_parameter(clusters):
    params, apply = sf.functionalize(model())
    loss = loss_fn(apply, params, batches()[0])
    want = dict(zip(NAMES, torch.autograd.grad(loss, [params[n] for n in NAMES])))
    for got in clusters[2].run(grads, IGNORED):
        assert sorted(got) == NAMES
        for n in NAMES:
            assert float(((got[n] - want[n]).abs() - RTOL * want[n].abs()).max()) <= ATOL, n


def save_and_step(path, ignored):
    """One step, saved; then the next step. Returns the saved state and the state after."""
    mesh = sf.Mesh.from_group()
    params, _ = sf.functionalize(model())
    tree = sf.shard(params, mesh, "FULL_SHARD", ignored=ignored)
    opt = sf.optim.adamw(1e-2, eps=1e-3)
    state, step = opt.init(tree), sf.jit_step(loss_fn, mesh, optimizer=opt)
    tree, state, _ = step(tree, state, split_batch(batches()[0], mesh.rank, mesh.size))
    if path is not None:
        ck.save(path, tree, state)
    saved = sf.gather(tree)
    tree, state, _ = step(tree, state, split_batch(batches()[1], mesh.rank, mesh.size))
    return saved, sf.gather(tree)


def load_and_step(path, ignored):
    mesh = sf.Mesh.from_group()
    torch.manual_seed(1)
    params, _ = sf.functionalize(GPT(CFG))  # other values: the checkpoint's replace them
    tree = sf.shard(params, mesh, "FULL_SHARD", ignored=ignored)
    opt = sf.optim.adamw(1e-2, eps=1e-3)
    tree, state, _ = ck.load(path, tree, opt.init(tree))
    loaded = sf.gather(tree)
    tree, state, _ = sf.jit_step(loss_fn, mesh, optimizer=opt)(tree, state, split_batch(batches()[1], mesh.rank,
                                                                                         mesh.size))
    return loaded, sf.gather(tree)


def test_checkpoints_move_parameters_into_and_out_of_ignored(clusters, tmp_path):
    # saved at 2 with and without ignored; loaded at 3 with, without, and other ignored parameters
    for saved_with in (IGNORED, None):
        path = str(tmp_path / f"ck-{saved_with is None}")
        saved, after = clusters[2].run(save_and_step, path, saved_with)[0]
        for loaded_with in (None, IGNORED, ["blocks.1"]):
            loaded, stepped = clusters[3].run(load_and_step, path, loaded_with)[0]
            assert all(torch.equal(loaded[n], saved[n]) for n in saved), (saved_with, loaded_with)
            # and the AdamW moments came with them: the next step is the one the saving run took
            # (another world: the gradient's sum in another order; AdamW with eps 1e-3, tests/bounds.py)
            for n, want in after.items():
                assert float(((stepped[n] - want).abs() - RTOL * want.abs()).max()) <= ATOL, (n, saved_with, loaded_with)


def refused(kind):
    mesh = sf.Mesh.from_group(tensor=2 if kind == "tensor" else None)
    params, _ = sf.functionalize(model().to(torch.bfloat16) if kind == "bf16" else model())
    kw = {"offload": dict(offload=sf.Offload(params=True, optimizer=True)), "remat": dict(remat=sf.Remat()),
          "precision": dict(precision=sf.Precision(param=torch.bfloat16))}.get(kind, {})
    ignored = {"nothing": ["blocks.9"], "type": [42]}.get(kind, ["blocks.0.mlp"])
    try:
        tree = sf.shard(params, mesh, "FULL_SHARD", ignored=ignored, **kw)
        opt = SGD_MOMENTUM()
        sf.jit_step(loss_fn, mesh, optimizer=opt, graph=True)(tree, opt.init(tree), split_batch(
            batches()[0], mesh.rank, mesh.size))
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind, said", [
    ("tensor", "ignored parameters are not split over it yet"),
    ("offload", "ignored parameters stay on the device"),
    ("remat", "blocks.0.mlp.0.bias, blocks.0.mlp.0.weight, blocks.0.mlp.2.bias would be recomputed in unit 'blocks.0'"),
    ("graph", "the gradients of the ignored parameters (blocks.0.mlp.0.weight"),
    ("precision", "ignored parameters are not cast, so a unit's computed dtype would meet theirs"),
    ("bf16", "blocks.0.mlp.0.bias, blocks.0.mlp.0.weight, blocks.0.mlp.2.bias train in torch.bfloat16"),
    ("nothing", "'blocks.9' names no parameter"),
    ("type", "expected parameter names, module paths or module classes; got 42"),
])
def test_what_ignored_parameters_cannot_do_is_refused_on_every_rank(clusters, kind, said):
    for rank, msg in enumerate(clusters[2].run(refused, kind)):
        assert said in msg, (rank, msg)


def tied():
    params, _ = sf.functionalize(GPT(GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layers=1, n_heads=2,
                                               tie_embeddings=True)))
    mesh = sf.Mesh.from_group()
    try:
        sf.shard(params, mesh, "FULL_SHARD", ignored=["head"])
        said = "no error"
    except ValueError as e:
        said = str(e)
    tree = sf.shard(params, mesh, "FULL_SHARD", ignored=["head", "tok"])  # both of its modules: whole
    return said, list(tree.layout.ignored), str(tree.layout)


def test_a_tied_parameter_is_ignored_whole_or_not_at_all(clusters):
    for said, ignored, layout in clusters[2].run(tied):
        assert "'tok.weight' is tied across the ignored modules and others" in said, said
        assert ignored == ["tok.weight"] and "ignored (whole on every rank, outside the units): 1 parameters" in layout
