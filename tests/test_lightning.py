"""shardfn inside Lightning (issue 58): Lightning's own FSDP example (``demos.Transformer`` in a
LightningModule, a torch optimizer) trained by ``Trainer(strategy=shardfn.lightning.TrainerStrategy(...))``
equals the same run under Lightning's ``DDPStrategy``: the losses at every step, the full
checkpoint, the optimizer's state ([Note: Lightning's calls on shards] in shardfn/lightning/_trainer.py).

The ranks are the test clusters' processes: with ``LOCAL_RANK`` set and the process group
made, Lightning treats them as launched from outside (as under torchrun) and launches nothing."""

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
        self.losses.append(float(loss))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.nll_loss(self.model(x, y), y.view(-1)), sync_dist=True)

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


def data(rows=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, 1)), batch_size=ROWS)


class _Seen(L.Callback):
    """What the strategy holds at the end of training, before it gives the state back."""

    bytes = None

    def on_train_end(self, trainer, module):
        s = trainer.strategy
        if getattr(s, "sharded", None) is None:
            return
        own = sf.shard(sf.functionalize(LanguageModel())[0], s.mesh, s.plan)  # shardfn's own step's tree
        leaves = s.sharded.layout.leaves
        self.bytes = (sum(t.numel() * t.element_size() for n, t in s.sharded.items() if n in leaves),
                      sum(t.numel() * t.element_size() for n, t in own.items() if n in leaves),
                      sum(t.numel() * t.element_size() for o in s.optimizers for st in o.state.values()
                          for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0))


def _fit(name, *, model=LanguageModel, max_steps=STEPS, ckpt_path=None, save=None, **kw):
    """A Trainer's fit at the cluster's world: ``name`` "ddp" (Lightning's DDPStrategy) or a
    TrainerStrategy's keywords in ``kw["shardfn"]``. The losses each rank's training_step saw,
    the full state after, what a collective log saw, and the strategy's bytes."""
    from shardfn.lightning import TrainerStrategy

    strategy = TrainerStrategy(**kw.pop("shardfn")) if name == "shardfn" else DDPStrategy()
    torch.manual_seed(0)
    module = model() if isinstance(model, type) else model
    seen = _Seen()
    trainer = L.Trainer(accelerator="cpu", devices=torch.distributed.get_world_size(), strategy=strategy,
                        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[seen], **kw)
    with sf.record_collectives() as log:
        trainer.fit(module, data(), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    kinds = sorted({c.kind.value for c in log.select()})
    return module.losses, {n: t.detach().clone() for n, t in module.state_dict().items()}, kinds, seen.bytes


_DDP = {}


def _ddp(clusters, world, **kw):
    """Lightning's DDP run at ``world`` with these Trainer options: the reference of every
    sharding strategy, run once."""
    key = (world, tuple(sorted(kw.items())))
    if key not in _DDP:
        _DDP[key] = clusters[world].run(_fit, "ddp", **kw)
    return _DDP[key]


def _alike(ours, ddp):
    for (losses, state, *_), (ref_losses, ref_state, *_) in zip(ours, ddp):
        assert len(losses) == len(ref_losses) > 0
        assert all(abs(a - b) <= ATOL + RTOL * abs(b) for a, b in zip(losses, ref_losses)), (losses, ref_losses)
        assert state.keys() == ref_state.keys()
        for n, ref in ref_state.items():
            assert float(((state[n] - ref).abs() - RTOL * ref.abs()).max()) <= ATOL, n


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_the_trainer_equals_lightnings_ddp(clusters, strategy):
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy=strategy))
    _alike(ours, _ddp(clusters, 2))
    for _, _, kinds, _ in ours:  # shardfn's own reductions ran: the gradient reduce-scattered, or all-reduced
        assert ("reduce_scatter" in kinds) == (strategy != "NO_SHARD"), kinds


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
    assert plain[0][0][2:] != ours[0][0][2:]  # (the clipping changed the training)


def test_memory_is_shardfns_own_step(clusters):
    # per rank: the parameter shards and the optimizer's momentum, half the model each under
    # FULL_SHARD at world 2, as shardfn.shard gives its own step
    ours = clusters[2].run(_fit, "shardfn", shardfn=dict(sharding_strategy="FULL_SHARD"))
    full = sum(t.numel() * 4 for t in LanguageModel().parameters())
    for _, _, _, (params, own, momentum) in ours:
        assert params == own == momentum, (params, own, momentum)
        assert full / 2 <= params <= full / 2 + 4 * 64, (params, full)  # (flat shards: at most a padding run)
