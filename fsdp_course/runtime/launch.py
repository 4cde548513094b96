"""Start a script under real `torchrun` on this machine: one launcher for the checkers and the test suite.

Each launch is N processes that import torch (about 20 CPU-seconds of start-up), so callers run several things per
launch where they can. Where `FSDP_COURSE_LAUNCH_LOG` names a file, every launch appends one line to it (the test
suite prints the count).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from fsdp_course.runtime.ports import free_port

__all__ = ["LAUNCH_LOG", "TORCHRUN", "count_launches", "record_launch", "start_torchrun", "torchrun_command",
           "torchrun_flags"]

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LAUNCH_LOG = "FSDP_COURSE_LAUNCH_LOG"


def torchrun_flags(nproc: int, *, port: int | None = None, nodes: tuple[int, int, int] | None = None) -> list[str]:
    """torchrun's options for `nproc` processes on 127.0.0.1: one node meeting at `port` (a free one if None), or
    with `nodes=(k, n, port)` node k of n "nodes" meeting there through the c10d rendezvous (which assigns ranks)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    if nodes is None:
        return ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
                str(port or free_port())]
    k, n, port = nodes
    if not 0 <= k < n:
        raise ValueError(f"node {k} is not one of {n} nodes")
    return ["--nproc-per-node", str(nproc), "--nnodes", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", f"fsdp_course{port}", "--local-addr", "127.0.0.1"]


def torchrun_command(script: str | os.PathLike, nproc: int, *args: str, nodes: tuple[int, int, int] | None = None,
                     module: bool = False) -> list[str]:
    """`torchrun [torchrun_flags] script *args` with no restarts; `module=True` runs `python -m script`."""
    target = ["-m", str(script)] if module else [str(script)]
    return [TORCHRUN, *torchrun_flags(nproc, nodes=nodes), "--max-restarts", "0", *target, *args]


def start_torchrun(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                   what: str = "") -> subprocess.Popen:
    """Start `cmd` (from `torchrun_command`) with one intra-op thread per process, its output captured as text."""
    record_launch(cmd, what)
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def record_launch(cmd: Sequence[str], what: str) -> None:
    """Append one line for this torchrun command to the launch log, where `FSDP_COURSE_LAUNCH_LOG` names one."""
    log = os.environ.get(LAUNCH_LOG)
    if not log:
        return
    cmd = list(cmd)

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1] if name in cmd else "?"

    job = flag("--rdzv-id") if "--rdzv-id" in cmd else flag("--master-port")  # the agents of one world share it
    caller = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] or "-"
    place = "notebook" if _in_kernel() else "process"
    with open(log, "a") as f:
        f.write(f"{place}\t{job}\t{flag('--nproc-per-node')}\t{caller}\t{what or '-'}\n")


def _in_kernel() -> bool:
    app = sys.modules.get("ipykernel.kernelapp")  # imported by nbval in pytest too: only a started kernel counts
    return app is not None and app.IPKernelApp.initialized()


def count_launches(log: str | os.PathLike) -> dict[str, dict[str, str]]:
    """The worlds a log recorded (the agents of a multi-node world count once), by place ("process": the tests and
    the checkers they call; "notebook": a kernel), each job's caller and what it ran."""
    found: dict[str, dict[str, str]] = {"process": {}, "notebook": {}}
    path = Path(log)
    if path.exists():
        for line in path.read_text().splitlines():
            place, job, _nproc, caller, what = line.split("\t")
            found.setdefault(place, {}).setdefault(job, f"{caller} {what}")
    return found
