"""exercises/ is generated from solutions/ by nbgrader's ClearSolutions, stays in sync, and runs as a learner sees it.

What an unsolved exercise does, precisely: the stub cells (nbgrader solution cells) run without error, because
every stub sits inside a function (or a method); every checker cell (nbgrader grade cell) fails with
NotImplementedError saying "not implemented yet"; every other cell runs cleanly. So a learner can run the notebook
top to bottom, and an unsolved exercise scores 0. Every solution/exercise pair is covered (parametrized by file).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

from fsdp_course.classroom import exercises
from fsdp_course.runtime.ports import kernel_transport

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))


def _nbgrader(cell: nbformat.NotebookNode) -> dict:
    return cell.metadata.get("nbgrader", {})


def _without_hidden_tests(source: str) -> str:
    """The source with its `### BEGIN HIDDEN TESTS` ... `### END HIDDEN TESTS` lines removed (what learners get)."""
    kept, hidden = [], False
    for line in source.split("\n"):
        if "BEGIN HIDDEN TESTS" in line:
            hidden = True
        elif "END HIDDEN TESTS" in line:
            hidden = False
        elif not hidden:
            kept.append(line)
    return "\n".join(kept)


def test_there_are_exercises_for_every_solution() -> None:
    assert SOLUTIONS, "no solution notebooks"
    assert [p.name for p in EXERCISES] == [p.name for p in SOLUTIONS]


def test_exercises_are_in_sync_with_solutions() -> None:
    problems = exercises.check(ROOT / "solutions", ROOT / "exercises")
    assert problems == [], "\n".join(problems) + "\nrun `make exercises`"


def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    exercises.generate(ROOT / "solutions", first)
    shutil.copytree(first, second)
    exercises.generate(ROOT / "solutions", second)  # over its own output
    for path in sorted(first.glob("*.ipynb")):
        assert (second / path.name).read_bytes() == path.read_bytes()
        assert path.read_bytes() == (ROOT / "exercises" / path.name).read_bytes()


def test_check_reports_a_stale_exercise_and_the_cli_fails(tmp_path: Path) -> None:
    exercises.generate(ROOT / "solutions", tmp_path)
    stale = sorted(tmp_path.glob("*.ipynb"))[0]
    stale.write_text(stale.read_text().replace("YOUR CODE HERE", "YOUR CODE THERE"))
    (tmp_path / "99_orphan.ipynb").write_text("{}")
    problems = exercises.check(ROOT / "solutions", tmp_path)
    assert any(stale.name in p and "differs" in p for p in problems)
    assert any("99_orphan.ipynb has no solutions/" in p for p in problems)
    args = ["check", "--solutions", str(ROOT / "solutions"), "--exercises", str(tmp_path)]
    assert exercises.main(args) == 1


def test_a_solution_region_outside_a_solution_cell_is_refused(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION")])
    (tmp_path / "solutions").mkdir()
    nbformat.write(nb, tmp_path / "solutions" / "01_bad.ipynb")
    with pytest.raises(RuntimeError, match="non-solution cell"):
        exercises.generate(tmp_path / "solutions", tmp_path / "exercises")


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_exercise_is_the_solution_with_stubs_and_no_outputs(solution: Path) -> None:
    sol = nbformat.read(solution, as_version=4)
    ex = nbformat.read(ROOT / "exercises" / solution.name, as_version=4)
    assert [c.id for c in ex.cells] == [c.id for c in sol.cells]
    stubs = 0
    for s, e in zip(sol.cells, ex.cells, strict=True):
        assert e.get("outputs", []) == [] and e.get("execution_count") is None
        assert "execution" not in e.metadata
        if _nbgrader(s).get("solution"):
            stubs += 1
            assert "### BEGIN SOLUTION" in s.source, f"solution cell {s.id} has no solution region"
            assert "# YOUR CODE HERE" in e.source and "raise NotImplementedError()" in e.source
            assert "BEGIN SOLUTION" not in e.source and "END SOLUTION" not in e.source
            before_region = s.source.split("### BEGIN SOLUTION")[0]
            assert e.source.startswith(before_region), "the stub's instructions above the region must stay"
            assert "roughly" in before_region, "a stub says roughly how many lines to write"
        else:
            assert e.source == _without_hidden_tests(s.source)
            assert "BEGIN SOLUTION" not in s.source
            assert "HIDDEN TESTS" not in e.source
            if "BEGIN HIDDEN TESTS" in s.source:
                assert _nbgrader(s).get("grade"), "hidden tests belong in a checker (grade) cell"
        if _nbgrader(s).get("grade"):
            assert _nbgrader(e) == _nbgrader(s) and _nbgrader(e)["locked"] and _nbgrader(e)["points"] > 0
    assert stubs > 0


@pytest.mark.parametrize("solution", SOLUTIONS, ids=lambda p: p.name)
def test_checker_cells_import_their_own_checker(solution: Path) -> None:
    """A checker cell imports its checker itself: editing the notebook's import cell cannot swap the checker out."""
    nb = nbformat.read(solution, as_version=4)
    for cell in nb.cells:
        if _nbgrader(cell).get("grade"):
            assert cell.source.startswith("from fsdp_course.classroom.checks import "), cell.id


RESET = ("%reset -f\n"  # a fresh namespace: what a new kernel gives, without starting one per notebook
         "import os, matplotlib.pyplot\n"
         f"matplotlib.pyplot.close('all'); os.chdir({str(ROOT)!r})")


@pytest.fixture(scope="module")
def kernel() -> Iterator[KernelManager]:
    """One kernel for every stub notebook, its namespace reset before each (torch and the course are imported once:
    17 kernel starts were a minute of the suite)."""
    km = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager(),
                       **kernel_transport())
    km.start_kernel(cwd=str(ROOT))
    yield km
    km.shutdown_kernel(now=True)


def _execute(path: Path, km: KernelManager) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    reset = nbformat.v4.new_code_cell(RESET)
    run = nbformat.v4.new_notebook(cells=[reset, *nb.cells], metadata=nb.metadata)
    NotebookClient(run, km=km, allow_errors=True, timeout=240, resources={"metadata": {"path": str(ROOT)}}).execute()
    assert not [o for o in reset.outputs if o.output_type == "error"], reset.outputs
    return nb


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda p: p.name)
def test_unsolved_exercise_fails_only_in_its_checkers_with_not_implemented(exercise: Path, kernel: KernelManager
                                                                          ) -> None:
    nb = _execute(exercise, kernel)
    grade_cells = [c for c in nb.cells if _nbgrader(c).get("grade") and c.cell_type == "code"]
    assert grade_cells, "an exercise needs at least one checker (grade) cell"
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if cell in grade_cells:
            assert len(errors) == 1, f"checker cell {cell.id} should fail while the stub is unsolved"
            assert errors[0].ename == "NotImplementedError", f"cell {cell.id}: {errors[0].ename}: {errors[0].evalue}"
            assert "is not implemented yet" in errors[0].evalue
        else:
            assert errors == [], f"cell {cell.id} failed: {errors[0].ename}: {errors[0].evalue}"
