"""Runs every docstring example of the public surface (tests/test_surface.py starts it in
a fresh process and reads its report).

Each example runs on its own, as a user would paste it, in a namespace holding what its
prose assumes: the public names (``from shardfn import *`` and the optim and testing
namespaces), a small model with its ``params`` and ``apply``, a batch, a loss; and, when
the example names them, a world of one (``mesh``), its shards, an optimizer, its state and
a step. A model that must be a Hugging Face one (the example generates or loads with
``from_pretrained``) is a tiny GPT-2 built from a config (nothing is downloaded). Each
example runs in its own empty directory; the process group it started is destroyed after
it, so that ``explain`` for a world of any size can run in the next. An example written as
a script (``if __name__ == "__main__":``, as a ``Cluster`` must be) runs as one, in a
child process.

Output: the last line of stdout, JSON ``{where: "ok" | "<error>"}``.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import functools
import inspect
import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
import shardfn  # noqa: E402
import shardfn as sf  # noqa: E402
from shardfn.testing.models import GPT, GPTConfig, Block, lm_loss  # noqa: E402
from test_surface import _namespaces, public_callables  # noqa: E402

CFG = GPTConfig(vocab_size=17, seq_len=4, d_model=8, n_layers=2, n_heads=2)
# Names whose value needs the process group: made only for an example that names them.
NEEDS_MESH = {"mesh", "sharded", "opt_state", "state", "step", "grad_fn", "grads", "metrics"}


def _hf_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=17, n_positions=32, n_embd=8, n_layer=2, n_head=2))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(CFG)


def loss_fn(apply, params, batch):
    return lm_loss(apply(params, batch["input_ids"]), batch["labels"])


def _batch(seed: int = 0, rows: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 17, (rows, 4), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def namespace(source: str, data_dir: str) -> dict:
    """What the example's prose assumes (see the module docstring)."""
    ns: dict = {"__name__": "docstring_example"}
    exec("from shardfn import *\nfrom shardfn.optim import *\nfrom shardfn.testing import *", ns)
    hf = "generate(" in source or "from_pretrained" in source
    model = _hf_model() if hf else make_model()
    params, apply = sf.functionalize(model)
    if hf:
        from transformers import GPT2LMHeadModel

        def hf_loss(apply, params, batch):
            return apply(params, batch["input_ids"], labels=batch["labels"]).loss

        ns.update(GPT2LMHeadModel=GPT2LMHeadModel, loss_fn=hf_loss)
    else:
        ns["loss_fn"] = loss_fn
    batch = _batch()
    ns.update(
        torch=torch, nn=nn, dist=dist, os=os, functools=functools, partial=functools.partial, sf=sf,
        shardfn=shardfn, GPT=GPT, GPTConfig=GPTConfig, Block=Block, lm_loss=lm_loss, model=model, params=params,
        apply=apply, batch=batch, batches=[_batch(i, rows=12) for i in range(3)], x=batch["input_ids"], y=batch["labels"],
        input_ids=batch["input_ids"], make_model=make_model, my_loss=ns["loss_fn"], loss=ns["loss_fn"],
        local_loss=0.5, data_dir=data_dir, cfg=CFG,
    )
    ns.update(opt=sf.optim.adamw(1e-3), optimizer=sf.optim.adamw(1e-3))
    return ns


class WorldOfOne(dict):
    """The example's namespace, whose names of :data:`NEEDS_MESH` are made on first use, so
    that an example can plan for a world of 64 before it builds its mesh (explain cannot
    start its fake world once a process group exists). (CPython reads a module's names
    through ``__missing__`` when its globals are a dict subclass.)"""

    def __init__(self, ns: dict, uses_shards: bool):
        super().__init__(ns)
        self.ns, self.uses_shards = ns, uses_shards

    def __missing__(self, name: str):
        if name not in NEEDS_MESH or "mesh" in self:
            raise KeyError(name)
        ns = self.ns
        if name in ("grads", "state") and not self.uses_shards:  # an optimizer example on full parameters
            self.setdefault("grads", {n: torch.full_like(t, 0.01) for n, t in ns["params"].items() if t.requires_grad})
            self.setdefault("state", ns["opt"].init(ns["params"]))
            return self[name]
        mesh = sf.Mesh.from_env()
        sharded = sf.shard(ns["params"], mesh, "FULL_SHARD")
        grad_fn = sf.jit_grad(ns["loss_fn"], mesh)
        _, grads, metrics = grad_fn(sharded, ns["batch"])
        opt_state = ns["opt"].init(sharded)
        made = dict(mesh=mesh, sharded=sharded, grad_fn=grad_fn, metrics=metrics, opt_state=opt_state, grads=grads,
                    state=opt_state, step=sf.jit_step(ns["loss_fn"], mesh, optimizer=ns["opt"]))
        for k, v in made.items():  # what the example set itself stays
            self.setdefault(k, v)
        return self[name]


def docstrings() -> list[tuple[str, list[doctest.Example]]]:
    """``(where, its examples)`` for every public callable and namespace whose docstring has any."""
    parser, out = doctest.DocTestParser(), []
    for where, obj in public_callables() + list(_namespaces()):
        examples = parser.get_examples(inspect.getdoc(obj) or "")
        if examples:
            out.append((where, examples))
    return out


def _check(where: str, example: doctest.Example, ns: dict) -> None:
    """Runs one ``>>>`` statement; one shown with its output must print it (an output for
    another world, marked ``# torchrun ...``, is not compared)."""
    code = compile(example.source, where, "single" if example.want else "exec")
    if not example.want or "# torchrun" in example.source:
        exec(compile(example.source, where, "exec"), ns)
        return
    shown = []
    hook, sys.displayhook = sys.displayhook, lambda v: shown.append(repr(v)) if v is not None else None
    try:
        exec(code, ns)
    finally:
        sys.displayhook = hook
    if "\n".join(shown).strip() != example.want.strip():
        raise AssertionError(f"{example.source.strip()!r} shows {chr(10).join(shown)!r}, the docstring says "
                             f"{example.want.strip()!r}")


def run(where: str, examples: list[doctest.Example]) -> str:
    source = "".join(e.source for e in examples)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):
        os.makedirs(os.path.join(tmp, "data"))
        open(os.path.join(tmp, "data", "part-0.txt"), "w").close()
        if '__name__ == "__main__"' in source:  # a script: run as one
            path = os.path.join(tmp, "example.py")
            with open(path, "w") as f:
                f.write("import torch\nimport torch.distributed as dist\nfrom shardfn.testing import *\n" + source)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=300, env=env)
            return "ok" if out.returncode == 0 else f"exit {out.returncode}: {out.stderr.strip()[-400:]}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                ns = namespace(source, os.path.join(tmp, "data"))
                used = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
                world = WorldOfOne(ns, bool(used & {"sharded", "opt_state"}))
                for example in examples:
                    _check(where, example, world)
            return "ok"
        except Exception as e:  # noqa: BLE001 - reported
            tb = traceback.extract_tb(e.__traceback__)
            line = next((f"line {t.lineno}" for t in reversed(tb) if t.filename == where), "")
            return f"{type(e).__name__} ({line}): {str(e).strip()[:300]}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # Mesh.from_env(replicate="nodes") in a world of one
    results = {}
    for where, examples in docstrings():
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(var, None)  # a fresh world of one (and store) for each example
        results[where] = run(where, examples)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
