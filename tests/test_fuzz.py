"""Bad input is fuzzed (issue 13 §4).

Each wrong input -- per-rank batch shapes, dtypes, micro-batch counts, unit policies,
strategies, model differences, non-tensor leaves, missing or extra keys, wrong optimizer
state, misbehaving loss functions (see KINDS) -- is a test on a spawned 2- and 3-rank gloo
world; Hypothesis draws the ranks that get it (some, or every rank where the input is wrong
in itself) and the setting they share (strategy, micro-batches, optimizer). On every rank
the worker first shards a tiny model and
takes one good step, then the bad call (a ``shard()`` or a step), then one more good step.
Every rank must raise a clear error within the step timeout, leave its shards and
optimizer state bitwise as they were, and go on with the next good step: never a hang,
never a rank whose bad call returned normally, never a broken process group (CommError)
from bad input. See docs/ranks-that-differ.md.
"""

from __future__ import annotations

import re
import time
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import shardfn as sf

# The meshes' step_timeout. A relayed error takes milliseconds; a bad call that ends only when
# the timeout fires is a missing relay, which the check below names. The bound is that
# behaviour, not a speed: 30 s holds on a machine with another heavy job on both cores (issue
# 38: at 5 s, two meta-batch cases failed there), and a failing example costs at most that.
STEP_TIMEOUT = 30.0
ROWS, SEQ, FEATS, VOCAB = 4, 5, 3, 11  # SEQ != ROWS: a good batch is not ambiguous (docs/training.md)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


class Tiny(nn.Module):
    """Token ids plus per-token features -> logits; two blocks (the default units)."""

    def __init__(self, d: int = 8, n_blocks: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, d))
        self.feat = nn.Linear(FEATS, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n_blocks))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]] + self.feat(feats)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


class Case(NamedTuple):
    """One drawn input: ``kind`` and ``variant`` say what is wrong, ``bad`` on which ranks;
    the rest is the (good) setting every rank shares."""

    kind: str
    variant: tuple
    bad: tuple[int, ...]
    strategy: str
    micro_batches: int
    optimizer: str


# kind -> (variants, whether the variant is wrong in itself: then every rank may get it;
# else it is wrong only as a difference between ranks, and some rank must stay good).
KINDS: dict[str, tuple[list[tuple], bool]] = {
    # -- the batch (a step) ---------------------------------------------------------------
    "rows": ([(d,) for d in (-4, -2, -1, 1, 2)], False),  # -4: an empty batch
    "seq_shorter": ([(2,), (3,)], False),  # a sequence length the model accepts
    "seq_longer": ([(6,), (7,)], True),  # longer than the model's positions
    "dtype": ([("ids", "float32"), ("ids", "float64"), ("feats", "float64"), ("feats", "float16"),
               ("feats", "int64"), ("y", "float32"), ("y", "int32"), ("feats", "meta")], True),
    "indivisible_rows": ([(3,), (5,), (7,)], True),  # with micro_batches 2 or 4
    "micro_batch_count": ([(1,), (2,), (4,)], False),  # jit_step(micro_batches=...) on bad ranks
    # sf.MicroBatches of another count, or of 2 uneven sizes (3 and 1 rows) with a plain mean loss
    "micro_batches_given": ([(1,), (4,), ("uneven",)], False),
    "missing_key": ([("ids",), ("feats",), ("y",)], True),
    "extra_key": ([("mask",), ("labels",)], True),
    "non_tensor": ([(k, v) for k in ("ids", "feats", "y") for v in ("None", "str", "list")], True),
    "not_a_dict": ([("tuple",), ("tensor",)], True),
    # -- the loss ------------------------------------------------------------------------
    "loss": ([("raise",), ("non_scalar",), ("python_float",), ("detached",), ("nan",)], True),
    "loss_kind": ([("mean",)], False),  # shardfn.Mean on some ranks, a plain mean on others
    # -- shard() -------------------------------------------------------------------------
    "units": ([("by_module_type(Linear)",), ("by_param_count(40)",), ("by_prefix(blocks.0)",),
               ("remat(blocks.0)",)], False),
    "bad_units": ([("by_module_type(Conv2d)",), ("by_prefix(nothing)",)], True),  # match no module
    "strategy": ([(s,) for s in STRATEGIES], False),
    "bad_strategy": ([("ZERO_SEVEN",)], True),
    "model": ([("extra_block",), ("hidden",), ("init",), ("frozen",), ("double",)], False),
    # -- the optimizer state -------------------------------------------------------------
    "opt_state": ([("other_model",), ("wrong_shape",), ("missing_key",), ("extra_key",),
                   ("other_optimizer",)], True),
}
SHARD_KINDS = {"units", "bad_units", "strategy", "bad_strategy", "model"}
VARIANTS = [(kind, variant) for kind, (variants, _) in KINDS.items() for variant in variants]


