"""Counts of the package's structure, and its import graph.

    python tools/structure.py counts          # the figures issues 41 and 57 track
    python tools/structure.py graph           # the import graph, as a Mermaid flowchart
    python tools/structure.py folders         # the same between concept folders, and the pairs that import each other
    python tools/structure.py trip            # the modules one step's code runs in

The counts read the source (``ast``), never run it; ``trip`` runs one FULL_SHARD step of a
small model in a world of one and records which of the package's modules it calls into.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardfn"

# Modules that may read the strategy: the plan, its resolution against a mesh, the layout.
# (lightning/_keywords.py: where FSDPStrategy's keywords become a plan)
PLAN_MODULES = {"_state/plan.py", "_state/resolve.py", "_state/layout.py", "lightning/_keywords.py"}
TREE_FIELDS = {"_data", "_verdict", "_replicas"}
TREE_MUTATORS = {"_set_buffers", "_donate_replicas", "_values_replaced"}


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in sorted(ROOT.rglob("*.py"))}


def strategy_reads(modules: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """Places outside plan, resolve and layout that re-derive what a strategy implies: a
    strategy's flag (``x.strategy.sharded``; ``x.strategy.value``, its name, is display),
    a member (``Strategy.NO_SHARD``: a comparison, or the planner naming candidates), a
    plan's ``reshard_after_forward``, and ``world`` or ``replicas`` compared with 1."""
    out = []
    for path, tree in modules.items():
        if path in PLAN_MODULES:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                inner = n.value
                if isinstance(inner, ast.Attribute) and inner.attr == "strategy" and n.attr != "value":
                    out.append((path, n.lineno, ast.unparse(n)))
                elif isinstance(inner, ast.Name) and inner.id == "Strategy" and n.attr.isupper():
                    out.append((path, n.lineno, ast.unparse(n)))
                elif n.attr == "reshard_after_forward" and not (isinstance(inner, ast.Name) and inner.id == "self"):
                    out.append((path, n.lineno, ast.unparse(n)))
            elif isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == 1 for c in n.comparators):
                left = n.left.attr if isinstance(n.left, ast.Attribute) else getattr(n.left, "id", "")
                if left in ("world", "replicas"):
                    out.append((path, n.lineno, ast.unparse(n)))
    return out


def tree_writers(modules: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """Places outside ``_state/sharded.py`` that change a ShardedParams: a store to one of its
    fields on anything but ``self``, or a call of its private mutators."""
    out = []
    for path, tree in modules.items():
        if path == "_state/sharded.py":
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr in TREE_FIELDS \
                    and not (isinstance(n.value, ast.Name) and n.value.id == "self") and path != "optim/_gradients.py":
                out.append((path, n.lineno, ast.unparse(n)))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in TREE_MUTATORS:
                out.append((path, n.lineno, ast.unparse(n.func)))
    return out


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "scatter", "gather", "barrier", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "all_gather_single", "reduce_scatter_single",
               "all_gather_into_tensor_out"}


def collective_callers(modules: dict[str, ast.Module]) -> dict[str, int]:
    """Modules that call a collective themselves (``dist.all_reduce(...)``, a functional
    collective, the _compat aliases), with how many calls."""
    out: dict[str, int] = {}
    for path, tree in modules.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Call):
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                via = ast.unparse(n.func.value) if isinstance(n.func, ast.Attribute) else ""
                aliases = ("all_gather_single", "reduce_scatter_single")  # shardfn._compat's, called bare
                if name in COLLECTIVES and (via in ("dist", "_F", "torch.distributed", "funcol")
                                            or (not via and name in aliases)):
                    out[path] = out.get(path, 0) + 1
    return out


def slots(modules: dict[str, ast.Module], module: str, cls: str) -> int:
    """A class's instance fields: its ``__slots__``, else the ``self.x`` its methods assign."""
    for n in ast.walk(modules[module]):
        if isinstance(n, ast.ClassDef) and n.name == cls:
            for stmt in n.body:
                if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "__slots__" for t in stmt.targets):
                    return len(ast.literal_eval(stmt.value))
            return len({a.attr for a in ast.walk(n) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
                        and isinstance(a.value, ast.Name) and a.value.id == "self"})
    raise LookupError(f"{module}: no class {cls}")


