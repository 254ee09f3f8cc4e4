"""The public surface agrees with itself: one name per concept, one loss convention, the
same plan fields wherever a plan is built, enums, sizes and timeouts that parse one way,
``__all__`` holding what users call, and docstring examples that run and whose names and
keywords exist.
The next drift fails here (docs/migrating.md, "Changes", lists what moved)."""

from __future__ import annotations

import ast
import dataclasses
import datetime
import functools
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

import shardfn as sf
from conftest import dotted
import shardfn.optim
import shardfn.testing
from shardfn._memory import parse_size
from shardfn._mesh import seconds
from shardfn.testing import check_equivalence
from shardfn.testing.models import GPT, GPTConfig, lm_loss

# Old spellings, gone from every public signature (docs/migrating.md, "Changes").
OLD_NAMES = {"batch_example": "batch", "has_aux": "aux", "mean_aux": "aux", "skip_nonfinite": "on_nonfinite"}
# A parameter that takes a concept goes by its name (or a role name for it).
CONCEPTS = {"plan": ("Plan", {"plan", "base"}), "mesh": ("Mesh", {"mesh"})}
PLAN_FIELDS = [f.name for f in dataclasses.fields(sf.Plan) if f.name != "strategy"]
CFG = GPTConfig(vocab_size=17, seq_len=4, d_model=8, n_layers=2, n_heads=2)


def _namespaces() -> list[tuple[str, object]]:
    return [("shardfn", sf), ("shardfn.optim", sf.optim), ("shardfn.testing", sf.testing)]


def public_callables() -> list[tuple[str, object]]:
    """Every public function and class of the three public namespaces, and the public
    methods of those classes: ``(qualified name, object)``."""
    out = []
    for prefix, module in _namespaces():
        for name in module.__all__:
            obj = getattr(module, name)
            if not callable(obj) or inspect.ismodule(obj):
                continue
            out.append((f"{prefix}.{name}", obj))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and inspect.isfunction(member):
                        out.append((f"{prefix}.{name}.{attr}", member))
    return out


def _parameters(fn: object) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def test_all_holds_what_users_call_and_each_name_is_documented():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no name of __all__ is a deprecated one
        objects = {name: getattr(sf, name) for name in sf.__all__}
    assert not set(sf._DEPRECATED) & set(sf.__all__)
    assert all(inspect.getdoc(obj) for obj in objects.values()), [n for n, o in objects.items() if not inspect.getdoc(o)]
    for name in ("LeafLayout", "UnitLayout", "BufferLayout", "Purpose", "Grad", "Step", "FullShard", "HybridShardZero2"):
        with pytest.warns(DeprecationWarning, match="goes in the next release"):
            assert getattr(sf, name) is not None


def test_errors_go_by_their_public_names():
    """A traceback names an error as users import it (``shardfn.PeerError``, not
    ``shardfn._comm.guard.PeerError``), and it pickles under that name, with its fields."""
    errors = [(prefix, name, getattr(module, name)) for prefix, module in _namespaces() for name in module.__all__
              if inspect.isclass(getattr(module, name)) and issubclass(getattr(module, name), BaseException)]
    assert {f"{p}.{n}" for p, n, _ in errors} >= {"shardfn.DivergenceError", "shardfn.PeerError", "shardfn.CommError",
                                                  "shardfn.testing.ClusterError"}
    for prefix, name, cls in errors:
        assert (cls.__module__, cls.__qualname__) == (prefix, name), cls
        args = ("[rank 0] shardfn: rank 1 raised", 1, "KeyError: 'labels'") if cls is sf.PeerError else ("it broke",)
        err = cls(*args)
        if prefix == "shardfn":  # the guard marks the errors it relays with process groups, which do not pickle
            err._shardfn_told = [dist.ProcessGroup(dist.HashStore(), 0, 1)]
        err.add_note("a note")
        assert traceback.format_exception_only(err)[0] == f"{prefix}.{name}: {args[0]}\n"
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is cls and back.args == err.args and back.__notes__ == ["a note"]
        assert not hasattr(back, "_shardfn_told")
        if cls is sf.PeerError:
            assert (back.rank, back.original) == (1, "KeyError: 'labels'")