@st.composite
def cases(draw, world: int, kind: str, variant: tuple) -> Case:
    """``variant`` of ``kind`` on some ranks (drawn), in a setting (drawn) every rank shares."""
    alone = KINDS[kind][1]
    n_bad = draw(st.integers(1, world if alone else world - 1))
    bad = tuple(sorted(draw(st.permutations(range(world)))[:n_bad]))
    strategy = draw(st.sampled_from(STRATEGIES))
    micro = draw(st.sampled_from([2, 4] if kind == "indivisible_rows" else [1, 2]))
    optimizer = draw(st.sampled_from(["adamw", "sgd"]))
    if kind == "strategy" and variant[0] == strategy:  # a strategy other than the good one
        strategy = STRATEGIES[(STRATEGIES.index(strategy) + 1) % 3]
    if kind == "micro_batch_count" and variant[0] == micro:  # other micro_batches than the good
        micro = 2 if micro == 1 else 1
    if kind == "micro_batches_given":
        micro = 1  # the batch is given as sf.MicroBatches of 2 equal parts on good ranks
    return Case(kind, variant, bad, strategy, micro, optimizer)


# -- the worker (module level: the cluster imports it by reference) ------------------------


def _model(variant: tuple = ()) -> nn.Module:
    torch.manual_seed(1 if variant == ("init",) else 0)
    model = Tiny(d=12 if variant == ("hidden",) else 8, n_blocks=3 if variant == ("extra_block",) else 2)
    if variant == ("frozen",):
        model.blocks[0].requires_grad_(False)
    if variant == ("double",):
        model.double()
    return model


def _batch(seed: int, rows: int = ROWS, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"ids": torch.randint(0, VOCAB, (rows, seq), generator=g),
            "feats": torch.randn(rows, seq, FEATS, generator=g),
            "y": torch.randint(0, VOCAB, (rows, seq), generator=g)}


def _halves(batch: dict, parts: int) -> sf.MicroBatches:
    n = ROWS // parts
    return sf.MicroBatches([{k: v[i * n:(i + 1) * n] for k, v in batch.items()} for i in range(parts)])


_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "int64": torch.int64,
           "int32": torch.int32}


def _bad_batch(case: Case, seed: int):
    kind, v = case.kind, case.variant
    if kind == "rows":
        return _batch(seed, rows=ROWS + v[0])
    if kind in ("seq_shorter", "seq_longer"):
        return _batch(seed, seq=v[0])
    if kind == "indivisible_rows":
        return _batch(seed, rows=v[0])
    batch = _batch(seed)
    if kind == "dtype":
        batch[v[0]] = batch[v[0]].to("meta") if v[1] == "meta" else batch[v[0]].to(_DTYPES[v[1]])
    elif kind == "micro_batches_given" and v[0] == "uneven":
        return sf.MicroBatches([{k: t[:3] for k, t in batch.items()}, {k: t[3:] for k, t in batch.items()}])
    elif kind == "micro_batches_given":
        return _halves(batch, v[0])
    elif kind == "missing_key":
        del batch[v[0]]
    elif kind == "extra_key":
        batch[v[0]] = torch.ones(ROWS, SEQ)
    elif kind == "non_tensor":
        batch[v[0]] = {"None": None, "str": "tokens.txt", "list": batch[v[0]].tolist()}[v[1]]
    elif kind == "not_a_dict":
        return tuple(batch.values()) if v[0] == "tuple" else batch["ids"]
    return batch


def _opt(name: str):
    return sf.optim.adamw(1e-2) if name == "adamw" else sf.optim.sgd(0.1, momentum=0.9)


def _bad_opt_state(case: Case, sharded, state):
    v = case.variant[0]
    if v == "other_model":
        params, _ = sf.functionalize(_model(("extra_block",)))
        return _opt(case.optimizer).init(dict(params))
    if v == "other_optimizer":
        return _opt("sgd" if case.optimizer == "adamw" else "adamw").init(sharded)
    bad = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
    trees = [bad.mu, bad.nu] if case.optimizer == "adamw" else [bad.momentum_buffer]
    for tree in trees:
        if v == "wrong_shape":
            tree["blocks.0.weight"] = torch.zeros(tree["blocks.0.weight"].shape[0] + 1, 8)
        elif v == "missing_key":
            del tree["head.weight"]
        elif v == "extra_key":
            tree["blocks.7.weight"] = torch.zeros(2, 8)
    return bad


def _flat(sharded, *states) -> list:
    leaves = [t for k, t in sorted(sharded.items())]
    for s in states:
        leaves += pytree.tree_leaves(s)
    return leaves


