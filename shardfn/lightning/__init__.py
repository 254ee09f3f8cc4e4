"""shardfn inside Lightning (``pip install -e ".[lightning]"``): :class:`TrainerStrategy` for
``lightning.pytorch.Trainer(strategy=...)`` (also ``strategy="shardfn"``) and
:class:`FabricStrategy` for ``lightning.fabric.Fabric(strategy=...)``. docs/lightning.md."""

from ._trainer import TrainerStrategy

__all__ = ["TrainerStrategy"]