def _loss(apply, params, batch):
    return lm_loss(apply(params, batch["x"]), batch["y"])


def test_one_name_per_concept():
    bad = []
    for qual, fn in public_callables():
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            annotation = str(p.annotation)
            if p.name in OLD_NAMES:
                bad.append(f"{qual}({p.name}=): now {OLD_NAMES[p.name]}=")
            for concept, (kind, names) in CONCEPTS.items():
                # a plan is "Plan | Strategy | str"; a mesh a Mesh or, to plan for, a world size or pair
                takes = re.search(rf"\b{kind}\b", annotation) is not None or (
                    concept == "mesh" and re.fullmatch(r"int \| tuple\[int, int\]( \| None)?", annotation) is not None)
                if takes and p.name not in names:
                    bad.append(f"{qual}({p.name}=) takes a {concept}: call it {concept}=")
            if p.name == "strategy" and "Plan" in annotation or p.name == "strategy" and p.annotation is p.empty:
                bad.append(f"{qual}(strategy=) takes a plan or a strategy: call it plan=")
    assert not bad, "public signatures that name a concept otherwise:\n" + "\n".join(sorted(bad))


def test_every_entry_point_that_builds_a_plan_takes_all_of_its_fields():
    # the functions that build a plan from a plan (or a strategy) and fields of their own
    takers = [(q, fn) for q, fn in public_callables() if inspect.isfunction(fn)
              and {"plan", "precision"} <= set(_parameters(fn))]
    assert {q for q, _ in takers} >= {"shardfn.shard", "shardfn.reshard"}
    for qual, fn in takers:
        params = _parameters(fn)
        assert set(PLAN_FIELDS) <= set(params), (qual, sorted(set(PLAN_FIELDS) - set(params)))
        assert "plan" in params, qual


def test_every_entry_point_that_takes_a_loss_says_one_convention():
    takers = [(q, fn) for q, fn in public_callables() if "loss_fn" in _parameters(fn)]
    assert {"shardfn.jit_step", "shardfn.jit_grad", "shardfn.explain", "shardfn.autoplan",
            "shardfn.testing.check_equivalence"} <= {q for q, _ in takers}
    for qual, fn in takers:
        doc = inspect.getdoc(fn) or ""
        assert "(apply, params, batch)" in doc, qual
        assert not re.search(r"loss_fn\(params, batch\)", doc.replace("former ``(params, batch)``", "")), qual


def gpt_model():
    return GPT(CFG)


