"""`fsdp-course grade SUBMISSIONS --out grades.csv`: grade a class's exercise notebooks with nbgrader's machinery.

Design notes: docs/CLASSROOM.md, "Grading a class", `grading.py`.
"""

from __future__ import annotations

import csv
import html
import math
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["STATUSES", "InputError", "StudentGrades", "discover", "feedback_page", "grade", "run"]

STATUSES = ("ok", "error", "timeout", "invalid", "grader-error", "partial")  # from best to worst
STARTUP_GRACE = 90.0  # seconds a worker may take beyond --timeout (imports, kernel start, gradebook)


class InputError(ValueError):
    """Bad input to `grade` (the message says what to do); nothing was graded."""


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


def _check_output(out: Path, feedback: Path) -> None:
    """Fail before grading, not after it: --out names a file in a folder that exists and is writable."""
    if out.is_dir():
        raise InputError(f"--out {out} is a folder: name the CSV file to write, e.g. --out {out / 'grades.csv'}")
    if not out.parent.is_dir():
        raise InputError(f"--out {out}: its folder {out.parent} does not exist: create it, or write the CSV elsewhere")
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise InputError(f"--out {out}: you may not write there: write the CSV elsewhere")
    if feedback.exists() and not feedback.is_dir():
        raise InputError(f"--feedback {feedback} is a file: name a folder for the feedback files")


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def _check_layout(submissions: Path, found: dict[str, dict[str, Path]], exercises: list[str]) -> None:
    """Refuse a class with nothing to grade, or with notebooks outside student folders (they would get no row)."""
    flat = sorted(p.name for p in submissions.glob("*.ipynb"))
    if flat:
        seen = f"notebooks outside student folders ({_some(flat)})"
    elif not found:
        seen = "no student folder"
    elif not any(found.values()):
        seen = f"student folders ({_some(list(found))}) but no exercise notebook in them"
    else:
        return
    raise InputError(f"{submissions}/ holds {seen}. Expected one folder per student, named by the student's id, "
                     f"holding notebooks named like the exercises ({', '.join(exercises[:2])}, ...), e.g. "
                     f"{submissions}/alice/{exercises[0]}.ipynb: move each notebook into its student's folder")


