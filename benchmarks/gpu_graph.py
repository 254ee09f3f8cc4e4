"""``gpu_check.py --graph``: ``jit_step(graph=True)`` replayed as one CUDA graph, on one GPU.

One process, world 1 (NCCL, or gloo if NCCL does not start), ``SHARDFN_CUDA_GRAPH=1`` set
inside (the CUDA path is unverified until this has passed: docs/compile.md, "The CUDA path").
Three rows:

* ``small GPT fp32``: the GPT of ``shardfn.testing.models``, d_model 64, 24 layers, seq 16,
  batch 1, vocab 256, fp32: many small units, where launches dominate;
* ``GPT bf16``: gpu_check's default GPT (d_model 1024, 8 layers, seq 1024, batch 8, vocab
  32000), ``Precision(param=bfloat16, reduce=float32)`` (plain torch: bf16 autocast);
* ``Llama ~1B bf16``: transformers' ``LlamaForCausalLM`` from a ``LlamaConfig`` (hidden
  2048, 22 layers, 32 heads, 4 key-value heads, MLP 5632, vocab 32000; random weights, no
  download), seq 1024, batch 4, bf16 as above; its causal mask given as a 4-D tensor
  (:func:`logits`).

Columns, each a fresh model with the same initial weights, SGD (lr ``LR``, momentum 0.9) on
the same batches, FULL_SHARD for shardfn: ``graph=True`` (inductor's program, captured),
``graph="eager"`` (the recorded ops one by one, captured), shardfn's eager step
(``on_nonfinite="raise_next"``: no host read), plain PyTorch eager, and the floor: plain
PyTorch's step captured as one CUDA graph (Llama: plain ``torch.compile`` of the model). Per
cell: median ms/step over ``TIMED`` steps after ``WARMUP`` (a graph step records at call 2,
runs its program eagerly at call 3 and captures at call 4), each step between two
``torch.cuda.synchronize()``; ``first s``: from the first call to the end of the first
replayed (captured) call, compiling included; ``MiB``: ``torch.cuda.max_memory_allocated()``
over the timed steps; ``loss rel``: the largest relative difference of the losses of every
call (read after the run: a kept loss must not be overwritten by later replays) from
shardfn's eager step. Bounds: fp32 ``1e-5`` (the fp32 equivalence bound of DESIGN.md: the
same ops, the recorded update taking its scalars as tensors, inductor fusing in another
order); bf16 ``2**-7``, the bound tests/test_graph.py derives for a recorded bf16 step
against the eager one (over 3 steps; over these 14 a FAIL there is a flag to look at, not
a proof of a defect).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LR, MOMENTUM = 1e-3, 0.9
WARMUP, TIMED = 4, 10
LOSS_RTOL = {"fp32": 1e-5, "bf16": 2**-7}
LIMIT_S = 470.0  # the whole run, under 8 minutes
# inductor's program last in a row: its compile is the longest part of a run that has a time limit
COLUMNS = ("graph=eager", "shardfn eager", "plain eager", "floor", "graph=True")
GRAPH = ("graph=eager", "graph=True")
NO_CUDA = ("gpu_check.py --graph needs a CUDA device (torch.cuda.is_available() is False here): it captures "
           "jit_step(graph=True) as one CUDA graph. Run it on a CUDA machine; nothing was run.")


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "gpt" or "llama"
    dims: dict
    seq: int
    batch: int
    dtype: str  # "fp32" or "bf16"


ROWS = (
    Row("small GPT fp32", "gpt", {"vocab": 256, "d_model": 64, "layers": 24, "heads": 4}, 16, 1, "fp32"),
    Row("GPT bf16", "gpt", {"vocab": 32000, "d_model": 1024, "layers": 8, "heads": 16}, 1024, 8, "bf16"),
    Row("Llama ~1B bf16", "llama", {"vocab": 32000, "d_model": 2048, "layers": 22, "heads": 32, "kv": 4,
                                    "mlp": 5632}, 1024, 4, "bf16"),
)


CPU_ROWS = (  # --device cpu: a smoke run of the logic (graph cells replay uncaptured on a CPU mesh)
    Row("small GPT fp32", "gpt", {"vocab": 64, "d_model": 32, "layers": 2, "heads": 2}, 8, 1, "fp32"),
    Row("Llama tiny bf16", "llama", {"vocab": 64, "d_model": 32, "layers": 2, "heads": 4, "kv": 2, "mlp": 64}, 8, 2,
        "bf16"),
)


def build(row: Row, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The row's model, the same weights every time (seeded, made on ``device``)."""
    d = row.dims
    torch.manual_seed(seed)
    with torch.device(device):
        if row.kind == "gpt":
            from shardfn.testing.models import GPT, GPTConfig

            return GPT(GPTConfig(vocab_size=d["vocab"], seq_len=row.seq, d_model=d["d_model"], n_layers=d["layers"],
                                 n_heads=d["heads"]))
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=d["vocab"], hidden_size=d["d_model"], intermediate_size=d["mlp"],
                          num_hidden_layers=d["layers"], num_attention_heads=d["heads"], num_key_value_heads=d["kv"],
                          max_position_embeddings=row.seq, use_cache=False, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg)


