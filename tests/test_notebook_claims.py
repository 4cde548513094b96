"""Saved outputs are claims: a cell whose output nbval ignores must still check its claim in code.

nbval compares every saved output with a fresh run, on whatever CPU the student has. Where a number must vary
from machine to machine (a training trajectory, Adam's amplified rounding noise, a timing), the cell is tagged
`nbval-ignore-output`; it then opens with one comment line `# varies: <what varies, and why>` and holds at least
one `assert` on the invariant, so that nbval still fails when the claim breaks. This test lists those cells.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "lessons").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
IGNORE = "nbval-ignore-output"
MAX_IGNORED = 13  # keep it small: a claim that can be printed at its own precision is compared, not ignored
REASON = re.compile(r"^# varies: \S.{15,}")


def _ignored_cells() -> list[tuple[Path, int, nbformat.NotebookNode]]:
    found = []
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and IGNORE in cell.metadata.get("tags", []):
                found.append((path, index, cell))
    return found


def _has_assert(source: str) -> bool:
    # IPython magics would not parse; course notebooks use none in tagged cells
    return any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(source)))


def test_the_notebooks_are_found() -> None:
    assert len(NOTEBOOKS) >= 10, NOTEBOOKS


def test_every_ignored_cell_says_why_and_asserts_its_claim(capsys: pytest.CaptureFixture[str]) -> None:
    cells = _ignored_cells()
    with capsys.disabled():
        print(f"\n{len(cells)} cells tagged {IGNORE}:")
        for path, index, cell in cells:
            print(f"  {path.relative_to(ROOT)} cell {index}: {cell.source.splitlines()[0][2:]}")
    problems = []
    for path, index, cell in cells:
        where = f"{path.relative_to(ROOT)} cell {index}"
        if not REASON.match(cell.source):
            problems.append(f"{where}: the first line must be '# varies: <what varies, and why>'")
        if not _has_assert(cell.source):
            problems.append(f"{where}: an ignored output must assert its invariant in code")
    assert not problems, "\n".join(problems)
    assert len(cells) <= MAX_IGNORED, f"{len(cells)} ignored cells: print claims at their precision instead"


def test_no_cell_is_ignored_by_a_comment_marker() -> None:
    """nbval also honours `# NBVAL_IGNORE_OUTPUT` / `# NBVAL_SKIP` in a cell: those would bypass the check above."""
    for path in NOTEBOOKS:
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type == "code":
                first = cell.source.lstrip().splitlines()[:1]
                assert not (first and first[0].startswith("# NBVAL_")), f"{path.name} cell {index}: use the tag"
                assert "nbval-skip" not in cell.metadata.get("tags", []), f"{path.name} cell {index} is skipped"


def test_below_prints_a_difference_against_its_bound() -> None:
    from fsdp_course.classroom.notebooks import below

    assert below(3.4e-7) == below(9.9e-6) == "< 1e-05"  # the digits of rounding noise never reach the output
    assert below(2e-7, bound=1e-6) == "< 1e-06"
    assert below(1e-5) == "1.0e-05" and below(0.016) == "1.6e-02"  # at or above the bound: the value itself


def test_lessons_import_below_instead_of_defining_their_own() -> None:
    for path in NOTEBOOKS:
        for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
            assert "def below(" not in cell.source and "def rounded(" not in cell.source, f"{path.name} {index}"


def test_show_source_prints_the_courses_code_and_refuses_torchs(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from fsdp_course.classroom.notebooks import below, show_source

    show_source(below)
    assert capsys.readouterr().out.startswith("def below(err: float, bound: float = 1e-5) -> str:\n")
    with pytest.raises(ValueError, match="not torch.nn.modules.linear's: cite torch's file and function"):
        show_source(torch.nn.Linear)
