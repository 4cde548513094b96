"""Programs the lessons start as real processes, one module each, and `run`, how a lesson starts one.

A lesson shows the lines that matter (`show`) and runs the file (`python -m fsdp_course.examples.NAME`); the
tests run the same file."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import import_module

__all__ = ["run", "show"]

PROGRAMS = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def _module(name: str) -> str:
    if name not in PROGRAMS:
        raise ValueError(f"no program {name!r} in fsdp_course.examples: there are {', '.join(PROGRAMS)}")
    return f"fsdp_course.examples.{name}"


def run(name: str, *args: str, workdir: str | os.PathLike, launcher: Sequence[str] = (),
        env: Mapping[str, str] | None = None, drop: Sequence[str] = (), timeout: float = 180.0
        ) -> subprocess.CompletedProcess:
    """Run `python [LAUNCHER...] -m fsdp_course.examples.NAME ARGS...` with this kernel's interpreter (so the same
    packages) and wait for it, capturing its output as text. The child gets one intra-op thread and its temporary
    files in `workdir`; `env` is added to this process's environment and the names in `drop` are removed from it.
    `launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")` runs it under torchrun."""
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update({"OMP_NUM_THREADS": "1", "TMPDIR": os.fspath(workdir), **(env or {})})
    cmd = [sys.executable, *launcher, "-m", _module(name), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=environ, timeout=timeout)


def show(name: str, function: str = "main") -> None:
    """Print the source of one function of a program: the lines a lesson discusses, read from the file it runs."""
    from fsdp_course.classroom.notebooks import show_source

    show_source(getattr(import_module(_module(name)), function))
