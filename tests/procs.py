"""Running a command as a user would, in the tests: bounded in time, and nothing left behind."""

import os
import signal
import subprocess


def run_in_session(cmd: list[str], *, cwd, env: dict[str, str], timeout: float = 120) -> tuple[int, str, str]:
    """``cmd``'s return code, stdout and stderr. It runs in a session of its own, so that a
    hang is ended with every process it started (torchrun's workers, not only torchrun)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left (nothing, after a clean exit)
        except ProcessLookupError:
            pass
        proc.wait()
    return proc.returncode, out, err
