"""The rank context built inside real processes by torchrun runs the simulator's code unchanged."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from phases import launched

from fsdp_course import RankContext, run_ranks

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from torchrun_hello import hello  # noqa: E402


def phase(out: Path) -> None:  # in each process of the "pair" launch (tests/phases.py)
    ctx = RankContext.from_env(timeout=30)
    (out / f"rank{ctx.rank}.json").write_text(json.dumps({"world": ctx.world_size, "result": hello(ctx),
                                                          "ledger": len(ctx.ledger)}))
    ctx.close()


def test_same_function_under_torchrun_and_in_threads(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = launched(tmp_path_factory, "hello")
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    simulated = run_ranks(hello, 2)
    for rank in range(2):
        assert found[rank] == {"world": 2, "result": simulated[rank], "ledger": 3}


def test_without_a_launcher_the_error_says_how_to_launch() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(HERE / "torchrun_hello.py")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode != 0
    assert "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in proc.stderr
    assert "torchrun --nproc-per-node" in proc.stderr
