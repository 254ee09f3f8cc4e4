"""Plans: which strategy, and which parameters travel together (units).

A plan is data. ``Strategy`` says where parameters live between uses (FSDP's
``ShardingStrategy``); a unit policy groups parameters into *units*, each of which
costs one collective per direction. Policies resolve against the module tree that
:func:`shardfn.functionalize` keeps, or, for :func:`by_prefix` and the default,
against parameter names alone.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch.nn as nn

from ._offload import Offload
from ._precision import Precision

__all__ = [
    "Plan",
    "Remat",
    "RematMode",
    "Strategy",
    "UnitPolicy",
    "by_module_type",
    "by_param_count",
    "by_prefix",
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
        if isinstance(value, Strategy):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        names = ", ".join(repr(s.value) for s in cls)
        raise ValueError(f"Unknown strategy {value!r}. Use one of {names}, or a Plan.")


# -- unit policies ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UnitPolicy:
    """Base of unit policies: ``resolve`` returns unit module paths, outermost only."""

    def resolve(self, module: nn.Module | None, names: Sequence[str]) -> list[str]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _ByModuleType(UnitPolicy):
    types: tuple[type, ...]

    def resolve(self, module: nn.Module | None, names: Sequence[str]) -> list[str]:
        if module is None:
            raise ValueError(_NEEDS_MODULE.format(policy=self))
        paths = [p for p, m in module.named_modules() if p and isinstance(m, self.types)]
        if not paths:
            present = sorted({type(m).__name__ for p, m in module.named_modules() if p})
            raise ValueError(
                f"{self!r} matches no module of {type(module).__name__}: it has no "
                f"{' or '.join(t.__name__ for t in self.types)}. Its module types are {present}; pass one of them "
                f"(the class of the repeated block, usually)."
            )
        return _outermost(paths)

    def __repr__(self) -> str:
        return f"by_module_type({', '.join(t.__name__ for t in self.types)})"


@dataclasses.dataclass(frozen=True)
class _ByParamCount(UnitPolicy):
    min_params: int

    def resolve(self, module: nn.Module | None, names: Sequence[str]) -> list[str]:
        if module is None:
            raise ValueError(_NEEDS_MODULE.format(policy=self))
        units: list[str] = []

        def visit(path: str, m: nn.Module) -> int:
            # Post-order: a module becomes a unit when the parameters not yet claimed
            # by units below it reach the threshold (FSDP's size-based auto-wrap).
            free = sum(p.numel() for p in m.parameters(recurse=False))
            for name, child in m.named_children():
                free += visit(f"{path}.{name}" if path else name, child)
            if path and free >= self.min_params and not isinstance(m, _CONTAINERS):
                units.append(path)
                return 0
            return free

        visit("", module)
        if not units:
            total = sum(p.numel() for p in module.parameters())
            raise ValueError(
                f"{self!r} matches no module of {type(module).__name__}: no module holds {self.min_params:,} "
                f"parameters of its own ({total:,} in the whole model), so every parameter would be in the root unit. "
                f"Pass a smaller min_params, or units=by_module_type(...) with one of its module types "
                f"{sorted({type(m).__name__ for p, m in module.named_modules() if p})}."
            )
        return units

    def __repr__(self) -> str:
        return f"by_param_count({self.min_params})"


@dataclasses.dataclass(frozen=True)
class _ByPrefix(UnitPolicy):
    prefixes: tuple[str, ...]

    def resolve(self, module: nn.Module | None, names: Sequence[str]) -> list[str]:
        if module is not None:  # aliases of tied weights are module paths too
            names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
        for pre in self.prefixes:
            if not any(n.startswith(pre + ".") for n in names):
                raise ValueError(
                    f"by_prefix: no parameter name starts with {pre + '.'!r}. "
                    f"Parameter names look like {list(names)[:4]}; pass module paths such as 'blocks.0'."
                )
        return _outermost(list(self.prefixes))

    def __repr__(self) -> str:
        return f"by_prefix({', '.join(map(repr, self.prefixes))})"


@dataclasses.dataclass(frozen=True)
class _DefaultUnits(UnitPolicy):
    """Each element of the outermost list of repeated blocks (``blocks.0``, ``blocks.1``...).

    Outermost, not longest: every rank runs every element of the outermost list (the
    blocks), while a list nested in them may be run in part, chosen by the data (the
    experts of a mixture-of-experts block); units that only some ranks gather would not
    meet in their collectives."""

    def resolve(self, module: nn.Module | None, names: Sequence[str]) -> list[str]:
        groups: dict[str, set[str]] = {}
        for n in names:
            parts = n.split(".")
            for i in range(1, len(parts) - 1):
                if parts[i].isdigit():
                    groups.setdefault(".".join(parts[:i]), set()).add(parts[i])
        if not groups:
            return []
        # The outermost list of two or more wins; then the longest, then the first seen.
        groups = {g: ids for g, ids in groups.items() if len(ids) >= 2}
        if not groups:
            return []
        best = max(groups, key=lambda g: (-g.count("."), len(groups[g])))
        return [f"{best}.{i}" for i in sorted(groups[best], key=int)]

    def __repr__(self) -> str:
        return "default_units()"


# Modules without a forward of their own: their children are called directly, so a
# unit hook on the container would never fire.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def check_unit_modules(module: nn.Module | None, paths: Sequence[str]) -> None:
    """A unit must be a module whose forward runs (hooks fire there), not a container."""
    if module is None:
        return
    for p in paths:
        try:
            m = module.get_submodule(p)
        except AttributeError:
            raise ValueError(f"units: {p!r} is not a module path of {type(module).__name__}.") from None
        if isinstance(m, _CONTAINERS):
            raise ValueError(
                f"units: {p!r} is a {type(m).__name__}, which has no forward of its own, so it cannot be a unit "
                f"(its children are called directly). Use its elements instead, e.g. {p + '.0'!r}, ..."
            )


_NEEDS_MODULE = (
    "{policy} needs the module tree, but the params were not made by shardfn.functionalize(model). "
    "Pass the params that functionalize returned, or use units=shardfn.by_prefix('blocks.0', ...)."
)


def _outermost(paths: list[str]) -> list[str]:
    """Drops paths nested inside another path: a unit owns everything below it."""
    keep = []
    for p in sorted(set(paths), key=lambda s: (s.count("."), s)):
        if not any(p.startswith(k + ".") for k in keep):
            keep.append(p)
    order = {p: i for i, p in enumerate(paths)}
    return sorted(keep, key=lambda p: order[p])


def by_module_type(*types: type) -> UnitPolicy:
    """Every module of one of ``types`` (outermost only) is a unit.

    Example:
        >>> shard(params, mesh, "FULL_SHARD", units=by_module_type(Block))
    """
    if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
        raise TypeError(f"by_module_type expects nn.Module subclasses, got {types!r}")
    return _ByModuleType(tuple(types))


def by_param_count(min_params: int) -> UnitPolicy:
    """Modules become units bottom-up once they hold ``min_params`` unclaimed parameters."""
    if min_params < 1:
        raise ValueError(f"by_param_count: min_params must be >= 1, got {min_params}")
    return _ByParamCount(int(min_params))


def by_prefix(*prefixes: str) -> UnitPolicy:
    """Each given module path (a prefix of parameter names, e.g. ``"blocks.0"``) is a unit."""
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise TypeError(f"by_prefix expects non-empty module paths, got {prefixes!r}")
    return _ByPrefix(tuple(p.rstrip(".") for p in prefixes))


UnitsArg = Union[UnitPolicy, Sequence[type], None]


def _as_policy(units: UnitsArg) -> UnitPolicy:
    if units is None:
        return _DefaultUnits()
    if isinstance(units, UnitPolicy):
        return units
    if isinstance(units, type):
        return by_module_type(units)
    if isinstance(units, (list, tuple)) and all(isinstance(u, type) for u in units):
        return by_module_type(*units)
    if isinstance(units, (list, tuple)) and all(isinstance(u, str) for u in units):
        return by_prefix(*units)
    raise TypeError(
        f"units={units!r}: pass a unit policy (shardfn.by_module_type(Block), by_param_count(n), "
        "by_prefix('blocks.0', ...)), a module class or a list of module classes or of module paths."
    )


class RematMode(enum.Enum):
    """How a rematerialised unit recomputes (see :class:`Remat`)."""

    FULL = "full"  # save the unit's inputs only; recompute its whole forward in backward
    SELECTIVE = "selective"  # also save the outputs of the ops in Remat.save; recompute the rest

    @classmethod
    def parse(cls, value: "RematMode | str") -> "RematMode":
        return parse_enum(cls, value, "Remat(mode=...)")


def parse_enum(cls: type[enum.Enum], value: object, what: str) -> Any:
    """``value`` as a member of the enum ``cls``: a member, or the value of one."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = " or ".join(f"{cls.__name__}.{m.name} ({m.value!r})" for m in cls)
        raise ValueError(f"{what}: {value!r} is not one of them; use {choices}.") from None


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
        object.__setattr__(self, "units", None if self.units is None else _as_policy(self.units))
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


