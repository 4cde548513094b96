"""Test-session settings: one intra-op thread per process, nbval's kernels on Unix sockets (and, with
`--notebook-numerics=portable`, under another machine's numerics), the Chinese notebooks left to
tests/test_translations.py, and the count of torchrun launches.

At the repository root so that it applies to every pytest run, also `pytest --nbval lessons solutions` alone,
not only to runs that collect tests/.

`make test` is one pytest run: the unit tests under this CPU's kernels and nbval's notebook kernels under the
environment of tests/portable.py, checked once before anything runs (both in one run, so the workers stay busy to
the end instead of waiting for the slowest file of each of two runs).

Rank threads share torch's intra-op thread pool; with two pytest workers on two cores, extra
intra-op threads only fight each other (a one-process reference run went from 0.07 s to 2.6 s).

nbval starts each notebook's kernel on five TCP ports that jupyter_client picks by binding port 0 and
letting go; the Gloo groups of the other worker's notebook take ephemeral ports all the time, and once
took one of them first (CI: "zmq.error.ZMQError: Address already in use", "Kernel died before replying
to kernel_info"). Kernels started here use `ipc` sockets instead (fsdp_course.runtime.ports.kernel_transport).
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbval.kernel
import pytest
import torch
from jupyter_client.manager import KernelManager

from fsdp_course.runtime.launch import LAUNCH_LOG, count_launches
from fsdp_course.runtime.ports import kernel_transport, remove_kernel_dir

sys.path.insert(0, str(Path(__file__).parent / "tests"))  # the suite's helpers: phases, portable, launch
from phases import SHARED  # noqa: E402

torch.set_num_threads(1)


_KERNEL_ENV: dict[str, str] = {}  # added to the environment of nbval's kernels (--notebook-numerics=portable)


class _SocketFileKernelManager(KernelManager):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**{**kernel_transport(), **kwargs})

    def start_kernel(self, **kwargs: object) -> None:
        if _KERNEL_ENV:
            kwargs["env"] = {**os.environ, **_KERNEL_ENV, **kwargs.get("env", {})}  # type: ignore[dict-item]
        super().start_kernel(**kwargs)


nbval.kernel.KernelManager = _SocketFileKernelManager  # read by nbval.kernel.start_new_kernel at each start

# The Chinese notebooks run the English notebooks' code cells and carry their outputs (docs/TRANSLATING.md):
# nbval checks them once, on the English notebooks, and tests/test_translations.py checks that they are the same.
collect_ignore_glob = ["lessons/zh/*", "exercises/zh/*"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--notebook-numerics", choices=("native", "portable"), default="native",
                     help="run nbval's notebook kernels under this CPU's kernels (native) or under another machine's "
                          "numerics (portable: tests/portable.py, checked first)")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist's controller: hand out the files in FIRST's order
        config.option.loadscopereorder = False  # (--no-loadscope-reorder)
    if config.getoption("--notebook-numerics") == "portable":
        import portable

        env = portable.portable_env()
        if not hasattr(config, "workerinput"):  # once, before the workers start
            problems = portable.check(env)
            if problems:
                pytest.exit(portable.refusal(env, problems), returncode=3)
        _KERNEL_ENV.update(env)
    # every torchrun launch of this run (tests, the checkers they call, notebooks' kernels) appends a line to one
    # file; set before xdist starts its workers, which inherit it
    if not hasattr(config, "workerinput") and SHARED not in os.environ:
        os.environ[SHARED] = tempfile.mkdtemp(prefix="fsdp_course_phases_")  # the launches' folder: tests/phases.py
    if not hasattr(config, "workerinput") and LAUNCH_LOG not in os.environ:
        fd, path = tempfile.mkstemp(prefix="fsdp_course_launches_", suffix=".tsv")
        os.close(fd)
        os.environ[LAUNCH_LOG] = path
        config._fsdp_course_launch_log = path  # type: ignore[attr-defined]


def pytest_sessionstart(session: pytest.Session) -> None:
    # the whole suite (tests/ among the paths, or no paths): its torchrun launches start now, in the background of
    # the controller, and the tests read their phases when they get there (tests/phases.py)
    config = session.config
    if hasattr(config, "workerinput"):
        return
    args = [Path(a).resolve() for a in config.args] or [Path(__file__).parent / "tests"]
    if Path(__file__).parent.joinpath("tests").resolve() in args:
        import phases

        config._fsdp_course_phases = phases.start_all(Path(os.environ[phases.SHARED]))  # type: ignore[attr-defined]


# xdist hands out one file at a time, in this order, to whichever worker runs short. The longest files go first
# (seconds in a full run on 2 cores), so that the run does not end with one worker finishing lesson 11 while the other
# is idle; the files that read the torchrun launches come after them, when the launches have ended (tests/phases.py).
# xdist would otherwise sort the files by their number of tests, which put the longest ones last. Lesson 19 stays
# late: its three-process DCP job aborted now and then (1 run in ~10 on a loaded machine) in a rank's interpreter
# shutdown ("terminate called without an active exception"); its ranks now leave with os._exit, and late is cheap.
FIRST = ("tests/test_grading.py",                     # 91 s, most of it waiting for graded notebooks
         "lessons/11_real_fsdp.ipynb",                # 71 s: five torchrun jobs
         "tests/test_browser.py",                     # 70 s: JupyterLab and Chromium
         "tests/test_site.py",                        # 60 s: the website built, then every page in Chromium
         "lessons/08_transformer.ipynb",              # 61 s: six trainings
         "lessons/10_distributed_pitfalls.ipynb",     # 43 s
         "tests/test_exercises.py",                   # 40 s: every exercise, unsolved, in one kernel
         "lessons/17_finetune.ipynb",                 # 36 s
         "tests/test_grading_nbgrader.py",            # 34 s: nbgrader's own course
         "lessons/16_hsdp.ipynb", "lessons/12_mixed_precision.ipynb")  # 32 s, 28 s


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    rank = {name: i for i, name in enumerate(FIRST)}

    def key(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(root).as_posix()
        except ValueError:
            return len(FIRST)
        return rank.get(name, len(FIRST))

    items.sort(key=key)  # stable: every other file keeps its place, and the tests of each file their order


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
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


def pytest_unconfigure(config: pytest.Config) -> None:
    remove_kernel_dir()  # the kernels' socket directory: xdist's workers skip atexit
    if getattr(config, "_fsdp_course_phases", None) is not None:
        import phases

        phases.stop_all()  # a run stopped early (-x, Ctrl-C) leaves no torchrun behind
    if not hasattr(config, "workerinput") and os.environ.get(SHARED):
        shutil.rmtree(os.environ.pop(SHARED), ignore_errors=True)
