"""Another machine's numerics on this one: the environment of `make test`'s portability pass, checked before use.

    pytest --notebook-numerics=portable ...   # nbval's kernels under it, checked first (conftest.py; make test)
    python tests/portable.py                  # print it as NAME=VALUE words, and whether every library believes it

Every library that picks its kernels by CPU is told the same story, an AVX2 machine without AVX-512 or AMX: ATen
runs its portable kernels, oneDNN stops at AVX2, MKL takes its CPU-independent path, and on x86_64 numpy's own loops
and its OpenBLAS stop at AVX2 too. Telling only some of them breaks: on a CPU with AMX, ATen's portable kernels beside
oneDNN's AMX make bf16 `scaled_dot_product_attention` fail ("pack_vnni2 is only supported when avx512 is supported").
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

# What each library is told (the variables it reads are its own documented switches).
FIXED = {
    "ATEN_CPU_CAPABILITY": "default",  # ATen: the kernels compiled without vector extensions
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (bf16 matmul and attention's packing): no AVX-512, no AMX
    "MKL_CBWR": "COMPATIBLE",  # MKL: the code path that gives the same bits on every x86 CPU
    "OMP_NUM_THREADS": "1",  # one intra-op thread: sums in one order
}

# Run in a fresh interpreter under the environment: what a library would do differently from the story, one line each.
PROBE = r"""
import numpy, torch
import torch.nn.functional as F
problems = []
if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
    problems.append(f"ATen runs its {torch.backends.cpu.get_cpu_capability()} kernels, not the portable ones")
q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
try:  # ATen's kernel and oneDNN's packing must agree on the CPU (they do not when only ATen is told)
    F.scaled_dot_product_attention(q, q, q)
    torch.nn.functional.linear(q, torch.randn(16, 16, dtype=torch.bfloat16))
except RuntimeError as err:
    problems.append(f"bf16 attention fails: {str(err).splitlines()[0]}")
umath = numpy._core._multiarray_umath
if any(umath.__cpu_features__.get(t) for t in umath.__cpu_dispatch__ if t.startswith("AVX512") or t == "X86_V4"):
    problems.append("numpy still dispatches to AVX-512 loops")
print("\n".join(problems))
"""


def _numpy_avx512_features() -> list[str]:
    """numpy's AVX-512 dispatch targets that this CPU would run (the ones NPY_DISABLE_CPU_FEATURES must name)."""
    import numpy

    umath = numpy._core._multiarray_umath
    return [t for t in umath.__cpu_dispatch__ if umath.__cpu_features__.get(t) and (t.startswith("AVX512") or
                                                                                     t == "X86_V4")]


def portable_env() -> dict[str, str]:
    """The variables of the portability pass on this machine (added to the environment, never replacing it)."""
    env = dict(FIXED)
    if platform.machine().lower() in ("x86_64", "amd64"):
        avx512 = _numpy_avx512_features()
        if avx512:
            env["NPY_DISABLE_CPU_FEATURES"] = " ".join(avx512)
        if avx512 or _cpu_has("avx2"):
            env["OPENBLAS_CORETYPE"] = "Haswell"  # OpenBLAS's AVX2 kernels (only named on a CPU that has AVX2)
    return env


def _cpu_has(flag: str) -> bool:
    try:
        return any(line.startswith("flags") and flag in line.split() for line in open("/proc/cpuinfo"))
    except OSError:
        return False


def check(env: dict[str, str]) -> list[str]:
    """What contradicts the story under `env`, one sentence each (empty: consistent), from a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        return [f"the probe failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"]
    return [line for line in proc.stdout.splitlines() if line.strip()]


def refusal(env: dict[str, str], problems: list[str]) -> str:
    """The sentence that stops the run when a library does not believe the story."""
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    return (f"The portability pass cannot imitate another CPU's numerics on this machine under {shown}: "
            + "; ".join(problems) + ". Run `make test-native` instead (this CPU's own kernels), and report this CPU "
            "(lscpu) with this sentence.")


if __name__ == "__main__":  # python tests/portable.py: the environment as NAME=VALUE words, and whether it holds
    found = portable_env()
    print(" ".join(f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in found.items()))
    trouble = check(found)
    print(refusal(found, trouble) if trouble else "consistent: every library believes it")
    raise SystemExit(3 if trouble else 0)
