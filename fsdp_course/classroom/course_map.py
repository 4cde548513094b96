"""The course map lesson 00 prints: each lesson's title, its exercise, and its reading time estimated from its text.

Read from the notebooks themselves (lessons/, exercises/ beside the package), so the map is never out of date."""

from __future__ import annotations

import json
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CODE_LINES_PER_MINUTE", "WORDS_PER_MINUTE", "Lesson", "course_map", "print_course_map"]

ROOT = Path(__file__).resolve().parents[2]
WORDS_PER_MINUTE = 150      # technical prose, read to be understood
CODE_LINES_PER_MINUTE = 10  # code lines (not blank) read with their output


@dataclass(frozen=True)
class Lesson:
    number: str           # "00" ... "19", "A1"
    title: str            # the lesson's heading, without its number
    exercise: str | None  # the exercise's heading, or None
    words: int            # of its markdown
    code_lines: int       # of its code cells, blank lines left out
    spine_words: int      # the same, before its "## Going deeper" part (all of it when it has none)
    spine_code_lines: int

    @property
    def minutes(self) -> int:
        """Reading time at WORDS_PER_MINUTE and CODE_LINES_PER_MINUTE, rounded up to 5 minutes."""
        return _minutes(self.words, self.code_lines)

    @property
    def spine_minutes(self) -> int:
        """The same for the spine only: what a learner reads before "Going deeper"."""
        return _minutes(self.spine_words, self.spine_code_lines)


def _minutes(words: int, code_lines: int) -> int:
    return 5 * math.ceil((words / WORDS_PER_MINUTE + code_lines / CODE_LINES_PER_MINUTE) / 5)


def _count(cells: list[dict]) -> tuple[int, int]:
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = sum(1 for c in cells if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines()
               if line.strip())
    return words, code


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _heading(cells: list[dict]) -> str:
    first = "".join(cells[0]["source"]).splitlines()[0] if cells else ""
    return re.sub(r"^#\s*(Exercise\s+)?[0-9A-Z]+\d*\s*·\s*", "", first).strip()


def course_map(root: Path | None = None) -> list[Lesson]:
    """Every lesson of `root`/lessons in order, with its exercise from `root`/exercises."""
    root = ROOT if root is None else Path(root)
    lessons = sorted((root / "lessons").glob("[0-9A]*.ipynb"))
    if not lessons:
        raise FileNotFoundError(f"no lessons in {root / 'lessons'}: the course map reads the notebooks beside the "
                                "package, so run it from a clone of the course (see README.md, make lab)")
    found = []
    for path in lessons:
        cells = _cells(path)
        number = path.stem.split("_")[0]
        exercise = next(iter(sorted((root / "exercises").glob(f"{number}_*.ipynb"))), None)
        deeper = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                       and "".join(c["source"]).startswith("## Going deeper")), len(cells))
        found.append(Lesson(number, _heading(cells), _heading(_cells(exercise)) if exercise else None,
                            *_count(cells), *_count(cells[:deeper])))
    return found


def print_course_map(root: Path | None = None, widths: tuple[int, int] = (52, 24)) -> None:
    """The map as a table: lesson (its heading, wrapped at `widths[0]`), exercise (its heading up to the colon, cut
    at `widths[1]`), minutes to read its spine, and all of it."""
    a, b = widths
    lessons = course_map(root)
    print(f"{'':<3} {'lesson':<{a}}  {'exercise':<{b}}  {'spine':>5} {'all':>3}")
    for lesson in lessons:
        exercise = (lesson.exercise or "-").split(": ", 1)[0]
        exercise = exercise if len(exercise) <= b else exercise[:b - 1] + "…"
        first, *more = textwrap.wrap(lesson.title, a)
        print(f"{lesson.number:<3} {first:<{a}}  {exercise:<{b}}  {lesson.spine_minutes:>5} {lesson.minutes:>3}")
        for line in more:
            print(f"{'':<3}   {line}")
    spine, total = (sum(getattr(m, k) for m in lessons) for k in ("spine_minutes", "minutes"))
    print(f"\n{len(lessons)} lessons; minutes of reading at {WORDS_PER_MINUTE} words and {CODE_LINES_PER_MINUTE} code "
          f"lines a minute, rounded up to 5: the spines about {spine / 60:.0f} hours, everything about "
          f"{total / 60:.0f} (running the cells and the exercises come on top)")
