"""Sharded checkpoints (``torch.distributed.checkpoint``); :func:`shardfn.save_pretrained` exports.

Example:
    >>> shardfn.checkpoint.save("ckpt/step-100", sharded, opt_state, extra={"step": 100})
    >>> sharded, opt_state, extra = shardfn.checkpoint.load("ckpt/step-100", sharded, opt_state)
    >>> shardfn.checkpoint.latest("ckpt")  # the newest complete checkpoint there, or None
    'ckpt/step-100'
"""

from ._io.checkpoint import latest as latest
from ._io.checkpoint import load as load
from ._io.checkpoint import save as save

__all__ = ["latest", "load", "save"]
