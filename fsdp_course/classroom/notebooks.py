"""Notebooks whose saved outputs are claims: `below` for lessons, and `run` to save a notebook (for authors).

Design notes: docs/CLASSROOM.md, "The authors' tools", `notebooks.py`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

__all__ = ["below", "main", "run_notebook", "show_source"]

_VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled")


def below(err: float, bound: float = 1e-5) -> str:
    """A difference printed against a bound: `"< 1e-05"` when `err < bound`, else its value (`"1.6e-02"`).

    Rounding noise (a sum in another order) differs from CPU to CPU in its digits, not in being below the bound,
    so this text is the same on every machine; the cell asserts the bound itself."""
    return f"< {bound:.0e}" if err < bound else f"{err:.1e}"


def show_source(obj: object) -> None:
    """Print the source of one of the course's own functions or classes, as a lesson shows the code it discusses.

    Only the course's code: a claim about torch is checked by running torch (tests/test_torch_claims.py), and its
    source is cited in prose, never printed, since its text changes with every refactor."""
    import inspect

    module = getattr(inspect.getmodule(obj), "__name__", "")
    if module.split(".")[0] != "fsdp_course":
        raise ValueError(f"show_source shows the course's own code, not {module or type(obj).__name__}'s: cite "
                         "torch's file and function in the lesson's text, and check the claim in "
                         "tests/test_torch_claims.py")
    print(inspect.getsource(obj), end="")


def run_notebook(path: Path, *, timeout: float = 240.0) -> float:
    """Execute `path` in a fresh kernel and write it back with its outputs; returns the seconds it took."""
    import nbformat  # authors' tools: a lesson that imports `below` does not load them
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    from fsdp_course.runtime.ports import kernel_transport

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", **kernel_transport())
    started = time.perf_counter()
    client = NotebookClient(nb, km=km, timeout=int(timeout), allow_errors=False,
                            resources={"metadata": {"path": str(path.resolve().parent)}})
    try:
        client.execute()
    finally:  # a kernel manager passed in is ours to stop: nbclient leaves it running, and its client's sockets open
        if getattr(client, "kc", None) is not None:
            client.kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    seconds = time.perf_counter() - started
    for cell in nb.cells:
        for key in _VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
    path.write_text(nbformat.writes(nb, version=4).rstrip("\n") + "\n", encoding="utf-8")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_course.classroom.notebooks",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="execute notebooks in fresh kernels and save them with outputs")
    run.add_argument("notebooks", nargs="+", type=Path)
    run.add_argument("--timeout", type=float, default=240.0, help="seconds per cell (default 240)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file() or p.suffix != ".ipynb"]
    if missing:
        parser.error(f"not a notebook file: {', '.join(missing)}")
    for path in args.notebooks:
        try:
            seconds = run_notebook(path, timeout=args.timeout)
        except Exception as err:  # nbclient's CellExecutionError carries the cell's traceback
            print(f"{path}: FAILED, not saved\n{err}", file=sys.stderr)
            return 1
        print(f"{path}: saved ({seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
