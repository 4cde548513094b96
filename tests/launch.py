"""Start a test's worker script under real torchrun (one launch, N processes on this machine) and fail the test
with the end of its output when it fails or times out. Starting torchrun and importing torch costs most of a launch
(about 20 CPU-seconds), so the tests that use it share one launch per file where they can."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_course.runtime.ports import free_port

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def torchrun(script: Path, nproc: int, *args: str, timeout: float = 600, what: str = "torchrun"
             ) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc script *args` (one thread per process, warnings off); returns the
    finished process, whose stdout the caller may read."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [TORCHRUN, "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--max-restarts", "0", str(script), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{what}: timed out after {timeout:.0f} s:\n{str(err.stdout)[-2000:]}\n{str(err.stderr)[-3000:]}")
    assert proc.returncode == 0, f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc
