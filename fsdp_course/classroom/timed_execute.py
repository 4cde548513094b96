"""Run a notebook the way `fsdp-course grade` does: nbgrader's Execute, with a time limit for the whole notebook.

Design notes: docs/CLASSROOM.md, "Grading a class", `timed_execute.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Float, Integer

from fsdp_course.runtime.ports import kernel_transport

__all__ = ["NOT_RUN", "TimedExecute", "error_output", "kernel_manager", "kill_tree", "shutdown"]

NOT_RUN = "NotRun"  # ename of the error output put on cells that never ran


class _CurrentPython(KernelSpecManager):
    """Kernels run this interpreter (the course's environment), whatever the notebook's metadata says."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="fsdp-course grader", language="python", name=kernel_name)


class TimedExecute(Execute):
    """nbgrader's Execute with one time limit for the whole notebook and a cap on each cell's output."""

    notebook_timeout = Float(120.0, help="seconds for all cells together").tag(config=True)
    max_output_chars = Integer(20_000, help="output kept per cell; the rest is dropped").tag(config=True)

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.timeout_func = self._remaining  # nbclient asks it before each cell
        self.deadline: float | None = None  # set when the first code cell starts
        self.executed: set[int] = set()
        self.stopped = ""  # why the remaining cells were not run
        self.kernel_env: dict[str, str] | None = None  # the kernel's environment (default: this process's)
        self._chars: dict[int, int] = {}

    def _remaining(self, cell: NotebookNode) -> int:
        left = (self.deadline or time.monotonic()) - time.monotonic()
        return max(1, int(left + 0.999))  # nbclient reads 0 as "no limit"

    def start_new_kernel(self, **kwargs: Any) -> None:  # what preprocess() calls (not async_start_new_kernel)
        if self.kernel_env is not None:
            kwargs.setdefault("env", self.kernel_env)
        super().start_new_kernel(**kwargs)

    def preprocess_cell(self, cell: NotebookNode, resources: Any, index: int) -> tuple[NotebookNode, Any]:
        if cell.cell_type != "code":
            return cell, resources
        if self.deadline is None:
            self.deadline = time.monotonic() + self.notebook_timeout
        if not self.stopped and time.monotonic() >= self.deadline:
            self.stopped = f"time limit of {self.notebook_timeout:g} s reached"
        if self.stopped:
            return cell, resources
        try:
            cell, resources = super().preprocess_cell(cell, resources, index)
        except Exception as exc:  # noqa: BLE001  (a dead kernel, a lost reply: the notebook's doing, reported)
            name = type(exc).__name__
            self.stopped = "the kernel died" if name == "DeadKernelError" else f"{name}: {exc}"
            if not any(o.output_type == "error" for o in cell.outputs):
                cell.outputs.append(error_output(name, self.stopped))
            return cell, resources
        self.executed.add(index)
        if any(o.output_type == "error" and o.ename == "CellTimeoutError" for o in cell.outputs):
            self.stopped = f"time limit of {self.notebook_timeout:g} s reached"
        return cell, resources

    def output(self, outs: list, msg: dict, display_id: str | None, cell_index: int) -> NotebookNode | None:
        if msg["msg_type"] in ("stream", "display_data", "execute_result"):  # errors always pass
            content = msg["content"]
            size = len(content["text"]) if "text" in content else len(json.dumps(content.get("data", {})))
            used = self._chars.get(cell_index, 0)
            self._chars[cell_index] = used + size
            if used + size > self.max_output_chars:
                if used <= self.max_output_chars:
                    outs.append(nbformat.v4.new_output(
                        "stream", name="stdout",
                        text=f"\n... output cut by the grader after {self.max_output_chars} characters ...\n"))
                return None
        return super().output(outs, msg, display_id, cell_index)


def kernel_manager(folder: Path | None = None) -> AsyncKernelManager:
    """A kernel manager for a fresh kernel of this interpreter (the course's environment); with `folder`, the
    kernel's connection file and sockets go there (not in Jupyter's runtime folder, shared by all kernels)."""
    if folder is None or os.name == "nt" or len(str(folder / "ipc-00000")) > 100:  # a Unix socket path: < 108 B
        return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_CurrentPython(), **kernel_transport())
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_CurrentPython(), transport="ipc",
                              ip=str(folder / "ipc"), connection_file=str(folder / "kernel.json"))


def error_output(ename: str, evalue: str) -> NotebookNode:
    return nbformat.v4.new_output("error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def shutdown(km: AsyncKernelManager) -> None:
    try:
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
    except Exception:  # noqa: BLE001, S110  (already gone)
        pass


# -- ending a kernel and all it started ------------------------------------------------------------------
def _parent_pids() -> dict[int, int]:
    """{pid: parent pid} of every process: Linux's /proc/PID/stat, else `ps` (macOS)."""
    if not Path("/proc/self/stat").exists():
        try:
            ps = subprocess.Popen(["ps", "-A", "-o", "pid=,ppid="], stdout=subprocess.PIPE, text=True)
            out, _ = ps.communicate()
        except OSError:
            return {}
        parents = {int(pid): int(ppid) for pid, ppid in (line.split() for line in out.splitlines())}
        parents.pop(ps.pid, None)  # ps itself: a child of this process, gone already
        return parents
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # b"pid (command) state ppid ...": the command may hold spaces, parentheses and any bytes
            parents[int(stat.parent.name)] = int(stat.read_bytes().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass  # it ended meanwhile
    return parents


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL every process below `root` (and `root`), found by parent pid, so also those that left its session
    or process group. Each is stopped first (it can then neither fork nor end and hand its children to
    another parent), and the look-up is repeated until it finds no new process."""
    stopped = {root} if include_root else set()
    if include_root:
        _signal(root, signal.SIGSTOP)
    while True:
        children: dict[int, list[int]] = {}
        for pid, ppid in _parent_pids().items():
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), [root]
        while todo:
            found = [c for c in children.get(todo.pop(), []) if c not in tree]
            tree.update(found)
            todo += found
        if not tree - stopped:
            break
        for pid in tree - stopped:
            _signal(pid, signal.SIGSTOP)
        stopped |= tree
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
