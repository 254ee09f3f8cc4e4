"""The state tree of a module: its parameters and buffers, their names, ties and persistence.

[Note: the state tree]
shardfn holds all of a model's state in one flat mapping name -> tensor: every parameter
and every buffer (persistent or not), each tensor once, under its *canonical* name (the
first name ``named_parameters()`` / ``named_buffers()`` gives it). A tensor reachable
under several names (a weight tied between two modules, a submodule shared by two
parents) has *aliases*. ``model.state_dict()`` lists every alias of every parameter and
of every persistent buffer; :func:`shardfn.gather` returns exactly those keys, so
``model.load_state_dict(gather(sharded), strict=True)`` works. Everything here is
computed once per model, from the module tree, by :func:`tree_info`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import ItemsView, Iterable, Iterator, KeysView, Mapping, ValuesView
from typing import Any

import torch
import torch.nn as nn

__all__ = ["Params", "TensorTree", "TreeInfo", "check_names", "tree_info"]


class Params(dict):
    """A plain ``dict`` name -> tensor, the model's state, that also remembers its module tree.

    It holds every parameter and every buffer (see [Note: the state tree]). The module
    tree (``params.module``: parameters and buffers on the meta device) lets unit
    policies such as ``by_module_type(Block)`` resolve and names the buffers, ties and
    state-dict keys. A plain dict works everywhere a ``Params`` does, except with policies
    that need the module tree (and then every entry is taken for a parameter).
    """

    module: nn.Module | None = None


class TensorTree(Mapping):
    """A read-only mapping name -> tensor over ``self._data``: the trees shardfn hands out
    (:class:`shardfn.ShardedParams`, the gradients a step gives its optimizer)."""

    __slots__ = ("_data",)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    # The dict's own views and look-ups, not Mapping's, which call __getitem__ once per
    # key: a step's checks and its optimizer read every leaf of these trees.
    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def keys(self) -> KeysView[str]:
        return self._data.keys()

    def values(self) -> ValuesView[torch.Tensor]:
        return self._data.values()

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self._data.items()


@dataclasses.dataclass(frozen=True)
class TreeInfo:
    """Names of a module's state (see [Note: the state tree])."""

    params: tuple[str, ...]  # canonical parameter names, in named_parameters() order
    buffers: tuple[str, ...]  # canonical buffer names, in named_buffers() order
    persistent: frozenset[str]  # the buffers that state_dict() holds
    aliases: Mapping[str, tuple[str, ...]]  # canonical name -> every name of that tensor, itself first
    state_dict_keys: tuple[tuple[str, str], ...]  # (state_dict key, canonical name), in state_dict() order

    @property
    def names(self) -> tuple[str, ...]:
        return self.params + self.buffers


def tree_info(module: nn.Module | None, names: Iterable[str] = ()) -> TreeInfo:
    """The state tree of ``module``; without a module, ``names`` are all parameters."""
    if module is None:
        names = tuple(names)
        return TreeInfo(names, (), frozenset(), {n: (n,) for n in names}, tuple((n, n) for n in names))
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    params, buffers = [], []
    for kind, named in ((params, module.named_parameters(remove_duplicate=False)),
                        (buffers, module.named_buffers(remove_duplicate=False))):
        for name, t in named:
            if id(t) not in canonical:
                canonical[id(t)] = name
                kind.append(name)
            aliases.setdefault(canonical[id(t)], []).append(name)
    state_dict_keys = []
    persistent = set()
    for key, t in module.state_dict(keep_vars=True).items():
        name = canonical.get(id(t))
        if name is None:  # extra state a module's own state-dict hook adds: not a tensor of ours
            continue
        state_dict_keys.append((key, name))
        if name in aliases and name not in params:
            persistent.add(name)
    return TreeInfo(tuple(params), tuple(buffers), frozenset(persistent),
                    {n: tuple(a) for n, a in aliases.items()}, tuple(state_dict_keys))


_NAMES_HINT = (
    "  Pass the state returned by functionalize(model) (parameters and buffers), or shard() of it, for this same "
    "model."
)


def check_names(got: Iterable[str], expected: Iterable[str], *, what: str) -> None:
    """Raises one ValueError listing every missing and unexpected name of the state tree."""
    got, expected = set(got), set(expected)
    if got == expected:
        return
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    lines = [f"{what}: the names of the state tree do not match the model."]
    if missing:
        lines.append(f"  missing ({len(missing)}): {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        lines.append(
            f"  unexpected ({len(unexpected)}): {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}"
        )
    lines.append(_NAMES_HINT)
    raise ValueError("\n".join(lines))