def _copy(leaves: list) -> list:
    return [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]


def _same(before: list, after: list) -> bool:
    return len(before) == len(after) and all(
        (isinstance(b, torch.Tensor) and isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
         and torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b))
        or (not isinstance(b, torch.Tensor) and a == b)
        for b, a in zip(before, after))


def _outcome(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "first_line": "", "message": "", "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - the test inspects it
        text = str(e).strip()
        return {"error": type(e).__name__, "first_line": text.splitlines()[0] if text else "",
                "message": text[:2000], "seconds": time.monotonic() - t0}


def fuzz_worker(case: Case) -> dict:
    """On every rank: a good shard and step, the bad call, checks, a good step."""
    mesh = sf.Mesh.from_group(step_timeout=STEP_TIMEOUT)
    rank, is_bad = mesh.rank, mesh.rank in case.bad
    cell = {"bad": False}  # whether the loss_fn is in the bad call

    def loss_fn(apply, params, batch):
        if isinstance(batch, torch.Tensor):  # the token ids alone
            logits = apply(params, batch)
        elif not isinstance(batch, dict):  # as a user's loss_fn would, it indexes the batch by name
            logits = apply(params, batch["ids"], batch["feats"])
        else:
            logits = apply(params, **{k: v for k, v in batch.items() if k != "y"})
        loss = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        if cell["bad"] and is_bad and case.kind == "loss":
            what = case.variant[0]
            if what == "raise":
                raise KeyError("no column 'weights' in this batch")
            if what == "non_scalar":
                return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), reduction="none")
            if what == "python_float":
                return float(loss.detach())
            if what == "detached":
                return loss.detach()
            if what == "nan":
                return loss * float("nan")
        if cell["bad"] and is_bad and case.kind == "loss_kind":
            return sf.Mean(loss * batch["y"].numel(), batch["y"].numel())
        return loss

    def setup(model, strategy=case.strategy, **plan):
        params, apply = sf.functionalize(model)
        sharded = sf.shard(params, mesh, strategy, **plan)
        opt = _opt(case.optimizer)
        step = sf.jit_step(loss_fn, mesh, optimizer=opt, micro_batches=case.micro_batches)
        return sharded, step, opt.init(sharded), apply

    def good_batch(seed):
        batch = _batch(seed)
        return _halves(batch, 2) if case.kind == "micro_batches_given" else batch

    # A good shard and step on every rank.
    sharded, step, state, apply = setup(_model())
    sharded, state, _ = step(sharded, state, good_batch(100 + rank))
    # The bad ranks' step of a "micro_batch_count" case: another jit_step(micro_batches=...).
    other_step = sf.jit_step(loss_fn, mesh, optimizer=_opt(case.optimizer),
                             micro_batches=case.variant[0]) if case.kind == "micro_batch_count" and is_bad else step
    bad_state = _bad_opt_state(case, sharded, state) if case.kind == "opt_state" and is_bad else state
    before = _copy(_flat(sharded, state, bad_state))
    phase = {"where": "step"}

    def bad_call():
        cell["bad"] = True
        if case.kind in SHARD_KINDS:
            phase["where"] = "shard"
            plan, strategy, variant = {}, case.strategy, ()
            if is_bad:
                v = case.variant[0]
                if case.kind in ("units", "bad_units"):
                    policy = {"by_module_type(Linear)": sf.by_module_type(nn.Linear),
                              "by_param_count(40)": sf.by_param_count(40),
                              "by_prefix(blocks.0)": sf.by_prefix("blocks.0"),
                              "remat(blocks.0)": None,
                              "by_module_type(Conv2d)": sf.by_module_type(nn.Conv2d),
                              "by_prefix(nothing)": sf.by_prefix("nothing")}[v]
                    plan = {"remat": sf.by_prefix("blocks.0")} if policy is None else {"units": policy}
                elif case.kind in ("strategy", "bad_strategy"):
                    strategy = v
                else:
                    variant = case.variant
            new_sharded, new_step, new_state, _ = setup(_model(variant), strategy, **plan)
            phase["where"] = "step after shard"
            new_step(new_sharded, new_state, _batch(200 + rank))
        elif case.kind in ("opt_state", "loss", "loss_kind", "micro_batch_count"):
            other_step(sharded, bad_state, _batch(200 + rank))
        else:
            step(sharded, state, _bad_batch(case, 200 + rank) if is_bad else good_batch(200 + rank))

    out = _outcome(bad_call)
    cell["bad"] = False
    out["phase"] = phase["where"] if out["error"] else "returned"
    out["unchanged"] = _same(before, _flat(sharded, state, bad_state))
    # The world goes on: one more good step on every rank.
    result = {}
    nxt = _outcome(lambda: result.update(metrics=step(sharded, state, good_batch(300 + rank))[2]))
    out["next_error"] = nxt["error"] and f"{nxt['error']}: {nxt['first_line']}"
    out["next_loss"] = result["metrics"]["loss"] if "metrics" in result else None
    # A CommError leaves the process group unusable (docs/ranks-that-differ.md).
    out["broken"] = "CommError" in (out["error"], nxt["error"])
    out["rank"] = rank
    return out


