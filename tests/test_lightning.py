"""shardfn inside Lightning (issue 58): Lightning's own FSDP example (``demos.Transformer`` in a
LightningModule, a torch optimizer) trained by ``Trainer(strategy=shardfn.lightning.TrainerStrategy(...))``
equals the same run under Lightning's ``DDPStrategy``: the losses at every step, the full
checkpoint, the optimizer's state ([Note: Lightning's calls on shards] in shardfn/lightning/_trainer.py).

The ranks are the test clusters' processes: with ``LOCAL_RANK`` set and the process group
made, Lightning treats them as launched from outside (as under torchrun) and launches nothing."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardfn as sf

import lightning.pytorch as L
from lightning.pytorch.demos import Transformer
from lightning.pytorch.strategies import DDPStrategy

VOCAB, SEQ, ROWS, STEPS = 32, 8, 2, 4
# a rank's gradient here is the same terms as DDP's, reduced in another order (tests/bounds.py):
# SGD with momentum 0.9 at lr 0.1 over 4 steps moves a parameter by at most sgd_bound(0.1, 0.9, 4, 6e-8)
RTOL, ATOL = 1e-5, 1e-6


class LanguageModel(L.LightningModule):
    """Lightning's FSDP example, small: its Transformer (no dropout), NLL loss, a torch optimizer."""

    def __init__(self, optimizer="sgd"):
        super().__init__()
        self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
        self.optimizer = optimizer
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.nll_loss(self.model(x, y), y.view(-1))
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.nll_loss(self.model(x, y), y.view(-1)), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.nll_loss(self.model(x, y), y.view(-1)), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, y).argmax(-1)

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-3)
        if self.optimizer == "adafactor":
            return torch.optim.Adafactor(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Manual(LanguageModel):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def data(rows=8):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=ROWS)  # (world 2: 2 steps an epoch)


class _Seen(L.Callback):
    """What the strategy holds at the end of training, before it gives the state back."""

    bytes = None

    def on_train_end(self, trainer, module):
        s = trainer.strategy
        if getattr(s, "sharded", None) is None:
            return
        own = sf.shard(sf.functionalize(LanguageModel())[0], s.mesh, s.plan)  # shardfn's own step's tree
        leaves = s.sharded.layout.leaves
        self.ignored = len(s.sharded.layout.ignored)
        self.remat = sorted(u.path for u in s.sharded.layout.units if u.remat is not None)
        self.offloaded = s.sharded.layout.offloaded
        self.bytes = (sum(t.numel() * t.element_size() for n, t in s.sharded.items() if n in leaves),
                      sum(t.numel() * t.element_size() for n, t in own.items() if n in leaves),
                      sum(t.numel() * t.element_size() for o in s.optimizers for st in o.state.values()
                          for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0))


def _fit(name, *, model=LanguageModel, max_steps=STEPS, ckpt_path=None, save=None, evaluate=False, every=None, **kw):
    """A Trainer's fit at the cluster's world: ``name`` "ddp" (Lightning's DDPStrategy) or a
    TrainerStrategy's keywords in ``kw["shardfn"]``. The losses each rank's training_step saw,
    the full state after, what a collective log saw, and the strategy's bytes; with ``save``,
    the checkpoint written after fit (rank 0 reads it back); with ``evaluate``, what
    validate, test and predict give after fit; with ``every``, a ModelCheckpoint into that
    directory every 2 steps."""
    from shardfn.lightning import TrainerStrategy

    torch.manual_seed(0)
    module = model()
    options = kw.pop("shardfn", {})
    if "ignored_modules" in options:  # (paths and names here: the strategy takes the modules and parameters)
        options = {**options, "ignored_modules": [module.get_submodule(p) for p in options["ignored_modules"]],
                   "ignored_states": [module.get_parameter(n) for n in options.get("ignored_states", ())]}
    strategy = {"shardfn": lambda: TrainerStrategy(**options), "ddp": DDPStrategy,
                "by name": lambda: "shardfn"}[name]()  # ("shardfn": the registered name, FULL_SHARD)
    callbacks = [_Seen()]
    if every is not None:
        callbacks.append(L.callbacks.ModelCheckpoint(dirpath=every, every_n_train_steps=2, save_top_k=-1,
                                                     filename="{step}"))
    trainer = L.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), strategy=strategy,
                        max_steps=max_steps, logger=False, enable_checkpointing=every is not None,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)
    with sf.record_collectives() as log:
        trainer.fit(module, data(), ckpt_path=ckpt_path)
    out = {"losses": module.losses, "state": {n: t.detach().clone() for n, t in module.state_dict().items()},
           "kinds": sorted({c.kind.value for c in log.select()}), "bytes": callbacks[0].bytes,
           "ignored": getattr(callbacks[0], "ignored", None), "remat": getattr(callbacks[0], "remat", None),
           "offloaded": getattr(callbacks[0], "offloaded", None)}
    if save is not None:
        trainer.save_checkpoint(save)
        torch.distributed.barrier()
        out["saved"] = torch.load(save, weights_only=False)
    if evaluate:
        out["validate"] = trainer.validate(module, data(8), verbose=False)
        out["test"] = trainer.test(module, data(8), verbose=False)
        out["predict"] = torch.cat(trainer.predict(module, data(8)))
    return out


