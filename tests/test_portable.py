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


def test_make_test_runs_the_notebooks_under_it() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "--notebook-numerics=portable" in recipe and "lessons solutions" in recipe


def test_nbvals_kernels_start_under_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # what --notebook-numerics=portable sets (conftest.py): the kernel process itself is started with it
    import nbval.kernel

    import conftest

    monkeypatch.setitem(conftest._KERNEL_ENV, "ATEN_CPU_CAPABILITY", "default")
    kernel = nbval.kernel.RunningKernel("python3", cwd=str(ROOT))
    try:
        msg_id = kernel.execute_cell_input("import torch; print(torch.backends.cpu.get_cpu_capability())",
                                           allow_stdin=False)
        printed = ""
        while True:
            msg = kernel.get_message(stream="iopub", timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                printed += msg["content"]["text"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        kernel.stop()
    assert printed.strip() == "DEFAULT"
