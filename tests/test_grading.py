"""`fsdp-course grade` on a class of fixture submissions made here, mostly of exercise 01.

One grading run (module fixture, through the CLI, 3 jobs) grades: a correct notebook, a partly correct one with
cells moved and removed, an untouched stub, one that raises (and floods its output, and deletes the files in its
folder), one that hangs (short --timeout), malformed JSON, one whose checker cells were edited, emptied and deleted,
another exercise saved under 01's name, an empty folder, a saboteur (deletes every gradebook it finds beside its
TMPDIR while the others are graded), and one that kills its grading worker. Two notebooks start a detached
`sleep` (start_new_session=True) and write its pid. Four try to game the checks: rebinding every check_* (module
attributes, the notebook's names, sys.modules), hiding the checkers' exceptions (an IPython custom exception
handler, sys.excepthook, printing the checkers' "passed" line), blanking the checker cells with an IPython input
transformer, and patching torch under a correct solution. The tests then read the CSV, the feedback (text and
HTML) and the pids.
Smaller runs (exercise 01 only, one student) check what is refused up front and Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from fsdp_course.classroom import cli, grading
from fsdp_course.classroom.autograde import _package_digest, _rewrite_checker

ROOT = Path(__file__).resolve().parents[1]
EX01 = "01_collectives"
TIMEOUT = 40.0  # seconds per notebook: a correct one needs a few (more on a loaded machine); the hanging one uses all


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


def _sleeper(pid_file: Path) -> str:
    """A cell that starts a process in a new session (out of the kernel's process group) and writes its pid."""
    return ("import subprocess\n"
            "sleeper = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(sleeper.pid))")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


SABOTEUR = """import glob, json, os, time
found, deadline = [], time.monotonic() + 4
tmpdir = os.environ["TMPDIR"]
while time.monotonic() < deadline:  # while the others are graded: every gradebook beside TMPDIR or one folder up
    for up in (os.path.dirname(tmpdir), os.path.dirname(os.path.dirname(tmpdir))):
        for path in glob.glob(os.path.join(up, "fsdp_grade_*", "**", "*.db"), recursive=True):
            found.append(path)
            os.remove(path)
    time.sleep(0.1)
json.dump({"found": found, "beside_tmpdir": sorted(os.listdir(os.path.dirname(tmpdir))),
           "cwd": os.getcwd(), "tmpdir_parent": os.path.dirname(tmpdir),
           "pwd": os.environ.get("PWD")}, open(%r, "w"))
"""


REBIND = """import sys
import fsdp_course.classroom.checks as checks
def passed(*args, **kwargs):
    print("All tests passed!")
fake = type(sys)("fsdp_course.classroom.checks")
for name, module in list(sys.modules.items()):
    if name.startswith("fsdp_course.classroom.checks") and module is not None:
        for attr in dir(module):
            if attr.startswith("check_"):
                setattr(module, attr, passed)
                setattr(fake, attr, passed)
                globals()[attr] = passed
sys.modules["fsdp_course.classroom.checks"] = fake
"""
HIDE = """import sys
get_ipython().set_custom_exc((BaseException,), lambda *args, **kwargs: print("All tests passed!"))
sys.excepthook = lambda *args: None
print("All tests in check_all_reduce passed!")
print("All tests in check_ring_all_reduce passed!")
"""
BLANK = """get_ipython().input_transformers_cleanup.append(
    lambda lines: ["pass\\n"] if any("check_" in line for line in lines) else lines)
"""
PATCH = """import torch
torch.equal = lambda *args, **kwargs: True
torch.allclose = lambda *args, **kwargs: True
"""


def _make_class(root: Path, spy: Path) -> None:
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
    partly.cells = [c for c in partly.cells if c.cell_type == "code" or "<summary><b>Hint" not in c.source]  # no hints
    put("partly", partly)

    put("stub", _exercise())
    for student, cell in (("rebinder", REBIND), ("hider", HIDE), ("blanker", BLANK)):  # stubs that game the checks
        gamed = _exercise()
        gamed.cells.insert(1, _code(cell))
        put(student, gamed)
    patcher = _solve(_exercise(), "my_all_reduce", "ring_all_reduce")
    patcher.cells.insert(1, _code(PATCH))
    put("patcher", patcher)

    raising = _solve(_exercise(), "my_all_reduce", "ring_all_reduce")  # and floods, and deletes its files
    raising.cells.insert(2, _code("raise RuntimeError('a bug in a cell outside the checks')"))
    raising.cells.insert(3, _code("for i in range(20000):\n    print('flood', i)\nprint('x' * 2_000_000)"))
    raising.cells.insert(4, _code("import os, shutil\nfor f in os.listdir('.'):\n    os.remove(f)\n"
                                  "shutil.rmtree('..', ignore_errors=True)"))
    put("raising", raising)

    saboteur = _solve(_exercise(), "my_all_reduce", "ring_all_reduce")
    saboteur.cells.insert(2, _code(SABOTEUR % str(spy / "saboteur.json")))
    saboteur.cells.insert(3, _code(_sleeper(spy / "saboteur.pid")))  # the notebook then ends normally
    put("saboteur", saboteur)

    killer = _exercise()
    killer.cells.insert(1, _code("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)  # the grading worker"))
    put("killer", killer)

    hanging = _exercise()
    hanging.cells.insert(2, _code(_sleeper(spy / "hanging.pid")))  # then its time limit stops it
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
    submissions, spy = root / "submissions", root / "spy"
    spy.mkdir()
    _make_class(submissions, spy)
    out = root / "grades.csv"
    leftovers = lambda: set(Path(tempfile.gettempdir()).glob("fsdp_grade_*"))  # noqa: E731
    before = leftovers()
    digest = _package_digest()
    status = cli.main(["grade", str(submissions), "--out", str(out), "--solutions", str(ROOT / "solutions"),
                       "--timeout", str(TIMEOUT), "--jobs", "3"])
    left = leftovers() - before
    with out.open() as f:
        rows = {row["student"]: row for row in csv.DictReader(f)}
    feedback = {p.stem: p.read_text() for p in (root / "grades_feedback").glob("*.txt")}
    html = {p.stem: p.read_text() for p in (root / "grades_feedback").glob("*.html")}
    return {"status": status, "rows": rows, "feedback": feedback, "submissions": submissions, "left": left,
            "spy": spy, "html": html, "files_changed": _package_digest() != digest}


def test_grading_leaves_no_temporary_folders(graded: dict[str, object]) -> None:
    # the jobs' folders and the kernels' TMPDIRs, also of the notebook that hangs and of the one that deletes '..'
    assert graded["left"] == set()


def test_one_row_and_one_feedback_file_per_student(graded: dict) -> None:
    students = {"correct", "different", "empty", "hanging", "killer", "malformed", "partly", "raising", "saboteur",
                "stub", "tampered", "rebinder", "hider", "blanker", "patcher"}
    assert set(graded["rows"]) == students
    assert set(graded["feedback"]) == students
    assert set(graded["html"]) == students
    header = list(next(iter(graded["rows"].values())))
    exercises = sorted(p.stem for p in (ROOT / "solutions").glob("*.ipynb"))
    assert header == ["student", *exercises, "total", "max_total", "status", "notes"]


@pytest.mark.parametrize(("student", "score", "status"), [
    ("correct", "5", "ok"),
    ("partly", "3", "ok"),
    ("stub", "0", "ok"),
    ("raising", "5", "error"),
    ("saboteur", "5", "ok"),
    ("killer", "0", "grader-error"),
    ("hanging", "0", "timeout"),
    ("malformed", "0", "invalid"),
    ("different", "0", "invalid"),
    ("empty", "0", "invalid"),
    ("rebinder", "0", "ok"),
    ("hider", "0", "ok"),
    ("blanker", "0", "ok"),
    ("patcher", "0", "ok"),
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
    assert "FLAGGED for the instructor: cell 2 rebinds a check_* name" in text
    assert "FLAGGED for the instructor: 2 names in the notebook's namespace were rebound: check_all_reduce, " \
           "check_ring_all_reduce" in text
    # its HTML page too: nbgrader's template on a notebook whose deleted checker cells were added back
    assert "Grade cell: <code>check_ring_all_reduce</code>" in graded["html"]["tampered"]


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


def test_rebinding_the_checks_gains_nothing_and_is_flagged(graded: dict) -> None:
    text, row = graded["feedback"]["rebinder"], graded["rows"]["rebinder"]
    assert "[FAIL] check_all_reduce (0 / 3)" in text and "[FAIL] check_ring_all_reduce (0 / 2)" in text
    assert "my_all_reduce is not implemented yet" in text  # the grader's own copy of the checks ran on the stub
    assert "names in fsdp_course.classroom.checks were replaced: check_" in text  # module attributes
    assert "names in fsdp_course.classroom.checks.collectives were replaced: check_" in text
    assert "FLAGGED for the instructor: sys.modules['fsdp_course.classroom.checks'] was replaced" in text
    assert "names in the notebook's namespace were rebound: check_" in text
    assert f"{EX01}: FLAGGED: " in row["notes"]


def test_hiding_the_checkers_errors_gains_nothing_and_is_flagged(graded: dict) -> None:
    hider, blanker = graded["feedback"]["hider"], graded["feedback"]["blanker"]
    assert "[FAIL] check_all_reduce (0 / 3)" in hider  # printing "passed" scores nothing either
    assert "FLAGGED for the instructor: cell 2 sets an IPython custom exception handler" in hider
    assert "FLAGGED for the instructor: an IPython custom exception handler (set_custom_exc) changed" in hider
    assert "FLAGGED for the instructor: cell 2 sets sys.excepthook" in hider
    assert "[FAIL] check_all_reduce (0 / 3)" in blanker
    assert "GraderCheckIncomplete: the checker cell did not run to its end as the grader wrote it" in blanker
    assert "FLAGGED for the instructor: cell 2 changes how IPython runs cells" in blanker


def test_patching_what_the_checks_use_fails_them_and_is_flagged(graded: dict) -> None:
    text = graded["feedback"]["patcher"]  # a correct solution, with torch.equal and torch.allclose replaced
    assert "CheckingMachineryModified: this check is not scored: the notebook modified what the checker relies on " \
           "(2 names in torch were replaced: allclose, equal)" in text
    assert "FLAGGED for the instructor: 2 names in torch were replaced: allclose, equal" in text


def test_an_honest_notebook_is_not_flagged(graded: dict) -> None:
    changed = "FLAGGED for the instructor: the course's files on disk changed while this notebook ran"
    for student in ("correct", "partly", "stub"):
        text = graded["feedback"][student]
        if graded["files_changed"]:  # someone edited the package during the run: that flag is right
            text = "\n".join(line for line in text.splitlines() if changed not in line)
        assert "FLAGGED" not in text
        assert graded["files_changed"] or "FLAGGED" not in graded["rows"][student]["notes"]


def test_html_feedback_per_student(graded: dict) -> None:
    page = graded["html"]["partly"]
    assert page.startswith("<!DOCTYPE html>") and "<title>Feedback for partly</title>" in page
    assert "[FAIL] check_ring_all_reduce (0 / 2)" in page  # the summary
    # nbgrader's feedback template: the notebook's cells, each checker cell with its score
    assert 'Grade cell: <code>check_ring_all_reduce</code>' in page and "Score: 0.0 / 2.0" in page
    assert "Score: 3.0 / 3.0" in page and "ring_all_reduce is not implemented yet" in page
    assert page.count("bootstrap") < 10  # nbgrader's stylesheet once, not once per notebook
    assert "not submitted (expected 02_ddp.ipynb)" in page


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


def test_a_notebook_cannot_reach_the_gradebook_nor_the_other_students(graded: dict) -> None:
    spy = json.loads((graded["spy"] / "saboteur.json").read_text())
    assert spy["found"] == []  # no gradebook file exists while notebooks run
    assert spy["beside_tmpdir"] == ["tmp", "work"]  # the kernel's TMPDIR and cwd share a folder of their own
    assert os.path.dirname(os.path.dirname(spy["cwd"])) == spy["tmpdir_parent"]
    assert spy["pwd"] is None  # the environment names no folder of the grader's
    for student in ("correct", "partly", "stub", "tampered"):  # graded before, beside and after the saboteur
        assert graded["rows"][student]["status"] in ("ok", "invalid"), graded["rows"][student]


def test_a_worker_failure_is_one_row_and_the_exit_status(graded: dict) -> None:
    assert graded["status"] == 1  # not every notebook could be graded
    assert "the grading worker exited with code -9 and no result" in graded["feedback"]["killer"]
    assert graded["rows"]["correct"]["status"] == "ok"


def test_no_process_outlives_its_notebook(graded: dict) -> None:
    # a sleep started in a new session, by a notebook that ended and by one its time limit stopped
    for name in ("saboteur.pid", "hanging.pid"):
        pid = int((graded["spy"] / name).read_text())
        assert not _alive(pid), f"{name}: process {pid} still runs"


def test_kill_tree_finds_processes_in_other_sessions() -> None:
    from fsdp_course.classroom.timed_execute import kill_tree

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                               "p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
                               "print(p.pid, flush=True)\ntime.sleep(600)"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    kill_tree(parent.pid)
    assert parent.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_worker_past_the_hard_limit_is_killed(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "sub.ipynb")  # reading it blocks forever: a worker that hangs before any kernel
    job = {"submission": str(tmp_path / "sub.ipynb"), "exercise": EX01, "student": "x", "timeout": 0.5, "order": {}}
    before = set(Path(tempfile.gettempdir()).glob("fsdp_grade_*"))
    result = grading._run_worker(job, "", hard_limit=1.0)
    assert result["status"] == "grader-error"
    assert "stopped this notebook's worker after 1 s" in result["notes"][0]
    assert set(Path(tempfile.gettempdir()).glob("fsdp_grade_*")) <= before  # its folders are removed


def _one_student(tmp_path: Path, notebook: nbformat.NotebookNode | None) -> tuple[Path, Path]:
    """A class of one (exercise 01 only, so the gradebook builds fast): (submissions, solutions)."""
    solutions, submissions = tmp_path / "solutions", tmp_path / "submissions"
    solutions.mkdir()
    shutil.copy(ROOT / "solutions" / f"{EX01}.ipynb", solutions)
    (submissions / "ann").mkdir(parents=True)
    if notebook is not None:
        nbformat.write(notebook, submissions / "ann" / f"{EX01}.ipynb")
    return submissions, solutions


def test_nothing_to_grade_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    submissions, solutions = _one_student(tmp_path, None)
    args = ["grade", str(submissions), "--out", str(tmp_path / "g.csv"), "--solutions", str(solutions)]
    assert cli.main(args) == 2  # a student folder, but no exercise notebook in it
    assert "student folders (ann) but no exercise notebook in them" in capsys.readouterr().err
    (submissions / "ann").rmdir()
    assert cli.main(args) == 2  # an empty class
    err = capsys.readouterr().err
    assert "holds no student folder" in err and f"/alice/{EX01}.ipynb" in err
    (submissions / "ann.ipynb").write_text("{}")
    (submissions / "bob.ipynb").write_text("{}")
    assert cli.main(args) == 2  # notebooks placed flat
    assert "notebooks outside student folders (ann.ipynb, bob.ipynb)" in capsys.readouterr().err
    assert not (tmp_path / "g.csv").exists()


def test_a_bad_out_fails_before_grading(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_course.classroom import autograde

    def no_gradebook(*args: object, **kwargs: object) -> None:
        raise AssertionError("a bad --out must be refused before the gradebook is built")

    monkeypatch.setattr(autograde, "build_gradebook", no_gradebook)
    submissions, solutions = _one_student(tmp_path, _exercise())
    for out, message in [(tmp_path, "is a folder: name the CSV file to write"),
                         (tmp_path / "nowhere" / "g.csv", "does not exist: create it")]:
        assert cli.main(["grade", str(submissions), "--out", str(out), "--solutions", str(solutions)]) == 2
        assert message in capsys.readouterr().err  # refused before the gradebook, let alone any notebook


def test_ctrl_c_and_sigterm_stop_promptly_and_write_what_was_graded(tmp_path: Path) -> None:
    runs = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        folder = tmp_path / signum.name
        folder.mkdir()
        hanging = _exercise()
        hanging.cells.insert(1, _code(_sleeper(folder / "sleeper.pid") + "\nimport time\ntime.sleep(3600)"))
        submissions, solutions = _one_student(folder, hanging)
        tmp = Path(tempfile.mkdtemp(prefix="fg"))  # the run's own TMPDIR, short (Unix socket paths), to check
        proc = subprocess.Popen([sys.executable, "-m", "fsdp_course.classroom.cli", "grade", str(submissions), "--out",
                                 str(folder / "g.csv"), "--solutions", str(solutions), "--timeout", "600"],
                                cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        runs[signum] = (folder, tmp, proc)
    try:
        for signum, (folder, tmp, proc) in runs.items():
            deadline = time.monotonic() + 300  # imports, the gradebook, a worker and a kernel on a loaded machine
            while not (folder / "sleeper.pid").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert (folder / "sleeper.pid").exists(), proc.communicate(timeout=60)[0]
            time.sleep(0.5)
            proc.send_signal(signum)
            sent = time.monotonic()
            while proc.poll() is None and time.monotonic() - sent < 60:  # more, until it has exited: a terminal's
                time.sleep(0.02)  # Ctrl-C and `timeout`'s, or a user pressing again; some land as Python shuts down
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)
            output = proc.communicate(timeout=60)[0]
            took = time.monotonic() - sent
            assert proc.returncode == 128 + signum, output
            assert took < 45, output  # a few seconds; the rest is room for a loaded machine (the kernel sleeps 3600 s)
            assert f"stopped by {signum.name}" in output
            with (folder / "g.csv").open() as f:
                (row,) = csv.DictReader(f)
            assert (row["student"], row["status"], row[EX01]) == ("ann", "partial", "0")
            assert "not graded: the grading was stopped" in (folder / "g_feedback" / "ann.txt").read_text()
            assert not _alive(int((folder / "sleeper.pid").read_text()))
            assert sorted(p.name for p in tmp.iterdir()) == []  # no fsdp_grade_*, pymp-*, kernel sockets
    finally:
        for _, tmp, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(tmp, ignore_errors=True)


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--solutions",
                     str(tmp_path / "none")]) == 2
    assert "no solution notebooks" in capsys.readouterr().err
    assert cli.main(["grade", str(tmp_path / "missing"), "--out", str(tmp_path / "g.csv")]) == 2
    assert "is not a folder of student folders" in capsys.readouterr().err
    for value, says in (("0", "must be positive, got 0"), ("nan", "must be a finite number, got nan"),
                        ("inf", "must be a finite number, got inf")):  # nan and inf: every notebook a timeout
        with pytest.raises(SystemExit):
            cli.main(["grade", str(tmp_path), "--out", "g.csv", "--timeout", value])
        assert says in capsys.readouterr().err
    with pytest.raises(grading.InputError, match="timeout must be a positive, finite number of seconds, got nan"):
        grading.grade(tmp_path, tmp_path / "g.csv", solutions=ROOT / "solutions", timeout=float("nan"))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux's /proc")
def test_kill_tree_finds_a_process_whose_name_is_not_utf8() -> None:
    """/proc/PID/stat holds the command name as raw bytes: one that is not UTF-8 must not hide the process."""
    from fsdp_course.classroom.timed_execute import _parent_pids

    code = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x\\xff\\xfe', 0, 0, 0); print(1, flush=True); " \
           "time.sleep(60)"  # PR_SET_NAME
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # the name is set
        assert _parent_pids().get(child.pid) == os.getpid()
    finally:
        child.kill()
        child.wait()


def test_the_default_solutions_are_the_checkouts_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Run from another folder, `fsdp-course grade` finds the solutions beside the package (an -e checkout)."""
    from fsdp_course.classroom.cli import default_solutions

    monkeypatch.chdir(tmp_path)
    found = default_solutions()
    assert found.is_dir() and any(found.glob("*.ipynb")), found
    assert found.resolve() == (Path(__file__).resolve().parents[1] / "solutions")


def test_more_jobs_than_the_machine_can_run_are_capped_and_said(tmp_path: Path) -> None:
    submissions, solutions = _one_student(tmp_path, None)
    (submissions / "ann" / f"{EX01}.ipynb").write_text("not json")  # graded at once: invalid, no kernel
    lines: list[str] = []
    graded = grading.grade(submissions, tmp_path / "g.csv", solutions=solutions, jobs=10_000, log=lines.append)
    most = 2 * (os.cpu_count() or 1)
    assert f"10000 jobs is more than this machine can run ({os.cpu_count()} cores): {most} at a time" in lines
    assert [g.status for g in graded] == ["invalid"]


def test_a_checker_cell_is_rewritten_to_the_private_copy_and_a_submodule_import_is_refused() -> None:
    """The guard hands out the checks package's functions: a checker cell importing a submodule would get the public
    copy a notebook can rebind, so the grader refuses it and says what to write instead."""
    rewritten = _rewrite_checker("from fsdp_course.classroom.checks import check_ddp\ncheck_ddp(f)", "_g", "c1", "n1")
    assert rewritten.splitlines() == ["_g.begin('c1')", "check_ddp = _g.get('check_ddp')  # the grader's own copy",
                                      "check_ddp(f)", "_g.done('c1', 'n1')"]
    with pytest.raises(ValueError, match=r"imports from fsdp_course\.classroom\.checks\.ddp: import its checks from"):
        _rewrite_checker("from fsdp_course.classroom.checks.ddp import check_ddp\ncheck_ddp(f)", "_g", "c1", "n1")
