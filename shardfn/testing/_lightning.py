"""``check_equivalence`` on a LightningModule: the module trained by a Trainer
under :class:`shardfn.lightning.TrainerStrategy` at each world size, against the same module
trained by a Trainer on one device on the global batches.

Each rank is given its contiguous slice of every global batch (``split_batch``), in order,
with Lightning's distributed sampler off; the loss of a step is the mean of the ranks' losses
(their slices are equal, so it is the global batch's mean loss, which the one-device run
reports). Imported only for a LightningModule: Lightning is an extra."""

from __future__ import annotations

import warnings

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist  # (the cluster's process group: its world and rank)

__all__ = ["lightning_reference", "lightning_training", "mean_losses"]


def _fit(devices: int, strategy: Any, steps: int, options: Mapping[str, Any] | None, seen: Any, module: Any,
         batches: list[Any]) -> None:
    import lightning.pytorch as L
    from lightning.fabric.utilities.warnings import PossibleUserWarning
    from torch.utils.data import DataLoader

    with warnings.catch_warnings():  # (Lightning's advice on the loop: a validation_step without its loader, ...)
        warnings.simplefilter("ignore", PossibleUserWarning)
        _trainer(L, devices, strategy, steps, options, seen).fit(module, DataLoader(batches, batch_size=None))


def _trainer(L: Any, devices: int, strategy: Any, steps: int, options: Mapping[str, Any] | None, seen: Any) -> Any:
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, callbacks=[seen], **dict(options or {}))


def _seen() -> Any:
    import lightning.pytorch as L

    class Seen(L.Callback):
        """Each step's loss (training_step's return) and, at the end of fit, the strategy's shards."""

        def __init__(self) -> None:
            self.losses: list[float] = []
            self.shards: Any = None

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"].detach()))

        def on_train_end(self, trainer: Any, module: Any) -> None:
            sharded = getattr(trainer.strategy, "sharded", None)
            if sharded is not None:
                from ._pieces import local_shards

                self.shards = local_shards(sharded)

    return Seen()


def lightning_reference(module_fn: Callable[[], Any], batches: Sequence[Any], options: Mapping[str, Any] | None,
                        seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One device: ``(the loss of each step, the final state_dict)``."""
    torch.manual_seed(seed)
    module, seen = module_fn(), _seen()
    _fit(1, "auto", len(batches), options, seen, module, list(batches))
    return seen.losses, {n: t.detach().clone() for n, t in module.state_dict().items()}


def lightning_training(module_fn: Callable[[], Any], batches: Sequence[Any], strategy: str, units: Any,
                       replicate: int | None, options: Mapping[str, Any] | None, seed: int) -> dict[str, Any]:
    """On every rank of a cluster: the module trained under TrainerStrategy, as
    ``sharded_training`` returns it (this rank's loss of each step, the full state after fit,
    this rank's shards, the buffers' names)."""
    from ..lightning import TrainerStrategy
    from ._pieces import split_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = None if replicate is None else (replicate, world // replicate)
    torch.manual_seed(seed)
    module, seen = module_fn(), _seen()
    _fit(world, TrainerStrategy(strategy, units=units, device_mesh=mesh), len(batches), options, seen, module,
         [split_batch(b, rank, world) for b in batches])
    state = {n: t.detach().clone() for n, t in module.state_dict().items()}
    buffers = [n for n, _ in module.named_buffers() if n in state]  # (the persistent ones)
    return {"losses": seen.losses, "state": state, "shards": seen.shards or {}, "buffers": buffers}


def mean_losses(results: list[dict[str, Any]]) -> None:
    """Each step's loss as the mean of the ranks' (each rank's result then holds it)."""
    steps = list(zip(*(r["losses"] for r in results)))
    for r in results:
        r["losses"] = [sum(step) / len(step) for step in steps]
