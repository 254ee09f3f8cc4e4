"""The state put back when a graph step's first calls raise: :func:`put_back`."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

__all__ = ["put_back"]


@contextlib.contextmanager
def put_back(state: list[torch.Tensor], optimizers: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Runs the block; if it raises, ``state`` and the torch optimizers' own state are put
    back as they were before it, then the error goes on.

    [Note: a recording that raises]
    A graph step's first call (eager, under a recording's rules) and each recording run the
    whole step on the state itself, in place, and some refusals can only come after it: a
    module attribute the forward changed, a host tensor in a device program, ranks whose
    programs differ. So these calls keep a host copy of the state (and of a ``from_torch``
    optimizer's state dict) while they run, and put it back before raising: a refused call
    changes nothing, as an eager step's error does. The copy lives for those calls only
    (host memory of one rank's state); replays take none.
    """
    saved = [t.detach().to("cpu", copy=True) for t in state]
    dicts = [copy.deepcopy(o.state_dict()) for o in optimizers]
    try:
        yield
    except BaseException:
        with torch.no_grad():
            for t, s in zip(state, saved):
                t.copy_(s)
        for o, d in zip(optimizers, dicts):
            o.load_state_dict(d)
        raise