def context_vars(modules: dict[str, ast.Module]) -> list[tuple[str, int]]:
    return [(path, n.lineno) for path, tree in modules.items() for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "ContextVar"]


_QUOTES = ('"""', "'''")
_HEADER = re.compile(r"""^\s*(#\s*|[rRbBuU]?(?:\"\"\"|'''))?\[Note: ([^\]]+)\](?![:).])""")
FIGURE = re.compile(r"\d(\.\d+)?\s?(ms|s|MiB|GiB|KiB|MB|GB|x)\b")  # a measured figure: 13.8 ms, 4 MiB, 1.5x


def _words(line: str) -> str:
    """A line's prose: without a comment's ``#``, a docstring's quotes and the spaces."""
    line = re.sub(r"^\s*#", "", line)
    for q in _QUOTES:
        line = line.replace(q, "")
    return line.strip()


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def note_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """Every Note of a module's source: its name, first line (1-based) and lines.

    A Note starts a paragraph with ``[Note: name]``, in a docstring or in a comment
    (``# [Note: name]``): the line before it is blank, or it opens the docstring, or it is
    the first line of the comment. ``[Note: name]`` inside a paragraph, or followed by
    ``:``, ``)`` or ``.``, is a reference to one. A Note in comments runs while the lines
    are comments; one in a docstring to the next Note or to the docstring's end (the closing
    line counted when it holds text). Blank lines at a Note's end are not counted.
    """
    lines = text.splitlines()
    starts: dict[int, tuple[str, bool]] = {}  # line index -> (name, in a comment)
    for i, line in enumerate(lines):
        m = _HEADER.match(line)
        if not m:
            continue
        comment = _is_comment(line)
        prev = lines[i - 1] if i else ""
        opens_docstring = bool(m.group(1)) and not comment
        if comment and not (_is_comment(prev) and _words(prev)):
            starts[i] = (m.group(2), True)
        elif not comment and (opens_docstring or not _words(prev)):
            starts[i] = (m.group(2), False)
    out = []
    for i, (name, comment) in starts.items():
        j = i + 1
        if comment:
            while j < len(lines) and _is_comment(lines[j]) and j not in starts:
                j += 1
        elif not any(q in lines[i][lines[i].index("[Note:"):] for q in _QUOTES):  # else it ends on its line
            while j < len(lines) and j not in starts and not any(q in lines[j] for q in _QUOTES):
                j += 1
            if j < len(lines) and j not in starts and _words(lines[j]):
                j += 1  # the closing line holds text
        while j > i + 1 and not _words(lines[j - 1]):
            j -= 1
        out.append((name, i + 1, lines[i:j]))
    return out


def notes(root: pathlib.Path = ROOT) -> list[tuple[int, str, str]]:
    """Every Note of the package: its length in lines, name and module, longest first
    (:func:`note_blocks` says where a Note starts and ends)."""
    return sorted(((len(body), name, str(path.relative_to(root)))
                   for path in sorted(root.rglob("*.py")) for name, _, body in note_blocks(path.read_text())),
                  reverse=True)


def code_lines(text: str) -> int:
    """Lines of a module that hold code: not blank, not a comment, not in a docstring."""
    tree = ast.parse(text)
    prose: set[int] = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            prose |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in prose)


def counts() -> None:
    modules = _modules()
    writers, reads = tree_writers(modules), strategy_reads(modules)
    print(f"ShardedParams writers outside _state/sharded.py: {len(writers)}")
    for w in writers:
        print(f"    {w[0]}:{w[1]}  {w[2]}")
    print(f"strategy-derived flags read outside {', '.join(sorted(PLAN_MODULES))}: {len(reads)}")
    per: dict[str, int] = {}
    for path, _, _ in reads:
        per[path] = per.get(path, 0) + 1
    print("    " + ", ".join(f"{p} {k}" for p, k in sorted(per.items(), key=lambda kv: -kv[1])))
    print("modules that call collectives themselves: " + ", ".join(f"{p} {k}" for p, k in
                                                                sorted(collective_callers(modules).items())))
    print(f"slots: Unit {slots(modules, '_group/gather.py', 'Unit')}, Runtime {slots(modules, '_run/runtime.py', 'Runtime')}")
    print(f"ContextVars: {len(context_vars(modules))}  ({', '.join(f'{p}:{n}' for p, n in context_vars(modules))})")
    longest = notes()[:3]
    print("longest Notes: " + "; ".join(f"[Note: {name}] {k} lines ({p})" for k, name, p in longest))
    figures = [f"[Note: {name}] ({p.relative_to(ROOT)}:{first + k})" for p in sorted(ROOT.rglob("*.py"))
               for name, first, body in note_blocks(p.read_text()) for k, line in enumerate(body) if FIGURE.search(line)]
    print(f"measured figures in Notes: {len(figures)}" + "".join(f"\n    {f}" for f in figures))
    sizes = sorted(((code_lines((ROOT / p).read_text()), len((ROOT / p).read_text().splitlines()), p)
                    for p in modules), reverse=True)[:5]
    print("largest modules (code lines / all lines): " + ", ".join(f"{p} {c}/{a}" for c, a, p in sizes))
    core_counts()


