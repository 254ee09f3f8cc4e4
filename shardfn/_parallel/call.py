"""What a split layer's forward reads of the sharded call it runs in: one typed value a call;
and how a layout says in words what it splits.

A sharded call on a layout with split layers (shardfn._parallel.tensor, shardfn._parallel.sequence) hands
a :class:`TensorCall` to the site of each hooked module for the call ([Note: a site per
hooked module] in shardfn._run.call); each split module's forward reads its own. It
carries the layout's styles, the runtime whose scope and observers its collectives take
([Note: backward on device threads] in shardfn._comm.guard), how the call runs (:class:`Pass`),
the shared colwise inputs of the call ([Note: one all-reduce per shared input]) and the
sequence region's state ([Note: the sequence region]). Made afresh for each call, so none
of it outlives the call.
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REPLICATED", "SEQUENCE_STYLES", "Pass", "TensorCall", "blocks_of", "params_text", "styles_text"]

SEQUENCE_STYLES = ("sequence", "sequence_start", "sequence_end")
REPLICATED = "replicated_with_grad_allreduce"  # whole on every rank, gradients summed (shardfn._parallel.tensor)


def blocks_of(styles: Mapping[str, str]) -> set[str]:
    """The modules that hold colwise layers: in a plan with sequence parallelism, each
    gathers its input for them ([Note: the sequence region] in shardfn._parallel.sequence)."""
    return {p.rpartition(".")[0] for p, s in styles.items() if s == "colwise"}


class Pass(enum.Enum):
    """How a call runs its split layers."""

    FORWARD = "forward"  # a sharded call's forward: the region is checked as it opens and closes
    RECOMPUTE = "recompute"  # a remat recompute in backward, inside the region its forward checked
    WHOLE = "whole"  # bind's block: split layers run split, a sequence region runs whole


@dataclass
class TensorCall:
    """One sharded call, as its split layers see it."""

    layout: Any  # the call's shardfn._state.layout.Layout
    rt: Any  # its shardfn._run.runtime.Runtime
    mode: Pass
    styles: dict[str, str]  # module path -> style (the layout's)
    blocks: frozenset[str]  # the modules that hold colwise layers (shardfn._parallel.sequence.blocks_of)
    region: bool  # the layout has sequence styles
    # shared colwise inputs ([Note: one all-reduce per shared input] in shardfn._parallel.ops)
    copies: dict[int, tuple] = field(default_factory=dict)
    opened: str | None = None  # the 'sequence_start' module whose region is open, if one is
    draws: tuple[bytes, ...] | None = None  # the generators' states when the region opened
    made: dict[int, weakref.ref] = field(default_factory=dict)  # the 'sequence' modules' outputs, by id

    @classmethod
    def of(cls, layout: Any, rt: Any, mode: Pass = Pass.FORWARD) -> "TensorCall":
        styles = dict(layout.tensor)
        region = any(s in SEQUENCE_STYLES for s in styles.values())
        return cls(layout, rt, mode, styles, frozenset(blocks_of(styles)), region)

    def again(self) -> "TensorCall":
        """This call as a remat recompute in backward sees it: the same layout and runtime, no
        region to check, and shared inputs of its own (the forward's are activations)."""
        return TensorCall(self.layout, self.rt, Pass.RECOMPUTE, self.styles, self.blocks, self.region)

    @property
    def sequence(self) -> bool:
        """Whether the call runs a sequence region split (a plan with one, outside bind)."""
        return self.region and self.mode is not Pass.WHOLE

    @property
    def checks(self) -> bool:
        """Whether this call checks the region (its forward; not a recompute, not bind's block)."""
        return self.mode is Pass.FORWARD


def styles_text(styles: Sequence[tuple[str, str]]) -> str:
    """``(path, style)`` pairs in a line: paths that differ only by their numbers (the layers
    of a stack) as one pattern with ``*``, and how many layers it stands for."""
    groups: dict[tuple[str, str], list[list[str]]] = {}
    for path, style in styles:
        parts = path.split(".")
        groups.setdefault((".".join("#" if p.isdigit() else p for p in parts), style), []).append(parts)
    out = []
    for (_, style), paths in groups.items():
        pattern = ".".join(col[0] if len(set(col)) == 1 else "*" for col in zip(*paths))
        out.append(f"{pattern} {style}" + (f" ({len(paths)} layers)" if len(paths) > 1 else ""))
    return ", ".join(out)


def params_text(num_params: int, leaves: Mapping[str, Any], splits: Sequence[Any]) -> str:
    """A layout's parameters in words (``leaves``: its LeafLayouts, each a piece where split),
    and with a tensor axis the part each tensor rank holds."""
    if not splits:
        return f"{num_params:,} params"
    whole = num_params + sum(math.prod(s.shape) - math.prod(leaves[s.leaf].shape) for s in splits)
    return f"{whole:,} params ({num_params:,} on each tensor rank: {len(splits)} leaves split over the 'tensor' axis)"
