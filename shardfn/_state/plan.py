"""Plans: which strategy, and which parameters travel together (units).

A plan is data. ``Strategy`` says where parameters live between uses (FSDP's
``ShardingStrategy``); a unit policy (shardfn._state.units) groups parameters into *units*,
each of which costs one collective per direction; ``Placement`` says how a unit is cut
into shards.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from .._memory import parse_size
from .offload import Offload
from .precision import Precision
from .units import DefaultUnits, UnitPolicy, UnitsArg, as_policy

__all__ = [
    "Placement",
    "Plan",
    "Reduction",
    "Whole",
    "whole",
    "Remat",
    "RematMode",
    "Strategy",
    "FullShard",
    "ShardGradOp",
    "NoShard",
    "HybridShard",
    "HybridShardZero2",
    "ShardOptimizer",
]


class Strategy(enum.Enum):
    """Where parameters live between uses.

    * ``FULL_SHARD``: sharded; a unit is gathered for its forward, freed, gathered
      again for its backward (ZeRO-3).
    * ``SHARD_GRAD_OP``: sharded; gathered once in forward, kept until the unit's
      backward (ZeRO-2).
    * ``NO_SHARD``: replicated; gradients all-reduced (DDP).
    * ``HYBRID_SHARD``: on a 2-D mesh, FULL_SHARD over the ``shard`` axis and replicated
      over ``replicate``; each unit's shard-sized gradient is all-reduced over
      ``replicate`` after its reduce-scatter.
    * ``HYBRID_SHARD_ZERO2``: the same with SHARD_GRAD_OP's residency.
    * ``SHARD_OPTIMIZER``: ZeRO-1: the parameters stay gathered (replicated) between
      steps, gradients are reduce-scattered, the optimizer updates this rank's shards with
      its sharded state, and each unit's updated shards are all-gathered after the update:
      one reduce-scatter and one all-gather per unit and step (see [Note: replicated parameters]).
    """

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"
    SHARD_OPTIMIZER = "SHARD_OPTIMIZER"

    @property
    def sharded(self) -> bool:
        return self is not Strategy.NO_SHARD

    @property
    def hybrid(self) -> bool:
        return self in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)

    @classmethod
    def parse(cls, value: "Strategy | str") -> "Strategy":
        return parse_enum(cls, value, "strategy (or pass a shardfn.Plan)")

    @classmethod
    def candidates(cls, hybrid: bool) -> "tuple[Strategy, ...]":
        """The strategies that run on a mesh with a replicate axis (``hybrid``) or without one, as
        the planner tries them (a ``tensor`` axis changes nothing)."""
        if hybrid:
            return (cls.HYBRID_SHARD, cls.HYBRID_SHARD_ZERO2)
        return (cls.FULL_SHARD, cls.SHARD_GRAD_OP, cls.SHARD_OPTIMIZER, cls.NO_SHARD)


class Reduction(enum.Enum):
    """How every unit's gradients are reduced, and over which groups (``Layout.reduction``)."""

    NONE = "none"  # a world of one without replicas: a rank's gradients are the gradients
    ALL_REDUCE = "all-reduce"  # NO_SHARD: over the replicas
    REDUCE_SCATTER = "reduce-scatter"  # FULL_SHARD, SHARD_GRAD_OP, SHARD_OPTIMIZER: over the shard axis
    REDUCE_SCATTER_ALL_REDUCE = "reduce-scatter, all-reduce"  # hybrid: over shard, then replicate

    @property
    def scatters(self) -> bool:
        """A reduce-scatter over the shard axis: each rank keeps its shard's gradient."""
        return self in (Reduction.REDUCE_SCATTER, Reduction.REDUCE_SCATTER_ALL_REDUCE)

    @property
    def all_reduces(self) -> bool:
        """An all-reduce over the replicas of each shard."""
        return self in (Reduction.ALL_REDUCE, Reduction.REDUCE_SCATTER_ALL_REDUCE)


class RematMode(enum.Enum):
    """How a rematerialised unit recomputes (see :class:`Remat`)."""

    FULL = "full"  # save the unit's inputs only; recompute its whole forward in backward
    SELECTIVE = "selective"  # also save the outputs of the ops in Remat.save; recompute the rest

    @classmethod
    def parse(cls, value: "RematMode | str") -> "RematMode":
        return parse_enum(cls, value, "Remat(mode=...)")


