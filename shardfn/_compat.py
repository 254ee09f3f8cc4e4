"""The torch APIs that differ across the supported range (torch 2.11 to 2.15).

Every use of an API that some supported release lacks, renames or changes goes through
this module, each with a comment naming the releases, so that raising the floor later is
a matter of deleting lines here. ``tools/torch_matrix.sh VERSION`` runs the whole suite on
one release (docs/benchmarks.md, "The torch range").

One difference is a behaviour, not a name, and is met where it arises: torch 2.11's
``dcp.load`` swallows what a storage reader's ``read_metadata`` raises and fails later
with "metadata is None", so ``shardfn._io.checkpoint._SafeReader`` keeps a refused
``.metadata`` and the load raises that (the same error on every release).
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["all_gather_single", "reduce_scatter_single", "written_files"]

# torch 2.13 added all_gather_single / reduce_scatter_single and deprecated the old names
# (a FutureWarning); torch 2.11 and 2.12 have only all_gather_into_tensor /
# reduce_scatter_tensor (since 2.0). Same arguments in both.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def written_files(directory: str) -> list[str]:
    """The files ``torch.distributed.checkpoint.save`` wrote into a fresh ``directory``,
    relative to it, sorted.

    Read from the directory itself, not from what ``dcp.save`` returns: its ``Metadata``'s
    ``storage_data`` names the files on torch 2.13 but is ``None`` on 2.11. The directory is empty before the save (the caller removes what a dead save left).
    """
    out = []
    for root, _, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(root, f), directory) for f in files]
    return sorted(out)
