"""Load the reference solutions out of solutions/NN_topic.ipynb (a helper module, not a test file), and
`fails` / `passes`: how the tests of the checkers call one and read its report.

`load("01_collectives")` runs the notebook's first code cell (its imports) and its nbgrader solution cells,
and returns the namespace: the reference functions and classes, exactly as the notebook defines them.
Each cell's source is registered with `linecache` under a name of its own, as IPython does, so that
`inspect.getsource` works on them (the checkpoint checker ships `load` to torchrun by its source).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]


@cache
def load(notebook: str) -> dict[str, Any]:
    nb = nbformat.read(ROOT / "solutions" / f"{notebook}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    namespace: dict[str, Any] = {"__name__": f"solution_{notebook}"}
    for i, cell in enumerate(code):
        if i == 0 or cell.metadata.get("nbgrader", {}).get("solution"):
            filename = f"<solution {notebook} cell {cell.id}>"
            linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(True), filename)
            exec(compile(cell.source, filename, "exec"), namespace)  # noqa: S102  (our own notebooks)
    return namespace


def fails(check: Callable[..., None], *args: Any, hint: str, capsys: pytest.CaptureFixture[str], **kwargs: Any) -> str:
    """Run a checker that must fail: its report names the failure and the hint, and never says it passed."""
    with pytest.raises(AssertionError) as info:
        check(*args, **kwargs)
    out = capsys.readouterr().out
    assert f"{check.__name__} FAILED at " in out
    assert hint in out and hint in str(info.value), out
    assert f"All tests in {check.__name__} passed" not in out
    return out


def passes(check: Callable[..., None], *args: Any, capsys: pytest.CaptureFixture[str], **kwargs: Any) -> str:
    check(*args, **kwargs)
    out = capsys.readouterr().out
    assert out.startswith(f"All tests in {check.__name__} passed (world sizes ")
    return out