class Placement(enum.Enum):
    """How a unit is cut into shards ([Note: placements] in shardfn._state.layout). ``FLAT``
    (``"flat"``): the unit's parameters end to end, cut into equal pieces anywhere (a shard
    of a parameter is a 1-D piece of it, maybe empty); all-gathers copy nothing in or out.
    ``ROWS`` (``"rows"``): each parameter cut on dim 0, ``ceil(rows / world)`` rows per rank,
    zero-padded; each all-gather packs the shards and assembles the parameters (two copies)."""

    FLAT = "flat"
    ROWS = "rows"

    @classmethod
    def parse(cls, value: "Placement | str | Whole") -> "Placement | Whole":
        if isinstance(value, Whole):
            return value
        return parse_enum(cls, value, "placement")


@dataclasses.dataclass(frozen=True)
class Whole:
    """A placement (``placement=shardfn.whole(select)``): the parameters ``select(name,
    shape)`` picks each live whole on one rank of the shard axis, spread so that the ranks'
    shares are as even as their sizes allow (largest first, each to the least loaded rank);
    the others are cut flat. A module's whole parameters are a unit of their own, gathered
    with no copy like a flat unit (each a view of the gathered buffer); its shard buffer is
    the largest rank's share, the others padded to it. An optimizer that needs a whole
    matrix (Muon, Adafactor) finds it on one rank. See [Note: placements].

    Example:
        >>> shard(params, mesh, "FULL_SHARD", placement=shardfn.whole(lambda name, shape: len(shape) == 2))
    """

    select: Callable[[str, tuple[int, ...]], bool] | None = None

    def picks(self, name: str, shape: tuple[int, ...]) -> bool:
        return True if self.select is None else bool(self.select(name, tuple(shape)))

    def __repr__(self) -> str:
        return f"whole({getattr(self.select, '__name__', repr(self.select)) if self.select is not None else ''})"


def whole(select: Callable[[str, tuple[int, ...]], bool] | None = None) -> Whole:
    """The :class:`Whole` placement: ``select(name, shape) -> bool`` picks the parameters that
    live whole on one rank (default: every parameter); the rest are cut flat."""
    if select is not None and not callable(select):
        raise TypeError(f"whole(select={select!r}): pass a function (name, shape) -> bool, e.g. "
                        "lambda name, shape: len(shape) == 2.")
    return Whole(select)


def whole_starts(names: Sequence[str], state: Mapping[str, torch.Tensor], world: int,
                  totals: list[int]) -> dict[str, int]:
    """Each leaf's start in the global buffer of a whole unit ([Note: placements]), and under
    the key ``""`` the shard buffers' size: the largest leaves first, each to the rank whose
    range in this unit holds least so far (the least padding), among those the rank that
    holds least of all the whole units so far (``totals``, updated: so that units of one
    matrix each take turns), placed after what that range holds."""
    loads = [0] * world
    at: dict[str, tuple[int, int]] = {}
    for n in sorted(names, key=lambda n: -math.prod(state[n].shape)):  # (stable: ties keep unit order)
        r = min(range(world), key=lambda q: (loads[q], totals[q], q))
        at[n] = (r, loads[r])
        loads[r] += math.prod(state[n].shape)
        totals[r] += math.prod(state[n].shape)
    span = max(loads)
    return {"": span, **{n: r * span + off for n, (r, off) in at.items()}}