def _worker(job: dict[str, Any], gradebook: str, send: Any) -> None:
    """The body of one worker process: its own session (the grader may kill it and all below it), no inherited
    terminal output (a kernel's C++ logs or a flood written to fd 2 go nowhere), a cwd that names nothing of
    the grader's, then autograde; the result goes back through the pipe `send`."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.chdir("/")
    from fsdp_course.classroom import autograde

    send.send(autograde.grade_notebook(job, gradebook))


def _unfinished(exercise: str, status: str, note: str) -> dict[str, Any]:
    """The result of a notebook the grader could not grade."""
    return {"exercise": exercise, "status": status, "checks": [], "errors": [], "notes": [note]}


def _run_worker(job: dict[str, Any], gradebook: str, hard_limit: float,
                stop: threading.Event | None = None) -> dict[str, Any]:
    """One notebook in its own worker process, with two folders made for it alone (the kernel's sandbox, and a
    private one for the kernel's connection file), removed after it. Past the hard limit, or once `stop` is
    set, the worker is killed with every process below it."""
    from fsdp_course.classroom.timed_execute import kill_tree

    def unfinished(status: str, note: str) -> dict[str, Any]:
        return _unfinished(job["exercise"], status, note)

    interrupted = unfinished("partial", "not graded: the grading was stopped (Ctrl-C or SIGTERM)")
    if stop is not None and stop.is_set():
        return interrupted
    context = multiprocessing.get_context("forkserver")  # forked from a server that imported nbgrader and torch once
    context.set_forkserver_preload(["fsdp_course.classroom.grading", "fsdp_course.classroom.autograde"])
    sandbox, private = tempfile.mkdtemp(prefix="fsdp_grade_"), tempfile.mkdtemp(prefix="fsdp_grade_")
    receive, send = context.Pipe(duplex=False)
    proc = context.Process(target=_worker, args=({**job, "sandbox": sandbox, "private": private}, gradebook, send),
                           name=f"fsdp-grade {job['exercise']}")
    deadline = time.monotonic() + hard_limit
    try:
        proc.start()
        send.close()  # the worker holds the only writing end: its end is our EOF
        while not receive.poll(0.5):
            if stop is not None and stop.is_set():
                return interrupted
            if time.monotonic() > deadline:
                return unfinished("grader-error", f"the grader stopped this notebook's worker after {hard_limit:g} s "
                                  f"(the notebook's own limit is {job['timeout']:g} s): grade it again")
        try:
            result = receive.recv()
        except EOFError:
            proc.join(10)
            return unfinished("grader-error", f"the grading worker exited with code {proc.exitcode} and no result")
        proc.join(10)
        return result
    finally:
        send.close()
        if proc.is_alive():
            kill_tree(proc.pid)
        if proc.pid is not None:
            proc.join()
        receive.close()
        shutil.rmtree(sandbox, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def grade(submissions: Path, out: Path, *, solutions: Path, feedback: Path | None = None, timeout: float = 180.0,
          jobs: int = 1, log: Callable[[str], None] = print,
          stop: threading.Event | None = None) -> list[StudentGrades]:
    """Grade every student folder in `submissions`; write the CSV `out` and one feedback file per student.
    Once `stop` is set (run() sets it on Ctrl-C and SIGTERM), the running notebooks are killed and the rest
    skipped, with status `partial`; the CSV and the feedback are written all the same. Bad input: InputError."""
    out = Path(out)
    feedback = Path(feedback) if feedback is not None else out.with_name(out.stem + "_feedback")
    _check_output(out, feedback)
    solution_paths = sorted(Path(solutions).glob("*.ipynb"))
    if not solution_paths:
        raise InputError(f"no solution notebooks in {solutions}/ (pass --solutions)")
    if not Path(submissions).is_dir():
        raise InputError(f"{submissions} is not a folder of student folders")
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
        raise InputError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    exercises = [p.stem for p in solution_paths]
    found, ignored = discover(Path(submissions), exercises)
    _check_layout(Path(submissions), found, exercises)

    from fsdp_course.classroom.autograde import build_gradebook, cell_order, gradebook_sql  # imports nbgrader: seconds

    log(f"building the gradebook from {len(solution_paths)} solution notebooks in {solutions}/")
    with tempfile.TemporaryDirectory(prefix="fsdp_grade_") as tmp:  # gone before any student's code runs
        max_scores = build_gradebook(solution_paths, Path(tmp) / "gradebook.db")
        gradebook = gradebook_sql(Path(tmp) / "gradebook.db")
    order = {p.stem: cell_order(p) for p in solution_paths}
    work = [(student, ex, path) for student, notebooks in found.items() for ex, path in notebooks.items()]
    most = 2 * (os.cpu_count() or 1)  # each notebook's kernel waits about half the time: two per core
    if jobs > most:
        log(f"{jobs} jobs is more than this machine can run ({os.cpu_count()} cores): {most} at a time")
        jobs = most
    log(f"grading {len(work)} notebooks of {len(found)} students, {jobs} at a time, {timeout:g} s each at most")
    results: dict[tuple[str, str], dict[str, Any]] = {}
    style = ""
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {}
        for student, ex, path in work:
            job = {"submission": str(path.resolve()), "exercise": ex, "student": student, "timeout": timeout,
                   "order": order}
            futures[pool.submit(_run_worker, job, gradebook, timeout + STARTUP_GRACE, stop)] = (student, ex)
        for future in as_completed(futures):
            student, ex = futures[future]
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001  (a grader bug: this notebook's row only, and the exit status)
                result = _unfinished(ex, "grader-error", f"grading failed: {type(exc).__name__}: {exc}")
            if result.get("html"):
                head, result["html"] = split_html(result["html"])
                style = style or head  # every page has nbgrader's same stylesheet: kept once
            results[student, ex] = result
            if result["status"] != "partial":
                score = sum(c["score"] for c in result["checks"])
                flagged = " FLAGGED" if result.get("flags") else ""
                log(f"  {student}/{ex}: {score:g} / {max_scores[ex]:g} {result['status']}{flagged}")
    graded = [StudentGrades(s, {ex: results.get((s, ex)) for ex in exercises}, ignored[s]) for s in found]
    write_csv(out, graded, exercises, max_scores)
    feedback.mkdir(parents=True, exist_ok=True)
    for g in graded:
        text = feedback_text(g, exercises, max_scores, timeout)
        (feedback / f"{g.student}.txt").write_text(text, encoding="utf-8")
        (feedback / f"{g.student}.html").write_text(feedback_page(g, exercises, text, style), encoding="utf-8")
    flagged = sorted(g.student for g in graded if any(r and r.get("flags") for r in g.results.values()))
    if flagged:
        log(f"FLAGGED (their notebooks touched the checking machinery; see their feedback): {', '.join(flagged)}")
    log(f"wrote {out} ({len(graded)} students) and {len(graded)} feedback files (.txt and .html) in {feedback}/")
    return graded


def write_csv(out: Path, graded: list[StudentGrades], exercises: list[str], max_scores: dict[str, float]) -> None:
    """student, one score per exercise, total, max_total, status, notes (what went wrong where)."""
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *exercises, "total", "max_total", "status", "notes"])
        total_max = sum(max_scores[ex] for ex in exercises)
        for g in sorted(graded, key=lambda g: g.student):
            notes = [f"{ex}: missing" if g.results[ex] is None else f"{ex}: {g.results[ex]['status']}"
                     for ex in exercises if g.results[ex] is None or g.results[ex]["status"] != "ok"]
            notes += [f"{ex}: FLAGGED: {'; '.join(result['flags'])}" for ex, result in g.results.items()
                      if result and result.get("flags")]
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
        lines += [f"  FLAGGED for the instructor: {flag}" for flag in result.get("flags", [])]
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


def split_html(page: str) -> tuple[str, str]:
    """An HTML page's <head> content and <body> content."""
    head = re.search(r"<head[^>]*>(.*?)</head>", page, re.S | re.I)
    body = re.search(r"<body[^>]*>(.*)</body>", page, re.S | re.I)
    return (head.group(1) if head else ""), (body.group(1) if body else page)


def feedback_page(g: StudentGrades, exercises: list[str], text: str, style: str) -> str:
    """One HTML page per student: the text feedback (scores, each failed check's report, notes, flags), then each
    graded notebook as nbgrader's generate_feedback shows it (its cells, outputs and per-cell scores)."""
    parts = [f"<!DOCTYPE html>\n<html>\n<head>\n<meta charset=\"utf-8\">\n"
             f"<title>Feedback for {html.escape(g.student)}</title>\n{style}\n</head>\n<body>",
             f'<div class="container"><h1>Feedback for {html.escape(g.student)}</h1>',
             f'<pre id="summary">{html.escape(text)}</pre>']
    for ex in exercises:
        result = g.results.get(ex)
        if result and result.get("html"):
            parts.append(f'<hr><h2 id="{html.escape(ex)}">{html.escape(ex)}</h2>\n{result["html"]}')
    parts.append("</div></body>\n</html>\n")
    return "\n".join(parts)


def run(args: Any) -> int:
    """The `grade` subcommand (see cli.py); returns the exit status (see above). Ctrl-C and SIGTERM stop the
    grading within a second or so, and the rows graded so far are written."""
    started = time.monotonic()
    stop, caught = threading.Event(), []

    def on_signal(signum: int, frame: Any) -> None:  # the first stops the grading; later ones (a terminal and
        caught.append(signum)  # `timeout` both send one, a second Ctrl-C) change nothing: what was graded is written
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        graded = grade(Path(args.submissions), Path(args.out), solutions=Path(args.solutions), feedback=args.feedback,
                       timeout=args.timeout, jobs=args.jobs, log=lambda line: print(line, flush=True), stop=stop)
    finally:
        if not caught:  # once stopped by one, the handlers stay: a second signal arriving after grade() returned
            for signum, handler in previous.items():  # would otherwise kill the process before it says what it wrote
                signal.signal(signum, handler)
    took = f"{time.monotonic() - started:.0f} s"
    if caught:
        partial = sum(g.status == "partial" for g in graded)
        print(f"stopped by {signal.Signals(caught[0]).name} after {took}: {len(graded) - partial} students graded, "
              f"{partial} with status partial (not or not fully graded: grade them again)", flush=True)
        return 128 + caught[0]
    failed = [g.student for g in graded if g.status == "grader-error"]
    bad = sum(g.status != "ok" for g in graded)
    print(f"done in {took}: {len(graded) - bad} students ok, {bad} with a problem (see the status and notes columns)")
    if failed:
        print(f"the grader failed on notebooks of {len(failed)} students ({', '.join(failed)}: status "
              "grader-error, see their feedback): grade them again")
        return 1
    return 0
