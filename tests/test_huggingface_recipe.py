"""docs/huggingface.md: its script, run as the page tells a user to run it.

The page's two commands run in a fresh directory: ``torchrun --nproc-per-node 2`` trains
4 steps and saves a sharded checkpoint; plain ``python`` (a world of one) resumes it, trains
to step 8, exports with ``save_pretrained``, loads the export with transformers'
``from_pretrained`` and generates. A third run, straight through at world 1, gives the
losses the resumed run must reproduce. The page shows the script verbatim.
"""

import math
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from procs import run_in_session
from shardfn.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "huggingface.py"
DOC = ROOT / "docs" / "huggingface.md"
STEP = re.compile(r"^step (\d+) loss ([0-9.]+)$", re.M)


def doc_command(launcher: str) -> list[str]:
    """The page's command line that starts with ``launcher``, as a list of arguments."""
    lines = [line.strip() for line in DOC.read_text(encoding="utf-8").splitlines()
             if line.strip().startswith(f"{launcher} ") and "examples/huggingface.py" in line]
    assert lines, f"docs/huggingface.md has no command starting with {launcher!r}"
    return shlex.split(lines[0])


def run(args: list[str], cwd: Path) -> str:
    """One command as a user types it (``torchrun``, ``python``), here; its stdout. Fails on error or hang."""
    if args[0] == "torchrun":  # the same launcher, on a free port (tests run side by side)
        args = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", "--master-port",
                str(free_port()), *args[1:]]
    elif args[0] == "python":
        args = [sys.executable, *args[1:]]
    args = [str(SCRIPT) if a == "examples/huggingface.py" else a for a in args]
    code, out, err = run_in_session(args, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert code == 0, f"{shlex.join(args)}\n{out[-3000:]}\n{err[-3000:]}"
    return out


def losses(out: str) -> dict[int, float]:
    return {int(n): float(v) for n, v in STEP.findall(out)}


def test_the_page_shows_the_script_verbatim():
    text = DOC.read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    assert SCRIPT.read_text(encoding="utf-8") in blocks, "docs/huggingface.md must show examples/huggingface.py as it is"
    for fact in ("`.logits`", "`.loss`", "`labels=`", "world of one", "`mesh.rank`", "`mesh.size`"):
        assert fact in text, fact


@pytest.mark.slow
def test_trained_at_2_ranks_resumed_at_1_exported_and_generated(tmp_path):
    train, resume = doc_command("torchrun"), doc_command("python")
    assert train[:3] == ["torchrun", "--nproc-per-node", "2"] and "--export" in resume

    first = run(train, tmp_path)
    steps = int(train[train.index("--steps") + 1])
    ckpt = train[train.index("--ckpt-dir") + 1]
    assert sorted(losses(first)) == list(range(1, steps + 1)), first
    assert f"saved {os.path.join(ckpt, f'step-{steps:06d}')}" in first

    second = run(resume, tmp_path)
    assert f"resumed from {os.path.join(ckpt, f'step-{steps:06d}')} at step {steps} (saved by 2 ranks, now 1)" in second
    end = int(resume[resume.index("--steps") + 1])
    assert sorted(losses(second)) == list(range(steps + 1, end + 1)), second

    # the same steps straight through, at world 1: the losses the two runs must have had
    straight = run(["python", "examples/huggingface.py", "--steps", str(end), "--ckpt-dir", "runs/straight"], tmp_path)
    expected = losses(straight)
    for n, loss in {**losses(first), **losses(second)}.items():
        # 2 ranks sum the gradients in another order: equal to float rounding (printed to 6 decimals)
        assert math.isclose(loss, expected[n], rel_tol=1e-5, abs_tol=2e-6), (n, loss, expected[n])
    assert expected[end] < expected[1] - 0.5, expected

    export = tmp_path / resume[resume.index("--export") + 1]
    assert sorted(os.listdir(export)) == ["config.json", "model.safetensors"]
    generated = re.search(r"^generated (\d+) tokens: b['\"].+['\"]$", second, re.M)
    assert generated and int(generated.group(1)) == 24, second
    # all three wrote under runs/ only, which .gitignore ignores: the checkout stays clean
    assert sorted(os.listdir(tmp_path)) == ["runs"]


def test_the_page_writes_under_runs_which_git_ignores():
    """What the commands write goes under runs/, the folder .gitignore ignores (with the
    main job's run directories), and the page says where."""
    written = [cmd[cmd.index(opt) + 1] for cmd in (doc_command("torchrun"), doc_command("python"))
               for opt in ("--ckpt-dir", "--export") if opt in cmd]
    assert written and all(path.startswith("runs/") for path in written), written
    assert "/runs/" in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
    assert SCRIPT.read_text(encoding="utf-8").count('default="runs/hf-ckpt"') == 1  # --ckpt-dir left out, too
