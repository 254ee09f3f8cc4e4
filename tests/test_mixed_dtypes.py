"""Mixed dtypes in one unit: a bf16 Hugging Face GPT-2 with fp32 peft LoRA adapters.

Each block holds bf16 base weights (frozen) and fp32 adapters (trainable); the block is
one unit per dtype group (see [Note: mixed dtypes in a unit]).
"""

import pytest
import torch
import torch.nn.functional as F

import shardfn as sf
from shardfn.testing import split_batch

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ROWS, SEQ, VOCAB, STEPS = 12, 16, 61, 3
BF16_ROUNDOFF = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)


def lora_gpt2():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0,
                                             fan_in_fan_out=True))
    with torch.no_grad():  # peft starts B at zero, which leaves A's first gradient zero: start both moving
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def loss_fn(apply, params, batch):
    logits = apply(params, input_ids=batch["x"]).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())


def batches():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), "y": torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)}
            for _ in range(STEPS)]


def opt():
    return sf.optim.sgd(0.5)


def reference(world):
    """One process, the same dtypes, plain SGD on the adapters: ``(global, per_slices)``.

    ``global``: each step's gradient on the whole batch. ``per_slices``: each step's
    gradient as the sum, in rank order, over the ``world`` slices the ranks get of the
    gradients of each slice's loss over ``world`` (what the sharded run computes)."""
    out = []
    for sliced in (False, True):
        params, apply = sf.functionalize(lora_gpt2())
        state = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
        trainable = [n for n, t in state.items() if t.requires_grad]
        o = opt()
        opt_state = o.init(state)
        moved = {n: 0.0 for n in trainable}  # per leaf: the sum over steps of the largest |update|
        for b in batches():
            parts = [split_batch(b, r, world) for r in range(world)] if sliced else [b]
            grads = {n: torch.zeros_like(state[n]) for n in trainable}
            for part in parts:
                # As a step does (see [Note: averaging gradients]): the loss is scaled before
                # backward, so bf16 gradients inside the model carry the 1/world factor.
                loss = loss_fn(apply, state, part) / len(parts)
                for n, g in zip(trainable, torch.autograd.grad(loss, [state[n] for n in trainable])):
                    grads[n] += g
            before = {n: state[n].detach().clone() for n in trainable}
            # The step's own update path: in place, on the donated shards.
            opt_state = o.update_(grads, opt_state, {n: state[n] for n in trainable})
            for n in trainable:
                moved[n] += float((state[n].detach() - before[n]).abs().max())
        out.append(({n: t.detach() for n, t in state.items()}, moved))
    return out


def train(strategy, remat):
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(lora_gpt2())
    sharded = sf.shard(params, mesh, strategy, remat=sf.Remat() if remat else None)
    o = opt()
    state = o.init(sharded)
    step = sf.jit_step(loss_fn, mesh, optimizer=o)
    for b in batches():
        sharded, state, metrics = step(sharded, state, split_batch(b, mesh.rank, mesh.size))
    lay = sharded.layout
    units = [(u.path, u.name, u.dtype, u.param_dtype, u.numel, u.grad_numel) for u in lay.units]
    # the memory the shards occupy: a flat unit's shards share one buffer, its padding included
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in sharded.params().values()
                if t.numel()}
    shard_bytes = sum(storages.values())
    full = sf.gather(sharded)
    # Dtypes are read here: the cluster sends bf16 tensors back as fp32 (numpy has no bf16).
    return (full, {n: t.dtype for n, t in full.items()}, units, shard_bytes, lay.shard_bytes(),
            dict(metrics["comm_bytes"]), {k: b for k, (_, b) in lay.collectives_per_step().items()})