# -- the core's counts (issue 57: one core) ------------------------------------------------

# A collective's handle is waited for through these; a class that calls one on what it keeps,
# or issues a collective with ``async_op``, holds a pending collective.
WAITS = {"wait", "wait_pending", "wait_tensor"}
# The handle types a collective returns are the pending collective itself, not a holder of
# one: the communicator's, and the guard's Pending (a handle waited for within the timeout).
HANDLES = {("_comm/communicator.py", None), ("_comm/guard.py", "Pending")}
MODE_CALLS = {"current", "here", "observers", "recording", "is_fake"}


def pending_holders(modules: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """Classes that hold a collective in flight: one of their methods issues a collective with
    ``async_op`` or waits for one (``x.wait()``, ``wait(work, ...)``, ``rt.wait_pending()``),
    outside the handle types a collective returns (``HANDLES``). (module, class), sorted."""
    out = set()
    for path, tree in modules.items():
        if (path, None) in HANDLES or path.startswith("testing/"):
            continue
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and (path, n.name) not in HANDLES):
            for n in ast.walk(c):
                if isinstance(n, ast.Call):
                    name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                    if name in WAITS or any(k.arg == "async_op" for k in n.keywords):
                        out.add((path, c.name))
    return sorted(out)


def _calls(tree: ast.Module, names: set[str]) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")) in names]


