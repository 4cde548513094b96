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

__all__ = ["finish", "run", "show", "start", "torchrun"]

PROGRAMS = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))


def _module(name: str) -> str:
    if name.startswith("fsdp_course."):  # another of the course's programs, e.g. fsdp_course.train
        return name
    if name not in PROGRAMS:
        raise ValueError(f"no program {name!r} in fsdp_course.examples: there are {', '.join(PROGRAMS)}")
    return f"fsdp_course.examples.{name}"


def torchrun(nproc: int, port: int | None = None) -> tuple[str, ...]:
    """The launcher for `start`/`run`: `torchrun --nproc-per-node NPROC --master-addr 127.0.0.1 --master-port PORT`
    (`python -m torch.distributed.run`), on a free port unless `port` is given."""
    from fsdp_course.runtime.launch import torchrun_flags

    return ("-m", "torch.distributed.run", *torchrun_flags(nproc, port=port))


def start(name: str, *args: str, workdir: str | os.PathLike, launcher: Sequence[str] = (),
          env: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> subprocess.Popen:
    """Start `python [LAUNCHER...] -m fsdp_course.examples.NAME ARGS...` (NAME may also be a module of the course,
    e.g. "fsdp_course.train") with this kernel's interpreter, so the same packages, and return at once: several
    jobs can run side by side. The child gets one intra-op thread and its temporary files in `workdir`; `env` is
    added to this process's environment and the names in `drop` are removed from it."""
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update({"OMP_NUM_THREADS": "1", "TMPDIR": os.fspath(workdir), **(env or {})})
    cmd = [sys.executable, *launcher, "-m", _module(name), *args]
    if launcher:
        from fsdp_course.runtime.launch import record_launch

        record_launch(cmd, name)  # the test suite counts every torchrun world
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)


def _wait(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # torchrun stops its processes when it is killed
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(name: str, *args: str, workdir: str | os.PathLike, launcher: Sequence[str] = (),
        env: Mapping[str, str] | None = None, drop: Sequence[str] = (), timeout: float = 180.0
        ) -> subprocess.CompletedProcess:
    """`start` the program and wait for it (killed after `timeout` s), its output captured as text; the exit code
    is the caller's to judge. `launcher=torchrun(2)` runs it under torchrun."""
    return _wait(start(name, *args, workdir=workdir, launcher=launcher, env=env, drop=drop), timeout)


def finish(job: subprocess.Popen | subprocess.CompletedProcess, what: str, timeout: float = 180.0
           ) -> subprocess.CompletedProcess:
    """Wait for a started job (or take a finished one), print `WHAT: exit code N`, and fail with the end of its
    error output when N is not 0: the job was expected to succeed."""
    proc = job if isinstance(job, subprocess.CompletedProcess) else _wait(job, timeout)
    print(f"{what}: exit code {proc.returncode}")
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit code {proc.returncode}); the end of its output:\n"
                           f"{proc.stderr[-3000:]}")
    return proc


def show(name: str, function: str = "main") -> None:
    """Print the source of one function of a program: the lines a lesson discusses, read from the file it runs."""
    from fsdp_course.classroom.notebooks import show_source

    show_source(getattr(import_module(_module(name)), function))
