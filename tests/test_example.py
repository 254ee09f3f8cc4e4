"""The README's main job: examples/train_lm.py under torchrun, 2 processes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfn.testing import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["FULL_SHARD"])
def test_train_lm_under_torchrun_loss_falls(strategy):
    steps = 12
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(ROOT / "examples" / "train_lm.py"),
        "--steps", str(steps), "--strategy", strategy, "--d-model", "64", "--layers", "2", "--log-every", "6",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)  tokens/s \d+$", proc.stdout, re.M)]
    assert len(losses) == steps, proc.stdout
    assert losses[-1] < losses[0] - 0.5, losses
    assert re.search(r"^final loss [0-9.]+ \(first [0-9.]+\)$", proc.stdout, re.M)
    assert proc.stdout.count("val loss") == 2
    assert "FULL_SHARD" in proc.stdout and "blocks.1" in proc.stdout  # the printed layout


def test_train_lm_resumes_by_default():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    assert train_lm.parse_args(["--ckpt-dir", "c"]).resume  # what a torchrun restart runs
    assert not train_lm.parse_args(["--ckpt-dir", "c", "--no-resume"]).resume
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--save-every", "0"])
