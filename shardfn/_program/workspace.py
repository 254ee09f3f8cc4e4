"""How many bytes a recorded program holds while it runs: ``GraphStep.workspace_bytes``."""

from __future__ import annotations

import operator

import torch

__all__ = ["workspace"]


_UNMARKED_ALIASES = (torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten._unsafe_view.default)


def _aliased(node: torch.fx.Node) -> torch.fx.Node | None | bool:
    """The node whose memory ``node``'s output shares (by the op's schema; ``wait_tensor``
    returns its input, ``_unsafe_view`` its input's memory; an element of a list output
    shares the list's), or False where the output is memory of its own."""
    target = node.target
    if target in _UNMARKED_ALIASES or target is operator.getitem:
        return node.args[0]
    if not isinstance(target, torch._ops.OpOverload):
        return False
    schema = target._schema
    info = schema.returns[0].alias_info if schema.returns else None
    if info is None:
        return False
    given = dict(zip((a.name for a in schema.arguments), node.args)) | dict(node.kwargs)
    for arg in schema.arguments:  # a list of views (``Tensor(a)[]``) names no set: its first aliased argument
        if arg.alias_info is not None and (arg.alias_info.before_set & info.before_set or not info.before_set):
            base = given.get(arg.name)
            return base[0] if isinstance(base, (list, tuple)) else base
    return False


def workspace(gm: torch.fx.GraphModule) -> int:
    """The most bytes the program holds beyond its inputs and constants, run in its recorded
    order with each tensor freed after its last use (as the graph's own code frees them).
    A view or an in-place result shares its base's memory and keeps it alive; an op's list
    of new tensors lives while the list is used, and each element while it is."""
    nodes = list(gm.graph.nodes)
    owns: dict[torch.fx.Node, list[tuple[torch.fx.Node, int]]] = {}  # node -> the allocations it keeps alive
    size: dict[tuple[torch.fx.Node, int], int] = {}  # allocation (node, element) -> bytes
    for n in nodes:
        base = _aliased(n) if n.op == "call_function" else None
        if n.op != "call_function" or base is None:
            owns[n] = []  # an input, a constant, or a view of one
        elif base is False:
            vals = n.meta.get("val")
            many = isinstance(vals, (list, tuple))
            keys = [(n, i) for i in range(len(vals) if many else 1)]
            for key, v in zip(keys, vals if many else [vals]):
                size[key] = v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0
            owns[n] = keys
        elif n.target is operator.getitem and len(owns[base]) > 1:
            owns[n] = [owns[base][n.args[1]]]
        else:
            owns[n] = owns[base] if isinstance(base, torch.fx.Node) else []
    order = {n: i for i, n in enumerate(nodes)}
    last = {key: order[key[0]] for key in size}
    for n in nodes:
        for user in n.users:
            for key in owns[n]:
                last[key] = max(last[key], order[user])
    freed: dict[int, int] = {}
    now = peak = 0
    for i, n in enumerate(nodes):
        for key in owns[n] if owns[n] and owns[n][0][0] is n else []:
            now += size[key]
            freed[last[key]] = freed.get(last[key], 0) + size[key]
        peak = max(peak, now)
        now -= freed.pop(i, 0)
    return peak