_DDP = {}


def _ddp(clusters, world, **kw):
    """Lightning's DDP run at ``world`` with these Trainer options: the reference of every
    sharding strategy, run once."""
    key = (world, tuple(sorted(kw.items())))
    if key not in _DDP:
        _DDP[key] = clusters[world].run(_fit, "ddp", **kw)
    return _DDP[key]


def _close(got, want):
    assert got.keys() == want.keys()
    for n, ref in want.items():
        assert float(((got[n] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, n


def _alike(ours, ddp):
    for run, ref in zip(ours, ddp):
        losses, ref_losses = run["losses"], ref["losses"]
        assert len(losses) == len(ref_losses) > 0
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        _close(run["state"], ref["state"])


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_the_trainer_equals_lightnings_ddp(clusters, strategy):
    if strategy == "FULL_SHARD":  # Trainer(strategy="shardfn") too
        named = clusters[2].run(_fit, "by name")
        _alike(named, _ddp(clusters, 2))
        assert all("reduce_scatter" in run["kinds"] for run in named)
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy=strategy))
    _alike(ours, _ddp(clusters, 2))
    for run in ours:  # shardfn's own reductions ran: the gradient reduce-scattered, or all-reduced
        assert ("reduce_scatter" in run["kinds"]) == (strategy != "NO_SHARD"), run["kinds"]


def test_ignored_modules_stay_whole_and_train_as_under_ddp(clusters):
    # FSDP's keywords: the decoder (the head) by module, the first encoder layer's attention by its
    # parameters, outside the plan
    attn = "model.transformer.encoder.layers.0.self_attn."
    states = [attn + n for n in ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")]
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD", ignored_modules=["model.decoder"],
                                                         ignored_states=states), gradient_clip_val=0.05)
    _alike(ours, _ddp(clusters, 2, gradient_clip_val=0.05))
    assert all(run["ignored"] == 6 for run in ours)  # 2 + 4 parameters, whole on every rank


def test_hybrid_shard_at_four_equals_ddp(clusters):
    ours = clusters[4].run(_fit, "shardfn", shardfn=dict(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2)))
    _alike(ours, _ddp(clusters, 4))


def test_accumulation_and_clipping_equal_ddp(clusters):
    # gradient_clip_val 0.05 is below the gradient's norm at every step here: every step clips
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.05)
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"), **kw)
    _alike(ours, _ddp(clusters, 2, **kw))
    plain = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"), accumulate_grad_batches=2)
    _alike(plain, _ddp(clusters, 2, accumulate_grad_batches=2))  # (clipping alone hides the gradient's scale)
    assert plain[0]["losses"][2:] != ours[0]["losses"][2:]  # (the clipping changed the training)


def test_memory_is_shardfns_own_step(clusters):
    # per rank: the parameter shards and the optimizer's momentum, half the model each under
    # FULL_SHARD at world 2, as shardfn.shard gives its own step
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"))
    full = sum(t.numel() * 4 for t in LanguageModel().parameters())
    for (params, own, momentum) in (run["bytes"] for run in ours):
        assert params == own == momentum, (params, own, momentum)
        assert full / 2 <= params <= full / 2 + 4 * 64, (params, full)  # (flat shards: at most a padding run)


