"""partition: a different transformation for each group of parameters (optax's multi_transform)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from ._checks import _check_mapping, _trainable
from ._protocol import GradientTransformation, Params, Updates, hyperparams
from ._whole import full_shape

__all__ = ["PartitionState", "partition"]

LabelFn = Callable[[str, tuple[int, ...]], str]


class PartitionState(NamedTuple):
    """State of :func:`partition`: each transformation's state (over its parameters), in the
    order of ``transforms`` (a tuple, not a dict by label: a state's mapping keys name
    parameters, see :func:`shardfn.optim.param_leaves`)."""

    inner: tuple[Any, ...]


class _Part(Mapping):
    """The parameters of one label, a view of the whole tree that keeps its layout and mesh
    (so a transformation inside sees global shapes: :func:`full_shape`)."""

    def __init__(self, tree: Mapping[str, torch.Tensor], names: list[str]):
        self._tree, self._names = tree, [n for n in names if n in tree]
        self.layout = getattr(tree, "layout", None)
        self.mesh = getattr(tree, "mesh", None)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._names:
            raise KeyError(key)
        return self._tree[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def partition(transforms: Mapping[str, GradientTransformation], label_fn: LabelFn) -> GradientTransformation:
    """Each trainable parameter gets the transformation of its label, ``label_fn(name, shape)``
    with the parameter's global shape (also on shards).

    Args:
        transforms: label -> :class:`GradientTransformation`.
        label_fn: ``(name, shape) -> label``, a key of ``transforms``; the same on every rank.

    Returns:
        A :class:`GradientTransformation` with state :class:`PartitionState`. Its
        ``update_`` exists when every member's does; its hyperparams are each member's,
        prefixed with its label (``"muon/learning_rate"``).

    Example:
        >>> opt = partition({"muon": muon(0.02), "adamw": adamw(3e-4)},
        ...                 lambda name, shape: "muon" if len(shape) == 2 and "blocks" in name else "adamw")
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError("partition: transforms must be a non-empty mapping label -> GradientTransformation.")
    if not callable(label_fn):
        raise TypeError(f"partition: label_fn={label_fn!r}; a function (name, shape) -> label.")
    transforms = dict(transforms)

    def groups(params: Params, names: list[str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {label: [] for label in transforms}
        bad = []
        for n in names:
            label = label_fn(n, full_shape(params, n))
            if label not in transforms:
                bad.append(f"{n}: {label!r}")
            else:
                out[label].append(n)
        if bad:
            raise ValueError(f"partition: label_fn gave labels that are not in transforms {sorted(transforms)}: "
                             + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
        return out

    def init(params: Params) -> PartitionState:
        by_label = groups(params, list(_trainable(params)))
        return PartitionState(tuple(t.init(_Part(params, by_label[label])) for label, t in transforms.items()))

    def split(grads: Params, state: PartitionState, params: Params | None) -> dict[str, tuple[Params, Params]]:
        _check_mapping(grads, "grads")
        if not isinstance(state, PartitionState) or len(state.inner) != len(transforms):
            raise TypeError(f"partition: state is {type(state).__name__}; pass the state this partition's init "
                            "returned.")
        tree = params if params is not None else grads
        by_label = groups(tree, list(grads))
        return {label: ({k: grads[k] for k in names}, _Part(params, names) if params is not None else None)
                for label, names in by_label.items()}

    def update(grads: Params, state: PartitionState, params: Params | None = None) -> tuple[Updates, PartitionState]:
        updates: Updates = {}
        inner = []
        for i, (label, (g, p)) in enumerate(split(grads, state, params).items()):
            u, new = transforms[label].update(g, state.inner[i], p)
            inner.append(new)
            updates.update(u)
        return updates, PartitionState(tuple(inner))

    update_ = None
    if all(t.update_ is not None for t in transforms.values()):
        def update_(grads: Params, state: PartitionState, params: Params | None = None) -> PartitionState:
            if params is None:
                raise ValueError("partition: update_ updates the params in place; call update_(grads, state, params).")
            inner = tuple(transforms[label].update_(g, state.inner[i], p)
                          for i, (label, (g, p)) in enumerate(split(grads, state, params).items()))
            return PartitionState(inner)

    def partition_hyperparams(state: PartitionState) -> dict[str, float]:
        return {f"{label}/{k}": v for i, (label, t) in enumerate(transforms.items())
                for k, v in hyperparams(t, state.inner[i]).items()}

    return GradientTransformation(init, update, partition_hyperparams, update_)
