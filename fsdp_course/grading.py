"""`fsdp-course grade SUBMISSIONS --out grades.csv`: grade a class's exercise notebooks with nbgrader's machinery.

For instructors who do not run an nbgrader course directory. The layout of SUBMISSIONS:

    SUBMISSIONS/
        alice/01_collectives.ipynb       one folder per student (the folder's name is the student's id),
        alice/02_ddp.ipynb               holding notebooks named like the exercises in solutions/
        bob/01_collectives.ipynb         (nbgrader's submitted/<student>/<assignment>/ works too: the
        bob/extra/notes.ipynb            notebooks are searched in subfolders; other files are ignored)

What happens (see autograde.py for each nbgrader preprocessor):
1. one gradebook is built from solutions/ (nbgrader's SaveCells), holding every checker cell as the
   instructor wrote it, hidden tests included;
2. every submitted notebook is graded in its own worker process (`--jobs` at once): nbgrader's
   sanitizing pass puts the instructor's checker cells back (edited, emptied or deleted ones), then
   the notebook runs in a fresh kernel in a private temporary directory holding only a copy of it,
   with one time limit for all its cells (`--timeout`), and nbgrader's SaveAutoGrades scores it;
3. one CSV row per student (score per exercise, total, status) and one feedback file per student
   (what passed, what failed with the checker's report, what was restored or went wrong).

Status of a notebook, and of a student (the worst of their notebooks): `ok` (it ran; checks may have
failed), `error` (a cell outside the checks raised, or the kernel died), `timeout` (the time limit
stopped it; the cells after were not run, and score 0), `invalid` (not a readable notebook, or not
this exercise). A notebook not submitted scores 0 and is listed in the notes.

Grading runs the students' code with your permissions. The isolation is a separate process, a
temporary directory and a time limit, nothing more: grade untrusted submissions inside a container
or a virtual machine.
"""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STATUSES", "StudentGrades", "discover", "grade"]

STATUSES = ("ok", "error", "timeout", "invalid")  # from best to worst
STARTUP_GRACE = 90.0  # seconds a worker may take beyond --timeout (imports, kernel start, gradebook)


@dataclass
class StudentGrades:
    """One student's results: per exercise the worker's result (or None when not submitted)."""

    student: str
    results: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # files that are not an exercise notebook

    def score(self, exercise: str) -> float:
        result = self.results.get(exercise)
        return sum(c["score"] for c in result["checks"]) if result else 0.0

    @property
    def status(self) -> str:
        found = [r["status"] for r in self.results.values() if r]
        return max(found, key=STATUSES.index) if found else "invalid"


def discover(submissions: Path, exercises: list[str]) -> tuple[dict[str, dict[str, Path]], dict[str, list[str]]]:
    """Per student folder: {exercise: notebook path}, and the files ignored (relative paths, with why)."""
    found: dict[str, dict[str, Path]] = {}
    ignored: dict[str, list[str]] = {}
    for folder in sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found[folder.name], ignored[folder.name] = {}, []
        notebooks = sorted((p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts),
                           key=lambda p: (len(p.parts), str(p)))
        for path in notebooks:
            rel = str(path.relative_to(folder))
            if path.stem not in exercises:
                ignored[folder.name].append(f"{rel} (not an exercise's name)")
            elif path.stem in found[folder.name]:
                ignored[folder.name].append(f"{rel} (a second {path.name}; graded: "
                                            f"{found[folder.name][path.stem].relative_to(folder)})")
            else:
                found[folder.name][path.stem] = path
    return found, ignored


def _kill_group(pid: int) -> None:
    if pid > 1:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _worker(job_file: str) -> None:
    """The body of one worker process: its own session (so it and what it starts can be killed as a group),
    no inherited terminal output (a kernel's C++ logs or a flood written to fd 2 go nowhere), then autograde."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    from fsdp_course import autograde  # main() limits OMP_NUM_THREADS: several workers' kernels share the cores

    autograde.main([job_file])


def _workers() -> Any:
    """Worker processes forked from a server that has imported nbgrader and torch once (seconds per notebook)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fsdp_course.grading", "fsdp_course.autograde"])
    return context


def _run_worker(job: dict[str, Any], folder: Path, hard_limit: float) -> dict[str, Any]:
    """One notebook in its own worker process; killed, with its kernel, past the hard limit."""
    job_file = folder / "job.json"
    job_file.write_text(json.dumps(job))
    proc = _workers().Process(target=_worker, args=(str(job_file),), name=f"fsdp-grade {job['exercise']}")
    proc.start()
    proc.join(hard_limit)
    if proc.is_alive():
        _kill_group(proc.pid)
        pid_file = Path(job["pid_file"])
        if pid_file.exists():  # the kernel runs in its own session
            _kill_group(int(pid_file.read_text() or 0))
        proc.kill()
        proc.join()
        return {"exercise": job["exercise"], "status": "timeout", "checks": [], "errors": [],
                "notes": [f"the grader stopped this notebook after {hard_limit:g} s"]}
    try:
        return json.loads(Path(job["result"]).read_text())
    except (OSError, ValueError):
        return {"exercise": job["exercise"], "status": "error", "checks": [], "errors": [],
                "notes": [f"the grading worker exited with code {proc.exitcode} and no result"]}