def test_the_full_checkpoint_and_evaluation_equal_ddps(clusters, tmp_path):
    # trainer.save_checkpoint after fit: one file whose state_dict is the full model (a plain
    # LightningModule loads it) and whose optimizer state is whole; validate, test, predict
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"), save=str(tmp_path / "a.ckpt"),
                           evaluate=True)[0]
    ref = clusters[2].run(_fit, "ddp", save=str(tmp_path / "b.ckpt"), evaluate=True)[0]
    saved, want = ours["saved"], ref["saved"]
    _close(saved["state_dict"], want["state_dict"])
    LanguageModel().load_state_dict(saved["state_dict"])  # (strict: every key, every shape)
    (opt,), (ref_opt,) = saved["optimizer_states"], want["optimizer_states"]
    assert opt["param_groups"] == ref_opt["param_groups"]
    assert opt["state"].keys() == ref_opt["state"].keys()
    for i, s in ref_opt["state"].items():
        assert s["momentum_buffer"].shape == opt["state"][i]["momentum_buffer"].shape, i
        _close({i: opt["state"][i]["momentum_buffer"]}, {i: s["momentum_buffer"]})
    for what in ("validate", "test"):
        (got,), (expect,) = ours[what], ref[what]
        assert got.keys() == expect.keys() and all(abs(got[k] - expect[k]) <= ATOL + RTOL * abs(expect[k])
                                                   for k in got), (what, got, expect)
    assert torch.equal(ours["predict"], ref["predict"])


def test_a_resumed_run_equals_an_uninterrupted_one(clusters, tmp_path):
    # ModelCheckpoint writes the full checkpoint every 2 steps, inside the run (the shards gathered)
    whole = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"), every=str(tmp_path))
    resumed = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"),
                              ckpt_path=str(tmp_path / "step=2.ckpt"))
    for r, w in zip(resumed, whole):
        assert r["losses"] == w["losses"][2:]  # (steps 3 and 4, bit for bit)
        assert all(torch.equal(r["state"][n], t) for n, t in w["state"].items())



def _refused(what):
    from shardfn.lightning import TrainerStrategy

    try:
        if what == "keyword":
            TrainerStrategy(limit_all_gathers=True)
        elif what == "mixed_precision":
            TrainerStrategy(mixed_precision=object())
        elif what == "units":  # shard() refuses the units: its own error, seen as it is (not a teardown's)
            _fit("shardfn", shardfn=dict(units=sf.by_prefix("model.no_such_layer")))
        else:
            _fit("shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"),
                 model=Manual if what == "manual" else (lambda: LanguageModel("adafactor")))
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def test_what_cannot_be_honoured_is_refused_by_name(clusters):
    keyword, mixed = _refused("keyword"), _refused("mixed_precision")
    assert keyword.startswith("TypeError: TrainerStrategy(limit_all_gathers=True): it is not one of FSDPStrategy's"), keyword
    assert "give the Trainer's precision= instead" in mixed, mixed
    for what, says in (("manual", "sets automatic_optimization = False"),
                       ("adafactor", "TrainerStrategy with torch.optim.Adafactor"),
                       ("units", "ValueError: ")):
        for said in clusters[2].run(_refused, what):  # (every rank, before a step)
            assert says in said, (what, said)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_precisions_equal_ddps(clusters, precision):
    # Lightning's precision plugins act on the module and its inputs, as under DDP: the same
    # casts, so the same bound as fp32 (the runs here agree bit for bit)
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"), precision=precision)
    _alike(ours, _ddp(clusters, 2, precision=precision))


# -- Fabric ---------------------------------------------------------------------------------


