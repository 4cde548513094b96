"""The portability pass imitates a real other machine: every CPU-dispatching library is told the same story."""

import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import portable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_portable_environment_is_consistent_on_this_cpu() -> None:
    # bf16 attention and a bf16 linear run (on a CPU with AMX they fail when only ATen is told), ATen reports its
    # portable kernels and numpy dispatches to no AVX-512 loop
    assert portable.check(portable.portable_env()) == []


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not portable._cpu_has("avx2"),
                    reason="needs an x86 CPU with AVX2 to name a capability ATen can be told to use")
def test_the_check_names_a_library_told_another_story() -> None:
    env = {**portable.portable_env(), "ATEN_CPU_CAPABILITY": "avx2"}
    assert portable.check(env) == ["ATen runs its AVX2 kernels, not the portable ones"]


def test_make_test_portable_runs_through_the_check() -> None:
    recipe = (ROOT / "Makefile").read_text().split("\ntest-portable:", 1)[1].split("\n\n", 1)[0]
    assert "tests/portable.py $(BIN)/python -m pytest" in recipe
