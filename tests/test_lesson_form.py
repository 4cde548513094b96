"""The form every lesson keeps: code cells a learner reads (40 lines at most), no reading of torch's source or
docstrings (a claim about torch is checked by running it, in tests/test_torch_claims.py), no program written
from a string literal (programs live in fsdp_course/examples/). Lessons not yet in this form are listed, each
with what it still breaks, and the list may only shrink."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
MAX_LINES = 40
READS_SOURCE = re.compile(r"\binspect\.(getsource|getsourcelines|getdoc)\b|\.__doc__\b|\bmmap\b")
PROGRAM = re.compile(r"^\s*(import \w|from \w[\w.]* import )", re.M)  # a string holding Python code
NOT_YET: dict[str, set[str]] = {}  # lessons being brought into the form: what they may still break, by name


def problems(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {"long": [], "source": [], "program": []}
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        where = f"cell {index}"
        if len(cell.source.splitlines()) > MAX_LINES:
            found["long"].append(f"{where}: {len(cell.source.splitlines())} lines (at most {MAX_LINES}: split it, "
                                 "or move bookkeeping to the library)")
        if READS_SOURCE.search(cell.source):
            found["source"].append(f"{where} reads source or docstrings: check the claim by running torch in "
                                   "tests/test_torch_claims.py and cite the file and function in the text")
        strings = [n.value for n in ast.walk(ast.parse(cell.source))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if any(PROGRAM.search(s) for s in strings):
            found["program"].append(f"{where} writes a program from a string: make it a module of "
                                    "fsdp_course/examples/ and run it with examples.run(name)")
    return {kind: lines for kind, lines in found.items() if lines}


def test_the_lessons_are_found() -> None:
    assert len(LESSONS) >= 19 and set(NOT_YET) <= {p.stem for p in LESSONS}


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_form(path: Path) -> None:
    found = problems(path)
    allowed = NOT_YET.get(path.stem, set())
    assert not {k: v for k, v in found.items() if k not in allowed}, found
    assert set(found) == allowed, f"{path.stem} no longer breaks {sorted(allowed - set(found))}: shrink NOT_YET"
