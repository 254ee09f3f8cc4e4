"""Sharded training equals plain single-process training on the same global batch."""

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import shardfn as sf
from bounds import ADAMW, SGD_MOMENTUM
from shardfn.testing import check_equivalence, reference_training
from shardfn.testing.models import GPT, MLP, GPTConfig, Layer, lm_loss

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
GLOBAL_BATCH = 12  # divisible by every world size 1..4
STEPS = 3


def mlp_model(sizes=(12, 10, 7, 5)):
    return MLP(list(sizes))


def mlp_loss(apply, params, batch):
    return F.mse_loss(apply(params, batch["x"]), batch["y"])


def mlp_batches(d_in=12, d_out=5, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(GLOBAL_BATCH, d_in, generator=g), "y": torch.randn(GLOBAL_BATCH, d_out, generator=g)} for _ in range(steps)]


GPT_CFG = GPTConfig(vocab_size=29, seq_len=8, d_model=16, n_layers=2, n_heads=2)


def gpt_model():
    return GPT(GPT_CFG)


def gpt_loss(apply, params, batch):
    return lm_loss(apply(params, batch["x"]), batch["y"])


def gpt_batches(steps=STEPS, seed=2):
    g = torch.Generator().manual_seed(seed)
    shape = (GLOBAL_BATCH, GPT_CFG.seq_len)
    return [{"x": torch.randint(0, 29, shape, generator=g), "y": torch.randint(0, 29, shape, generator=g)} for _ in range(steps)]


# Their tolerances, on any CPU: tests/bounds.py ([Note: tolerances after training]).
OPTIMIZERS = {"sgd_momentum": SGD_MOMENTUM, "adamw": ADAMW}
MODELS = {"mlp": (mlp_model, mlp_loss, mlp_batches), "gpt": (gpt_model, gpt_loss, gpt_batches)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_every_strategy_matches_single_process(clusters, model_name, opt_name, world):
    model_fn, loss_fn, batches = MODELS[model_name]
    report = check_equivalence(
        model_fn, loss_fn, batches(), optimizer=OPTIMIZERS[opt_name], strategies=STRATEGIES,
        world_sizes=[world], clusters=clusters, rtol=1e-5, atol=1e-6,
    )
    assert len(report.leaves) == len(STRATEGIES)
    assert all(len(v) == len(sf.functionalize(model_fn())[0]) for v in report.leaves.values())


@pytest.mark.parametrize("model_name, opt_name", [("gpt", "adamw"), ("mlp", "sgd_momentum")])
def test_functional_reference_is_plain_torch_training(model_name, opt_name):
    """The reference the kit compares against equals nn.Module + torch.optim training."""
    model_fn, loss_fn, batches = MODELS[model_name]
    losses, params = reference_training(model_fn, loss_fn, batches(), OPTIMIZERS[opt_name])
    torch.manual_seed(0)
    model = model_fn()
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch_losses = []
    for b in batches():
        out = model(b["x"])
        loss = lm_loss(out, b["y"]) if model_name == "gpt" else F.mse_loss(out, b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    assert losses == pytest.approx(torch_losses, rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(params[n], p.detach(), rtol=1e-5, atol=1e-6)


UNIT_POLICIES = {
    "default": None,
    "by_type": sf.by_module_type(Layer),
    "by_count": sf.by_param_count(40),
    "first_two": sf.by_prefix("layers.0", "layers.1"),
    "root_only": sf.by_prefix("layers.0"),
}


@settings(max_examples=16)
@given(
    sizes=st.lists(st.integers(1, 13), min_size=3, max_size=5),
    world=st.integers(1, 4),
    strategy=st.sampled_from(STRATEGIES),
    policy=st.sampled_from(sorted(UNIT_POLICIES)),
)
def test_drawn_shapes_units_and_world_sizes(clusters, sizes, world, strategy, policy):
    if policy == "by_count" and max(a * b + b for a, b in zip(sizes, sizes[1:])) < 40:
        policy = "by_type"  # by_param_count(40) would match nothing: an error (tests/test_layout.py)
    model_fn = functools.partial(mlp_model, tuple(sizes))
    report = check_equivalence(
        model_fn, mlp_loss, mlp_batches(sizes[0], sizes[-1]), optimizer=OPTIMIZERS["sgd_momentum"],
        strategies=[strategy], world_sizes=[world], units=UNIT_POLICIES[policy], clusters=clusters,
    )
    assert report.failures() == []


class _UserSGD:
    """A user-written optimizer: any object with init and update, nothing from shardfn.optim."""

    def init(self, params):
        return {"steps": 0}

    def update(self, grads, state, params):
        return {k: -0.05 * g for k, g in grads.items()}, {"steps": state["steps"] + 1}


USER_OPTIMIZERS = {
    "user_written": _UserSGD,
    "torch_adam": functools.partial(sf.optim.from_torch, torch.optim.Adam, lr=1e-3, eps=1e-3),  # tests/bounds.py
    "torch_sgd_nesterov": functools.partial(sf.optim.from_torch, torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt_name", list(USER_OPTIMIZERS))
def test_user_and_torch_optimizers_on_shards(clusters, opt_name, world):
    report = check_equivalence(
        gpt_model, gpt_loss, gpt_batches(), optimizer=USER_OPTIMIZERS[opt_name],
        strategies=["FULL_SHARD", "NO_SHARD"], world_sizes=[world], clusters=clusters,
    )
    assert report.failures() == []


class Recurrent(torch.nn.Module):
    """Each unit runs twice per forward (weights shared across "time")."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(12, 12), torch.nn.Linear(12, 12)])
        self.head = torch.nn.Linear(12, 5)

    def forward(self, x):
        for _ in range(2):
            for b in self.blocks:
                x = F.gelu(b(x))
        return self.head(x)


@pytest.mark.parametrize("world", [2, 3])
def test_units_called_twice_per_forward(clusters, world):
    report = check_equivalence(Recurrent, mlp_loss, mlp_batches(12, 5), optimizer=OPTIMIZERS["adamw"],
                               world_sizes=[world], clusters=clusters)
    assert report.failures() == []
