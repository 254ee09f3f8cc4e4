"""bind: the model as an ``nn.Module`` on shards, for inference and generation.

[Note: bind]
``apply(sharded, x)`` runs one forward and gathers every unit it needs, each call anew:
a 100-token greedy decode all-gathers the whole model 100 times, and only ``forward``
runs. ``with shardfn.bind(apply, sharded) as model:`` places the shards' state into
``apply``'s module tree for the block instead: the buffers and the root unit's
parameters (gathered once, at entry) as real tensors, and every other unit behind the
hooks of a sharded call (see [Note: how a sharded call works]), so each unit is gathered
when its module runs. Any method of the model runs then — ``model.generate(...)`` of a
Hugging Face model included — on every rank together: each forward issues the same
all-gathers on every rank, so every rank must make the same calls (with Hugging Face's
``generate``, pass ``synced_gpus=True`` when ranks may stop at different lengths).
Ranks whose calls differ all raise the same DivergenceError at the latest when the block
ends: its end is agreed on like a collective (``_guard.agree_exit``), so a rank that
stops early does not return while another waits in its next all-gather.

Without ``keep_gathered`` a unit lets go of its parameters after each of its forwards,
whatever the strategy (no backward follows), so the block holds what one forward of
FULL_SHARD holds, and each forward all-gathers every unit it runs. With
``keep_gathered=True`` a unit stays gathered from its first forward until the block
ends: one all-gather per unit for the whole block (all of the model's parameters in
memory by the end). The block runs under ``torch.no_grad()``: bind is for inference;
training goes through a step. The shards must not change inside the block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from .._comm import guard as G
from .call import _prepare, bound, units_for
from .functionalize import Apply
from .._comm.events import Purpose
from .._comm.guard import Where, guarded
from .runtime import AfterForward, Runtime
from .._state.sharded import ShardedParams
from .._parallel.call import Pass, TensorCall

__all__ = ["bind"]


def _slots(module: nn.Module, names: list[str]) -> list[tuple[dict, str]]:
    """The (parameter or buffer dict of a submodule, attribute) where each name lives."""
    out = []
    for name in names:
        sub_path, _, attr = name.rpartition(".")
        sub = module.get_submodule(sub_path)
        out.append((sub._parameters if attr in sub._parameters else sub._buffers, attr))
    return out


@contextmanager
def bind(apply: Any, sharded: ShardedParams, *, keep_gathered: bool = False) -> Iterator[nn.Module]:
    """The model as an ``nn.Module`` whose state comes from ``sharded``, for the block.

    Every method of the model runs on the shards (see [Note: bind]): the root unit's
    parameters and the buffers are in the module for the block, and each other unit is
    all-gathered when its module runs. All ranks must make the same calls in the same
    order. The block runs under ``torch.no_grad()``; set the mode with ``apply.eval()``.

    Args:
        apply: the ``apply`` of :func:`shardfn.functionalize` for this model.
        sharded: the model's shards (:func:`shardfn.shard`).
        keep_gathered: keep each unit gathered from its first use until the block ends
            (one all-gather per unit for the whole block, the whole model in memory then),
            for decoding when memory allows. ``False``: each forward of a unit gathers it
            and lets go after.

    Example:
        >>> apply.eval()
        >>> with shardfn.bind(apply, sharded, keep_gathered=True) as model:
        ...     tokens = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    """
    if not isinstance(sharded, ShardedParams):
        raise TypeError(f"bind(apply, sharded): expected the ShardedParams from shardfn.shard(), got "
                        f"{type(sharded).__name__}.")
    if not isinstance(apply, Apply):
        raise TypeError(f"bind(apply, sharded): expected the apply of shardfn.functionalize(), got "
                        f"{type(apply).__name__}.")
    # The block is one guarded region from here: an error on one rank (gathering the root
    # unit, or in the block) reaches the others at their next collective; ranks that made
    # different calls learn it at the latest at the end of the block (see the agreement below).
    alone = ("bind(apply, sharded) inside a step or a sharded call: bind is for inference outside a step; inside "
             "loss_fn call apply(params, ...).")
    with guarded(sharded.mesh, Where.BIND, alone=alone) as scope:
        returned = yield from _bound(apply, sharded, keep_gathered, scope)
    if returned:  # every rank ends the block here, or the ranks' calls differed: all of them raise
        G.agree_exit(sharded.mesh.channel("shard"), "shardfn.bind(...)", scope)


def _bound(apply: Any, sharded: ShardedParams, keep_gathered: bool, scope: Any) -> Iterator[nn.Module]:
    """The block of :func:`bind` inside its guarded region (``scope``); returns whether it ended without an error."""
    layout = sharded.layout
    rt = Runtime(sharded.mesh, scope, after_forward=AfterForward.KEEP if keep_gathered else AfterForward.FREE,
                 where=Where.BIND)
    units = units_for(apply, sharded, rt, _prepare(apply, layout))
    with torch.no_grad():
        state = {n: sharded[n] for n in (*layout.buffers, *layout.ignored)}
        for root in units.get("", []):
            state.update(zip(root.unit.leaves, root.start_use(Purpose.GATHER)))
    names = [(alias, n) for n in state for alias in layout.aliases.get(n, (n,))]
    slots = _slots(apply.module, [alias for alias, _ in names])
    originals = [d[attr] for d, attr in slots]
    placed = [state[n] for _, n in names]
    for (d, attr), t in zip(slots, placed):
        d[attr] = t
    # split layers run split in the block (shardfn._parallel.tensor); a sequence region runs whole: the
    # same sums, on sequences of any length (a generated token at a time)
    call = TensorCall.of(layout, rt, Pass.WHOLE)
    returned = False
    try:
        with bound(apply.sites, units, call), torch.no_grad(), sharded.mesh.random.drawing(sharded.mesh, rt.scope):
            yield apply.module
        returned = True
    finally:
        for unit in (u for group in units.values() for u in reversed(group)):
            if unit.entered:  # a unit's forward raised
                unit.exit()
            unit.end_use()
        rt.finish()  # the block's runtime ends: nothing stays gathered
        replaced = {}
        for (d, attr), (_, n), t, original in zip(slots, names, placed, originals):
            if d[attr] is not t and n in layout.buffers:  # the module replaced a buffer: keep it in the tree
                replaced[n] = d[attr]
            d[attr] = original
        if replaced:
            sharded._set_buffers(replaced)
    return returned
