"""Run a test's worker script under real torchrun (fsdp_course.runtime.launch) and fail the test with the end of its
output when it fails or times out."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fsdp_course.runtime.launch import start_torchrun, torchrun_command


def finish(proc: subprocess.Popen, timeout: float = 150, what: str = "the process") -> tuple[int, str, str]:
    """Wait for a started process; fail the test (with the end of its output) when it outlives `timeout`."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{what}: timed out after {timeout:.0f} s:\n{out[-2000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 600, what: str = "torchrun"
             ) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc script *args` (warnings off) and require success; returns the finished
    process, whose stdout the caller may read."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = torchrun_command(script, nproc, *args)
    rc, out, err = finish(start_torchrun(cmd, env=env, what=what), timeout, what)
    assert rc == 0, f"{what} failed:\n{out[-3000:]}\n{err[-6000:]}"
    return subprocess.CompletedProcess(cmd, rc, out, err)
