"""Optax-style optimizers over Mappings of this rank's local shards.

Example:
    >>> from shardfn import optim
    >>> opt = optim.adamw(3e-4)
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> optim.apply_updates_(params, updates)
"""

from ._adamw import AdamWState as AdamWState
from ._adamw import adamw as adamw
from ._base import EmptyState as EmptyState
from ._base import GradientTransformation as GradientTransformation
from ._base import ScalarOrSchedule as ScalarOrSchedule
from ._base import Schedule as Schedule
from ._base import add_decayed_weights as add_decayed_weights
from ._base import apply_updates as apply_updates
from ._base import apply_updates_ as apply_updates_
from ._base import chain as chain
from ._base import scale as scale
from ._sgd import SgdState as SgdState
from ._sgd import sgd as sgd
from ._torch import TorchOptimizerState as TorchOptimizerState
from ._torch import from_torch as from_torch

__all__ = [
    "AdamWState",
    "EmptyState",
    "GradientTransformation",
    "ScalarOrSchedule",
    "Schedule",
    "SgdState",
    "TorchOptimizerState",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "apply_updates_",
    "chain",
    "from_torch",
    "scale",
    "sgd",
]
