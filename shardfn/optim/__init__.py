"""Optax-style optimizers over Mappings of this rank's local shards.

Example:
    >>> from shardfn import optim
    >>> opt = optim.adamw(3e-4)
    >>> state = opt.init(params)
    >>> updates, state = opt.update(grads, state, params)
    >>> optim.apply_updates_(params, updates)
    >>> optim.hyperparams(opt, state)
    {'learning_rate': 0.0003}
"""

from ._gradients import Gradients as Gradients
from ._gradients import global_norm as global_norm
from ._psum import psum as psum
from ._adamw import AdamWState as AdamWState
from ._adafactor import AdafactorState as AdafactorState
from ._adafactor import adafactor as adafactor
from ._adamw import adamw as adamw
from ._protocol import EmptyState as EmptyState
from ._protocol import GradientTransformation as GradientTransformation
from ._protocol import ScalarOrSchedule as ScalarOrSchedule
from ._protocol import Schedule as Schedule
from ._combinators import add_decayed_weights as add_decayed_weights
from ._protocol import apply_updates as apply_updates
from ._protocol import apply_updates_ as apply_updates_
from ._combinators import chain as chain
from ._protocol import hyperparams as hyperparams
from ._combinators import scale as scale
from ._combinators import stateless as stateless
from ._clip import clip_by_global_norm as clip_by_global_norm
from ._masked import masked as masked
from ._muon import MuonState as MuonState
from ._muon import muon as muon
from ._partition import PartitionState as PartitionState
from ._partition import partition as partition
from ._whole import require_whole as require_whole
from ._sgd import SgdState as SgdState
from ._sgd import sgd as sgd
from ._torch import TorchOptimizerState as TorchOptimizerState
from ._torch import from_torch as from_torch

__all__ = [
    "AdafactorState",
    "AdamWState",
    "EmptyState",
    "GradientTransformation",
    "Gradients",
    "MuonState",
    "PartitionState",
    "ScalarOrSchedule",
    "Schedule",
    "SgdState",
    "TorchOptimizerState",
    "adafactor",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "apply_updates_",
    "chain",
    "clip_by_global_norm",
    "from_torch",
    "global_norm",
    "hyperparams",
    "masked",
    "muon",
    "partition",
    "psum",
    "require_whole",
    "scale",
    "sgd",
    "stateless",
]
