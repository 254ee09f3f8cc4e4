"""Sharded checkpoints (``torch.distributed.checkpoint``) and exports.

Example:
    >>> shardfn.checkpoint.save("ckpt/step-100", sharded, opt_state, extra={"step": 100})
    >>> sharded, opt_state, extra = shardfn.checkpoint.load("ckpt/step-100", sharded, opt_state)
    >>> shardfn.checkpoint.latest("ckpt")  # the newest complete checkpoint there, or None
    'ckpt/step-100'
"""

from ._checkpoint import export_safetensors as export_safetensors
from ._checkpoint import latest as latest
from ._checkpoint import load as load
from ._checkpoint import save as save

__all__ = ["export_safetensors", "latest", "load", "save"]