def _fabric(name, *, accumulate=1, clip=None, save=None, load=None, steps=STEPS, start=0, sharded=False,
            deferred=False, ignored=False):
    """The same model in a plain Fabric loop: ``name`` "ddp" or "shardfn" (FabricStrategy).
    The losses each rank saw, and the full state after (rank 0: the others get ``{}``); with
    ``save``, fabric.save after the loop; with ``load``, fabric.load before it, and the loop
    from batch ``start``."""
    from lightning.fabric import Fabric

    from shardfn.lightning import FabricStrategy

    torch.manual_seed(0)
    build = functools.partial(Transformer, vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
    early = build() if ignored else None  # (FSDP's ignored_modules: the strategy takes the module's own)
    fabric = Fabric(accelerator="cpu", devices=torch.distributed.get_world_size(),
                    strategy=FabricStrategy(state_dict_type="sharded" if sharded else "full",
                                            ignored_modules=[early.decoder] if ignored else None)
                    if name == "shardfn" else "ddp")
    fabric.launch()
    if early is not None:
        model = early
    elif deferred:  # (the reference: the same values, by shardfn.materialize on one device)
        with fabric.init_module(empty_init=True) if name == "shardfn" else torch.device("meta"):
            model = build()
        if name != "shardfn":
            sf.materialize(model, seed=0)
    else:
        model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = fabric.setup(model, opt)
    if load is not None:
        fabric.load(load, {"model": model, "optimizer": opt})
    losses = []
    for i, (x, y) in zip(range(steps), fabric.setup_dataloaders(data(16))):
        if i < start:
            continue
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = F.nll_loss(model(x, y), y.view(-1)) / accumulate
            fabric.backward(loss)
        if last:
            if clip is not None:
                fabric.clip_gradients(model, opt, max_norm=clip)
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
    if save is not None:
        fabric.save(save, {"model": model, "optimizer": opt})
    strategy = fabric.strategy
    state = strategy.shards.state_dict() if name == "shardfn" else model.state_dict()
    return {"losses": losses, "state": {n: t.detach().clone() for n, t in state.items()},
            "ignored": list(strategy.shards.sharded.layout.ignored) if name == "shardfn" else []}


def test_fabric_equals_fabric_with_ddp(clusters):
    for kw in ({}, {"accumulate": 2, "clip": 0.05}, {"accumulate": 2}, {"deferred": True},
               {"ignored": True, "clip": 0.05}):
        ours = clusters[2].run(_fabric, "shardfn", **kw)
        ref = clusters[2].run(_fabric, "ddp", **kw)
        for run, want in zip(ours, ref):
            assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(run["losses"], want["losses"])), kw
            assert run["ignored"] == (["decoder.weight", "decoder.bias"] if kw.get("ignored") else []), run["ignored"]
        _close(ours[0]["state"], ref[0]["state"])


def test_fabric_save_and_load_resume_the_run(clusters, tmp_path):
    # fabric.save writes the full model and the optimizer's whole state (rank 0); fabric.load
    # puts them back as shards, and the run goes on as if never stopped, bit for bit
    path = str(tmp_path / "fabric.ckpt")
    clusters[2].run(_fabric, "shardfn", steps=2, save=path)
    resumed = clusters[2].run(_fabric, "shardfn", start=2, load=path)
    whole = clusters[2].run(_fabric, "shardfn")
    for r, w in zip(resumed, whole):
        assert r["losses"] == w["losses"][2:]
    assert all(torch.equal(resumed[0]["state"][n], t) for n, t in whole[0]["state"].items())
    saved = torch.load(path, weights_only=False)
    model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)
    model.load_state_dict(saved["model"])  # (strict: the whole model)
    shapes = {p.shape for p in model.parameters()}
    assert all(s["momentum_buffer"].shape in shapes for s in saved["optimizer"]["state"].values())


def test_a_set_of_layer_classes_gives_every_rank_one_plan():
    # a set iterates by the classes' hashes, which differ between processes: the units must not
    # (before, the ranks' layouts disagreed at shard() in about one run of three)
    from shardfn.lightning._keywords import plan_of

    a, b = torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer
    one = plan_of("T", "FULL_SHARD", [a, b], [b, a], None, None, None)
    other = plan_of("T", "FULL_SHARD", [b, a], [a, b], None, None, None)
    assert repr(one) == repr(other)



def _validated(path, **kw):
    """The state a Trainer validates with after loading ``path`` (at the cluster's world)."""
    from shardfn.lightning import TrainerStrategy

    torch.manual_seed(1)  # (other initial values than the run that saved it)
    module = LanguageModel()
    trainer = L.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(),
                        strategy=TrainerStrategy(**kw), logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.validate(module, data(8), ckpt_path=path, verbose=False)
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


