"""The course's notebooks under nbgrader's own apps, as an instructor who runs an nbgrader course would use them.

A small course directory is built from solutions/ (nbgrader_config.py, source/<assignment>/), then nbgrader's
`generate_assignment`, `autograde` and `generate_feedback` run on it (`python -m nbgrader ...`, each in its own
process, with a kernel of this interpreter) for two submissions made from the released notebooks: `good` fills every
solution cell with the instructor's code, `partial` leaves one exercise at its stub. The gradebook's scores and the
feedback HTML are then read back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

pytest.importorskip("nbgrader")

from nbgrader.api import Gradebook  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT = "ps1"
NOTEBOOKS = ("03_memory", "16_hsdp")  # two short exercises (a few seconds each), one with a hidden-free checker
STUB_LEFT = "03_memory"  # the exercise `partial` leaves at its stub


def _nbgrader(course: Path, env: dict[str, str], *args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--force"], cwd=course, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


def _solution_sources(notebook: Path) -> dict[str, str]:
    nb = nbformat.read(notebook, as_version=4)
    return {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("solution")}


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nbgrader")
    course, jupyter = root / "course", root / "jupyter"
    # a kernel named python3 that runs this interpreter, found before any the machine has installed; no user config
    (jupyter / "kernels" / "python3").mkdir(parents=True)
    (jupyter / "kernels" / "python3" / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # nbgrader runs alembic
    env = {**os.environ, "PATH": path, "JUPYTER_PATH": str(jupyter), "JUPYTER_CONFIG_DIR": str(root / "config"),
           "JUPYTER_DATA_DIR": str(jupyter), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    (course / "source" / ASSIGNMENT).mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(
        "c = get_config()\n"
        "c.CourseDirectory.course_id = 'fsdp-course'\n"
        f"c.CourseDirectory.db_assignments = [dict(name={ASSIGNMENT!r})]\n"
        "c.CourseDirectory.db_students = [dict(id='good'), dict(id='partial')]\n"
        "c.Execute.timeout = 300  # seconds per cell: generous for a loaded machine\n")
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "solutions" / f"{name}.ipynb", course / "source" / ASSIGNMENT)
    _nbgrader(course, env, "generate_assignment", ASSIGNMENT)
    for student in ("good", "partial"):
        folder = course / "submitted" / student / ASSIGNMENT
        folder.mkdir(parents=True)
        for name in NOTEBOOKS:
            nb = nbformat.read(course / "release" / ASSIGNMENT / f"{name}.ipynb", as_version=4)
            if not (student == "partial" and name == STUB_LEFT):
                answers = _solution_sources(course / "source" / ASSIGNMENT / f"{name}.ipynb")
                for cell in nb.cells:
                    gid = cell.metadata.get("nbgrader", {}).get("grade_id")
                    if gid in answers:
                        cell.source = answers[gid]
            nbformat.write(nb, folder / f"{name}.ipynb")
        (folder / "timestamp.txt").write_text("2026-01-05 09:00:00.000000 UTC")
    _nbgrader(course, env, "autograde", ASSIGNMENT)
    _nbgrader(course, env, "generate_feedback", ASSIGNMENT)
    return course


def test_released_notebooks_have_stubs_and_no_hidden_tests(course: Path) -> None:
    for name in NOTEBOOKS:
        text = (course / "release" / ASSIGNMENT / f"{name}.ipynb").read_text()
        assert "raise NotImplementedError()" in text
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text


def test_the_gradebook_scores_the_submissions(course: Path) -> None:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {(s, nb.name): (nb.score, nb.max_score) for s in ("good", "partial")
                  for nb in gb.find_submission(ASSIGNMENT, s).notebooks}
    assert set(scores) == {(s, n) for s in ("good", "partial") for n in NOTEBOOKS}
    for (student, name), (score, max_score) in scores.items():
        assert max_score > 0
        expected = 0.0 if (student, name) == ("partial", STUB_LEFT) else max_score
        assert score == expected, (student, name, score, max_score)


def test_feedback_html_per_student_and_notebook(course: Path) -> None:
    for student in ("good", "partial"):
        for name in NOTEBOOKS:
            assert (course / "feedback" / student / ASSIGNMENT / f"{name}.html").is_file()
    page = (course / "feedback" / "partial" / ASSIGNMENT / f"{STUB_LEFT}.html").read_text()
    assert "Grade cell: <code>check_zero_memory</code>" in page
    assert "zero_memory is not implemented yet" in page  # the checker's message on the stub
