"""The `fsdp-course` command: `grade` a class's notebooks, regenerate or `check` the exercises.

Design notes: docs/CLASSROOM.md, "The classroom", `cli.py`.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from pathlib import Path

__all__ = ["default_solutions", "main"]


def default_solutions() -> Path:
    """solutions/ in the current folder, else the one beside this package (a checkout installed with -e)."""
    here = Path("solutions")
    if here.is_dir():
        return here
    return Path(__file__).resolve().parents[2] / "solutions"  # fsdp_course/classroom/cli.py -> the checkout


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        value = kind(text)
        if not math.isfinite(value):  # nan and inf compare false with everything: every notebook would time out
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text} (e.g. 600 for ten minutes)")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-course", description="The fsdp-course command line.")
    sub = parser.add_subparsers(dest="command", required=True)
    grade = sub.add_parser(
        "grade", help="grade a folder of submitted exercise notebooks",
        description="Grade SUBMISSIONS/<student>/<NN_topic>.ipynb with nbgrader's preprocessors: the instructor's "
                    "checker cells are restored, each notebook runs in a fresh kernel in a temporary folder with a "
                    "time limit; the checker cells use the grader's own copy of the checks, and a notebook that "
                    "touches the checking machinery is flagged in the feedback and the CSV's notes. WARNING: this "
                    "runs the students' code with your permissions; grade untrusted submissions inside a container "
                    "or a VM.",
        epilog="Exit status: 0 every notebook graded; 1 the grader failed on some (rows with status grader-error: "
               "grade them again); 2 bad input, nothing graded; 130 (Ctrl-C) or 143 (SIGTERM) stopped: the CSV "
               "holds the rows graded so far, the others have status partial.")
    grade.add_argument("submissions", type=Path, help="a folder with one folder per student")
    grade.add_argument("--out", type=Path, required=True, help="the CSV to write (one row per student)")
    grade.add_argument("--feedback", type=Path, default=None,
                       help="folder for the feedback, STUDENT.txt and STUDENT.html per student (default: "
                            "<out>_feedback beside the CSV)")
    grade.add_argument("--solutions", type=Path, default=None, help="the instructor's notebooks (default: solutions/)")
    grade.add_argument("--timeout", type=_positive(float), default=180.0,
                       help="seconds for all cells of one notebook (default 180)")
    grade.add_argument("--jobs", type=_positive(int), default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                       help="notebooks graded at once (default: half the cores, at most 4; at most twice the cores)")
    exercises = sub.add_parser("exercises", help="regenerate exercises/ from solutions/, or check they are in sync")
    exercises.add_argument("action", choices=("generate", "check"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:  # nbgrader and nbconvert come with the classroom extra, not with a student's install
        if args.command == "grade":
            from fsdp_course.classroom import grading
        else:
            from fsdp_course.classroom import exercises
    except ImportError as exc:
        print(f"fsdp-course {args.command}: {exc.name or exc} is missing: it comes with the classroom extra; "
              "install it with: pip install -e '.[classroom]' (in the course's folder)", file=sys.stderr)
        return 2
    if args.command == "grade":
        args.solutions = args.solutions or default_solutions()
        try:
            return grading.run(args)  # exit status: 0 all graded, 1 some not, 130/143 stopped (see grading.py)
        except grading.InputError as exc:
            print(f"fsdp-course grade: {exc}", file=sys.stderr)
            return 2
    return exercises.main([args.action])


def entry() -> None:
    """The `fsdp-course` command: `main`, then exit with its status. After a stop by Ctrl-C or SIGTERM (130, 143)
    further signals are ignored: Python resets its handlers while it shuts down, and a second Ctrl-C landing then
    (a terminal and `timeout` each send one) would kill the process by the signal, hiding the status."""
    status = main()
    if status in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)  # kept through shutdown, unlike a Python handler
    sys.exit(status)


if __name__ == "__main__":
    entry()
