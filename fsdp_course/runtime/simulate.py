"""Run several ranks inside one Python process: one thread each, each with a real Gloo group.

`run_ranks(fn, world_size)` is the course's stand-in for `torchrun --nproc-per-node N`: it makes a
fresh private temporary directory, and per rank a thread that opens a `torch.distributed.FileStore`
on the same file there and builds its own `ProcessGroupGloo` on it (exactly what the article does in
Java with `new FileStore("/tmp/fsdp_store", worldSize)`, minus its fixed path). Every collective is
real Gloo over loopback TCP; only the processes are threads.

What it adds for a notebook (docs/ARCHITECTURE.md, "Traps of ranks as threads"):
- each rank's prints are captured and replayed in rank order after the join (output.py);
- a rank that raises releases the others, and `RankError` names it with its traceback;
- mismatched or abandoned collectives are reported by name instead of hanging (monitor.py);
- nothing is left behind: threads joined, groups shut down, the store directory removed.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from fsdp_course.runtime.context import CONNECT_TIMEOUT, RankContext, gloo_group
from fsdp_course.runtime.monitor import CollectiveHang, PeerFailed, WorldMonitor
from fsdp_course.runtime.output import capture_ranks

__all__ = ["MAX_WORLD_SIZE", "RankError", "run_ranks"]

MAX_WORLD_SIZE = 64  # threads and loopback connections grow as N²; more teaches nothing new


class RankError(RuntimeError):
    """One or more ranks failed. `failures` maps rank -> its exception, `tracebacks` rank -> text.

    The message names the failing ranks with the original exception type and message; each rank's
    traceback is attached as a note (shown by Python and Jupyter under the error).
    """

    def __init__(self, failures: dict[int, BaseException], tracebacks: dict[int, str],
                 released: list[int]) -> None:
        self.failures = failures
        self.tracebacks = tracebacks
        self.released = released
        groups: dict[str, list[int]] = {}
        for rank, exc in sorted(failures.items()):
            groups.setdefault(f"{type(exc).__name__}: {exc}", []).append(rank)
        parts = []
        for text, ranks in groups.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            parts.append(f"{who} failed with {text}")
        super().__init__("\n".join(parts))
        for rank in sorted(tracebacks):
            _add_note(self, f"--- traceback of rank {rank} ---\n{tracebacks[rank].rstrip()}")
        if released:
            _add_note(self, f"rank(s) {', '.join(map(str, released))} were released when a peer failed")


def _add_note(exc: BaseException, text: str) -> None:
    """`exc.add_note(text)` (Python 3.11+); on 3.10 the same `__notes__` list, which IPython shows too."""
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), text]


def _validate(fn: object, world_size: object, timeout: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be a function taking the rank context, got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    if timeout == float("inf"):
        raise ValueError("timeout must be finite: it is also Gloo's own timeout and bounds every wait; "
                         "pass a number of seconds, e.g. timeout=600")


def run_ranks(fn: Callable[[RankContext], Any], world_size: int, *, timeout: float = 30.0,
              seed: int = 0) -> list[Any]:
    """Run `fn(ctx)` once per rank, each in its own thread with its own Gloo group; results in rank order.

    `timeout` (seconds) bounds every wait: the Gloo group's own timeout, the wait for peers at a
    collective, and the wait for ranks to stop after a failure. `seed` seeds each rank's
    `ctx.generator` (as `1000 * seed + rank`). Raises `RankError` if any rank fails.
    """
    _validate(fn, world_size, timeout)
    workdir = tempfile.mkdtemp(prefix="fsdp_course_")  # private (0700), fresh for every run
    store_path = os.path.join(workdir, "store")
    monitor = WorldMonitor(world_size, float(timeout))
    results: list[Any] = [None] * world_size
    failures: dict[int, BaseException] = {}
    tracebacks: dict[int, str] = {}
    groups: list[dist.ProcessGroup | None] = [None] * world_size
    subgroups: list[list[dist.ProcessGroup]] = [[] for _ in range(world_size)]  # made by ctx.mesh()

    def body(rank: int, capture: capture_ranks) -> None:
        capture.register(rank)
        try:
            store = dist.FileStore(store_path, world_size)
            try:
                group = gloo_group(store, rank, world_size, float(timeout))
            except RuntimeError as exc:
                connect = max(timeout, CONNECT_TIMEOUT)
                raise RuntimeError(
                    f"rank {rank} could not connect to its {world_size - 1} peer(s) over loopback within {connect:g} s "
                    f"(Gloo: {str(exc).splitlines()[0]}). Is the machine overloaded, or does a firewall block "
                    "127.0.0.1? Close other kernels and try again") from exc
            groups[rank] = group
            ctx = RankContext(rank, world_size, group, seed=seed, monitor=monitor, store=store)
            subgroups[rank] = ctx.subgroups
            results[rank] = fn(ctx)
            monitor.set_finished(rank)
        except BaseException as exc:  # noqa: BLE001  (reported to the caller as RankError)
            tracebacks[rank] = "".join(traceback.format_exception(exc))
            traceback.clear_frames(exc.__traceback__)  # frames would keep the group and store alive
            failures[rank] = exc
            monitor.set_failed(rank, exc)
        finally:
            capture.unregister()

    with capture_ranks(world_size) as capture:
        threads = [threading.Thread(target=body, args=(r, capture), name=f"fsdp-rank-{r}", daemon=True)
                   for r in range(world_size)]
        for t in threads:
            t.start()
        try:
            _join(threads, monitor)
        except KeyboardInterrupt:
            monitor.abort.set()
            _join(threads, monitor)
            raise
        finally:
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
            doing = {r: _whereabouts(threads[r], monitor.state(r)) for r in stuck}
            capture.replay()
    if not stuck:
        for group in [g for mine in subgroups for g in mine] + groups:
            if group is not None:
                group.shutdown()
    groups.clear()
    subgroups.clear()
    if failures:
        gc.collect()  # exceptions and their frames hold stores and groups in cycles
    shutil.rmtree(workdir, ignore_errors=True)
    if stuck:  # a stuck rank may still write its store file: remove the directory again once it ends
        _remove_after(workdir, [threads[r] for r in stuck])
    if failures or stuck:
        for r in stuck:
            failures[r] = CollectiveHang(
                f"rank {r} did not end within {_grace(timeout):g} s after another rank ended; {doing[r]}. "
                "Its thread is left running as a daemon (Python cannot stop a thread): restart the kernel if it "
                "holds on to memory or CPU")
        primary = {r: e for r, e in failures.items() if not isinstance(e, PeerFailed)}
        released = sorted(r for r, e in failures.items() if isinstance(e, PeerFailed))
        if not primary:  # only released ranks: cannot happen unless aborted from outside
            primary = failures
            released = []
        shown = {r: tracebacks[r] for r in primary if r in tracebacks}
        raise RankError(primary, shown, released)
    return results


def _remove_after(path: str, threads: list[threading.Thread]) -> None:
    def wait_then_remove() -> None:
        for t in threads:
            t.join()
        shutil.rmtree(path, ignore_errors=True)

    threading.Thread(target=wait_then_remove, name="fsdp-cleanup", daemon=True).start()


def _grace(timeout: float) -> float:
    """Seconds the other ranks get to end once one rank has ended (finished or failed).

    A rank blocked inside a raw Gloo call is released by Gloo's own timeout (the same value), which may have
    started just before; the half timeout and two seconds are a margin for a loaded machine. So `run_ranks`
    returns at most `timeout + _grace(timeout)` after a collective that a peer never joins begins, whatever that
    peer is doing (a rank stuck outside torch is reported as such and left behind as a daemon thread).
    """
    return 1.5 * timeout + 2.0


def _join(threads: list[threading.Thread], monitor: WorldMonitor) -> None:
    """Join all threads; once any rank has ended (finished or failed), the rest get `_grace(timeout)` to end."""
    pending = list(threads)
    while pending:
        pending[0].join(0.05)  # short joins keep Ctrl-C / Jupyter's interrupt responsive
        pending = [t for t in pending if t.is_alive()]
        first_end = monitor.first_end
        if pending and (monitor.abort.is_set() or first_end is not None):
            deadline = (first_end if first_end is not None else time.monotonic()) + _grace(monitor.timeout)
            while pending and time.monotonic() < deadline:
                pending[0].join(min(0.05, max(0.0, deadline - time.monotonic())))
                pending = [t for t in pending if t.is_alive()]
            return


def _whereabouts(thread: threading.Thread, state: str) -> str:
    """Where a stuck rank is: the referee's view and, from its Python stack, the innermost line it runs."""
    frame = sys._current_frames().get(thread.ident or -1)
    where = ""
    if frame is not None:
        stack = traceback.extract_stack(frame)
        library = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
        library += (os.path.dirname(__file__),)
        mine = [f for f in stack if not f.filename.startswith(library)]
        shown = [stack[-1]] + ([mine[-1]] if mine and mine[-1] is not stack[-1] else [])
        where = ", at " + ", called from ".join(
            f"{os.path.basename(f.filename)}:{f.lineno} ({f.line or f.name})" for f in shown)
    inside = state.startswith(("waiting in ", "in "))
    kind = "stuck inside a collective" if inside else "stuck outside the course's collectives"
    return f"it is {kind} (referee: {state}){where}"