@dataclasses.dataclass(frozen=True)
class Plan:
    """A strategy plus its policies; immutable, hashable, printable.

    Example:
        >>> plan = Plan("FULL_SHARD", units=by_module_type(Block), precision=Precision(param=torch.bfloat16))
        >>> sharded = shard(params, mesh, plan)
    """

    strategy: Strategy
    units: UnitPolicy = dataclasses.field(default_factory=_DefaultUnits)
    precision: Precision = dataclasses.field(default_factory=Precision)
    remat: Remat | None = None
    optional: UnitPolicy | None = None
    offload: Offload = dataclasses.field(default_factory=Offload)
    # bool | int, or ((unit name, bool | int), ...): see shardfn._sharded.reshard_rules
    reshard_after_forward: Any = None

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
    ):
        object.__setattr__(self, "strategy", Strategy.parse(strategy))
        object.__setattr__(self, "units", _as_policy(units))
        if precision is not None and not isinstance(precision, Precision):
            raise TypeError(f"precision={precision!r}: pass a shardfn.Precision(param=..., reduce=...).")
        object.__setattr__(self, "precision", precision or Precision())
        object.__setattr__(self, "remat", _as_remat(remat))
        # Modules some ranks may skip in a step (a branch taken for some batches, experts
        # chosen by the data): units of their own that every rank gathers at the start of
        # the step and reduces at the end, whether it ran them or not.
        object.__setattr__(self, "optional", _as_policy(optional) if optional is not None else None)
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

    def __repr__(self) -> str:
        extra = f", precision={self.precision!r}" if self.precision != Precision() else ""
        extra += f", remat={self.remat!r}" if self.remat is not None else ""
        extra += f", optional={self.optional!r}" if self.optional is not None else ""
        extra += f", offload={self.offload!r}" if self.offload.enabled else ""
        rule = self.reshard_after_forward
        extra += f", reshard_after_forward={dict(rule) if isinstance(rule, tuple) else rule!r}" if rule is not None else ""
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


_FIELDS = ("units", "precision", "remat", "optional", "offload", "reshard_after_forward")


def make_plan(strategy: Plan | Strategy | str, **fields: Any) -> Plan:
    """``shard()``'s ``strategy`` argument plus keyword fields -> a Plan."""
    unknown = set(fields) - set(_FIELDS)
    if unknown:
        raise TypeError(f"shard(): unknown plan field(s) {sorted(unknown)}; the fields are {list(_FIELDS)}.")
    given = {k: v for k, v in fields.items() if v is not None}
    if isinstance(strategy, Plan):
        return dataclasses.replace(strategy, **given) if given else strategy
    return Plan(strategy, **given)
