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
@pytest.mark.parametrize("strategy, extra", [("FULL_SHARD", []), ("SHARD_OPTIMIZER", ["--offload"])])
def test_train_lm_under_torchrun_loss_falls(strategy, extra):
    steps = 12
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(ROOT / "examples" / "train_lm.py"),
        "--steps", str(steps), "--strategy", strategy, "--d-model", "64", "--layers", "2", "--log-every", "6",
        "--progress", "plain", "--sample-tokens", "20", *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)  tokens/s \d+$", proc.stdout, re.M)]
    assert len(losses) == steps, proc.stdout
    assert losses[-1] < losses[0] - 0.5, losses
    assert re.search(r"^final loss [0-9.]+ \(first [0-9.]+\)$", proc.stdout, re.M)
    assert len(re.findall(r"^val loss [0-9.]+ at step \d+$", proc.stdout, re.M)) == 2
    assert strategy in proc.stdout and "blocks.1" in proc.stdout  # the printed layout
    assert ("offload=Offload(params=True, optimizer=True)" in proc.stdout) == bool(extra)
    sample = re.search(r"^sample: The (.*)$", proc.stdout, re.M | re.S)
    assert sample and len(sample.group(1)) >= 5, proc.stdout[-2000:]  # 20 bytes (some may not be UTF-8)
    summary = re.search(r"^summary: 12 steps in [0-9.]+ s \(([0-9,]+) tokens/s\), train loss ([0-9.]+), val loss "
                        r"([0-9.]+), peak (\d+) MiB per rank \(resident set\), ([0-9.]+) MiB communicated per rank and step, "
                        r"checkpoint none", proc.stdout, re.M)
    assert summary, proc.stdout[-2000:]
    assert float(summary.group(2)) == losses[-1] and int(summary.group(4)) > 50 and float(summary.group(5)) > 0


@pytest.mark.slow
def test_train_lm_progress_bar():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "examples" / "train_lm.py"), "--steps", "4", "--d-model",
           "32", "--layers", "2", "--log-every", "4", "--sample-tokens", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train: 100%" in proc.stderr and "4/4" in proc.stderr and "tok/s" in proc.stderr, proc.stderr[-2000:]
    assert "MiB/rank" in proc.stderr and "MiB/step" in proc.stderr
    assert not re.search(r"^step \d+ loss", proc.stdout, re.M)  # no line per step
    assert re.search(r"^val loss [0-9.]+ at step 4$", proc.stdout, re.M) and "summary: 4 steps" in proc.stdout


def test_train_lm_resumes_by_default():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    assert train_lm.parse_args(["--ckpt-dir", "c"]).resume  # what a torchrun restart runs
    assert not train_lm.parse_args(["--ckpt-dir", "c", "--no-resume"]).resume
    with pytest.raises(SystemExit):
        train_lm.parse_args(["--save-every", "0"])


@pytest.mark.slow
def test_train_lm_trains_hugging_face_gpt2_and_exports_it(tmp_path):
    """--model gpt2: the same bytes and loop on a transformers GPT-2; --export writes what from_pretrained reads."""
    import torch
    from transformers import GPT2LMHeadModel

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(ROOT / "examples" / "train_lm.py"), "--model", "gpt2",
        "--steps", "8", "--d-model", "32", "--layers", "2", "--heads", "2", "--log-every", "8", "--progress", "plain",
        "--sample-tokens", "0", "--export", str(tmp_path / "hf"), "--final-state", str(tmp_path / "final.pt"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)  tokens/s \d+$", proc.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0], proc.stdout
    assert f"exported to {tmp_path / 'hf'} (model.safetensors)" in proc.stdout
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    final = torch.load(tmp_path / "final.pt")
    assert model.state_dict().keys() == final.keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k