def test_a_sharded_checkpoint_resumes_and_loads_at_another_world_size(clusters, tmp_path):
    # state_dict_type="sharded": a directory, each rank's shards and optimizer state written by
    # shardfn.checkpoint; the resumed run equals the uninterrupted one bit for bit, and 4 ranks
    # read the 2 ranks' step-2 state exactly
    kw = dict(sharding_strategy="FULL_SHARD", state_dict_type="sharded")
    whole = clusters[2].run(_fit, "shardfn", shardfn=kw, every=str(tmp_path))
    path = tmp_path / "step=2.ckpt"
    assert path.is_dir() and (path / "lightning.pt").is_file(), sorted(p.name for p in tmp_path.iterdir())
    resumed = clusters[2].run(_fit, "shardfn", shardfn=kw, ckpt_path=str(path))
    for r, w in zip(resumed, whole):
        assert r["losses"] == w["losses"][2:]
        assert all(torch.equal(r["state"][n], t) for n, t in w["state"].items())
    at_step_2 = clusters[2].run(_fit, "shardfn", shardfn=kw, max_steps=2)[0]["state"]
    for got in clusters[4].run(_validated, str(path), **kw):
        assert all(torch.equal(got[n], t) for n, t in at_step_2.items())


def test_a_sharded_fabric_checkpoint_loads_at_another_world_size(clusters, tmp_path):
    # fabric.save with state_dict_type="sharded" at 2 ranks; 4 ranks load it and hold the same state
    path = str(tmp_path / "sharded")
    saved = clusters[2].run(_fabric, "shardfn", steps=2, save=path, sharded=True)[0]["state"]
    assert (tmp_path / "sharded" / "fabric.pt").is_file()
    for got in clusters[4].run(_fabric, "shardfn", steps=0, load=path, sharded=True)[:1]:
        assert all(torch.equal(got["state"][n], t) for n, t in saved.items())
    resumed = clusters[2].run(_fabric, "shardfn", start=2, load=path, sharded=True)
    whole = clusters[2].run(_fabric, "shardfn")
    assert resumed[0]["losses"] == whole[0]["losses"][2:]  # (and the optimizer's momentum came back)


# -- deferred init: init_module(empty_init=True) ------------------------------------------

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.ff = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, h):
        return h + torch.tanh(self.ff(self.norm(h)))


class Deferred(L.LightningModule):
    """A model whose every module initialises itself (reset_parameters), as deferred init needs."""

    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.ModuleList(
            Block() for _ in range(2)), torch.nn.Linear(16, VOCAB)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        loss = F.cross_entropy(self.head(h).flatten(0, 1), y.reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit_deferred(name, seed=0, model=Deferred):
    """A fit from a module built on the meta device: under TrainerStrategy by
    ``trainer.init_module(empty_init=True)``; under DDP (the reference) materialised on one
    device by shardfn.materialize with the seed the strategy uses (the one seed_everything set)."""
    from shardfn.lightning import TrainerStrategy

    torch.manual_seed(seed)
    trainer = L.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), max_steps=STEPS,
                        strategy=TrainerStrategy() if name == "shardfn" else DDPStrategy(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    if name == "shardfn":
        with trainer.init_module(empty_init=True):
            module = model()
        assert all(p.is_meta for p in module.parameters())
    else:
        with torch.device("meta"):
            module = model()
        sf.materialize(module, seed=seed)
    try:
        trainer.fit(module, data())
    except ValueError as e:
        return str(e)
    return {"losses": module.losses, "state": {n: t.detach().clone() for n, t in module.state_dict().items()}}


class Unwritten(Deferred):
    """A raw parameter that no reset_parameters() writes."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(16))


def _differently_seeded():
    return _fit_deferred("shardfn", seed=torch.distributed.get_rank())


def test_a_module_built_on_the_meta_device_is_initialised_on_the_shards(clusters):
    # each unit drawn by its reset_parameters() from (seed, unit path): equal to shardfn.materialize
    # on one device, then trained as DDP trains that model
    _alike(clusters[2].run(_fit_deferred, "shardfn"), clusters[2].run(_fit_deferred, "ddp"))
    # ranks seeded differently would hold pieces of different models: every rank refuses
    for rank, said in enumerate(clusters[2].run(_differently_seeded)):
        assert said.startswith("TrainerStrategy: the module was built on the meta device") and \
            "seed_everything" in said and f"shard(seed={rank})" in said, said
    # a parameter that no module initialises is named, with the way out
    for said in clusters[2].run(_fit_deferred, "shardfn", 0, Unwritten):
        assert "never written: gain" in said and "param_init_fn" in said, said


# -- the kit: shardfn.testing.check_equivalence on a LightningModule ----------------------

class RankScaled(LanguageModel):
    """Wrong under any strategy: each rank's loss is scaled by its rank."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * (1 + self.trainer.global_rank)


def _global_batches():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randint(0, VOCAB, (4, SEQ), generator=g) for _ in range(3)]
    return [(x, torch.roll(x, -1, 1)) for x in xs]


