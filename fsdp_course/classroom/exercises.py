"""Generate the learners' exercise notebooks from the solution notebooks, the single source of each exercise.

Cites nbgrader's ClearSolutions, ClearHiddenTests and ClearOutput preprocessors.
Design notes: docs/CLASSROOM.md, "The authors' tools", `exercises.py`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import nbformat
from nbgrader.preprocessors import ClearHiddenTests, ClearOutput, ClearSolutions

__all__ = ["check", "exercise_json", "generate", "main"]

_VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled")


def exercise_json(solution: Path) -> str:
    """The exercise notebook generated from one solution notebook, as the exact text to write."""
    nb = nbformat.read(solution, as_version=4)
    for pp in (ClearSolutions(), ClearHiddenTests(), ClearOutput()):
        nb, _ = pp.preprocess(nb, {})
    for cell in nb.cells:
        for key in _VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
    return nbformat.writes(nb) + "\n"


def generate(solutions_dir: Path = Path("solutions"), exercises_dir: Path = Path("exercises")) -> list[Path]:
    """Write `exercises_dir/<name>` for every `solutions_dir/*.ipynb`; returns the paths written.

    A file is rewritten only when its text changes, so an unchanged exercise keeps its timestamp.
    """
    solutions = sorted(Path(solutions_dir).glob("*.ipynb"))
    if not solutions:
        raise FileNotFoundError(f"no solution notebooks in {solutions_dir}/")
    Path(exercises_dir).mkdir(parents=True, exist_ok=True)
    written = []
    for solution in solutions:
        target = Path(exercises_dir) / solution.name
        text = exercise_json(solution)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        written.append(target)
    return written


def check(solutions_dir: Path = Path("solutions"), exercises_dir: Path = Path("exercises")) -> list[str]:
    """Regenerate into a temporary folder and list how `exercises_dir` differs (empty: in sync)."""
    problems = []
    with tempfile.TemporaryDirectory(prefix="fsdp_course_exercises_") as tmp:
        fresh = {p.name: p for p in generate(solutions_dir, Path(tmp))}
        present = {p.name: p for p in Path(exercises_dir).glob("*.ipynb")}
        for name in sorted(fresh.keys() - present.keys()):
            problems.append(f"{exercises_dir}/{name} is missing")
        for name in sorted(present.keys() - fresh.keys()):
            problems.append(f"{exercises_dir}/{name} has no solutions/{name} to come from")
        for name in sorted(fresh.keys() & present.keys()):
            if fresh[name].read_bytes() != present[name].read_bytes():
                problems.append(f"{exercises_dir}/{name} differs from what solutions/{name} generates")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line: `generate` or `check`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m fsdp_course.classroom.exercises",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("generate", "check"))
    parser.add_argument("--solutions", type=Path, default=Path("solutions"), help="default: solutions")
    parser.add_argument("--exercises", type=Path, default=Path("exercises"), help="default: exercises")
    args = parser.parse_args(argv)
    if args.command == "generate":
        for path in generate(args.solutions, args.exercises):
            print(f"wrote {path}")
        return 0
    problems = check(args.solutions, args.exercises)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print("run `make exercises` to regenerate", file=sys.stderr)
        return 1
    print(f"{args.exercises}/ is in sync with {args.solutions}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
