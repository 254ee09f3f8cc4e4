import logging
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


class _Margins(logging.Handler):
    """Collects check_equivalence's margins (issue 38): the worst |diff| / tolerance of every
    check, by test. A bound that passes here at 0.9x may fail on a CPU whose kernels round
    otherwise; the summary at the end of the run shows it before that machine does."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: list[tuple[float, str, str]] = []

    def emit(self, record):
        if record.msg.startswith("check_equivalence: worst"):
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
            self.seen.append((float(record.args[0]), test, record.args[3], bool(record.args[4])))


_MARGINS = _Margins()
_SHOWN = 0.25  # margins at or above this fraction of their bound are listed at the end


def pytest_sessionstart(session):
    # Printed under -q too (a report header is not), so CI's log shows what it tested on.
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in _environment_lines():
            reporter.write_line(line)
    log = logging.getLogger("shardfn.testing")
    log.setLevel(logging.INFO)
    log.addHandler(_MARGINS)


# A test whose code names one of these compares floating-point results with a reference: it
# is marked `numerics`, and tools/other_kernels.sh runs those again on another CPU kernel path
# (issue 38: MKL and oneDNN round by instruction set, and a claim can hold on one CPU only).
_NUMERICS = ("check_equivalence", "reference", "assert_close", "approx")


def pytest_collection_modifyitems(items):
    import inspect

    sources = {}
    for item in items:
        fn = getattr(item, "function", None)
        if fn is None:
            continue
        if fn not in sources:
            try:
                sources[fn] = inspect.getsource(fn)
            except (OSError, TypeError):
                sources[fn] = ""
        if any(word in sources[fn] for word in _NUMERICS):
            item.add_marker(pytest.mark.numerics)


def pytest_terminal_summary(terminalreporter):
    if not _MARGINS.seen:
        return
    # A check that failed inside a passing test was meant to (the kit must see broken training).
    passed = sorted((m for m in _MARGINS.seen if not m[3]), reverse=True)
    close = [m for m in passed if m[0] >= _SHOWN]
    terminalreporter.write_sep("-", f"equivalence margins: {len(passed)} checks passed, {len(close)} of them at >= "
                                    f"{_SHOWN}x their tolerance (1.0 fails); {len(_MARGINS.seen) - len(passed)} "
                                    f"failed as their tests expected")
    for ratio, test, where, _ in close:
        terminalreporter.write_line(f"{ratio:6.2f}x  {test}  ({where})")


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

