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


def _environment_lines() -> list[str]:
    """What can move a test's numerics: the Python, torch and its kernels' CPU paths, the
    versions of every installed distribution, and the CPU (issue 31: MKL picks its kernels
    by CPU vendor and instruction set, and a different kernel can round differently)."""
    import platform
    from importlib import metadata

    lines = [f"python {platform.python_version()}  torch {torch.__version__}  (cuda {torch.version.cuda}, "
             f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}, mkl {torch.backends.mkl.is_available()}, "
             f"threads {torch.get_num_threads()})"]
    dists = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]},
                   key=str.lower)
    lines.append("installed: " + " ".join(dists))
    cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                cpu.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    lines.append(f"cpu: {cpu.get('model name', platform.processor() or platform.machine())} "
                 f"({cpu.get('vendor_id', '?')}, {os.cpu_count()} cores)")
    lines.append(f"cpu flags: {cpu.get('flags', '(unknown)')}")
    return lines


def pytest_sessionstart(session):
    # Printed under -q too (a report header is not), so CI's log shows what it tested on.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in _environment_lines():
            reporter.write_line(line)


def dotted(node):
    """The names of a dotted expression (``sf.optim.adamw`` -> ``["sf", "optim", "adamw"]``),
    or None for anything else (a call, a subscript). Used by the tests that read code in
    docs and docstrings."""
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]