def runtime_reads(modules: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """Places that find the step's runtime instead of being handed it: the ambient lookup
    ``current()``, a ``.runtime`` back-pointer read, and a stack of calls in progress kept on
    ``apply`` (``apply.calls``, ``apply.tensor_calls``, ``apply.active``). Not counted: a
    public entry point's read of the scope it begins in, ``here().runtime`` (the boundary,
    where the issue lets a ContextVar stay; its ``here()`` counts among the mode reads), and
    what ``apply`` makes once per layout (``apply.prepared``: hooks, slots and ties, the
    model's and not a step's)."""
    out = []
    for path, tree in modules.items():
        for n in _calls(tree, {"current"}):
            out.append((path, n.lineno, ast.unparse(n)))
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and (
                    (n.attr == "runtime" and not (isinstance(n.value, ast.Call)
                                                  and getattr(n.value.func, "id", "") == "here"))
                    or (isinstance(n.value, ast.Name) and n.value.id == "apply"
                        and n.attr in ("calls", "tensor_calls", "active"))):
                out.append((path, n.lineno, ast.unparse(n)))
    return sorted(out)


def boundary_reads(modules: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """Where a public entry point takes the step it runs in from the scope it begins in
    (``here().runtime``), with the function that does: the one lookup of the runtime that
    :func:`runtime_reads` leaves out."""
    out = []
    for path, tree in modules.items():
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(f):
                    if isinstance(n, ast.Attribute) and n.attr == "runtime" and isinstance(n.value, ast.Call) \
                            and getattr(n.value.func, "id", "") == "here":
                        out.append((path, n.lineno, f.name))
    return sorted(set(out))


def mode_reads(modules: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """Places that read a mode from the air: a call of ``current()``, ``here()``,
    ``observers()``, ``recording()`` or ``is_fake()``, a ``scope.recording`` read, and a
    ContextVar's ``.get()``."""
    out = []
    for path, tree in modules.items():
        names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Call) and getattr(n.value.func, "attr", "") == "ContextVar"
                 for t in n.targets if isinstance(t, ast.Name)}
        names |= {n.target.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                  and isinstance(n.value, ast.Call) and getattr(n.value.func, "attr", "") == "ContextVar"}
        for n in _calls(tree, MODE_CALLS):
            out.append((path, n.lineno, ast.unparse(n.func)))
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr == "recording" \
                    and (getattr(n.value, "attr", "") == "scope" or getattr(n.value, "id", "") == "scope"):
                out.append((path, n.lineno, ast.unparse(n)))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                    and isinstance(n.func.value, ast.Name) and n.func.value.id in names:
                out.append((path, n.lineno, ast.unparse(n.func)))
    return sorted(out)


def swapped_globals(tests: pathlib.Path, modules: dict[str, ast.Module]) -> list[tuple[str, int, str]]:
    """Module globals of shardfn that tests swap (``module.NAME = x``, ``monkeypatch.setattr(
    module, "NAME", x)`` for a NAME in capitals: a setting, not a function a fault test wraps),
    and module-level dicts keyed by ``id()``."""
    out = []
    for path in sorted(tests.glob("*.py")):
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("shardfn") for a in n.names}
        for n in ast.walk(tree):
            targets = []
            if isinstance(n, ast.Assign):
                targets = [e for t in n.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                targets = [(t.value, t.attr) for t in targets if isinstance(t, ast.Attribute)]
            elif isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "setattr" and len(n.args) >= 2 \
                    and isinstance(n.args[1], ast.Constant):
                targets = [(n.args[0], n.args[1].value)]
            for owner, attr in targets:
                if isinstance(owner, ast.Name) and owner.id in aliases and re.fullmatch(r"_?[A-Z][A-Z0-9_]*", attr):
                    out.append((path.name, 0, f"{owner.id}.{attr}"))  # one entry per global
    for path, tree in modules.items():
        top = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name) and n.value.id in top \
                    and isinstance(n.slice, ast.Call) and getattr(n.slice.func, "id", "") == "id":
                out.append((path, n.lineno, ast.unparse(n)))
    return sorted(set(out))


def top_modules(root: pathlib.Path = ROOT) -> list[str]:
    """Modules directly in shardfn/, besides __init__.py."""
    return sorted(p.name for p in root.glob("*.py") if p.name != "__init__.py")


def reduce_scatter_modules(modules: dict[str, ast.Module]) -> list[str]:
    """Modules one must change to change how a gradient reduce-scatter is issued: those that
    define a reduce-scatter on torch.distributed, issue one asynchronously (``async_op`` not literally False), or
    wait for a pending reduction (``wait_pending``). A synchronous call through the
    communicator (tensor and sequence parallelism) is a use, not an issue."""
    out = set()
    for path, tree in modules.items():
        if path == "_compat.py":
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and "reduce_scatter" in n.name \
                    and collective_callers({path: ast.Module(body=[n], type_ignores=[])}):
                out.add(path)  # a reduce-scatter that calls torch.distributed itself
            elif isinstance(n, ast.Call):
                name = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                asynchronous = any(k.arg == "async_op" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                                   for k in n.keywords)
                if ("reduce_scatter" in name and asynchronous) or name == "wait_pending":
                    out.add(path)
    return sorted(out)


def core_counts() -> None:
    modules = _modules()
    holders = pending_holders(modules)
    print(f"classes that hold a pending collective: {len(holders)}")
    print("    " + ", ".join(f"{p}:{c}" for p, c in holders))
    for title, found in (("reads of the runtime from below the step", runtime_reads(modules)),
                         ("ambient mode reads", mode_reads(modules))):
        per: dict[str, int] = {}
        for path, _, what in found:
            per[path] = per.get(path, 0) + 1
        print(f"{title}: {len(found)}")
        print("    " + ", ".join(f"{p} {k}" for p, k in sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))))
        if title.startswith("reads of the runtime"):
            print("    at a public entry instead (here().runtime): "
                  + ", ".join(f"{p}:{line} {f}" for p, line, f in boundary_reads(modules)))
    calls = [r for r in mode_reads(modules) if r[2].split(".")[-1] in MODE_CALLS]
    print(f"    of which calls of {', '.join(sorted(MODE_CALLS))}: {len(calls)}")
    swapped = swapped_globals(ROOT.parent / "tests", modules)
    print(f"module globals swapped by tests or keyed by id(): {len(swapped)}  "
          + ", ".join(f"{p}:{n} {w}" if n else f"{p} {w}" for p, n, w in swapped))
    print(f"modules that issue a reduce-scatter: {len(reduce_scatter_modules(modules))}  "
          + ", ".join(reduce_scatter_modules(modules)))
    print(f"modules directly in shardfn/ (besides __init__.py): {len(top_modules())}  " + ", ".join(top_modules()))


def graph() -> None:
    sys.path.insert(0, str(ROOT.parent / "tests"))
    from test_structure import cycles, imports

    edges = imports()
    looped = {m for c in cycles(edges) for m in c}
    short = {m: m.removeprefix("shardfn.").replace(".", "/") or "shardfn" for m in edges}
    print("flowchart LR")
    for m in sorted(edges):
        print(f"    {short[m].replace('/', '_')}[\"{short[m]}\"]" + (":::cycle" if m in looped else ""))
    for m in sorted(edges):
        for t in sorted(edges[m]):
            print(f"    {short[m].replace('/', '_')} --> {short[t].replace('/', '_')}")
    print("    classDef cycle stroke:#c00,stroke-width:3px")
    print(f"%% {len(edges)} modules, {sum(len(v) for v in edges.values())} imports, "
          f"{len(cycles(edges))} cycles", file=sys.stderr)


def folder_edges() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Imports between the package's folders (a top-level module is a folder of its own):
    (folder, folder) -> the (module, module) imports behind the arrow."""
    sys.path.insert(0, str(ROOT.parent / "tests"))
    from test_structure import imports

    def folder(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else module

    out: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for a, targets in imports().items():
        for b in targets:
            if folder(a) != folder(b):
                out.setdefault((folder(a), folder(b)), []).append((a.rpartition(".")[2], b.rpartition(".")[2]))
    return out


def folders() -> None:
    """The folder graph as a Mermaid flowchart (``<-->``: two folders that import each other)."""
    edges = folder_edges()
    short = lambda m: (m.removeprefix("shardfn").removeprefix(".") or "shardfn").lstrip("_")  # noqa: E731
    print("flowchart TB")
    for a, b in sorted(edges):
        if a == "shardfn" or ((b, a) in edges and a > b):
            continue
        print(f"    {short(a)} {'<-->' if (b, a) in edges else '-->'} {short(b)}")
    mutual = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    print(f"%% folder pairs that import each other: {len(mutual)}", file=sys.stderr)
    for a, b in mutual:
        print(f"%%   {short(a)} -> {short(b)}: {edges[(a, b)][:3]}; back: {edges[(b, a)][:3]}", file=sys.stderr)


def trip() -> None:
    """The modules whose functions one step calls, after the step is built and has run once."""
    import os

    import torch
    import torch.nn as nn

    import shardfn
    from shardfn import optim

    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    mesh = shardfn.Mesh.from_env(device="cpu")
    try:
        torch.manual_seed(0)
        params, apply = shardfn.functionalize(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
        sharded = shardfn.shard(params, mesh, "FULL_SHARD", units=["0", "2"])

        def loss_fn(apply, params, batch):
            return apply(params, batch).square().mean()

        step = shardfn.jit_step(loss_fn, mesh, optimizer=optim.adamw(1e-3))
        opt_state = optim.adamw(1e-3).init(sharded)
        batch = torch.randn(4, 8)
        sharded, opt_state, _ = step(sharded, opt_state, batch)
        entered: set[str] = set()
        prefix = str(ROOT)

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(prefix):
                entered.add(str(pathlib.Path(frame.f_code.co_filename).relative_to(ROOT)))

        sys.setprofile(profile)
        try:
            step(sharded, opt_state, batch)
        finally:
            sys.setprofile(None)
        print(f"modules one FULL_SHARD step enters: {len(entered)}")
        print("    " + ", ".join(sorted(entered)))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT.parent))  # this checkout's shardfn, for `trip`
    {"counts": counts, "graph": graph, "folders": folders, "trip": trip}[sys.argv[1] if len(sys.argv) > 1 else "counts"]()
