"""Unit policies: which parameters travel together (one collective per unit and direction).

A policy resolves against the module tree that :func:`shardfn.functionalize` keeps, or,
for :func:`by_prefix` and the default, against parameter names alone, to the module paths
of the units (outermost only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Union

import torch.nn as nn

__all__ = ["DefaultUnits", "UnitPolicy", "UnitsArg", "as_policy", "by_module_type", "by_param_count", "by_prefix",
           "check_unit_modules"]


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
class DefaultUnits(UnitPolicy):
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
    "{policy}: needs the module tree, but the params were not made by shardfn.functionalize(model). "
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
        raise TypeError(f"by_module_type(*types): expected nn.Module subclasses, got {types!r}")
    return _ByModuleType(tuple(types))


def by_param_count(min_params: int) -> UnitPolicy:
    """Modules become units bottom-up once they hold ``min_params`` unclaimed parameters."""
    if min_params < 1:
        raise ValueError(f"by_param_count: min_params must be >= 1, got {min_params}")
    return _ByParamCount(int(min_params))


def by_prefix(*prefixes: str) -> UnitPolicy:
    """Each given module path (a prefix of parameter names, e.g. ``"blocks.0"``) is a unit."""
    if not prefixes or not all(isinstance(p, str) and p for p in prefixes):
        raise TypeError(f"by_prefix(*prefixes): expected non-empty module paths, got {prefixes!r}")
    return _ByPrefix(tuple(p.rstrip(".") for p in prefixes))


UnitsArg = Union[UnitPolicy, Sequence[type], None]


def as_policy(units: UnitsArg) -> UnitPolicy:
    if units is None:
        return DefaultUnits()
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
