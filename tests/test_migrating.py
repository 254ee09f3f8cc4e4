"""docs/migrating.md: its shardfn blocks run, and what its tables claim holds.

Every fenced ```python block of the guide preceded by a line ``<!-- test: world=N id=NAME -->``
runs on every rank of an N-process gloo world (the session's ``clusters``). A block is
written as a torchrun script would be, building its mesh with ``sf.Mesh.from_env()``; the
ranks here are started by the test, with the process group already initialised, so that call
is replaced by ``sf.Mesh.from_group()`` before the block runs. Each block runs in a namespace
holding ``sf``, ``torch`` and ``nn``, in a fresh directory every rank shares (its checkpoints
and exports go there). The block's asserts are counted as they pass: each rank must pass at
least one, and every assert of the block must have passed on some rank (one guarded by
``if mesh.rank == 0:`` runs on rank 0 only), so a block cannot pass without checking.

The other tests read the guide without running it: every ``sf.`` name on the page exists,
the keyword arguments of the shardfn calls it writes are accepted, the FSDP tables list every
constructor argument and public method of the installed torch, and the row counts each
section states are the tables' lengths.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

import shardfn as sf
from conftest import dotted
from shardfn._run.step import Step  # what jit_step returns

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parent.parent / "docs" / "migrating.md"
TEXT = DOC.read_text(encoding="utf-8")

_RUNNABLE = re.compile(r"^<!-- test: (?P<opts>[^>]*?) -->\n```python\n(?P<source>.*?)\n```$", re.M | re.S)
_FENCE = re.compile(r"^```[^\n]*\n.*?\n```$", re.M | re.S)


def runnable_blocks() -> list[tuple[str, int, str, int]]:
    """``(id, world, source, line of its first line in the guide)`` for every marked block."""
    out = []
    for m in _RUNNABLE.finditer(TEXT):
        opts = dict(kv.split("=", 1) for kv in m.group("opts").split())
        line = TEXT.count("\n", 0, m.start("source")) + 1
        out.append((opts["id"], int(opts["world"]), m.group("source"), line))
    return out


BLOCKS = runnable_blocks()


# -- running the blocks ------------------------------------------------------------------


class _CountAsserts(ast.NodeTransformer):
    """After each ``assert`` that passes, calls ``__checked__(line)``."""

    def visit_Assert(self, node: ast.Assert) -> list[ast.stmt]:
        count = ast.Expr(ast.Call(ast.Name("__checked__", ast.Load()), [ast.Constant(node.lineno)], []))
        return [node, ast.copy_location(count, node)]


def run_block(source: str, first_line: int, workdir: str) -> dict:
    """Runs one block of the guide on this rank (a module-level function: it travels to the ranks)."""
    # The guide's blocks are torchrun scripts; here the process group exists already.
    source = source.replace("sf.Mesh.from_env()", "sf.Mesh.from_group()")
    tree = ast.parse(source)
    ast.increment_lineno(tree, first_line - 1)  # tracebacks (and the counted asserts) name lines of the guide
    tree = _CountAsserts().visit(tree)
    code = compile(ast.fix_missing_locations(tree), str(DOC), "exec")
    checked: list[int] = []
    namespace = {"__name__": "__migrating__", "sf": sf, "torch": torch, "nn": torch.nn, "__checked__": checked.append}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        exec(code, namespace)
    finally:
        os.chdir(cwd)
    return {
        "checked": sorted(set(checked)),
        "mesh": type(namespace.get("mesh")).__name__,
        "sharded": type(namespace.get("sharded")).__name__,
    }


def test_the_guide_has_runnable_blocks():
    ids = [b[0] for b in BLOCKS]
    assert len(ids) == len(set(ids)), ids
    assert {"fsdp1", "fsdp2", "lightning", "fairscale", "deepspeed", "transformer"} <= set(ids), ids
    for block_id, _, source, _ in BLOCKS:
        assert "sf.Mesh.from_env()" in source, f"{block_id}: build the mesh as a torchrun script would"
        assert any(isinstance(n, ast.Assert) for n in ast.walk(ast.parse(source))), f"{block_id} asserts nothing"


@pytest.mark.parametrize(("world", "source", "line"), [pytest.param(w, s, n, id=i) for i, w, s, n in BLOCKS])
def test_block_runs(clusters, tmp_path, world, source, line):
    outs = clusters[world].run(run_block, source, line, str(tmp_path))
    asserts = {n.lineno + line - 1 for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Assert)}
    for rank, out in enumerate(outs):
        assert out["checked"], f"rank {rank} passed none of the block's asserts"
        assert set(out["checked"]) <= asserts
        assert out["mesh"] == "Mesh" and out["sharded"] == "ShardedParams", out
    # An assert run on one rank only (inside `if mesh.rank == 0:`) still counts; one run on none does not.
    ran = set().union(*(set(o["checked"]) for o in outs))
    assert ran == asserts, f"asserts at lines {sorted(asserts - ran)} of {DOC.name} never ran"


# -- reading the guide -------------------------------------------------------------------


def _tables() -> dict[str, list[list[str]]]:
    """Section title -> its table rows (cells), header and separator excluded."""
    out: dict[str, list[list[str]]] = {}
    title = ""
    for line in _FENCE.sub("", TEXT).splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith("|") and title:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if all(re.fullmatch(r"-+", c) for c in cells):
                continue
            out.setdefault(title, []).append(cells)
    return {t: rows[1:] for t, rows in out.items()}  # the first row of each table is its header


TABLES = _tables()
SOURCES = {  # section title prefix -> the table of that source
    "fsdp1": "PyTorch FSDP1",
    "fsdp2": "PyTorch FSDP2",
    "lightning": "Lightning: ",
    "fairscale": "Lightning with FairScale",
    "deepspeed": "DeepSpeed ZeRO",
}


def _table(prefix: str) -> list[list[str]]:
    (title,) = [t for t in TABLES if t.startswith(prefix)]
    return TABLES[title]


def test_each_section_states_its_row_count():
    for prefix in SOURCES.values():
        (title,) = [t for t in TABLES if t.startswith(prefix)]
        section = TEXT.split(f"## {title}\n", 1)[1]
        stated = re.match(r"\s*(\d+) rows", section)
        assert stated, f"section {title!r} does not open with its row count"
        rows = _table(prefix)
        assert int(stated.group(1)) == len(rows), f"{title!r} says {stated.group(1)} rows, its table has {len(rows)}"
        assert all(len(r) == 3 for r in rows), [r for r in rows if len(r) != 3]


def _first_column(prefix: str) -> str:
    return "\n".join(r[0] for r in _table(prefix))


def _listed(name: str, column: str) -> bool:
    return re.search(r"`(?:[\w.]+\.)?" + re.escape(name) + r"(?![\w])", column) is not None


def test_fsdp1_table_lists_every_argument_and_public_method():
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names = [p for p in inspect.signature(FSDP.__init__).parameters if p != "self"]
    names += [n for n in vars(FSDP) if not n.startswith("_")]
    column = _first_column(SOURCES["fsdp1"])
    missing = [n for n in names if not _listed(n, column)]
    assert not missing, f"the FSDP1 table has no row for {missing}"
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType

    fields = [f.name for f in dataclasses.fields(MixedPrecision) if not f.name.startswith("_")]
    values = [*ShardingStrategy.__members__, *StateDictType.__members__]
    assert not [n for n in fields + values if not _listed(n, column)]


def test_fsdp2_table_lists_every_argument_and_public_method():
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    names = list(inspect.signature(fully_shard).parameters)
    names += [n for n in vars(FSDPModule) if not n.startswith("_")]
    names += [f.name for f in dataclasses.fields(MixedPrecisionPolicy)]
    missing = [n for n in names if not _listed(n, _first_column(SOURCES["fsdp2"]))]
    assert not missing, f"the FSDP2 table has no row for {missing}"


def _prose() -> str:
    """What the guide says about shardfn outside code blocks: the text without its fenced
    blocks, and the tables without their first column (the other library's names)."""
    lines = []
    for line in _FENCE.sub("", TEXT).splitlines():
        if line.startswith("|"):
            line = " | ".join(re.split(r"(?<!\\)\|", line.strip())[2:-1])
        lines.append(line)
    return "\n".join(lines)


def _shardfn_text() -> str:
    """The prose and the runnable blocks (not Lightning's block, which is not shardfn code)."""
    return "\n".join([_prose(), *(source for _, _, source, _ in BLOCKS)])


def _resolve(dotted: str):
    obj = sf
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_every_shardfn_name_exists():
    text = _shardfn_text()
    missing = []
    for dotted in sorted(set(re.findall(r"\bsf(?:\.[A-Za-z_]\w*)+", text))):
        try:
            _resolve(dotted)
        except AttributeError:
            missing.append(dotted)
    assert not missing, f"the guide names shardfn attributes that do not exist: {missing}"
    for module in re.findall(r"python -m (shardfn[\w.]*)", TEXT):
        assert importlib.util.find_spec(module) is not None, module


def _instance_names(cls: type) -> set[str]:
    names = set(dir(cls))
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


def test_methods_on_shardfn_objects_exist():
    """``mesh.x``, ``sharded.x``, ``sharded.layout.x``, ``apply.x``, ``step.x`` in the guide."""
    text = _shardfn_text()
    model = torch.nn.Linear(2, 2)
    _, apply = sf.functionalize(model)
    receivers = {  # how the guide names an object -> what such an object has
        "mesh": _instance_names(sf.Mesh),
        "sharded": _instance_names(sf.ShardedParams),
        "sharded.layout": _instance_names(sf.Layout),
        "apply": set(dir(apply)),
        "step": _instance_names(Step),
    }
    bad = []
    for receiver, names in receivers.items():
        for attr in re.findall(r"\b" + re.escape(receiver) + r"\.([A-Za-z_]\w*)", text):
            if attr not in names:
                bad.append(f"{receiver}.{attr}")
    assert not bad, f"the guide calls methods that do not exist: {sorted(set(bad))}"


def _code_spans() -> list[str]:
    """Each runnable block, and each inline code span of the prose."""
    return [source for _, _, source, _ in BLOCKS] + re.findall(r"`([^`\n]+)`", _prose())


def _callee(func: ast.expr):
    """The shardfn callable a call names (``sf.a.b``, ``mesh.reduce``, ...), or None."""
    parts = dotted(func)
    if parts is None:
        return None
    roots = {"sf": sf, "mesh": sf.Mesh, "sharded": sf.ShardedParams, "step": Step}
    if parts[0] not in roots:
        return None
    obj = roots[parts[0]]
    for p in parts[1:]:
        obj = getattr(obj, p, None)
        if obj is None:
            return None
    return obj if callable(obj) else None


def test_keyword_arguments_of_shardfn_calls_exist():
    checked, bad = 0, []
    for span in _code_spans():
        try:
            tree = ast.parse(span)
        except SyntaxError:
            continue  # a fragment (an argument alone, a with-statement header, a shell command)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.keywords:
                continue
            fn = _callee(node.func)
            if fn is None:
                continue
            try:
                params = inspect.signature(fn).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                continue
            checked += 1
            bad += [f"{ast.unparse(node.func)}({k.arg}=...)" for k in node.keywords if k.arg and k.arg not in params]
    assert checked > 50, checked  # the parse above keeps finding the calls
    assert not bad, f"the guide passes keyword arguments shardfn does not take: {sorted(set(bad))}"
