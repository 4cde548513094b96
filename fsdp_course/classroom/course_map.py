"""The course map lesson 00 prints: each lesson's title, its exercise, and its reading time estimated from its text.

Read from the notebooks themselves (lessons/, exercises/ beside the package), so the map is never out of date; in
Chinese (`fsdp_course.i18n.language()`) with the Chinese notebooks' titles (lessons/zh/, exercises/zh/)."""

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
    title: str            # the lesson's heading, without its number (in the course's language)
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


def _title(path: Path, lang: str) -> str:
    """The heading of `path`, or of its Chinese twin (zh/ beside it) in Chinese when there is one."""
    twin = path.parent / "zh" / path.name
    cells = _cells(twin if lang == "zh" and twin.exists() else path)
    first = "".join(cells[0]["source"]).splitlines()[0] if cells else ""
    return re.sub(r"^#\s*(Exercise\s+|练习\s*)?[0-9A-Z]+\d*\s*·\s*", "", first).strip()


def course_map(root: Path | None = None, lang: str = "en") -> list[Lesson]:
    """Every lesson of `root`/lessons in order, with its exercise from `root`/exercises; titles in `lang`, minutes
    from the English text."""
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
        found.append(Lesson(number, _title(path, lang), _title(exercise, lang) if exercise else None,
                            *_count(cells), *_count(cells[:deeper])))
    return found


HEADERS = {"en": ("lesson", "exercise", "spine", "all"), "zh": ("课", "练习", "主线", "全部")}
SUMMARY = {"en": "\n{n} lessons; minutes of reading at {words} words and {lines} code lines a minute, rounded up to "
                 "5: the spines about {spine:.0f} hours, everything about {total:.0f} (running the cells and the "
                 "exercises come on top)",
           "zh": "\n共 {n} 课；按每分钟 {words} 个英文单词、{lines} 行代码估算的阅读分钟数，向上取整到 5："
                 "主线约 {spine:.0f} 小时，全部约 {total:.0f} 小时（运行单元格和做练习的时间另计）"}


def _width(text: str) -> int:
    """Columns `text` takes in a monospaced font: a CJK character takes two."""
    return sum(2 if "\u2e80" <= ch <= "\uffef" else 1 for ch in text)


def _pad(text: str, width: int, right: bool = False) -> str:
    space = " " * max(0, width - _width(text))
    return space + text if right else text + space


def _cut(text: str, width: int) -> str:
    while _width(text) > width:
        text = text[:-2] + "…"
    return text


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most `width` columns, broken between words or Chinese characters, never inside `code` or a word."""
    if _width(text) <= width:
        return [text]
    if text.isascii():
        return textwrap.wrap(text, width)
    lines, line = [], ""
    for piece in re.findall(r"`[^`]*`|[\x21-\x7e]+|\s+|.", text):  # code, a word, spaces, or one character
        if line and _width(line + piece) > width:
            lines.append(line.rstrip())
            line = piece.lstrip()
        else:
            line += piece
    return [*lines, line]


def print_course_map(root: Path | None = None, widths: tuple[int, int] = (52, 24), lang: str | None = None) -> None:
    """The map as a table: lesson (its heading, wrapped at `widths[0]`), exercise (its heading up to the colon, cut
    at `widths[1]`), minutes to read its spine, and all of it; in `lang` (default: the course's language)."""
    from fsdp_course.i18n import language

    lang = language() if lang is None else lang
    a, b = widths
    lessons = course_map(root, lang)
    head = HEADERS[lang]
    print(f"{'':<3} {_pad(head[0], a)}  {_pad(head[1], b)}  {_pad(head[2], 5, True)} {_pad(head[3], 3, True)}")
    for lesson in lessons:
        exercise = _cut(re.split(r": |：", lesson.exercise or "-", maxsplit=1)[0], b)
        first, *more = _wrap(lesson.title, a)
        minutes = f"{lesson.spine_minutes:>5} {lesson.minutes:>3}"
        print(f"{lesson.number:<3} {_pad(first, a)}  {_pad(exercise, b)}  {minutes}")
        for line in more:
            print(f"{'':<3}   {line}")
    spine, total = (sum(getattr(m, k) for m in lessons) for k in ("spine_minutes", "minutes"))
    print(SUMMARY[lang].format(n=len(lessons), words=WORDS_PER_MINUTE, lines=CODE_LINES_PER_MINUTE, spine=spine / 60,
                               total=total / 60))