def parse_enum(cls: type[enum.Enum], value: object, what: str) -> Any:
    """``value`` as a member of the enum ``cls``: a member, or a string naming one by its name
    or its value, in any case (``"FULL_SHARD"``, ``"full_shard"``; ``"local"``, ``"LOCAL"``):
    every enum of the library parses the same way."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for member in cls:
            if key in (member.name.lower(), str(member.value).lower()):
                return member
    choices = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"{what}: {value!r} is not one of {choices} (or {cls.__name__}.<NAME>).")


# Matmuls and the scaled-dot-product-attention kernels of the CPU and CUDA backends.
_DEFAULT_SAVE = (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
)


@dataclasses.dataclass(frozen=True)
class Remat:
    """Activation rematerialisation (checkpointing), per unit.

    Args:
        units: which units to recompute: a unit policy (``by_module_type(Block)``,
            ``by_prefix(...)``); ``None`` means every unit except the root. Each selected
            module must be a unit of the plan (remat works at unit granularity).
        mode: :attr:`RematMode.FULL` (``"full"``) saves only the unit's inputs and
            recomputes its whole forward in backward; :attr:`RematMode.SELECTIVE`
            (``"selective"``) also saves the outputs of the ops in ``save`` and recomputes
            the cheap rest.
        every: recompute every ``every``-th selected unit (1: all of them).
        save: names of ``torch.ops.aten`` ops whose outputs selective mode keeps; the
            default is the matmuls and the attention kernels of CPU and CUDA. A name that
            is not an aten op is an error.

    Under FULL_SHARD the recompute gathers the unit again (the all-gather is part of the
    recomputed region), so a step still costs two all-gathers and one reduce-scatter per
    unit; under SHARD_GRAD_OP the kept parameters are reused.

    Example:
        >>> shard(params, mesh, "FULL_SHARD", remat=Remat(by_module_type(Block), mode="selective"))
    """

    units: UnitPolicy | None = None
    mode: RematMode = RematMode.FULL
    every: int = 1
    save: tuple[str, ...] = _DEFAULT_SAVE

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", RematMode.parse(self.mode))
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Remat(every={self.every!r}): a positive int.")
        object.__setattr__(self, "units", None if self.units is None else as_policy(self.units))
        object.__setattr__(self, "save", tuple(self.save))
        unknown = [name for name in self.save if not _is_aten_op(name)]
        if unknown:
            raise ValueError(
                f"Remat(save=...): {unknown} are not ops of torch.ops.aten, so selective remat could not save them. "
                "Use aten op names such as 'mm', 'addmm', 'bmm' or '_scaled_dot_product_flash_attention_for_cpu' "
                "(print(torch.ops.aten.__dir__()) lists them)."
            )

    def select(self, module: nn.Module | None, names: Sequence[str], unit_paths: Sequence[str]) -> dict[str, RematMode]:
        """Unit path -> mode, for the units to recompute."""
        chosen = list(unit_paths) if self.units is None else self.units.resolve(module, names)
        missing = [p for p in chosen if p not in unit_paths]
        if missing:
            raise ValueError(
                f"remat: {missing[:4]} are not units of this plan (units are {list(unit_paths)[:6]}...). Remat "
                "recomputes whole units: choose remat modules among the units, or make them units with units=."
            )
        chosen = [p for p in unit_paths if p in chosen]
        return {p: self.mode for i, p in enumerate(chosen) if i % self.every == 0}


def _is_aten_op(name: str) -> bool:
    import torch

    packet = getattr(torch.ops.aten, name, None) if isinstance(name, str) else None
    return isinstance(packet, torch._ops.OpOverloadPacket) and hasattr(packet, "default")


def _as_remat(remat: Any) -> Remat | None:
    if remat is None or isinstance(remat, Remat):
        return remat
    if remat is True:
        return Remat()
    return Remat(units=remat)


DEFAULT_BUCKET_BYTES = 4 * 2**20  # measured: docs/strategies.md, "Buckets" ([Note: buckets] says why)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy plus its policies; immutable, hashable, printable.

    Example:
        >>> plan = Plan("FULL_SHARD", units=by_module_type(Block), precision=Precision(param=torch.bfloat16))
        >>> sharded = shard(params, mesh, plan)
    """

    strategy: Strategy
    units: UnitPolicy = dataclasses.field(default_factory=DefaultUnits)
    precision: Precision = dataclasses.field(default_factory=Precision)
    remat: Remat | None = None
    optional: UnitPolicy | None = None
    offload: Offload = dataclasses.field(default_factory=Offload)
    # bool | int, or ((unit name, bool | int), ...): see shardfn._state.resolve.reshard_rules
    reshard_after_forward: Any = None
    placement: Placement | Whole = Placement.FLAT  # see [Note: placements]
    # bytes of a collective's buffer per bucket: neighbouring units share collectives ([Note: buckets])
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __init__(
        self,
        strategy: Strategy | str = Strategy.FULL_SHARD,
        *,
        units: UnitsArg = None,
        precision: Precision | None = None,
        remat: Remat | UnitPolicy | bool | None = None,
        optional: UnitsArg = None,
        offload: Offload | None = None,
        reshard_after_forward: bool | int | Mapping[str, bool | int] | None = None,
        placement: Placement | Whole | str | None = None,
        bucket_bytes: int | str | None = None,
    ):
        object.__setattr__(self, "strategy", Strategy.parse(strategy))
        object.__setattr__(self, "units", as_policy(units))
        if precision is not None and not isinstance(precision, Precision):
            raise TypeError(f"precision={precision!r}: pass a shardfn.Precision(param=..., reduce=...).")
        object.__setattr__(self, "precision", precision or Precision())
        object.__setattr__(self, "remat", _as_remat(remat))
        # Modules some ranks may skip in a step (a branch taken for some batches, experts
        # chosen by the data): units of their own that every rank gathers at the start of
        # the step and reduces at the end, whether it ran them or not.
        object.__setattr__(self, "optional", as_policy(optional) if optional is not None else None)
        if offload is not None and not isinstance(offload, Offload):
            raise TypeError(f"offload={offload!r}: pass a shardfn.Offload(params=True, optimizer=True).")
        object.__setattr__(self, "offload", offload or Offload())  # see [Note: offload]
        rule = reshard_after_forward
        if isinstance(rule, Mapping):  # per unit: kept as sorted pairs, so the plan stays hashable
            rule = tuple(sorted(rule.items()))
        values = [v for _, v in rule] if isinstance(rule, tuple) else [rule]
        if not all(v is None or isinstance(v, (bool, int)) for v in values) or (
                isinstance(rule, tuple) and not all(isinstance(k, str) for k, _ in rule)):
            raise TypeError(f"reshard_after_forward={reshard_after_forward!r}: pass True, False, a sub-group size "
                            "(an int), or a dict unit name -> one of those, e.g. {'blocks.7': False}.")
        object.__setattr__(self, "reshard_after_forward", rule)
        object.__setattr__(self, "placement", Placement.FLAT if placement is None else Placement.parse(placement))
        object.__setattr__(self, "bucket_bytes", DEFAULT_BUCKET_BYTES if bucket_bytes is None else
                           0 if bucket_bytes == 0 else parse_size(bucket_bytes, "Plan(bucket_bytes=...)"))

    def __repr__(self) -> str:
        extra = f", precision={self.precision!r}" if self.precision != Precision() else ""
        extra += f", remat={self.remat!r}" if self.remat is not None else ""
        extra += f", optional={self.optional!r}" if self.optional is not None else ""
        extra += f", offload={self.offload!r}" if self.offload.enabled else ""
        rule = self.reshard_after_forward
        extra += f", reshard_after_forward={dict(rule) if isinstance(rule, tuple) else rule!r}" if rule is not None else ""
        shown = self.placement.value if isinstance(self.placement, Placement) else self.placement
        extra += f", placement={shown!r}" if self.placement is not Placement.FLAT else ""
        extra += f", bucket_bytes={self.bucket_bytes}" if self.bucket_bytes != DEFAULT_BUCKET_BYTES else ""
        return f"Plan({self.strategy.value}, units={self.units!r}{extra})"