def grade(submissions: Path, out: Path, *, solutions: Path, feedback: Path | None = None, timeout: float = 180.0,
          jobs: int = 1, max_output_chars: int = 20_000, log: Callable[[str], None] = print) -> list[StudentGrades]:
    """Grade every student folder in `submissions`; write the CSV `out` and one feedback file per student."""
    from fsdp_course.autograde import build_gradebook, cell_order  # imports nbgrader: seconds

    solution_paths = sorted(Path(solutions).glob("*.ipynb"))
    if not solution_paths:
        raise FileNotFoundError(f"no solution notebooks in {solutions}/ (pass --solutions)")
    if not Path(submissions).is_dir():
        raise NotADirectoryError(f"{submissions} is not a folder of student folders")
    exercises = [p.stem for p in solution_paths]
    found, ignored = discover(Path(submissions), exercises)
    feedback = Path(feedback) if feedback is not None else Path(out).with_name(Path(out).stem + "_feedback")
    with tempfile.TemporaryDirectory(prefix="fsdp_grade_") as tmp:
        db = Path(tmp) / "gradebook.db"
        log(f"building the gradebook from {len(solution_paths)} solution notebooks in {solutions}/")
        max_scores = build_gradebook(solution_paths, db)
        order = {p.stem: cell_order(p) for p in solution_paths}
        work = [(student, ex, path) for student, notebooks in found.items() for ex, path in notebooks.items()]
        log(f"grading {len(work)} notebooks of {len(found)} students, {jobs} at a time, "
            f"{timeout:g} s each at most")
        results: dict[tuple[str, str], dict[str, Any]] = {}
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = {}
            for i, (student, ex, path) in enumerate(work):
                folder = Path(tmp) / f"job{i}"
                folder.mkdir()
                job = {"submission": str(path.resolve()), "exercise": ex, "student": student, "gradebook": str(db),
                       "timeout": timeout, "order": order, "result": str(folder / "result.json"),
                       "pid_file": str(folder / "kernel.pid"), "max_output_chars": max_output_chars}
                futures[pool.submit(_run_worker, job, folder, timeout + STARTUP_GRACE)] = (student, ex)
            for future in as_completed(futures):
                student, ex = futures[future]
                result = results[student, ex] = future.result()
                score = sum(c["score"] for c in result["checks"])
                log(f"  {student}/{ex}: {score:g} / {max_scores[ex]:g} {result['status']}")
    graded = [StudentGrades(s, {ex: results.get((s, ex)) for ex in exercises}, ignored[s]) for s in found]
    write_csv(Path(out), graded, exercises, max_scores)
    feedback.mkdir(parents=True, exist_ok=True)
    for g in graded:
        (feedback / f"{g.student}.txt").write_text(feedback_text(g, exercises, max_scores, timeout), encoding="utf-8")
    log(f"wrote {out} ({len(graded)} students) and {len(graded)} feedback files in {feedback}/")
    return graded


def write_csv(out: Path, graded: list[StudentGrades], exercises: list[str], max_scores: dict[str, float]) -> None:
    """student, one score per exercise, total, max_total, status, notes (what went wrong where)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *exercises, "total", "max_total", "status", "notes"])
        total_max = sum(max_scores[ex] for ex in exercises)
        for g in sorted(graded, key=lambda g: g.student):
            notes = [f"{ex}: missing" if g.results[ex] is None else f"{ex}: {g.results[ex]['status']}"
                     for ex in exercises if g.results[ex] is None or g.results[ex]["status"] != "ok"]
            if not any(g.results.values()):
                notes = ["no exercise notebook found"]
            scores = [g.score(ex) for ex in exercises]
            writer.writerow([g.student, *(f"{s:g}" for s in scores), f"{sum(scores):g}", f"{total_max:g}", g.status,
                             "; ".join(notes)])


def feedback_text(g: StudentGrades, exercises: list[str], max_scores: dict[str, float], timeout: float) -> str:
    """What passed and what failed, per exercise, with the checkers' reports."""
    total = sum(g.score(ex) for ex in exercises)
    lines = [f"Feedback for {g.student}: {total:g} / {sum(max_scores.values()):g} points, status {g.status}",
             f"(each notebook ran from the top in a fresh kernel, at most {timeout:g} s, with the original checker "
             "cells)", ""]
    for ex in exercises:
        result = g.results[ex]
        if result is None:
            lines += [f"## {ex}: 0 / {max_scores[ex]:g}: not submitted (expected {ex}.ipynb)", ""]
            continue
        lines.append(f"## {ex}: {g.score(ex):g} / {max_scores[ex]:g}, {result['status']}")
        lines += [f"  note: {note}" for note in result.get("notes", [])]
        for check in result["checks"]:
            passed = check["score"] >= check["max_score"]
            lines.append(f"  [{'pass' if passed else 'FAIL'}] {check['grade_id']} "
                         f"({check['score']:g} / {check['max_score']:g})")
            if not passed:
                output = check.get("output") or "(no output)"
                if "Error" not in output and "FAILED" not in output:
                    output += "\n(no error shown: nbgrader scores a checker cell that writes to stderr as failed)"
                lines += [f"      {line}" for line in output.splitlines()]
        if result.get("errors"):
            lines.append("  errors outside the checkers:")
            lines += [f"      {e}" for e in result["errors"]]
        lines.append("")
    if g.ignored:
        lines.append("ignored files: " + "; ".join(g.ignored))
    return "\n".join(lines).rstrip("\n") + "\n"


def run(args: Any) -> int:
    """The `grade` subcommand (see cli.py); returns the exit status."""
    started = time.monotonic()
    graded = grade(Path(args.submissions), Path(args.out), solutions=Path(args.solutions), feedback=args.feedback,
                   timeout=args.timeout, jobs=args.jobs, log=lambda line: print(line, flush=True))
    bad = sum(g.status != "ok" for g in graded)
    print(f"done in {time.monotonic() - started:.0f} s: {len(graded) - bad} students ok, {bad} with a problem "
          "(see the status and notes columns)")
    return 0
