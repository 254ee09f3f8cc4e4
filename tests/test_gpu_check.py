"""benchmarks/gpu_check.py: its verdict, and its CPU run end to end (the GPU run needs a GPU)."""

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_verdict_fails_a_defect_and_passes_rounding():
    gc = _gpu_check()
    ctx = types.SimpleNamespace(device=torch.device("cuda"))
    # Two steps of SGD that moved "w" (values near 1) by 0.01 each, and never moved "b".
    ref = {"losses": [2.0, 1.5], "state": {"w": torch.ones(8), "b": torch.zeros(3)}, "moved": {"w": 0.02, "b": 0.0}}

    def verdict(w, b=torch.zeros(3), losses=(2.0, 1.5), variant="fp32", keys=("w", "b")):
        full = {k: v for k, v in {"w": w, "b": b}.items() if k in keys}
        return gc.compare(list(losses), full, ref, variant, ctx)

    # Rounding: a few fp32 spacings of the values, and 1e-3 of the updates (CUDA's bound).
    assert verdict(torch.ones(8) + 2 * 2**-23)["equiv"] == "PASS"
    assert verdict(torch.ones(8) + 1e-3 * 0.02)["equiv"] == "PASS"
    # A defect moves a parameter by the order of an update: a lost reduction halves one.
    assert verdict(torch.ones(8) + 0.01)["equiv"] == "FAIL"
    assert verdict(torch.ones(8) + 0.01, variant="bf16")["equiv"] == "FAIL"
    assert verdict(torch.ones(8), b=torch.full((3,), 1e-6))["equiv"] == "FAIL"  # moved where nothing moves
    assert verdict(torch.ones(8), losses=(2.0, 1.5 + 1e-4))["equiv"] == "FAIL"
    out = verdict(torch.ones(8), keys=("w",))
    assert out["equiv"] == "FAIL" and "keys differ" in out["error"]
    # bf16 rows against the fp32 reference: 5e-2 of the updates.
    assert verdict(torch.ones(8) + 0.5e-3, losses=(2.0, 1.51), variant="bf16")["equiv"] == "PASS"


@pytest.mark.slow
def test_the_cpu_run_passes_for_shardfn_and_its_peers():
    # (the timed steps as a run that never waits for the device: [Note: a step that does not wait])
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--steps", "2", "--warmup",
           "0", "--timed-steps", "1", "--on-nonfinite", "raise_next"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith(f"torch {torch.__version__}, CUDA ")
    assert "shardfn's with on_nonfinite='raise_next'" in proc.stdout
    assert "PASS: 18 of 18 equivalence rows passed, their peers 18 of 18" in proc.stdout, proc.stdout[-3000:]
    # every shardfn row and every peer, both worlds, with its ratio to the bound
    rows = re.findall(r"^\s+[12]\s+(FULL_SHARD|SHARD_GRAD_OP|NO_SHARD)\s+\w+\s+PASS\s+\S+\s+(\S+)\s+.*\s+PASS\s+(\S+)",
                      proc.stdout, re.M)
    assert len(rows) == 18 and all(float(a) <= 1 and float(b) <= 1 for _, a, b in rows), proc.stdout


def test_the_graph_run_without_cuda_says_so_and_runs_nothing():
    # (this machine's torch has no CUDA; the run's rows need one: docs/compile.md, "The CUDA path")
    assert not torch.cuda.is_available()
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--graph"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "gpu_check.py --graph needs a CUDA device" in proc.stderr and proc.stdout == ""


def test_the_graph_run_judges_equal_losses_by_its_bounds():
    _gpu_check()
    spec = importlib.util.spec_from_file_location("gpu_graph", ROOT / "benchmarks" / "gpu_graph.py")
    gg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gg
    spec.loader.exec_module(gg)
    small, big = gg.ROWS[0], gg.ROWS[1]
    assert (small.dims["d_model"], small.dims["layers"], small.seq, small.batch, small.dtype) == (64, 24, 16, 1, "fp32")
    cells = {(small.name, "shardfn eager"): {"losses": [2.0, 1.0]},
             (small.name, "graph=True"): {"losses": [2.0, 1.0 + 0.5e-5]},
             (small.name, "graph=eager"): {"losses": [2.0, 1.0 + 2e-5]},
             (big.name, "shardfn eager"): {"losses": [2.0]}, (big.name, "graph=True"): {"losses": [2.0 * (1 + 2**-8)]}}
    assert gg.equality(small, "graph=True", cells)[1] == "PASS"
    assert gg.equality(small, "graph=eager", cells)[1] == "FAIL"
    assert gg.equality(big, "graph=True", cells)[1] == "PASS"  # bf16: 2**-7
    assert gg.equality(small, "plain eager", cells) == (None, "-")
    lines = gg.table((small, big), cells)
    assert sum("not run" in line for line in lines) == 2 * len(gg.COLUMNS) - 5
