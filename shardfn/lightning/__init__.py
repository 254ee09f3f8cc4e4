"""shardfn inside Lightning (``pip install -e ".[lightning]"``): :class:`TrainerStrategy` for
``lightning.pytorch.Trainer(strategy=...)`` (also ``strategy="shardfn"``) and
:class:`FabricStrategy` for ``lightning.fabric.Fabric(strategy=...)``. docs/lightning.md."""

from ._fabric import FabricStrategy
from ._trainer import TrainerStrategy

__all__ = ["FabricStrategy", "TrainerStrategy"]


def _register() -> None:
    """``Trainer(strategy="shardfn")``: Lightning looks names up in its registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "shardfn" not in StrategyRegistry:
        TrainerStrategy.register_strategies(StrategyRegistry)


_register()