def FullShard(**fields: Any) -> Plan:
    """``Plan("FULL_SHARD", ...)``."""
    return Plan(Strategy.FULL_SHARD, **fields)


def ShardGradOp(**fields: Any) -> Plan:
    """``Plan("SHARD_GRAD_OP", ...)``."""
    return Plan(Strategy.SHARD_GRAD_OP, **fields)


def NoShard(**fields: Any) -> Plan:
    """``Plan("NO_SHARD", ...)``."""
    return Plan(Strategy.NO_SHARD, **fields)


def HybridShard(**fields: Any) -> Plan:
    """``Plan("HYBRID_SHARD", ...)``: needs a 2-D mesh (``Mesh.from_env(replicate=...)``)."""
    return Plan(Strategy.HYBRID_SHARD, **fields)


def ShardOptimizer(**fields: Any) -> Plan:
    """``Plan("SHARD_OPTIMIZER", ...)``: ZeRO-1, only the optimizer state sharded."""
    return Plan(Strategy.SHARD_OPTIMIZER, **fields)


def HybridShardZero2(**fields: Any) -> Plan:
    """``Plan("HYBRID_SHARD_ZERO2", ...)``: needs a 2-D mesh."""
    return Plan(Strategy.HYBRID_SHARD_ZERO2, **fields)


_FIELDS = ("units", "precision", "remat", "optional", "offload", "reshard_after_forward", "placement", "bucket_bytes")


def make_plan(plan: Plan | Strategy | str, **fields: Any) -> Plan:
    """``shard()``'s (or ``reshard()``'s) ``plan`` argument plus keyword fields -> a Plan."""
    unknown = set(fields) - set(_FIELDS)
    if unknown:
        raise TypeError(f"shard(): unknown plan field(s) {sorted(unknown)}; the fields are {list(_FIELDS)}.")
    given = {k: v for k, v in fields.items() if v is not None}
    if isinstance(plan, Plan):
        return dataclasses.replace(plan, **given) if given else plan
    return Plan(plan, **given)