# -- the test ------------------------------------------------------------------------------

# (world size, repr(case)) -> what each rank did. Each distinct case runs once per session:
# Hypothesis runs a failing example again to report it, which would cost another step
# timeout and another world; the outcome of a case is deterministic.
OUTCOMES: dict[tuple[int, str], list[dict]] = {}
_RANK_NAMED = (
    r"\brank \d",  # "rank 1 raised", "  rank 0: all_gather (...)"
    r"\branks \[\d",  # "ranks [1] differ from rank 0", "(ranks [0] vs [1] agree ...)"
    r"\bby rank\b",  # "([2, 1] by rank)"
    r"Ranks whose own loss was not finite: \[\d",
)


def names_a_rank(message: str) -> bool:
    """Whether the message says which rank(s) it is about, beyond its own "[rank N]" prefix."""
    text = re.sub(r"^\[rank \d+\] ", "", message)
    return any(re.search(p, text) for p in _RANK_NAMED)


def problems_of(case: Case, outs: list[dict]) -> list[str]:
    problems = []
    for o in outs:
        r, err = o["rank"], o["error"]
        if err is None:
            problems.append(f"rank {r}: the bad call returned normally (a step that silently ran)")
        elif err == "CommError":
            problems.append(f"rank {r}: CommError from bad input: the process group is unusable now")
        if err and not o["first_line"]:
            problems.append(f"rank {r}: {err} with an empty message")
        if err and r not in case.bad and not names_a_rank(o["message"]):
            problems.append(f"rank {r} (good input): its {err} does not name the rank(s) at fault")
        if o["seconds"] >= STEP_TIMEOUT:
            problems.append(f"rank {r}: the bad call took {o['seconds']:.1f} s >= the step timeout")
        if not o["unchanged"]:
            problems.append(f"rank {r}: shards or optimizer state changed")
        if o["next_error"]:
            problems.append(f"rank {r}: the next good step failed: {o['next_error']}")
    if len({o["phase"] for o in outs}) > 1:
        problems.append("the ranks raised at different calls: " + str([o["phase"] for o in outs]))
    good = [o for o in outs if o["rank"] not in case.bad]
    if len({o["error"] for o in good}) > 1 or (not good and len({o["error"] for o in outs}) > 1):
        problems.append("ranks with the same input raised different errors")
    losses = {o["next_loss"] for o in outs}
    if len(losses) > 1:
        problems.append(f"the next good step's losses differ between ranks: {losses}")
    return problems


def _describe(o: dict) -> str:
    return (f"  rank {o['rank']}: {o['phase']}: {o['error']}: {o['first_line'][:300]} ({o['seconds']:.2f} s, "
            f"unchanged={o['unchanged']}, next step: {o['next_error'] or 'ok'})")


@pytest.fixture(scope="module", autouse=True)
def _count_inputs():
    t0 = time.monotonic()
    yield
    tried = {w: sum(1 for world, _ in OUTCOMES if world == w) for w in (2, 3)}
    print(f"\n[fuzz] distinct inputs tried: {tried[2]} on 2 ranks, {tried[3]} on 3 ranks "
          f"({len(OUTCOMES)} in all) in {time.monotonic() - t0:.0f} s")


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(("kind", "variant"), VARIANTS, ids=["-".join(map(str, [k, *v])) for k, v in VARIANTS])
@settings(max_examples=2, phases=[Phase.explicit, Phase.generate])  # no shrinking: see below
@given(data=st.data())
def test_bad_input_raises_everywhere_and_changes_nothing(clusters, kind, variant, world, data):
    # Hypothesis draws the ranks that get the bad input and the setting they share. A failing
    # example costs up to a step timeout and a new world, so it does not shrink: the cases
    # are small, and the failure message shows what each rank did.
    case = data.draw(cases(world, kind, variant), label="case")
    key = (world, repr(case))
    if key not in OUTCOMES:
        outs = OUTCOMES[key] = clusters[world].run(fuzz_worker, case)
        if any(o["broken"] or o["next_error"] for o in outs) or len({o["phase"] for o in outs}) > 1:
            clusters[world].close()  # the ranks may be out of step: the next example starts a fresh world
    outs = OUTCOMES[key]
    problems = problems_of(case, outs)
    assert not problems, "\n".join([f"{case}:", *problems, "what each rank did:", *map(_describe, outs)])
