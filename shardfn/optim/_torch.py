"""Run any ``torch.optim.Optimizer`` on local shards behind the functional protocol."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ._checks import _check_grads, _check_mapping, _trainable
from ._protocol import GradientTransformation, Params, Updates
from ._whole import require_whole

# torch optimizers whose step is elementwise per parameter (each element of the new value
# depends on the same element of the parameter, its gradient and its state), so that a shard
# steps as its whole parameter would: tests/test_muon.py reads each one's step functions in
# the installed torch for reductions or matrix products. Any other optimizer needs whole
# parameters on shards ([Note: whole-parameter optimizers]).
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "Rprop", "ASGD")
    if hasattr(torch.optim, name))

# [Note: from_torch state is not a pytree]
# A torch optimizer keeps its state (moments, step counts) inside itself, keyed by
# Parameter objects, and mutates it in step(). TorchOptimizerState therefore owns
# the optimizer and a private Parameter per trainable leaf, and update() advances
# that same object and returns it:
#   * the state is not pure: an old state object sees every later step, and calling
#     update twice with the same state takes two steps;
#   * it cannot be flattened into tensors; checkpoint state.optimizer.state_dict()
#     (load it with state.optimizer.load_state_dict after opt.init);
#   * learning-rate schedules are torch's: wrap state.optimizer in a
#     torch.optim.lr_scheduler and step that scheduler yourself.
# The Parameters are refreshed from `params` on every update, so the caller may
# update params in place (apply_updates_) or out of place (apply_updates).


@dataclasses.dataclass(frozen=True, eq=False)
class TorchOptimizerState:
    """The state of :func:`from_torch`: a torch optimizer over private copies.

    Attributes:
        optimizer: the ``torch.optim.Optimizer`` instance, or ``None`` when no param
            is trainable (torch refuses an empty parameter list).
        names: the trainable param names, in the order of
            ``optimizer.param_groups[0]["params"]``.
    """

    optimizer: torch.optim.Optimizer | None
    names: tuple[str, ...]

    def __repr__(self) -> str:
        kind = type(self.optimizer).__name__ if self.optimizer is not None else None
        return f"TorchOptimizerState(optimizer={kind}, names={self.names!r})"

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        if self.optimizer is None:
            return {}
        return dict(zip(self.names, self.optimizer.param_groups[0]["params"]))


def from_torch(optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> GradientTransformation:
    """Adapts a ``torch.optim.Optimizer`` class into a gradient transformation.

    ``init`` builds ``optimizer_class([...], **kwargs)`` over detached copies of the
    trainable params (``requires_grad``); ``update`` loads the current params into
    them, sets their ``.grad`` from ``grads``, calls ``optimizer.step()`` and returns
    ``new - old`` per key. Leaves missing from ``grads`` get ``.grad = None``, so the
    optimizer skips them. The state owns the optimizer and is mutated by ``update``;
    see ``[Note: from_torch state is not a pytree]``. Optimizers whose ``step`` needs
    a closure (``torch.optim.LBFGS``) are not supported. ``update_`` (what a donating
    step runs) passes the donated grads to the optimizer without a copy and copies the
    stepped values straight into ``params``, with no ``updates`` tensors.

    Args:
        optimizer_class: a subclass of ``torch.optim.Optimizer``.
        **kwargs: passed to its constructor (``lr``, ``betas``, ...).

    Returns:
        A :class:`GradientTransformation` with state :class:`TorchOptimizerState`;
        its hyperparams report the optimizer's current ``lr``.

    Example:
        >>> opt = from_torch(torch.optim.RMSprop, lr=1e-3, alpha=0.9)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> apply_updates_(params, updates)
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"from_torch: expected a torch.optim.Optimizer subclass, got "
            f"{optimizer_class!r}; pass the class, e.g. from_torch(torch.optim.Adam, lr=1e-3)."
        )

    def init(params: Params) -> TorchOptimizerState:
        trainable = _trainable(params)
        if optimizer_class not in ELEMENTWISE:
            require_whole(params, trainable, f"from_torch({optimizer_class.__name__})",
                          "its step is not known to be elementwise: it may read the whole parameter, as Muon "
                          "orthogonalises a matrix and Adafactor factors it by rows and columns, and on a cut "
                          "it would silently compute something else; shardfn.optim.muon and "
                          "shardfn.optim.adafactor run on shards")
        if not trainable:
            return TorchOptimizerState(None, ())
        copies = [torch.nn.Parameter(p.detach().clone()) for p in trainable.values()]
        return TorchOptimizerState(optimizer_class(copies, **kwargs), tuple(trainable))

    def check(grads: Params, state: TorchOptimizerState, params: Params | None) -> dict[str, torch.nn.Parameter]:
        if not isinstance(state, TorchOptimizerState):
            raise TypeError(
                f"from_torch: state is {type(state).__name__}, not TorchOptimizerState; "
                "pass the state returned by this optimizer's init."
            )
        copies = state._parameters()
        _check_grads(grads, copies, f"from_torch({optimizer_class.__name__})")
        if params is None:
            raise ValueError(
                "from_torch: needs the current params but got params=None; call "
                "update(grads, state, params)."
            )
        _check_mapping(params, "params")
        errors = [
            f"from_torch: params[{k!r}] is missing" if k not in params
            else f"from_torch: params[{k!r}] has shape {tuple(params[k].shape)}, "
            f"the state has {tuple(q.shape)}"
            for k, q in copies.items()
            if k not in params or params[k].shape != q.shape
        ]
        if errors:
            raise ValueError(
                "\n".join(errors) + "\nPass the params you called opt.init on."
            )
        return copies

    def step(grads: Params, state: TorchOptimizerState, params: Params, copies: dict, donated: bool) -> None:
        for k, q in copies.items():
            q.copy_(params[k])
            # torch optimizers may write into .grad (foreach Nesterov SGD adds the momentum
            # into it): update must not touch its inputs, so it passes a copy; update_'s
            # grads are donated, so it passes them (converted only if the dtype differs).
            q.grad = grads[k].detach().to(q.dtype, copy=not donated) if k in grads else None
        if state.optimizer is not None:
            state.optimizer.step()

    def update(
        grads: Params, state: TorchOptimizerState, params: Params | None = None
    ) -> tuple[Updates, TorchOptimizerState]:
        copies = check(grads, state, params)
        with torch.no_grad():
            step(grads, state, params, copies, donated=False)
            updates = {k: copies[k].detach() - params[k] for k in grads}
            for q in copies.values():
                q.grad = None  # do not keep a gradient-sized buffer alive between steps
        return updates, state

    def update_(grads: Params, state: TorchOptimizerState, params: Params | None = None) -> TorchOptimizerState:
        copies = check(grads, state, params)
        with torch.no_grad():
            step(grads, state, params, copies, donated=True)
            for k in grads:
                params[k].copy_(copies[k])  # no updates tensors: the new values go straight back
            for q in copies.values():
                q.grad = None
        return state

    def torch_hyperparams(state: TorchOptimizerState) -> dict[str, float]:
        # What the next step() reads, after any torch lr_scheduler has stepped.
        group = state.optimizer.param_groups[0] if state.optimizer is not None else {}
        return {"learning_rate": float(group["lr"])} if "lr" in group else {}

    return GradientTransformation(init, update, torch_hyperparams, update_)