@pytest.mark.parametrize("strategy, remat, world", [
    ("FULL_SHARD", False, 2), ("FULL_SHARD", False, 3), ("FULL_SHARD", True, 2), ("SHARD_GRAD_OP", False, 3),
])
def test_bf16_model_with_fp32_lora_adapters(clusters, strategy, remat, world):
    initial = {n: t.detach().clone() for n, t in sf.functionalize(lora_gpt2())[0].items()}
    assert {t.dtype for n, t in initial.items() if "lora_" in n} == {torch.float32}
    assert {t.dtype for n, t in initial.items() if "lora_" not in n} == {torch.bfloat16}
    (whole, moved), (sliced, _) = reference(world)
    for full, dtypes, units, shard_bytes, predicted_shard_bytes, comm, predicted_comm in clusters[world].run(
            train, strategy, remat):
        assert dtypes == {n: initial.get(n, initial["base_model.model.transformer.wte.weight"]).dtype for n in full}
        # Each block is two units on one module, one per dtype, gathered in its own dtype;
        # only the fp32 group has gradients to reduce.
        blocks = [u for u in units if u[0].endswith(("h.0", "h.1"))]
        assert [(name.rsplit(".", 1)[-1], dt, pdt) for _, name, dt, pdt, _, _ in blocks] == [
            ("0[bfloat16]", torch.bfloat16, torch.bfloat16), ("0[float32]", torch.float32, torch.float32),
            ("1[bfloat16]", torch.bfloat16, torch.bfloat16), ("1[float32]", torch.float32, torch.float32)]
        assert [g for *_, g in blocks][0::2] == [0, 0] and all(g > 0 for *_, g in blocks[1::2])
        # Memory and bytes exactly as the layout counts them: 2 bytes per bf16 element, 4 per fp32.
        assert shard_bytes == predicted_shard_bytes
        assert comm["all_gather"] == predicted_comm["all_gather"] and comm["reduce_scatter"] == predicted_comm["reduce_scatter"]
        for n, t in full.items():
            if "lora_" not in n:  # (lm_head.weight is the tied wte.weight)
                assert torch.equal(t, initial.get(n, full["base_model.model.transformer.wte.weight"]).float()), n
                continue
            # The sharded run computes what one process computes on the ranks' slices, bit for
            # bit: each rank runs the same kernels on the same shapes as the reference's slice
            # (the same matmuls, strides and alignment), and the reduce-scatter adds the ranks'
            # gradients in rank order, as the reference does (shardfn._comm.collectives [Note: the
            # order of the sum]). Only exactness can hold here: a last-bit difference in an fp32
            # adapter can move a bf16 rounding of the block's output, which the next steps turn
            # into a relative 2**-8 change of some gradient (on MKL's AVX-512 kernels, a world-3
            # run that summed in another order ended 7.5e-7 away, rel 3.8e-4).
            torch.testing.assert_close(t, sliced[n], rtol=0, atol=0)
            # Against the whole batch on one process: the adapters' gradients are fp32 sums
            # over rows of products with bf16 values; a different batch split changes the
            # bf16 kernels' blocking and where the 1/world factor meets a rounding, which can
            # move individual bf16 roundings by one unit (relative 2**-8). SGD's update is
            # linear in the gradient, so each step's update moves by at most 2**-8 of that
            # step's largest update, and the differences of the steps add up: the bound is
            # 2**-8 times the sum over steps of the leaf's largest |update|.
            assert moved[n] > 0, n
            assert (t - whole[n]).abs().max() <= BF16_ROUNDOFF * moved[n], n


