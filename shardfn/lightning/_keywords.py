"""Lightning's ``FSDPStrategy`` keywords, as a shardfn :class:`~shardfn.Plan`: what each means here,
and a clear error for each that cannot be honoured (docs/lightning.md)."""

from __future__ import annotations

import datetime
import functools
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from .._state.offload import Offload
from .._state.plan import Plan, Remat, Strategy
from .._state.units import UnitPolicy, by_module_type, by_param_count

__all__ = ["CANNOT", "STATE_DICT_TYPES", "plan_of", "refuse", "replicas_of", "timeout_of"]

STATE_DICT_TYPES = ("full", "sharded")
# torch FSDP's ShardingStrategy names, and shardfn's own
_STRATEGIES = {"FULL_SHARD": "FULL_SHARD", "SHARD_GRAD_OP": "SHARD_GRAD_OP", "NO_SHARD": "NO_SHARD",
               "HYBRID_SHARD": "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2": "HYBRID_SHARD_ZERO2",
               "HYBRID_SHARD_ZERO2": "HYBRID_SHARD_ZERO2", "SHARD_OPTIMIZER": "SHARD_OPTIMIZER"}


def _strategy(value: Any, who: str) -> Strategy:
    name = getattr(value, "name", value)  # (torch's ShardingStrategy enum, or its name)
    if isinstance(name, str) and name.upper() in _STRATEGIES:
        return Strategy(_STRATEGIES[name.upper()])
    raise ValueError(f"{who}(sharding_strategy={value!r}): expected one of {', '.join(sorted(set(_STRATEGIES)))} "
                     "(a name, or torch's ShardingStrategy).")


def _classes(policy: Any, who: str, keyword: str) -> tuple[type, ...] | None:
    """The layer classes a FSDP policy names (a set of classes, torch's ``ModuleWrapPolicy``,
    or ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=...)``), in
    one order on every rank: a set of classes iterates by their hashes, which differ between
    processes, and the plan (and so the layout every rank must agree on) would differ."""
    classes = _read(policy, who, keyword)
    return None if classes is None else tuple(sorted(set(classes), key=lambda c: (c.__module__, c.__qualname__)))


def _read(policy: Any, who: str, keyword: str) -> tuple[type, ...] | None:
    if policy is None:
        return None
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        return (policy,)
    if isinstance(policy, Iterable) and not isinstance(policy, (str, bytes)):
        classes = tuple(policy)
        if classes and all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            return classes
    held = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
    if held:
        return tuple(held)
    if isinstance(policy, functools.partial) and "transformer_layer_cls" in policy.keywords:
        return tuple(policy.keywords["transformer_layer_cls"])
    raise ValueError(f"{who}({keyword}={policy!r}): shardfn reads a set of layer classes (e.g. {{Block}}), torch's "
                     "ModuleWrapPolicy, or functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=...)"
                     + (", or size_based_auto_wrap_policy" if keyword == "auto_wrap_policy" else "")
                     + "; another callable cannot be read. Pass the layer classes, or a shardfn unit policy as "
                     "units= (shardfn.by_module_type, by_param_count, by_prefix).")


def _units(auto_wrap_policy: Any, units: Any, who: str) -> Any:
    if units is not None and auto_wrap_policy is not None:
        raise ValueError(f"{who}(auto_wrap_policy=..., units=...): give one of them (units= is shardfn's own).")
    if units is not None:
        return units
    if isinstance(auto_wrap_policy, functools.partial) and "min_num_params" in auto_wrap_policy.keywords:
        return by_param_count(int(auto_wrap_policy.keywords["min_num_params"]))  # size_based_auto_wrap_policy
    classes = _classes(auto_wrap_policy, who, "auto_wrap_policy")
    return None if classes is None else by_module_type(*classes)


def _offload(cpu_offload: Any, who: str) -> Offload:
    on = getattr(cpu_offload, "offload_params", cpu_offload)  # (torch's CPUOffload, or a bool)
    if on is None:
        on = False
    if not isinstance(on, bool):
        raise ValueError(f"{who}(cpu_offload={cpu_offload!r}): expected a bool or torch's CPUOffload.")
    return Offload(params=on, optimizer=on)


def plan_of(who: str, sharding_strategy: Any, auto_wrap_policy: Any, activation_checkpointing_policy: Any,
            cpu_offload: Any, plan: Plan | None, units: UnitPolicy | None) -> Plan:
    """The shardfn plan the keywords describe; ``plan=`` instead of them, never both."""
    if plan is not None:
        given = [k for k, v in (("auto_wrap_policy", auto_wrap_policy), ("cpu_offload", cpu_offload),
                                ("activation_checkpointing_policy", activation_checkpointing_policy),
                                ("units", units)) if v]
        if given:
            raise ValueError(f"{who}(plan=..., {given[0]}=...): plan= holds the whole plan; give its units, remat "
                             "and offload inside it, or leave plan= out.")
        if not isinstance(plan, Plan):
            raise TypeError(f"{who}(plan={plan!r}): expected a shardfn.Plan.")
        return plan
    remat = _classes(activation_checkpointing_policy, who, "activation_checkpointing_policy")
    return Plan(_strategy(sharding_strategy, who), units=_units(auto_wrap_policy, units, who),
                remat=None if remat is None else Remat(units=by_module_type(*remat)),
                offload=_offload(cpu_offload, who))


def replicas_of(who: str, plan: Plan, device_mesh: Any, num_nodes: int) -> int | None:
    """The ``replicate`` axis of the mesh: a hybrid plan's replicas (``device_mesh=(R, S)``,
    else one per node, as torch FSDP's hybrid shards within a node); None for the others."""
    hybrid = plan.strategy in (Strategy.HYBRID_SHARD, Strategy.HYBRID_SHARD_ZERO2)
    if device_mesh is None:
        return num_nodes if hybrid else None
    shape = tuple(device_mesh) if isinstance(device_mesh, (tuple, list)) else None
    if shape is None or len(shape) != 2 or not all(isinstance(n, int) and n > 0 for n in shape):
        raise ValueError(f"{who}(device_mesh={device_mesh!r}): expected (replicas, shards), two positive ints.")
    if not hybrid:
        raise ValueError(f"{who}(device_mesh={device_mesh!r}): a 2-D mesh is for HYBRID_SHARD and "
                         "HYBRID_SHARD_ZERO2; the other strategies shard over every rank.")
    return shape[0]


def timeout_of(who: str, timeout: Any) -> datetime.timedelta:
    if isinstance(timeout, (int, float)):
        return datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"{who}(timeout={timeout!r}): expected a datetime.timedelta (or seconds).")
    return timeout


def refuse(who: str, given: dict[str, Any], reasons: dict[str, str]) -> None:
    """Raises for the first keyword in ``given`` this strategy cannot honour, naming it."""
    for key, value in given.items():
        why = reasons.get(key, "it is not one of FSDPStrategy's keywords that shardfn honours (docs/lightning.md)")
        raise TypeError(f"{who}({key}={value!r}): {why}.")


CANNOT: dict[str, str] = {
    "mixed_precision": "give the Trainer's precision= instead (\"32-true\", \"bf16-mixed\", \"bf16-true\")",
    "activation_checkpointing": "give activation_checkpointing_policy= (a set of layer classes)",
}
