"""Mixed-precision policies: what dtype parameters travel and compute in, and gradients reduce in.

[Note: where the casts happen]
Master shards (and the optimizer state built from them) keep their own dtype, fp32
normally. A unit's shards are cast to ``param`` *before* its all-gather, so the
collective moves ``param``-sized elements (half of fp32 for bf16/fp16), and the unit
computes in ``param``. In backward the unit's gradients (in ``param``) are packed into a
``reduce``-dtype buffer, reduced in that dtype, and returned to the master dtype, so the
optimizer always sees master-dtype gradients. Floating-point inputs are cast to the root
unit's ``param`` dtype (``cast_inputs``), and floating-point outputs to ``output``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Union

import torch
import torch.nn as nn

__all__ = ["DynamicLossScale", "LossScaleState", "Precision"]

Selector = Union[str, type]


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy (FSDP's ``MixedPrecisionPolicy``).

    Args:
        param: dtype a unit is gathered and computed in (``None``: the master dtype).
        reduce: dtype of the reduce-scatter / all-reduce of gradients (``None``: ``param``,
            or the master dtype when ``param`` is ``None``).
        output: dtype floating-point outputs of the model are cast to (``None``: as computed).
        cast_inputs: cast floating-point inputs of the model to the root unit's ``param``.
        overrides: ``((selector, Precision), ...)``: a unit whose module path equals a
            string selector, or whose module is an instance of a type selector, uses that
            policy's ``param`` and ``reduce`` instead (for example fp32 for normalisation
            layers made their own units). The first match wins.

    Gradients are returned to the optimizer in the master dtype (autograd requires a leaf's
    gradient in the leaf's dtype); ``reduce`` decides the precision of their averaging.

    Example:
        >>> bf16 = Precision(param=torch.bfloat16, reduce=torch.float32, output=torch.float32)
        >>> sharded = shard(params, mesh, "FULL_SHARD", precision=bf16)
    """

    param: torch.dtype | None = None
    reduce: torch.dtype | None = None
    output: torch.dtype | None = None
    cast_inputs: bool = True
    overrides: tuple[tuple[Selector, "Precision"], ...] = ()

    def __post_init__(self) -> None:
        for name in ("param", "reduce", "output"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(f"Precision({name}={value!r}): expected a floating-point torch.dtype or None.")
        if not isinstance(self.overrides, tuple):
            object.__setattr__(self, "overrides", tuple(self.overrides))
        for sel, pol in self.overrides:
            if not isinstance(sel, (str, type)) or not isinstance(pol, Precision):
                raise TypeError(
                    f"Precision(overrides=...): each entry is (module path or module class, Precision), got {(sel, pol)!r}."
                )

    def unit_dtypes(self, path: str, module: nn.Module | None, master: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """``(param dtype, reduce dtype)`` for the unit at ``path``."""
        policy = self
        for sel, pol in self.overrides:
            if (isinstance(sel, str) and sel == path) or (isinstance(sel, type) and isinstance(module, sel)):
                policy = pol
                break
        param = policy.param or master
        return param, policy.reduce or param

    def __repr__(self) -> str:
        fields = [f"{f.name}={_short(getattr(self, f.name))}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return f"Precision({', '.join(fields)})"


def _short(v: Any) -> str:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, tuple):
        return "(" + ", ".join(f"({getattr(s, '__name__', repr(s))}, {p!r})" for s, p in v) + ")"
    return repr(v)


def cast_floating(tree: Any, dtype: torch.dtype | None) -> Any:
    """Casts every floating-point tensor in a pytree to ``dtype`` (``None``: unchanged)."""
    if dtype is None:
        return tree
    import torch.utils._pytree as pytree

    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree
    )


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """fp16 dynamic loss scaling (``torch.amp.GradScaler``'s rule), for ``jit_step(loss_scale=...)``.

    The loss is multiplied by the current scale before backward and the gradients divided
    by it after the reduce. If any gradient on any rank is inf or nan the step is skipped
    (parameters and optimizer state unchanged) and the scale multiplied by ``backoff``;
    after ``growth_interval`` good steps in a row it is multiplied by ``growth``. The check
    needs no collective of its own: it rides on the step's metrics all-reduce (a non-finite
    gradient anywhere makes the global sum of squares non-finite on every rank).

    The scale is state: it lives in the step's optimizer state, a :class:`LossScaleState`
    built by ``step.init(sharded)``, which the step returns updated and checkpoints save,
    so a resumed run continues with the same scale.

    Example:
        >>> step = jit_step(loss_fn, mesh, optimizer=opt, loss_scale=DynamicLossScale())
        >>> opt_state = step.init(sharded)         # LossScaleState(opt.init(sharded), scale, good_steps)
        >>> sharded, opt_state, m = step(sharded, opt_state, batch)   # m["loss_scale"], m["skipped"]
    """

    init_scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth > 1 and 0 < self.backoff < 1 and self.growth_interval >= 1):
            raise ValueError(
                f"{self!r}: need init_scale > 0, growth > 1, 0 < backoff < 1 and growth_interval >= 1."
            )

    def init(self, opt_state: Any) -> "LossScaleState":
        """The state of a loss-scaled step around the optimizer's ``opt_state``."""
        return LossScaleState(opt_state, torch.tensor(float(self.init_scale)), torch.tensor(0, dtype=torch.int64))

    def next(self, state: "LossScaleState", finite: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, good_steps)`` after a step whose gradients were (not) finite."""
        scale, good = float(state.scale), int(state.good_steps)
        if not finite:
            scale, good = scale * self.backoff, 0
        else:
            good += 1
            if good == self.growth_interval:
                scale, good = scale * self.growth, 0
        return torch.tensor(scale), torch.tensor(good, dtype=torch.int64)


class LossScaleState(NamedTuple):
    """The optimizer state of a step with ``loss_scale``: the optimizer's state and the scale.

    Attributes:
        opt_state: the optimizer's own state (what ``opt.init(sharded)`` returns).
        scale: 0-d float32 CPU tensor, the scale the next step multiplies the loss by.
        good_steps: 0-d int64 CPU tensor, finite steps since the scale last changed.
    """

    opt_state: Any
    scale: torch.Tensor
    good_steps: torch.Tensor


def check_norm_precision(module: nn.Module | None, layout: Any, mesh: Any) -> None:
    """Refuses a precision that would run a BatchNorm (or InstanceNorm) with running
    statistics on parameters of another dtype: torch's batch_norm wants its weight and its
    running statistics in one dtype ("expected scalar type BFloat16 but found Float" in the
    first step). Buffers are never cast (they are state, updated in place); the fix is to
    keep such modules in their statistics' dtype with ``Precision(overrides=...)``."""
    bad = []
    for path, sub in module.named_modules() if module is not None else ():
        if not isinstance(sub, nn.modules.batchnorm._NormBase) or not sub.track_running_stats or sub.weight is None:
            continue
        name = f"{path}.weight" if path else "weight"
        stats = sub.running_mean
        leaf = layout.leaves.get(name)
        if leaf is None or stats is None or not stats.is_floating_point():
            continue
        param_dtype = layout.units[leaf.unit].param_dtype
        if param_dtype != stats.dtype:
            bad.append(f"{path or '<root>'} ({type(sub).__name__}: parameters in {str(param_dtype)[6:]}, running "
                       f"statistics in {str(stats.dtype)[6:]})")
    if bad:
        raise ValueError(
            f"shard(..., precision=...): {len(bad)} normalisation module(s) would compute with parameters in another "
            f"dtype than their running statistics, which torch's batch_norm refuses (the first step would fail with "
            f"'expected scalar type'): {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}; mesh {mesh}. Buffers "
            f"are not cast. Keep these modules in their statistics' dtype, as units of their own: "
            f"shard(..., units=[YourBlock, torch.nn.BatchNorm2d], precision=shardfn.Precision(param=torch.bfloat16, "
            f"reduce=torch.float32, overrides=((torch.nn.modules.batchnorm._BatchNorm, "
            f"shardfn.Precision(param=torch.float32)),))) (they then take bf16 inputs and give bf16 outputs), or "
            f"train without a param dtype.")
