"""Test-session settings: one intra-op thread per process, nbval's kernels on Unix sockets, the Chinese notebooks
left to tests/test_translations.py.

At the repository root so that it applies to every pytest run, also `pytest --nbval lessons solutions` alone
(the portability pass of `make test`), not only to runs that collect tests/.

Rank threads share torch's intra-op thread pool; with two pytest workers on two cores, extra
intra-op threads only fight each other (a one-process reference run went from 0.07 s to 2.6 s).

nbval starts each notebook's kernel on five TCP ports that jupyter_client picks by binding port 0 and
letting go; the Gloo groups of the other worker's notebook take ephemeral ports all the time, and once
took one of them first (CI: "zmq.error.ZMQError: Address already in use", "Kernel died before replying
to kernel_info"). Kernels started here use `ipc` sockets instead (fsdp_course.runtime.ports.kernel_transport).
"""

import os
import tempfile
from pathlib import Path

import nbval.kernel
import torch
from jupyter_client.manager import KernelManager

from fsdp_course.runtime.launch import LAUNCH_LOG, count_launches
from fsdp_course.runtime.ports import kernel_transport, remove_kernel_dir

torch.set_num_threads(1)


class _SocketFileKernelManager(KernelManager):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**{**kernel_transport(), **kwargs})


nbval.kernel.KernelManager = _SocketFileKernelManager  # read by nbval.kernel.start_new_kernel at each start

# The Chinese notebooks run the English notebooks' code cells and carry their outputs (docs/TRANSLATING.md):
# nbval checks them once, on the English notebooks, and tests/test_translations.py checks that they are the same.
collect_ignore_glob = ["lessons/zh/*", "exercises/zh/*"]


def pytest_configure(config: object) -> None:
    # every torchrun launch of this run (tests, the checkers they call, notebooks' kernels) appends a line to one
    # file; set before xdist starts its workers, which inherit it
    if not hasattr(config, "workerinput") and LAUNCH_LOG not in os.environ:
        fd, path = tempfile.mkstemp(prefix="fsdp_course_launches_", suffix=".tsv")
        os.close(fd)
        os.environ[LAUNCH_LOG] = path
        config._fsdp_course_launch_log = path  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: object) -> None:
    path = getattr(config, "_fsdp_course_launch_log", None)
    if path is None:
        return
    found = count_launches(path)
    tr = terminalreporter
    tr.write_sep("-", f"torchrun launches: {len(found['process'])} by the tests and their checkers, "  # type: ignore
                 f"{len(found['notebook'])} by notebooks")
    for place in ("process", "notebook"):
        for job, who in found[place].items():
            tr.write_line(f"  {place:<8} {job:>8}  {who}")  # type: ignore[attr-defined]
    Path(path).unlink(missing_ok=True)


def pytest_unconfigure(config: object) -> None:
    remove_kernel_dir()  # the kernels' socket directory: xdist's workers skip atexit