class Scaled(torch.nn.Module):
    """A linear layer (fp32) with an fp64 output scale: two dtypes in one module."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.empty(4, dtype=torch.float64))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.scale.fill_(2.0)

    def forward(self, x):
        return self.lin(x) * self.scale.float()


def deferred_mixed():
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(Scaled(), torch.nn.Linear(4, 2))
    params, apply = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD", units=sf.by_prefix("0"), seed=3)
    full = sf.gather(sharded)
    plain = torch.nn.Sequential(Scaled(), torch.nn.Linear(4, 2))
    plain.load_state_dict(full)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    return ([u.name for u in sharded.layout.units], full["0.scale"].dtype, bool(torch.isfinite(full["0.lin.weight"]).all()),
            apply(sharded, x).detach(), plain(x).detach())


def test_deferred_init_and_a_call_of_a_unit_with_two_dtypes(clusters):
    for names, scale_dtype, finite, out, want in clusters[2].run(deferred_mixed):
        assert names == ["<root>", "0[float64]", "0[float32]"]  # groups in order of first appearance
        assert scale_dtype == torch.float64 and finite
        torch.testing.assert_close(out, want, rtol=0, atol=0)


def round_trips(path):
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(lora_gpt2())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    step = sf.jit_step(loss_fn, mesh, optimizer=sf.optim.adamw(1e-3))
    sharded, state, _ = step(sharded, step.init(sharded), split_batch(batches()[0], mesh.rank, mesh.size))
    sf.checkpoint.save(path, sharded, state)
    fresh = sf.shard(sf.functionalize(lora_gpt2())[0], mesh, "NO_SHARD")
    loaded, _, _ = sf.checkpoint.load(path, fresh)  # another strategy; parameters only
    moved, _ = sf.reshard(sharded, state, sf.Plan("SHARD_GRAD_OP"))
    trained, loaded, moved = sf.gather(sharded), sf.gather(loaded), sf.gather(moved)
    # Compared here: the cluster sends bf16 tensors back as fp32 (numpy has no bf16).
    wrong_dtype = [n for n, t in trained.items() if t.dtype != (torch.float32 if "lora_" in n else torch.bfloat16)]
    differ = [n for n, t in trained.items() if not (torch.equal(t, loaded[n]) and torch.equal(t, moved[n])
                                                    and t.dtype == loaded[n].dtype == moved[n].dtype)]
    return trained.keys() == loaded.keys() == moved.keys(), wrong_dtype, differ, len(trained)


def test_checkpoint_and_reshard_keep_each_dtype_bitwise(clusters, tmp_path):
    for same_keys, wrong_dtype, differ, n in clusters[2].run(round_trips, str(tmp_path / "ckpt")):
        assert same_keys and n > 0
        assert wrong_dtype == [] and differ == []


def values_of_another_dtype(placement):
    """A small fp32 unit before a large bf16 one, and values (moments) in one dtype for both:
    ``gather`` of a tree of such values, and ``reshard`` of an optimizer state holding them."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(16, 16).to(torch.bfloat16))
    params, _ = sf.functionalize(model)
    sharded = sf.shard(params, mesh, "FULL_SHARD", units=sf.by_module_type(torch.nn.Linear), placement=placement)
    full = sf.gather(sharded)  # each value in its own dtype: the units' own
    units = [(u.name, u.dtype) for u in sharded.layout.units if u.numel]
    wrong = []
    for dtype in (torch.float32, torch.bfloat16):
        values = {n: t.detach().to(dtype) for n, t in sharded.params().items()}
        # Casting commutes with gathering: the full values are the cast full parameters, bit for bit.
        got = sf.gather(sharded.replace(values))
        wrong += [(str(dtype), n) for n in full if got[n].dtype != dtype or not torch.equal(got[n], full[n].to(dtype))]
        moved, state = sf.reshard(sharded, {"mu": values}, "SHARD_GRAD_OP")
        got = sf.gather(moved.replace(state["mu"]))
        wrong += [(f"reshard {dtype}", n) for n in full
                  if got[n].dtype != dtype or not torch.equal(got[n], full[n].to(dtype))]
    return units, wrong


@pytest.mark.parametrize("placement", ["flat", "rows"])
def test_gather_and_reshard_values_of_another_dtype_than_their_unit(clusters, placement):
    for units, wrong in clusters[2].run(values_of_another_dtype, placement):
        assert units == [("0", torch.float32), ("1", torch.bfloat16)]
        assert wrong == []
