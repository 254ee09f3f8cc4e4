"""shardfn: JAX-style functional sharding (FSDP semantics) for PyTorch."""

from . import checkpoint as checkpoint
from . import optim as optim
from ._planning.autoplan import AutoPlan as AutoPlan
from ._planning.autoplan import Candidate as Candidate
from ._planning.autoplan import autoplan as autoplan
from ._run.batch import Batched as Batched
from ._run.batch import Mean as Mean
from ._run.batch import MicroBatches as MicroBatches
from ._run.batch import Whole as Whole
from ._run.bind import bind as bind
from ._compile import compile_stats as compile_stats
from ._comm.events import CollectiveLog as CollectiveLog
from ._comm.events import Residency as Residency
from ._comm.events import record_collectives as record_collectives
from ._comm.events import track_residency as track_residency
from ._planning.explain import Explanation as Explanation
from ._planning.explain import UnitCost as UnitCost
from ._planning.explain import explain as explain
from ._io.export import save_pretrained as save_pretrained
from ._run.functionalize import Apply as Apply
from ._state.tree import Params as Params
from ._run.functionalize import functionalize as functionalize
from ._errors import CommError as CommError
from ._errors import DivergenceError as DivergenceError
from ._errors import PeerError as PeerError
from ._run.grad import jit_grad as jit_grad
from ._state.layout import Layout as Layout
from ._state.materialize import materialize as materialize
from ._memory import LiveBytes as LiveBytes
from ._memory import track_live_bytes as track_live_bytes
from ._mesh import Mesh as Mesh
from ._state.offload import Offload as Offload
from ._state.plan import Placement as Placement
from ._state.plan import Plan as Plan
from ._state.plan import Remat as Remat
from ._state.plan import RematMode as RematMode
from ._state.plan import Strategy as Strategy
from ._state.plan import whole as whole
from ._state.units import UnitPolicy as UnitPolicy
from ._state.units import by_module_type as by_module_type
from ._state.units import by_param_count as by_param_count
from ._state.units import by_prefix as by_prefix
from ._state.precision import DynamicLossScale as DynamicLossScale
from ._state.precision import LossScaleState as LossScaleState
from ._state.precision import Precision as Precision
from ._run.options import Aux as Aux
from ._run.options import OnNonfinite as OnNonfinite
from .optim._psum import on_shards as on_shards
from ._parallel.loss import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from ._state.reshard import reshard as reshard
from ._run.options import Accumulate as Accumulate
from ._state.sharded import ShardedParams as ShardedParams
from ._state.sharded import gather as gather
from ._shard import shard as shard
from ._jit import jit_step as jit_step

__version__ = "0.1.0"

__all__ = [
    "Accumulate",
    "Apply",
    "AutoPlan",
    "Aux",
    "Batched",
    "Candidate",
    "CollectiveLog",
    "CommError",
    "DivergenceError",
    "DynamicLossScale",
    "Explanation",
    "Layout",
    "LiveBytes",
    "LossScaleState",
    "Mean",
    "Mesh",
    "MicroBatches",
    "Offload",
    "OnNonfinite",
    "Params",
    "PeerError",
    "Placement",
    "Plan",
    "Precision",
    "Remat",
    "RematMode",
    "Residency",
    "ShardedParams",
    "Strategy",
    "UnitCost",
    "UnitPolicy",
    "Whole",
    "autoplan",
    "bind",
    "by_module_type",
    "by_param_count",
    "by_prefix",
    "checkpoint",
    "compile_stats",
    "explain",
    "functionalize",
    "gather",
    "jit_grad",
    "jit_step",
    "materialize",
    "on_shards",
    "optim",
    "record_collectives",
    "reshard",
    "save_pretrained",
    "shard",
    "track_live_bytes",
    "track_residency",
    "vocab_parallel_cross_entropy",
    "whole",
]

# Reached through the objects that use them (sharded.layout.units, a step's .grad, a
# CollectiveLog's calls) or replaced (the strategy factories: Plan("FULL_SHARD", ...)):
# still importable from here for one release, with a warning.
_DEPRECATED = {
    "BufferLayout": ("_state.layout", "sharded.layout.buffers[name]"),
    "LeafLayout": ("_state.layout", "sharded.layout.leaves[name]"),
    "UnitLayout": ("_state.layout", "sharded.layout.units[i]"),
    "Purpose": ("_comm.events", "a purpose's name as a string, e.g. log.select(\"reduce\")"),
    "Grad": ("_run.grad", "the object shardfn.jit_grad(...) returns"),
    "Step": ("_run.step", "the object shardfn.jit_step(...) returns"),
    "FullShard": ("_state.plan", "shardfn.Plan(\"FULL_SHARD\", ...)"),
    "ShardGradOp": ("_state.plan", "shardfn.Plan(\"SHARD_GRAD_OP\", ...)"),
    "NoShard": ("_state.plan", "shardfn.Plan(\"NO_SHARD\", ...)"),
    "HybridShard": ("_state.plan", "shardfn.Plan(\"HYBRID_SHARD\", ...)"),
    "ShardOptimizer": ("_state.plan", "shardfn.Plan(\"SHARD_OPTIMIZER\", ...)"),
    "HybridShardZero2": ("_state.plan", "shardfn.Plan(\"HYBRID_SHARD_ZERO2\", ...)"),
}


def __getattr__(name: str):
    if name in _DEPRECATED:
        import importlib

        from ._deprecated import deprecated

        module, instead = _DEPRECATED[name]
        deprecated(f"shardfn.{name}", instead)
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module 'shardfn' has no attribute {name!r}")

