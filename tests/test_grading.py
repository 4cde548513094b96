"""`fsdp-course grade` on a class of fixture submissions made here, mostly of exercise 01.

One grading run (module fixture, through the CLI, 2 jobs) grades: a correct notebook, a partly correct one with
cells moved and removed, an untouched stub, one that raises (and floods its output, and deletes the files in its
folder), one that hangs (short --timeout), malformed JSON, one whose checker cells were edited, emptied and deleted,
another exercise saved under 01's name, and an empty folder. The tests then read the CSV and the feedback.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from pathlib import Path

import nbformat
import pytest

from fsdp_course import cli, grading

ROOT = Path(__file__).resolve().parents[1]
EX01 = "01_collectives"
TIMEOUT = 25.0  # seconds per notebook: the correct notebook needs a few; the hanging one uses them all


def _cell(nb: nbformat.NotebookNode, grade_id: str) -> nbformat.NotebookNode:
    return next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id)


def _exercise(name: str = EX01) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "exercises" / f"{name}.ipynb", as_version=4)


def _solve(nb: nbformat.NotebookNode, *grade_ids: str) -> nbformat.NotebookNode:
    """Put the solution's code into the learner's stub cells `grade_ids`, as a student who solved them would."""
    solution = nbformat.read(ROOT / "solutions" / f"{EX01}.ipynb", as_version=4)
    for gid in grade_ids:
        _cell(nb, gid).source = _cell(solution, gid).source
    return nb


def _code(source: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source)


def _make_class(root: Path) -> None:
    def put(student: str, nb: nbformat.NotebookNode | str, name: str = f"{EX01}.ipynb") -> None:
        folder = root / student
        folder.mkdir(parents=True, exist_ok=True)
        if isinstance(nb, str):
            (folder / name).write_text(nb)
        else:
            nbformat.write(nb, folder / name)

    put("correct", _solve(_exercise(), "my_all_reduce", "ring_all_reduce"))
    put("correct", "just notes", "notes.txt")
    (root / "correct" / "scratch.ipynb").write_text("{}")  # not an exercise name: ignored

    partly = _solve(_exercise(), "my_all_reduce")  # the ring is left at its stub
    ring_check = _cell(partly, "check_ring_all_reduce")
    partly.cells.remove(ring_check)
    partly.cells.insert(1, ring_check)  # moved above everything
    partly.cells = [c for c in partly.cells if c.cell_type == "code" or "Hints" not in c.source]  # removed
    put("partly", partly)

    put("stub", _exercise())

    raising = _solve(_exercise(), "my_all_reduce", "ring_all_reduce")  # and floods, and deletes its files
    raising.cells.insert(2, _code("raise RuntimeError('a bug in a cell outside the checks')"))
    raising.cells.insert(3, _code("for i in range(20000):\n    print('flood', i)\nprint('x' * 2_000_000)"))
    raising.cells.insert(4, _code("import os, shutil\nfor f in os.listdir('.'):\n    os.remove(f)\n"
                                  "shutil.rmtree('..', ignore_errors=True)"))
    put("raising", raising)

    hanging = _exercise()
    _cell(hanging, "my_all_reduce").source = ("import time\n\ndef my_all_reduce(ctx, tensor):\n"
                                              "    time.sleep(3600)  # never returns\n")
    put("hanging", hanging)

    put("malformed", '{"cells": [ {"cell_type": "code", "source": "print(1)"')  # cut off: not JSON

    tampered = _exercise()  # stubs untouched; the checks emptied, deleted, or swapped out by the import cell
    _cell(tampered, "check_all_reduce").source = ""
    tampered.cells.remove(_cell(tampered, "check_ring_all_reduce"))
    tampered.cells.remove(_cell(tampered, "ring_all_reduce"))  # the cell before the deleted checker is gone too
    tampered.cells[1].source += "\ncheck_all_reduce = check_ring_all_reduce = lambda fn: None"
    put("tampered", tampered)
    edited = _exercise()
    _cell(edited, "check_all_reduce").source = "print('All tests in check_all_reduce passed')"
    put("tampered", edited, "02_ddp.ipynb")  # exercise 01 under another exercise's name: invalid

    put("different", _exercise("02_ddp"))  # exercise 02 saved as 01

    (root / "empty").mkdir()


@pytest.fixture(scope="module")
def graded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("grading")
    submissions = root / "submissions"
    _make_class(submissions)
    out = root / "grades.csv"
    leftovers = lambda: set(Path(tempfile.gettempdir()).glob("fsdp_grade_*"))  # noqa: E731
    before = leftovers()
    status = cli.main(["grade", str(submissions), "--out", str(out), "--solutions", str(ROOT / "solutions"),
                       "--timeout", str(TIMEOUT), "--jobs", "2"])
    left = leftovers() - before
    with out.open() as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    feedback = {p.stem: p.read_text() for p in (root / "grades_feedback").glob("*.txt")}
    return {"status": status, "rows": rows, "feedback": feedback, "submissions": submissions, "left": left}


def test_grading_leaves_no_temporary_folders(graded: dict[str, object]) -> None:
    # the jobs' folders and the kernels' TMPDIRs, also of the notebook that hangs and of the one that deletes '..'
    assert graded["left"] == set()


def test_one_row_and_one_feedback_file_per_student(graded: dict) -> None:
    assert graded["status"] == 0
    students = {"correct", "different", "empty", "hanging", "malformed", "partly", "raising", "stub", "tampered"}
    assert set(graded["rows"]) == students
    assert set(graded["feedback"]) == students
    header = list(next(iter(graded["rows"].values())))
    exercises = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    assert header == ["student", *exercises, "total", "max_total", "status", "notes"]


@pytest.mark.parametrize(("student", "score", "status"), [
    ("correct", "5", "ok"),
    ("partly", "3", "ok"),
    ("stub", "0", "ok"),
    ("raising", "5", "error"),
    ("hanging", "0", "timeout"),
    ("malformed", "0", "invalid"),
    ("different", "0", "invalid"),
    ("empty", "0", "invalid"),
])
def test_scores_and_status(graded: dict, student: str, score: str, status: str) -> None:
    row = graded["rows"][student]
    assert (row[EX01], row["status"]) == (score, status), row
    assert row["total"] == score
    assert float(row["max_total"]) > 5


def test_only_the_instructors_checks_count(graded: dict) -> None:
    row = graded["rows"]["tampered"]
    assert row[EX01] == "0" and row["02_ddp"] == "0"
    assert row["status"] == "invalid"  # its "02_ddp.ipynb" holds exercise 01
    text = graded["feedback"]["tampered"]
    assert "checker cell check_all_reduce was edited: the instructor's was put back" in text
    assert "checker cell check_ring_all_reduce was missing: the instructor's was added back" in text
    assert "not exercise 02_ddp: it holds the cells of 01_collectives" in text
    assert "my_all_reduce is not implemented yet" in text  # the restored checkers ran
    assert "NameError: name 'ring_all_reduce' is not defined" in text


def test_feedback_says_what_passed_and_what_failed(graded: dict) -> None:
    correct = graded["feedback"]["correct"]
    assert correct.startswith("Feedback for correct: 5 / ")
    assert "[pass] check_all_reduce (3 / 3)" in correct and "[pass] check_ring_all_reduce (2 / 2)" in correct
    assert "## 02_ddp: 0 / 3: not submitted (expected 02_ddp.ipynb)" in correct
    assert "scratch.ipynb (not an exercise's name)" in correct and "notes.txt" not in correct
    partly = graded["feedback"]["partly"]
    assert "[pass] check_all_reduce (3 / 3)" in partly
    assert "[FAIL] check_ring_all_reduce (0 / 2)" in partly
    assert "ring_all_reduce is not implemented yet" in partly
    assert "checker cell check_ring_all_reduce stood above the cells it checks" in partly


def test_problems_are_reported(graded: dict) -> None:
    feedback, rows = graded["feedback"], graded["rows"]
    assert "cell 3: RuntimeError: a bug in a cell outside the checks" in feedback["raising"]
    assert f"time limit of {TIMEOUT:g} s reached" in feedback["hanging"]
    assert "NotRun" in feedback["hanging"] or "CellTimeoutError" in feedback["hanging"]
    assert "not a readable notebook" in feedback["malformed"]
    assert "not exercise 01_collectives: it holds the cells of 02_ddp" in feedback["different"]
    assert rows["empty"]["notes"] == "no exercise notebook found"
    assert rows["hanging"]["notes"].startswith(f"{EX01}: timeout")
    assert "02_ddp: missing" in rows["correct"]["notes"]


def test_a_raise_a_flood_and_deleted_files_harm_nothing_else(graded: dict) -> None:
    assert graded["feedback"]["raising"].count("[pass]") == 2  # the checkers after them still ran and passed
    assert (graded["submissions"] / "raising" / f"{EX01}.ipynb").exists()  # graded in a temporary copy
    assert (graded["submissions"] / "correct" / "notes.txt").exists()


def test_discover_layout(tmp_path: Path) -> None:
    (tmp_path / "ann" / "submitted").mkdir(parents=True)
    (tmp_path / "ann" / f"{EX01}.ipynb").write_text("{}")
    (tmp_path / "ann" / "submitted" / f"{EX01}.ipynb").write_text("{}")
    (tmp_path / "ann" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "ann" / ".ipynb_checkpoints" / f"{EX01}.ipynb").write_text("{}")
    (tmp_path / "ben" / "assignment1").mkdir(parents=True)
    (tmp_path / "ben" / "assignment1" / f"{EX01}.ipynb").write_text("{}")
    (tmp_path / "stray.ipynb").write_text("{}")
    found, ignored = grading.discover(tmp_path, [EX01, "02_ddp"])
    assert found == {"ann": {EX01: tmp_path / "ann" / f"{EX01}.ipynb"},
                     "ben": {EX01: tmp_path / "ben" / "assignment1" / f"{EX01}.ipynb"}}
    assert ignored["ann"] == [f"submitted/{EX01}.ipynb (a second {EX01}.ipynb; graded: {EX01}.ipynb)"]


def test_a_worker_past_the_hard_limit_is_killed(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "gradebook.db")  # reading it blocks forever: a worker that hangs before any kernel
    job = {"exercise": EX01, "gradebook": str(tmp_path / "gradebook.db"), "pid_file": str(tmp_path / "kernel.pid"),
           "result": str(tmp_path / "result.json")}
    result = grading._run_worker(job, tmp_path, hard_limit=1.0)
    assert result["status"] == "timeout" and "stopped this notebook after 1 s" in result["notes"][0]
    assert json.loads((tmp_path / "job.json").read_text())["exercise"] == EX01


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--solutions",
                     str(tmp_path / "none")]) == 2
    assert "no solution notebooks" in capsys.readouterr().err
    assert cli.main(["grade", str(tmp_path / "missing"), "--out", str(tmp_path / "g.csv")]) == 2
    assert "is not a folder of student folders" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["grade", str(tmp_path), "--out", "g.csv", "--timeout", "0"])