def train_with_one_loss():
    """One top-level loss through jit_grad and jit_step on shards (they pass the apply of
    the tree they run), against a plain one-process gradient of the global batch."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    reference = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    sharded = sf.shard(params, mesh, "FULL_SHARD")
    g = torch.Generator().manual_seed(1)
    batch = {k: torch.randint(0, CFG.vocab_size, (2 * mesh.size, CFG.seq_len), generator=g) for k in "xy"}
    mine = {k: v.chunk(mesh.size)[mesh.rank] for k, v in batch.items()}
    loss, grads, _ = sf.jit_grad(_loss, mesh)(sharded, mine)
    ref_loss = _loss(apply, reference, batch)
    ref_loss.backward()
    ref_norm = torch.stack([t.grad.pow(2).sum() for t in reference.values() if t.grad is not None]).sum().sqrt()
    step = sf.jit_step(_loss, mesh, optimizer=sf.optim.sgd(0.1))
    _, _, metrics = step(sharded, step.init(sharded), mine)
    return float(loss), metrics["loss"], float(ref_loss), float(grads.global_norm), float(ref_norm)


def test_one_loss_serves_every_entry_point(clusters):
    loss, step_loss, ref_loss, norm, ref_norm = clusters[2].run(train_with_one_loss)[0]
    assert loss == pytest.approx(ref_loss, rel=1e-6) and step_loss == pytest.approx(ref_loss, rel=1e-6)
    assert norm == pytest.approx(ref_norm, rel=1e-5)
    # ... explain and autoplan (no process group here: both simulate on a fake world) ...
    with torch.device("meta"):
        model = GPT(CFG)
    tokens = torch.zeros(1, CFG.seq_len, dtype=torch.long)
    report = sf.explain(model, 2, "FULL_SHARD", {"x": tokens, "y": tokens}, loss_fn=_loss, verbose=False)
    found = sf.autoplan(model, 2, "1GiB", {"x": tokens, "y": tokens}, loss_fn=_loss, verbose=False)
    assert report.peak_bytes and found.chosen is not None
    # ... and the testing kit, which builds the model in every process
    rows = torch.arange(2 * CFG.seq_len).reshape(2, CFG.seq_len) % CFG.vocab_size
    check_equivalence(gpt_model, _loss, [{"x": rows, "y": rows.flip(1)}], optimizer=functools.partial(sf.optim.sgd, 0.1),
                      strategies=["FULL_SHARD"], world_sizes=[2], clusters=clusters)


def old_spellings():
    """The former spellings still work, each with a warning naming the new one."""
    mesh = sf.Mesh.from_group()
    torch.manual_seed(0)
    params, apply = sf.functionalize(GPT(CFG))
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = sf.shard(params, mesh, strategy="SHARD_GRAD_OP")
        step = sf.jit_step(lambda p, b: _loss(apply, p, b), mesh, optimizer=sf.optim.sgd(0.1), has_aux=False,
                           skip_nonfinite=True)
        batch = {k: torch.zeros(2, CFG.seq_len, dtype=torch.long) for k in "xy"}
        with sf.record_collectives() as log:
            _, _, metrics = step(sharded, step.init(sharded), batch)
        call = log.select("metrics")[0]
        tag = call.tag
        seen = [(str(w.message), w.filename) for w in caught if issubclass(w.category, DeprecationWarning)]
    return sharded.layout.strategy.value, metrics["skipped"], seen, tag


def test_old_spellings_work_for_one_release_with_a_warning(clusters):
    strategy, skipped, seen, tag = clusters[2].run(old_spellings)[0]
    assert strategy == "SHARD_GRAD_OP" and skipped is False and tag == "metrics"
    assert all(filename == __file__ for _, filename in seen), seen  # each names the line that used the old spelling
    seen = [message for message, _ in seen]
    for old, new in [("shard(strategy=...)", "shard(plan=...)"), ("jit_step: a loss_fn(params, batch)",
                                                                 "loss_fn(apply, params, batch)"),
                     ("jit_step(has_aux=..., mean_aux=...)", 'aux="rank"'),
                     ("jit_step(skip_nonfinite=...)", 'on_nonfinite="skip"'),
                     ("CollectiveCall.tag", "call.purpose and call.unit")]:
        assert any(old in m and new in m for m in seen), (old, seen)
    with pytest.raises(TypeError, match="pass plan= only"):
        sf.shard({}, None, plan="FULL_SHARD", strategy="FULL_SHARD")


def test_enums_parse_their_names_and_values_in_any_case():
    for enum in (sf.Strategy, sf.RematMode, sf.Placement, sf.Accumulate, sf.Aux, sf.OnNonfinite):
        for member in enum:
            for text in (member.name, member.name.lower(), str(member.value), str(member.value).upper()):
                assert enum.parse(text) is member, (enum, text)
        with pytest.raises(ValueError, match=f"is not one of .*{enum.__name__}"):
            enum.parse("no such thing")


def test_sizes_and_timeouts_parse_one_way():
    assert parse_size("40GiB", "x") == 40 * 2**30 and parse_size("80GB", "x") == 80 * 10**9
    assert parse_size("512 KiB", "x") == 512 * 1024 and parse_size("2tb", "x") == 2 * 10**12
    assert parse_size(1000, "x") == parse_size("1000B", "x") == 1000
    for bad in ("forty", "3iB", 0, -1, True, 2.5):
        with pytest.raises(ValueError, match="save_pretrained\\(max_shard_size=...\\): .* is not a size"):
            parse_size(bad, "save_pretrained(max_shard_size=...)")
    assert seconds(datetime.timedelta(minutes=2), "t") == seconds(120, "t") == 120.0
    for bad in (0, -3, "60", None):
        with pytest.raises(ValueError, match="a positive number of seconds or a datetime.timedelta"):
            seconds(bad, "Mesh.from_env(timeout=...)")


# -- docstring examples -------------------------------------------------------------------


def _examples() -> list[tuple[str, str]]:
    """``(where, source)`` of every docstring example (its ``>>>`` and ``...`` lines) of the public callables."""
    out = []
    for qual, fn in public_callables() + [(p, m) for p, m in _namespaces()]:
        lines = [line.strip() for line in (inspect.getdoc(fn) or "").splitlines()]
        source = [line[4:] for line in lines if line.startswith((">>> ", "... "))]
        if source:
            out.append((qual, "\n".join(source)))
    return out


def _resolve(node: ast.AST) -> object | None:
    """The public object an expression names (``sf.x``, ``shardfn.optim.y``, a bare public
    name), or None for anything else (a user's variable)."""
    parts = dotted(node)
    if parts is None:
        return None
    if parts[0] in ("sf", "shardfn"):
        obj: object = sf
        for attr in parts[1:]:
            obj = getattr(obj, attr)  # a missing or deprecated name fails here
        return obj
    for _, module in _namespaces():
        if parts[0] in module.__all__:
            obj = getattr(module, parts[0])
            for attr in parts[1:]:
                obj = getattr(obj, attr)
            return obj
    return None


def test_docstring_examples_use_names_keywords_and_the_loss_that_exist():
    examples = _examples()
    assert len(examples) > 25, len(examples)
    checked, bad = 0, []
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for where, source in examples:
            try:
                tree = ast.parse(source)
            except SyntaxError:  # a with-block without its body, an elided line
                tree = ast.parse("\n".join(line for line in source.splitlines() if not line.rstrip().endswith(":")))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and "loss" in node.name:
                    if [a.arg for a in node.args.args][:1] != ["apply"]:
                        bad.append(f"{where}: def {node.name}({', '.join(a.arg for a in node.args.args)})")
                if isinstance(node, (ast.Attribute, ast.Name)):
                    try:
                        _resolve(node)
                    except (AttributeError, DeprecationWarning) as e:
                        bad.append(f"{where}: {ast.unparse(node)}: {e}")
                if isinstance(node, ast.Call) and node.keywords:
                    try:
                        fn = _resolve(node.func)
                    except (AttributeError, DeprecationWarning):
                        continue  # reported above
                    params = inspect.signature(fn).parameters if callable(fn) else {}
                    if fn is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                        continue
                    checked += 1
                    bad += [f"{where}: {ast.unparse(node.func)}({k.arg}=...)" for k in node.keywords
                            if k.arg and k.arg not in params]
    assert checked > 15, checked  # the parse keeps finding calls
    assert not bad, "docstring examples that do not match the code:\n" + "\n".join(bad)


def test_docstring_examples_run():
    """Every docstring example of the public surface runs as a user would paste it, and
    shows the output it says it shows (tests/docstring_examples.py, in a fresh process:
    explain plans its fake worlds before any process group exists)."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, "docstring_examples.py")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) >= 50 and set(results) >= {where for where, _ in _examples()}, sorted(results)
    failed = {where: result for where, result in results.items() if result != "ok"}
    assert not failed, "docstring examples that do not run:\n" + "\n".join(f"{k}: {v}" for k, v in failed.items())


# -- error messages -----------------------------------------------------------------------

# "<the call, as the user writes it>: <what is wrong and the fix>", after "[rank r] " where
# the message differs between ranks: shard(): ..., jit_step(aux='x'): ..., adamw: ...,
# step(sharded, opt_state, ...): ..., checkpoint.load('ckpt/'): ...
_CALL_PREFIX = re.compile(r"^(\[rank \{[^}]*\}\] )?[A-Za-z_{][^\s:]*( [^:\n]{0,60})?: ")


def _message(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The leading text of an exception's message (``{...}`` for each interpolation), or
    None where it is not written out here (a variable, a join of problem lines)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message(node.left, constants)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _message(node.func.value, constants)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def test_every_error_message_starts_with_the_call_it_is_about():
    root = os.path.dirname(os.path.abspath(sf.__file__))
    judged, bad = 0, []
    for dirpath, _, files in os.walk(root):
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            constants = {t.id: m for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                         if isinstance(t, ast.Name) and (m := _message(n.value, {})) is not None}
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                    continue
                if getattr(node.exc.func, "id", "") in ("AttributeError", "FileNotFoundError", "KeyError"):
                    continue  # Python's own forms: the missing name or path
                if getattr(node.exc.func, "id", "") == "Unrecordable":
                    continue  # a clause of jit_step(graph=True)'s refusal, which names the call
                text = _message(node.exc.args[0], constants)
                if text is None:
                    continue
                judged += 1
                if not _CALL_PREFIX.match(text):
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno}: {text[:90]!r}")
    assert judged > 120, judged
    assert not bad, "error messages that do not start with the call they are about:\n" + "\n".join(bad)


def rank_naming_errors():
    """A user's loss that raises on rank 1 only, and a bad batch on rank 0 only."""
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(GPT(CFG))
    sharded = sf.shard(params, mesh, "FULL_SHARD")

    def loss_fn(apply, params, batch):
        if mesh.rank == 1:
            raise KeyError("labels")
        return lm_loss(apply(params, batch["input_ids"]), batch["labels"])

    grad = sf.jit_grad(loss_fn, mesh)
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    try:
        grad(sharded, {"input_ids": ids, "labels": ids})
    except Exception as e:  # noqa: BLE001 - reported
        return type(e).__name__, str(e), getattr(e, "__notes__", [])
    return None


def test_an_error_raised_among_ranks_names_its_rank(clusters):
    (kind0, text0, notes0), (kind1, text1, notes1) = clusters[2].run(rank_naming_errors)
    assert kind1 == "KeyError" and notes1 == [
        "[rank 1] shardfn: raised on rank 1 of Mesh(shard=2, device=cpu, backend=gloo, rank=1); the other ranks raise "
        "PeerError naming it."]
    assert kind0 == "PeerError" and text0.startswith("[rank 0] shardfn: rank 1 raised") and notes0 == []


# -- no hidden state ----------------------------------------------------------------------

# Module-level values that change at run time, each a resource of the process rather than of
# a model or a mesh: the host storages memory accounting tells apart (weak references), the
# live-bytes trackers running now, CUDA's side streams and the events of copies to pinned
# memory not yet waited for, and autoplan's figures keyed by the value of their inputs.
PROCESS_RESOURCES = {("shardfn._memory", "_HOST"), ("shardfn._memory", "_ACTIVE"), ("shardfn._state.offload", "_SIDE"),
                     ("shardfn._state.offload", "_TO_HOST"), ("shardfn._planning.autoplan", "_CACHE")}


def module_state() -> dict[str, str]:
    """Every module-level value of shardfn's modules that is not a function, class or
    module, as text."""
    import sys as _sys

    out = {}
    for name, module in sorted(_sys.modules.items()):
        if not name.startswith("shardfn") or module is None:
            continue
        for key, value in vars(module).items():
            if key.startswith("__") or (name, key) in PROCESS_RESOURCES:
                continue
            if callable(value) or inspect.ismodule(value) or isinstance(value, (type, property)):
                continue
            out[f"{name}.{key}"] = repr(value)
    return out


def workload_leaves_module_state_alone():
    torch.manual_seed(0)
    mesh = sf.Mesh.from_group()
    params, apply = sf.functionalize(GPT(CFG))
    before = module_state()
    sharded = sf.shard(params, mesh, sf.Plan("NO_SHARD", bucket_bytes=1))
    opt = sf.optim.adamw(1e-3)
    step = sf.jit_step(lambda apply, params, batch: lm_loss(apply(params, batch), batch), mesh, optimizer=opt)
    state = opt.init(sharded)
    ids = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for _ in range(3):
        sharded, state, _ = step(sharded, state, ids)
    with sf.bind(apply, sharded) as model:
        model(ids)
    try:  # a divergence, so that the guard's messages and failure paths run too
        with sf.on_shards(sharded):
            if mesh.rank == 0:
                sf.optim.psum(torch.ones(()))
    except sf.DivergenceError:
        pass
    sf.gather(sharded)
    after = module_state()
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k)), len(before)


def test_a_training_run_leaves_no_state_in_shardfns_modules(clusters):
    # The guard is the mesh's (mesh.guard), a tree's replica is the tree's, autoplan's cache
    # is keyed by value: nothing a run does is left in a module.
    for changed, n in clusters[2].run(workload_leaves_module_state_alone):
        assert n > 50 and changed == [], changed
