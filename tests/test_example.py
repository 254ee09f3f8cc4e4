"""The README's main job: examples/train_lm.py under torchrun, 2 processes."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfn.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"step", "loss", "val_loss", "grad_norm", "tokens_per_s", "peak_memory_bytes", "comm_bytes"}


def load_train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", ROOT / "examples" / "train_lm.py")
    train_lm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_lm)
    return train_lm


def check_run_dir(run_dir: Path, stdout: str, steps: int, val_steps: list[int]) -> list[dict]:
    """metrics.jsonl has one well-formed line per step, agreeing with what the job printed;
    loss_curves.png is there when matplotlib is, else the job said how to get it."""
    assert f"metrics: {run_dir / 'metrics.jsonl'} (a JSON line per step)" in stdout, stdout[:3000]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), lines
    for r in records:
        assert set(r) == FIELDS, r
        assert isinstance(r["loss"], float) and r["tokens_per_s"] > 0 and r["grad_norm"] > 0, r
        assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 50 * 2**20, r
        assert isinstance(r["comm_bytes"], int) and r["comm_bytes"] > 0, r  # 2 ranks: every step communicates
    assert [r["step"] for r in records if r["val_loss"] is not None] == val_steps, lines
    printed_val = [float(v) for v in re.findall(r"^val loss ([0-9.]+) at step \d+$", stdout, re.M)]
    assert [round(r["val_loss"], 4) for r in records if r["val_loss"] is not None] == printed_val
    png = run_dir / "loss_curves.png"
    # matplotlib is a test dependency (pyproject's test extra); its absence is the test below
    assert f"loss curves: {png}" in stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", stdout[-2000:]
    return records


@pytest.mark.slow
@pytest.mark.parametrize("strategy, extra", [("FULL_SHARD", []), ("SHARD_OPTIMIZER", ["--offload"])])
def test_train_lm_under_torchrun_loss_falls(strategy, extra, tmp_path):
    steps = 12
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), str(ROOT / "examples" / "train_lm.py"),
        "--steps", str(steps), "--strategy", strategy, "--d-model", "64", "--layers", "2", "--log-every", "6",
        "--progress", "plain", "--sample-tokens", "20", "--run-dir", str(tmp_path / "run"), *extra,
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
    records = check_run_dir(tmp_path / "run", proc.stdout, steps, [6, 12])
    assert [round(r["loss"], 4) for r in records] == losses
    assert round(records[-1]["comm_bytes"] / 2**20, 2) == float(summary.group(5))


@pytest.mark.slow
def test_train_lm_progress_bar(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "examples" / "train_lm.py"), "--steps", "4", "--d-model",
           "32", "--layers", "2", "--log-every", "4", "--sample-tokens", "0", "--run-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train: 100%" in proc.stderr and "4/4" in proc.stderr and "tok/s" in proc.stderr, proc.stderr[-2000:]
    assert "MiB/rank" in proc.stderr and "MiB/step" in proc.stderr
    assert not re.search(r"^step \d+ loss", proc.stdout, re.M)  # no line per step
    assert re.search(r"^val loss [0-9.]+ at step 4$", proc.stdout, re.M) and "summary: 4 steps" in proc.stdout


def test_train_lm_resumes_by_default():
    train_lm = load_train_lm()
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
        "--run-dir", str(tmp_path / "run"),
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


def write_metrics(path: Path) -> None:
    lines = [{"step": n, "loss": 5.0 / n, "val_loss": 4.0 / n if n % 2 == 0 else None, "grad_norm": 1.0,
              "tokens_per_s": 1e4, "peak_memory_bytes": 2**28, "comm_bytes": 2**20} for n in range(1, 7)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_train_lm_draws_the_loss_curves(tmp_path):
    train_lm = load_train_lm()
    write_metrics(tmp_path / "metrics.jsonl")
    assert train_lm.plot_losses(str(tmp_path), "a title") == f"loss curves: {tmp_path / 'loss_curves.png'}"
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_lm_without_matplotlib_says_how_to_get_the_picture(tmp_path, monkeypatch):
    train_lm = load_train_lm()
    write_metrics(tmp_path / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    line = train_lm.plot_losses(str(tmp_path), "a title")
    assert line == ('no loss_curves.png: matplotlib is not installed (pip install matplotlib, or pip install -e ".[plot]"); '
                    f"the metrics are in {tmp_path / 'metrics.jsonl'}")
    assert not (tmp_path / "loss_curves.png").exists()


def test_train_lm_resumed_run_keeps_the_metrics_before_its_start(tmp_path):
    """A run resumed at step 4 keeps steps 1-3 of metrics.jsonl and rewrites the rest."""
    train_lm = load_train_lm()
    write_metrics(tmp_path / "metrics.jsonl")
    log = train_lm.MetricsFile(str(tmp_path), start=4)
    log.write({"step": 4, "loss": 1.0})
    log.close()
    assert [r["step"] for r in train_lm.read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]
    train_lm.MetricsFile(str(tmp_path), start=1).close()  # a fresh run in the same directory starts the file anew
    assert (tmp_path / "metrics.jsonl").read_text() == ""


@pytest.mark.slow
def test_train_lm_restart_continues_the_metrics_of_its_run(tmp_path):
    """Without --run-dir the job writes runs/<date>-<time> where it is started; a run resumed
    from its checkpoints writes into the same directory, keeping the steps before the one it
    resumes from and redoing the rest."""
    def train_lm(steps):
        cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", str(steps), "--d-model", "32",
               "--layers", "2", "--heads", "2", "--seq-len", "32", "--global-batch", "4", "--log-every", "2",
               "--save-every", "2", "--progress", "plain", "--sample-tokens", "0", "--ckpt-dir", "ckpt"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        where = re.search(r"^metrics: (runs/\d{8}-\d{6}(?:-\d+)?)/metrics\.jsonl \(a JSON line per step\)$",
                          proc.stdout, re.M)
        assert where, proc.stdout[-3000:]
        return where.group(1), [json.loads(line) for line in (tmp_path / where.group(1) / "metrics.jsonl").read_text().splitlines()]

    run_dir, first = train_lm(3)  # checkpoints at steps 2 and 3
    assert [r["step"] for r in first] == [1, 2, 3]
    for name in os.listdir(tmp_path / "ckpt" / "step-000003"):  # as if it died before step 3's checkpoint
        os.remove(tmp_path / "ckpt" / "step-000003" / name)
    os.rmdir(tmp_path / "ckpt" / "step-000003")
    again, resumed = train_lm(4)  # from step 2: redoes step 3, then step 4
    assert again == run_dir and os.listdir(tmp_path / "runs") == [os.path.basename(run_dir)]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:2] == first[:2] and resumed[2]["loss"] == first[2]["loss"]  # bitwise: one process both times
    assert [r["step"] for r in resumed if r["val_loss"] is not None] == [2, 4]


def readme_section(title: str) -> str:
    """The README's section under ``## title``, up to the next ``## `` heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_readme_two_commands_are_two_and_the_first_draws_the_loss_curve():
    blocks = re.findall(r"^```bash\n(.*?)^```$", readme_section("Two commands"), re.M | re.S)
    assert len(blocks) == 2, blocks  # exactly the two commands the heading promises
    main_job, tests = (b.strip() for b in blocks)
    assert "torchrun --nproc-per-node 2 examples/train_lm.py" in main_job and "pytest" in tests
    # the main job draws loss_curves.png only with matplotlib: its install takes the plot extra
    installs = re.findall(r'pip install -e "?\.\[([a-z,]+)\]"?', main_job)
    assert installs and "plot" in installs[0].split(","), main_job
    extra = re.search(r"^plot = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert extra and '"matplotlib"' in extra.group(1)


def test_train_lm_draws_the_loss_curves_again_from_a_metrics_file(tmp_path):
    """``python examples/train_lm.py --plot runs/<dir>/metrics.jsonl``, as the README says."""
    assert "python examples/train_lm.py --plot runs/<date>-<time>/metrics.jsonl" in readme_section("A run's loss curve")
    write_metrics(tmp_path / "metrics.jsonl")
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--plot", str(tmp_path / "metrics.jsonl")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout == f"loss curves: {tmp_path / 'loss_curves.png'}\n"
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["loss_curves.png", "metrics.jsonl"]  # no training, no run directory
    missing = subprocess.run(cmd[:-1] + [str(tmp_path / "none.jsonl")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and f"--plot {tmp_path / 'none.jsonl'}: no such file" in missing.stderr