def logits(row: Row, forward: Callable, x: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``x``. Llama gets its causal mask as a 4-D tensor: from none
    (or a 2-D one), transformers decides on the host whether the sequences are packed or
    padded (a host read, which a recorded step refuses)."""
    if row.kind == "gpt":
        return forward(x)
    n = x.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril().expand(x.shape[0], 1, n, n)
    return forward(input_ids=x, attention_mask=mask).logits


def batches(row: Row, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(row.dims["vocab"], (row.batch, row.seq + 1), generator=g) for _ in range(WARMUP + TIMED)]
    return [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in tokens]


def shardfn_step(row: Row, mesh: Any, graph: Any) -> Callable:
    import shardfn as sf
    from shardfn.testing.models import lm_loss

    params, _ = sf.functionalize(build(row, mesh.device))
    precision = sf.Precision(param=torch.bfloat16, reduce=torch.float32) if row.dtype == "bf16" else None
    tree = {"sharded": sf.shard(params, mesh, "FULL_SHARD", precision=precision)}
    del params
    opt = sf.optim.sgd(LR, momentum=MOMENTUM)
    tree["opt"] = opt.init(tree["sharded"])
    step_fn = sf.jit_step(lambda apply, p, b: lm_loss(logits(row, lambda *a, **k: apply(p, *a, **k), b[0]), b[1]), mesh, optimizer=opt,
                          **({"graph": graph} if graph else {"on_nonfinite": "raise_next"}))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tree["sharded"], tree["opt"], metrics = step_fn(tree["sharded"], tree["opt"], (x, y))
        return metrics["loss"]

    step.close = getattr(step_fn, "close", lambda: None)
    return step


def plain_step(row: Row, device: torch.device, how: str, x0: torch.Tensor, y0: torch.Tensor) -> Callable:
    """Plain PyTorch: eager, the whole step captured (``cg``, after 3 eager steps on a side
    stream, as PyTorch's CUDA-graph recipe does), or the model under ``torch.compile``."""
    from shardfn.testing.models import lm_loss

    model = build(row, device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, foreach=True)
    fwd = torch.compile(model) if how == "compile" else model
    bf16 = row.dtype == "bf16"

    def body(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cast = torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if bf16 else contextlib.nullcontext()
        with cast:
            loss = lm_loss(logits(row, fwd, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=how != "cg")
        return loss.detach()

    if how != "cg":
        return body
    static_x, static_y = x0.clone(), y0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body(static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = body(static_x, static_y)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return static_loss.clone()

    step.close = graph.reset
    return step


def measure(make: Callable[[], Callable], data: list, device: torch.device, first_call: int) -> dict:
    """ms/step, time to the end of call ``first_call``, peak MiB and the losses of every call."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    step = make()
    losses, times, first = [], [], None
    for i, (x, y) in enumerate(data):
        if i == WARMUP and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        losses.append(step(x, y))
        sync()
        times.append(time.perf_counter() - t)
        if i + 1 == first_call:
            first = time.perf_counter() - t0
    out = {"ms": 1e3 * statistics.median(times[WARMUP:]), "first_s": first,
           "mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
           "losses": [float(v) for v in losses]}  # read only now: a kept loss must still be its call's
    getattr(step, "close", lambda: None)()  # graphs before the process group ([Note: capturing a step])
    return out


def cell(row: Row, column: str, mesh: Any, data: list) -> dict:
    device = mesh.device
    if column == "graph=True":
        return measure(lambda: shardfn_step(row, mesh, "inductor"), data, device, 4)
    if column == "graph=eager":
        return measure(lambda: shardfn_step(row, mesh, "eager"), data, device, 4)
    if column == "shardfn eager":
        return measure(lambda: shardfn_step(row, mesh, False), data, device, 1)
    if column == "plain eager":
        return measure(lambda: plain_step(row, device, "eager", *data[0]), data, device, 1)
    if device.type != "cuda":
        return {"error": "the floor needs CUDA"}
    how = "compile" if row.kind == "llama" else "cg"
    return measure(lambda: plain_step(row, device, how, *data[0]), data, device, 1)


def worker(port: int, device_type: str, rows: tuple[Row, ...], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1", SHARDFN_CUDA_GRAPH="1")
    import shardfn as sf

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    except Exception as e:  # noqa: BLE001 - world 1 runs no collective: gloo does as well
        out.put(("info", {"nccl": f"{type(e).__name__}: {str(e)[:200]}"}))
        backend = "gloo"
        dist.init_process_group(backend)
    out.put(("info", {"backend": backend, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                      else "cpu"}))
    from gpu_check import make_mesh

    mesh = make_mesh(device)  # gloo with CUDA tensors: a CUDA DeviceMesh over the group (no collective at world 1)
    for row in rows:
        data = batches(row, device)
        for column in COLUMNS:
            try:
                result = cell(row, column, mesh, data)
            except Exception as e:  # noqa: BLE001 - reported in the table
                result = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                          "trace": traceback.format_exc()[-1500:]}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            out.put(("cell", (row.name, column, result)))
    out.put(("done", None))
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    os._exit(0)


def equality(row: Row, column: str, cells: dict) -> tuple[float | None, str]:
    """A graph cell's largest relative loss difference from shardfn eager's, and PASS/FAIL."""
    base = cells.get((row.name, "shardfn eager"), {}).get("losses")
    mine = cells.get((row.name, column), {}).get("losses")
    if not column.startswith("graph") or not base or not mine:
        return None, "-"
    rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(mine, base))
    return rel, "PASS" if rel <= LOSS_RTOL[row.dtype] else "FAIL"


def table(rows: tuple[Row, ...], cells: dict) -> list[str]:
    from gpu_check import fmt

    head = (f"{'row':<17}{'column':<15}{'ms/step':>9}{'x plain':>9}{'x floor':>9}{'first s':>9}{'loss rel':>10}"
            f"  {'equal':<6}{'MiB':>8}  error")
    lines = [head, "-" * len(head)]
    for row in rows:
        plain = cells.get((row.name, "plain eager"), {}).get("ms")
        floor = cells.get((row.name, "floor"), {}).get("ms")
        for column in COLUMNS:
            c = cells.get((row.name, column))
            if c is None:
                lines.append(f"{row.name:<17}{column:<15}  not run (the time limit, or the run died)")
                continue
            rel, equal = equality(row, column, cells)
            ms = c.get("ms")
            lines.append(f"{row.name:<17}{column:<15}{fmt(ms, '.2f'):>9}{fmt(ms / plain if ms and plain else None, '.2f'):>9}"
                         f"{fmt(ms / floor if ms and floor else None, '.2f'):>9}{fmt(c.get('first_s'), '.1f'):>9}"
                         f"{fmt(rel, '.1e'):>10}  {equal:<6}{fmt(c.get('mib'), '.0f'):>8}  {c.get('error', '')}")
    return lines


def main(device_type: str = "cuda", rows: tuple[Row, ...] = ROWS, limit_s: float = LIMIT_S) -> int:
    """Runs the rows in one spawned process (killed after ``limit_s``), prints the table.
    Exit status: 0 when every graph cell ran and its losses were equal, 1 otherwise, 2
    without CUDA."""
    if device_type == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from gpu_check import free_port, stop, versions

    print(versions(), flush=True)
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    proc = spawn.Process(target=worker, args=(free_port(), device_type, rows, out), daemon=True)
    proc.start()
    cells: dict = {}
    info: dict = {}
    deadline, done = time.monotonic() + limit_s, False
    try:
        while not done and time.monotonic() < deadline:
            try:
                kind, body = out.get(timeout=1.0)
            except Exception:  # noqa: BLE001 - queue.Empty: is the worker alive?
                if not proc.is_alive():
                    break
                continue
            if kind == "info":
                info.update(body)
            elif kind == "cell":
                cells[body[:2]] = body[2]
                print(f"  {body[0]}, {body[1]}: " + (f"ERROR {body[2]['error']}" if "error" in body[2] else
                                                     f"{body[2]['ms']:.2f} ms/step"), flush=True)
            done = kind == "done"
    finally:
        stop([proc])
    print(f"\ndevice: {info.get('device', '?')}; backend {info.get('backend', '?')}"
          + (f" (NCCL did not start: {info['nccl']})" if "nccl" in info else "") + f"; SGD lr {LR:g} momentum "
          f"{MOMENTUM:g}; {WARMUP} warm-up + {TIMED} timed steps per cell; SHARDFN_CUDA_GRAPH=1\n")
    print("\n".join(table(rows, cells)))
    print(f"\nms/step: median of the timed steps; x plain, x floor: over plain eager's and the floor's (plain "
          f"step as one CUDA graph; Llama: plain torch.compile); first s: first call to the end of the first "
          f"replayed call; loss rel: largest relative difference of every call's loss from shardfn eager's, "
          f"equal if at most {LOSS_RTOL['fp32']:g} (fp32) or 2**-7 (bf16) (module docstring); MiB: peak allocated "
          f"over the timed steps.")
    for (name, column), c in cells.items():
        if c.get("trace"):
            print(f"\n{name}, {column}:\n{c['trace']}")
    graph = [(r, c) for r in rows for c in GRAPH]
    ok = done and all("error" not in cells.get((r.name, c), {"error": "not run"}) and equality(r, c, cells)[1] == "PASS"
                      for r, c in graph)
    print(f"\n{'PASS' if ok else 'FAIL'}: graph rows " + ("ran, and their losses equal shardfn eager's" if ok else
                                                          "failed, did not run, or parted from shardfn eager"))
    return 0 if ok else 1