def test_the_kit_checks_a_lightning_module_under_the_strategy(clusters):
    from shardfn.testing import check_equivalence

    report = check_equivalence(LanguageModel, batches=_global_batches(), strategies=("FULL_SHARD", "SHARD_GRAD_OP"),
                               world_sizes=(2,), clusters=clusters)
    for cfg in (("FULL_SHARD", 2), ("SHARD_GRAD_OP", 2)):  # every leaf, every rank's shards and 3 losses compared
        assert len(report.leaves[cfg]) == len(LanguageModel().state_dict()) and len(report.losses[cfg]) == 3
        assert len(report.shards[cfg]) == 2 * len(list(LanguageModel().parameters()))
    with pytest.raises(AssertionError, match="loss at step 1"):  # a module that is not equivalent fails it
        check_equivalence(RankScaled, batches=_global_batches(), strategies=("FULL_SHARD",), world_sizes=(2,),
                          clusters=clusters)
    with pytest.raises(TypeError, match="optimizer given for a LightningModule"):
        check_equivalence(LanguageModel, batches=_global_batches(), optimizer=sf.optim.sgd)
    with pytest.raises(TypeError, match="loss_fn and optimizer missing for Transformer, which is not a Lightning"):
        check_equivalence(functools.partial(Transformer, vocab_size=VOCAB), batches=_global_batches())


# -- each FSDPStrategy keyword, with its meaning ----------------------------------------

LAYERS = {torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer}


class Configured(LanguageModel):
    """Its model built in configure_model, which Lightning calls under the strategy."""

    def __init__(self):
        L.LightningModule.__init__(self)
        self.optimizer, self.losses, self.model = "sgd", [], None

    def configure_model(self):
        if self.model is None:
            self.model = Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)


def test_a_model_built_in_configure_model_trains_as_under_ddp(clusters):
    _alike(clusters[2].run(_fit, "shardfn", model=Configured, shardfn=dict(sharding_strategy="FULL_SHARD")),
           clusters[2].run(_fit, "ddp", model=Configured))


def test_each_wrap_policy_form_gives_the_plan_fsdp_would_wrap_by():
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

    from shardfn.lightning import TrainerStrategy

    params = sf.functionalize(LanguageModel())[0]
    want = ["model.transformer.decoder.layers.0", "model.transformer.encoder.layers.0"]
    for policy in (LAYERS, ModuleWrapPolicy(LAYERS), functools.partial(transformer_auto_wrap_policy,
                                                                        transformer_layer_cls=LAYERS)):
        plan = TrainerStrategy(auto_wrap_policy=policy).plan
        assert sorted(plan.units.resolve(params.module, list(params))) == want, policy
    sized = TrainerStrategy(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000)).plan
    assert sized.units == sf.by_param_count(1000)
    plan = TrainerStrategy(ShardingStrategy.SHARD_GRAD_OP, activation_checkpointing_policy=LAYERS,
                           cpu_offload=CPUOffload(offload_params=True)).plan
    assert plan.strategy is sf.Strategy.SHARD_GRAD_OP and plan.offload == sf.Offload(params=True, optimizer=True)
    assert sorted(plan.remat.select(params.module, list(params), want)) == want
    import datetime

    assert TrainerStrategy(timeout=90)._timeout == datetime.timedelta(seconds=90)  # the process group's
    with pytest.raises(TypeError, match="timeout='soon'"):
        TrainerStrategy(timeout="soon")


def test_wrapped_recomputed_and_offloaded_layers_train_as_under_ddp(clusters):
    # units and remat by layer class, the shards and the optimizer's state in host memory:
    # each layer's forward runs again in backward, and the step is still DDP's
    kw = dict(sharding_strategy="FULL_SHARD", auto_wrap_policy=LAYERS, activation_checkpointing_policy=LAYERS)
    layers = ["model.transformer.decoder.layers.0", "model.transformer.encoder.layers.0"]
    for offload in (False, True):
        runs = clusters[2].run(_fit, "shardfn", shardfn=dict(kw, cpu_offload=offload))
        _alike(runs, _ddp(clusters, 2))
        assert all(run["remat"] == layers and run["offloaded"] is offload for run in runs)
