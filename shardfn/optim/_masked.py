"""Apply a transformation to some leaves only (``optax.masked``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Union

from ._checks import _check_mapping, _check_updates, _trainable
from ._protocol import GradientTransformation, OptState, Params, Updates, apply_updates_, hyperparams

Mask = Union[Callable[[str], bool], Mapping[str, bool]]

_MASK_MISSING = (
    "{fn}: the mask has no entry for {keys}. A Mapping mask needs a bool for every "
    "trainable param name; add the missing names, or pass a callable name -> bool "
    "(for example lambda name: not name.endswith('bias'))."
)


def _check_mask(mask: Mask, fn: str) -> None:
    if not (isinstance(mask, Mapping) or callable(mask)):
        raise TypeError(
            f"{fn}: mask must be a callable name -> bool or a Mapping name -> bool, "
            f"got {type(mask).__name__}."
        )


def _selected(mask: Mask, names: Iterable[str], fn: str) -> set[str]:
    """The names that ``mask`` selects; raises once for names a Mapping lacks."""
    names = list(names)
    if isinstance(mask, Mapping):
        missing = [k for k in names if k not in mask]
        if missing:
            keys = ", ".join(repr(k) for k in missing)
            raise ValueError(_MASK_MISSING.format(fn=fn, keys=keys))
        return {k for k in names if mask[k]}
    return {k for k in names if mask(k)}


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    """Applies ``inner`` to the leaves that ``mask`` selects; other grads pass through.

    As ``optax.masked``: ``inner`` sees plain dicts holding only the selected leaves
    (its state covers only the selected trainable params), and every other gradient
    comes out unchanged as its own update. The state is ``inner``'s state, and the
    hyperparams are ``inner``'s. It has an in-place ``update_`` when ``inner`` has one
    (the other gradients are added to their params in place), and an in-place
    gradient kernel for :func:`chain` when ``inner`` has one.

    Args:
        inner: the transformation to apply to the selected leaves.
        mask: a callable ``name -> bool``, or a Mapping ``name -> bool`` with an
            entry for every trainable param name.

    Returns:
        A :class:`GradientTransformation` whose state is ``inner``'s state.

    Example:
        >>> no_bias = lambda name: not name.endswith("bias")
        >>> opt = chain(masked(add_decayed_weights(0.1), no_bias), sgd(0.1, momentum=0.9))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"masked: inner is {type(inner).__name__}, not a GradientTransformation; "
            "pass a transformation such as add_decayed_weights(0.1)."
        )
    _check_mask(mask, "masked")

    def select(tree: Params) -> dict:
        keep = _selected(mask, tree, "masked")
        return {k: v for k, v in tree.items() if k in keep}

    def init(params: Params) -> OptState:
        return inner.init(select(_trainable(params)))

    def split(grads: Params, params: Params | None) -> tuple[dict, dict | None]:
        _check_mapping(grads, "grads")
        chosen = select(grads)
        if params is not None:
            _check_mapping(params, "params")
            # Only names with a gradient are looked up, so a Mapping mask needs
            # no entry for frozen params.
            params = {k: params[k] for k in chosen if k in params}
        return chosen, params

    def update(
        grads: Params, state: OptState, params: Params | None = None
    ) -> tuple[Updates, OptState]:
        chosen, selected_params = split(grads, params)
        inner_updates, state = inner.update(chosen, state, selected_params)
        return {k: inner_updates[k] if k in chosen else g for k, g in grads.items()}, state

    def masked_hyperparams(state: OptState) -> dict[str, float]:
        return hyperparams(inner, state)

    kernel = inner.update_grads_
    update_grads_ = None
    if kernel is not None:

        def update_grads_(
            grads: Params, state: OptState, params: Params | None = None
        ) -> tuple[Updates, OptState]:
            chosen, selected_params = split(grads, params)
            inner_updates, state = kernel(chosen, state, selected_params)
            return {k: inner_updates[k] if k in chosen else g for k, g in grads.items()}, state

    update_ = None
    if inner.update_ is not None:
        inner_update_ = inner.update_

        def update_(grads: Params, state: OptState, params: Params | None = None) -> OptState:
            if params is None:
                raise ValueError(
                    "masked: update_ needs the params to update in place but got params=None; "
                    "call update_(grads, state, params)."
                )
            chosen, selected_params = split(grads, params)
            others = {k: g for k, g in grads.items() if k not in chosen}  # their own updates
            _check_updates(params, others, "masked")  # before anything is written
            state = inner_update_(chosen, state, selected_params)
            apply_updates_(params, others)
            return state

    return GradientTransformation(init, update, masked_hyperparams, update_, update_grads_)
