"""Testing kit: a multi-process CPU harness and equivalence checks for your own models.

Example:
    >>> from shardfn.testing import check_equivalence
    >>> print(check_equivalence(make_model, loss_fn, batches, optimizer=partial(shardfn.optim.sgd, 0.1),
    ...                         strategies=("FULL_SHARD",), world_sizes=(2,)))
"""

from ._cluster import Cluster as Cluster
from ._cluster import ClusterError as ClusterError
from ._cluster import free_port as free_port
from ._equivalence import EquivalenceReport as EquivalenceReport
from ._equivalence import check_equivalence as check_equivalence
from ._equivalence import full_state as full_state
from ._equivalence import reference_training as reference_training
from ._equivalence import sharded_training as sharded_training
from ._pieces import split_batch as split_batch
from ._ops import OpCount as OpCount
from ._ops import count_ops as count_ops

__all__ = [
    "Cluster",
    "ClusterError",
    "EquivalenceReport",
    "OpCount",
    "check_equivalence",
    "count_ops",
    "free_port",
    "full_state",
    "reference_training",
    "sharded_training",
    "split_batch",
]
