import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from shardfn.testing import Cluster

# Every rank and every run draws the same examples.
settings.register_profile(
    "shardfn",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "shardfn"))

torch.set_num_threads(1)


class _Clusters(dict):
    """World size -> a Cluster started on first use and kept for the session."""

    def __missing__(self, world: int) -> Cluster:
        self[world] = Cluster(world, timeout=120.0)
        return self[world]


@pytest.fixture(scope="session")
def clusters():
    c = _Clusters()
    yield c
    for cluster in c.values():
        cluster.close()
