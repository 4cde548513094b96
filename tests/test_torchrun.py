"""The rank context built inside real processes by torchrun runs the simulator's code unchanged."""

import os
import re
import subprocess
import sys
from pathlib import Path

from fsdp_course import run_ranks
from fsdp_course.runtime.ports import free_port

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from torchrun_hello import hello  # noqa: E402


def test_same_function_under_torchrun_and_in_threads() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
         str(free_port()), str(HERE / "torchrun_hello.py")],
        capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(re.findall(r"RESULT rank=(\d) world=2 (\[.*?\]) ledger=3", proc.stdout))
    assert sorted(found) == ["0", "1"], proc.stdout
    simulated = run_ranks(hello, 2)
    for rank in range(2):
        assert eval(found[str(rank)]) == simulated[rank]  # noqa: S307  (our own printed list)


def test_without_a_launcher_the_error_says_how_to_launch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(HERE / "torchrun_hello.py")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode != 0
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in proc.stderr
    assert "torchrun --nproc-per-node" in proc.stderr
