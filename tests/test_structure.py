"""The package's structure: no import cycles, small modules (STYLE.md)."""

import ast
import importlib.util
import pathlib

import shardfn

ROOT = pathlib.Path(shardfn.__file__).parent


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Module -> the shardfn modules it imports, anywhere in it (function bodies included),
    except under ``if TYPE_CHECKING:``: an import for annotations only never runs."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in (n for n in ast.walk(tree) if id(n) not in typing_only):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("shardfn")):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                # `from pkg import x` imports the module pkg.x when x is one, else a name of pkg.
                candidates = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names if a.name.startswith("shardfn")]
            else:
                continue
            graph[name] |= {c for c in candidates if c in modules and c != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the list of its modules (Tarjan's strongly connected components)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = imports()
    assert {"shardfn._gather", "shardfn._reduce", "shardfn._runtime"} <= graph["shardfn._call"] | graph["shardfn._gather"]
    assert cycles(graph) == []


def test_type_only_imports_are_not_edges(tmp_path, monkeypatch):
    pkg = tmp_path / "shardfn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._b import B\n")
    (pkg / "_b.py").write_text("from ._a import A\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert imports() == {"shardfn": set(), "shardfn._a": set(), "shardfn._b": {"shardfn._a"}}


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n > 500} == {}


def _tool():
    """tools/structure.py, which measures what these tests bound (and prints the counts)."""
    spec = importlib.util.spec_from_file_location("shardfn_structure_tool", ROOT.parent / "tools" / "structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_plan_and_layout_read_the_strategy():
    """[Note: facts of a layout]: the runtime reads the layout's resolved facts, never what the
    strategy implies (its flags, its members, world or replicas compared with 1)."""
    tool = _tool()
    assert tool.strategy_reads(tool._modules()) == []


def test_the_strategy_reader_sees_a_read():
    tool = _tool()
    found = tool.strategy_reads({
        "_a.py": ast.parse("x = layout.strategy.sharded\ny = s is Strategy.NO_SHARD\nz = lay.world == 1\n"
                           "w = plan.reshard_after_forward\nprint(layout.strategy.value)\n"),
        "_layout.py": ast.parse("x = self.plan.strategy.sharded\n"),
    })
    assert sorted(line for _, line, _ in found) == [1, 2, 3, 4]
