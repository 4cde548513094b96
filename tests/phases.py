"""The suite's real multi-process checks as phases of three torchrun launches, shared by every test that needs one.

    torchrun --nproc-per-node N tests/phases.py BASE PHASE...   # what `launched(name)` starts (one world, N ranks)

A phase is a function `phase(out)` of a test module, run on every rank inside one process group (joined once by this
runner; `destroy_process_group` waits for the end of the launch). It writes what its tests assert into `out`
(BASE/PHASE); its stdout goes to `out/stdout_rank{r}.txt`. A phase that raises writes `out/error_rank{r}.txt` and
ends the launch: its tests, and those of the phases after it, fail naming it. Each launch runs once per test session:
the whole suite starts them all in the background at its start (conftest.py), and a test that needs a launch not yet
run runs it itself; the others wait for it under a file lock and read its files.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import pytest

# phase: (module in tests/, function); every phase of a launch runs in the same world, in this order
LAUNCHES: dict[str, tuple[int, int, list[str]]] = {  # name: (nodes, processes per node, phases)
    "pair": (1, 2, ["hello", "torch_claims", "lora", "train_features", "train_torch", "dcp_save",
                    "fully_shard_planted"]),
    "three": (1, 3, ["per_param", "dcp_load"]),
    "four": (2, 2, ["hsdp", "train_ours", "torch_claims_hsdp"]),  # two "nodes" of two processes, c10d rendezvous
}
PHASES = {
    "hello": ("test_torchrun", "phase"),
    "torch_claims": ("test_torch_claims", "phase"),
    "lora": ("test_lora", "in_torchrun"),
    "train_features": ("test_train_features", "in_torchrun"),
    "train_torch": ("test_train", "phase_torch"),
    "dcp_save": ("test_dcp", "phase_save"),
    "fully_shard_planted": ("test_checks_real_fsdp", "phase"),
    "per_param": ("test_per_param", "phase"),
    "dcp_load": ("test_dcp", "phase_load"),
    "hsdp": ("test_hsdp", "in_torchrun"),
    "train_ours": ("test_train", "phase_ours"),
    "torch_claims_hsdp": ("test_torch_claims", "phase_hsdp"),
}
AFTER = {"three": ["pair"]}  # dcp_load reads what dcp_save wrote
TIMEOUT = 600.0


# -- in each torchrun process ------------------------------------------------------------------------------------
def run_phases(base: Path, names: list[str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    seed = torch.initial_seed()  # each phase starts from the generator state of a fresh process
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, destroy = dist.get_rank(), dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # phases leave the world by RankContext.close()
    for name in names:
        out = base / name
        out.mkdir(parents=True, exist_ok=True)
        module, function = PHASES[name]
        torch.manual_seed(seed)
        with open(out / f"stdout_rank{rank}.txt", "w") as stdout, contextlib.redirect_stdout(stdout):
            try:
                getattr(importlib.import_module(module), function)(out)
            except BaseException:  # noqa: BLE001  (SystemExit too: reported, then the launch ends)
                (out / f"error_rank{rank}.txt").write_text(traceback.format_exc())
                stdout.flush()
                os._exit(1)  # the peers fail at their next collective; the tests name this phase
        dist.barrier()
        (out / f"done_rank{rank}").touch()
    dist.destroy_process_group = destroy
    dist.barrier()  # leave together: a rank that exits while a peer still talks can abort that peer
    destroy()


# -- in the test session -----------------------------------------------------------------------------------------
SHARED = "FSDP_COURSE_PHASES_DIR"  # set by conftest.py for the whole run, which then starts every launch early
_RUNNING: list[subprocess.Popen] = []  # the launches this process started, stopped at the end of the session


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the whole session: the xdist workers of one run share it, other runs do not."""
    if os.environ.get(SHARED):
        return Path(os.environ[SHARED])
    base = tmp_path_factory.getbasetemp()
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = base.parent / f"phases-{uid}" if uid else base / "phases"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run_once(name: str, base: Path) -> None:
    """Launch `name` unless this session already did (whoever comes first runs it; the others wait for it)."""
    import fcntl

    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (base / f"{name}.log").exists():
            _launch(name, base)


def start_all(base: Path) -> threading.Thread:
    """Run every launch in order in a background thread, from the start of the session (conftest.py), so that no
    test waits for one it could have had ready; a test that gets there first runs its launch itself."""
    def run() -> None:
        for name in LAUNCHES:
            try:
                _run_once(name, base)
            except BaseException:  # noqa: BLE001  (pytest.fail in a thread: the tests read the log, or launch again)
                pass

    thread = threading.Thread(target=run, name="fsdp_course-launches", daemon=True)
    thread.start()
    return thread


def stop_all() -> None:
    for proc in _RUNNING:
        if proc.poll() is None:
            proc.kill()


def _launch(name: str, base: Path) -> None:
    from launch import finish

    from fsdp_course.runtime.launch import start_torchrun, torchrun_command
    from fsdp_course.runtime.ports import free_port

    nodes, nproc, names = LAUNCHES[name]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    script, args = Path(__file__).resolve(), [str(base), *names]
    if nodes == 1:
        cmds = [torchrun_command(script, nproc, *args)]
    else:
        port = free_port()
        cmds = [torchrun_command(script, nproc, *args, nodes=(k, nodes, port)) for k in range(nodes)]
    procs = [start_torchrun(cmd, env=env, what=f"phases {name}: {' '.join(names)}") for cmd in cmds]
    _RUNNING.extend(procs)
    done = [finish(p, TIMEOUT, f"launch {name!r}") for p in procs]
    (base / f"{name}.log").write_text("\n".join(f"node {k}: exit {rc}\n{out[-3000:]}\n{err[-6000:]}"
                                                for k, (rc, out, err) in enumerate(done)))


def launched(tmp_path_factory: pytest.TempPathFactory, phase: str) -> Path:
    """The folder of `phase`'s results, its launch run first if no worker of this session has run it yet; fails the
    test with the phase's traceback (or its launch's output) when the phase did not finish on every rank."""
    base = _shared_dir(tmp_path_factory)
    name = next(n for n, (_, _, names) in LAUNCHES.items() if phase in names)
    for needed in (*AFTER.get(name, []), name):
        _run_once(needed, base)
    nodes, nproc, _ = LAUNCHES[name]
    out = base / phase
    errors = sorted(out.glob("error_rank*.txt")) if out.exists() else []
    if errors:
        pytest.fail(f"phase {phase!r} failed on {errors[0].stem.removeprefix('error_')}:\n{errors[0].read_text()}")
    if len(list(out.glob("done_rank*"))) != nodes * nproc:
        log = (base / f"{name}.log").read_text()
        pytest.fail(f"phase {phase!r} of launch {name!r} did not finish on every rank (an earlier phase failed, or "
                    f"the launch did):\n{log[-6000:]}")
    return out


def stdout_of(out: Path) -> str:
    """What every rank of a phase printed, in rank order."""
    return "".join(p.read_text() for p in sorted(out.glob("stdout_rank*.txt")))


if __name__ == "__main__":
    if len(sys.argv) < 3 or any(p not in PHASES for p in sys.argv[2:]):
        raise SystemExit(f"usage: torchrun --nproc-per-node N {Path(__file__).name} BASE PHASE... "
                         f"(phases: {', '.join(PHASES)})")
    run_phases(Path(sys.argv[1]), sys.argv[2:])
