"""shardfn.bind: the model as an nn.Module on shards; greedy decoding and HF generate."""

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from shardfn.testing.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=29, seq_len=16, d_model=16, n_layers=3, n_heads=2)
PROMPT = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
NEW = 10


def gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def greedy(model, prompt, new):
    """Greedy decoding with the model called as a module, one forward per token."""
    x = prompt
    for _ in range(new):
        x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=61, n_positions=32, n_embd=24, n_layer=3, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).eval()


def hf_generate(model, prompt, new):
    return model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))


MODELS = {"gpt": (gpt, greedy), "gpt2": (gpt2, hf_generate)}


def decode_on_shards(name, strategy, keep, remat=None):
    make, decode = MODELS[name]
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(make())
    sharded = sf.shard(params, mesh, strategy, remat=remat)
    apply.eval()
    with sf.record_collectives() as log:
        with sf.bind(apply, sharded, keep_gathered=keep) as model:
            out = decode(model, PROMPT, NEW)
    units = [u for u in sharded.layout.units if u.path]
    meta_after = all(p.is_meta for p in apply.module.parameters())  # the module holds no state again
    # the units gathered together ([Note: buckets]): one all-gather per bucket of units
    buckets = sum(1 for b in sharded.layout.gather_buckets if sharded.layout.units[b[0]].path)
    return out, dict(log.counts(purpose="gather")), len(units), any(u.path == "" for u in sharded.layout.units), \
        meta_after, buckets


def decode_plain(name):
    make, decode = MODELS[name]
    with torch.no_grad():
        return decode(make().eval(), PROMPT, NEW)


@pytest.mark.parametrize("name", ["gpt", "gpt2"])
@pytest.mark.parametrize("world", [2, 3])
def test_decoding_on_shards_gives_the_single_process_tokens(clusters, name, world):
    want = decode_plain(name)
    assert want.shape == (2, 4 + NEW)
    for keep in (False, True):
        for out, gathers, units, has_root, meta_after, buckets in clusters[world].run(
                decode_on_shards, name, "FULL_SHARD", keep):
            assert torch.equal(out, want), (keep, out, want)
            assert units == CFG.n_layers and has_root and meta_after and buckets == 1
            # One all-gather of the root at entry; then per bucket of units (here all of them)
            # one for every forward (NEW of them: HF and our loop both run one forward per new
            # token), or one in all.
            assert gathers == {"all_gather": 1 + buckets * (1 if keep else NEW)}, (keep, gathers)


@pytest.mark.parametrize("strategy, remat", [("SHARD_GRAD_OP", None), ("FULL_SHARD", sf.Remat())])
def test_decoding_under_other_strategies_and_remat(clusters, strategy, remat):
    # SHARD_GRAD_OP keeps units gathered until backward in a step; bind has no backward, so
    # without keep_gathered it lets go after each forward too. Remat units gather inside
    # their checkpoint region, which runs plainly under no_grad.
    want = decode_plain("gpt")
    for keep in (False, True):
        for out, gathers, units, _, _, buckets in clusters[2].run(decode_on_shards, "gpt", strategy, keep, remat):
            assert torch.equal(out, want)
            assert buckets == (units if remat is not None else 1)  # rematerialised units gather alone
            assert gathers == {"all_gather": 1 + buckets * (1 if keep else NEW)}, (keep, gathers)


def test_bind_refuses_what_is_not_shards():
    params, apply = sf.functionalize(gpt())
    with pytest.raises(TypeError, match="expected the ShardedParams"):
        with sf.bind(apply, params):
            pass


def bind_errors():
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(gpt())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    messages = []
    try:
        with sf.bind(apply, sharded) as model:
            model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))  # the model raises in forward
    except ValueError as e:
        messages.append(str(e))
    # After the error the module holds no state, and a call works again.
    with sf.bind(apply, sharded) as model:
        ok = model(PROMPT).shape == (2, 4, CFG.vocab_size)
    def loss_fn(apply, p, b):
        with sf.bind(apply, p):
            pass
        return apply(p, b).sum()

    step = sf.jit_step(loss_fn, mesh, optimizer=sf.optim.sgd(0.1))
    try:
        step(sharded, step.init(sharded), PROMPT)
    except RuntimeError as e:
        messages.append(str(e))
    dist.barrier()
    return messages, ok, all(p.is_meta for p in apply.module.parameters())


def test_bind_cleans_up_after_an_error_and_refuses_a_step(clusters):
    for messages, ok, meta in clusters[2].run(bind_errors):
        assert "exceeds cfg.seq_len" in messages[0]
        assert "inside a step" in messages[1]
        assert ok and meta


def bind_with_different_calls():
    """Rank 0 runs one forward inside bind, rank 1 two: what each rank's block ends with."""
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(gpt())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    apply.eval()
    try:
        with sf.bind(apply, sharded) as model:
            for _ in range(1 + mesh.rank):
                model(PROMPT)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        outcome = (type(e).__name__, str(e))
    else:
        outcome = ("returned", "")
    # and the ranks go on together: a later collective works on both
    return outcome, sf.gather(sharded)["head.weight"].shape


def test_ranks_whose_calls_inside_bind_differ_all_raise_the_same_error(clusters):
    (first, shape0), (second, shape1) = clusters[2].run(bind_with_different_calls)
    assert first[0] == second[0] == "DivergenceError"
    for _, message in (first, second):
        # each rank's message says what every rank was about to do
        assert "rank 0: the end of its `with shardfn.bind(...)` block" in message, message
        assert "rank 1: all_gather (gather of" in message and "synced_gpus=True" in message, message
        assert "float32, inside `with shardfn.bind(...)`" in message, message  # where rank 1 was
    assert shape0 == shape1 == (CFG.vocab_size, CFG.d_model)


def psums_that_differ():
    """Rank 0 runs one psum inside on_shards, rank 1 two."""
    mesh = sf.Mesh.from_group()
    params, _ = sf.functionalize(gpt())
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    try:
        with sf.on_shards(sharded):
            for _ in range(1 + mesh.rank):
                sf.optim.psum(torch.ones(()))
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return type(e).__name__, str(e)
    return "returned", ""


def test_ranks_whose_psums_inside_on_shards_differ_all_raise(clusters):
    first, second = clusters[2].run(psums_that_differ)
    assert first[0] == second[0] == "DivergenceError"
    for _, message in (first, second):
        assert "rank 0: the end of its `with shardfn.on_shards(...)` block" in message, message
        assert "rank 1: all_reduce (psum)" in message and "every psum" in message, message
