"""Every lesson is listed in the README's lesson table, and lessons are numbered without gaps."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_lesson_is_in_the_readme_table_and_numbers_have_no_gaps() -> None:
    lessons = sorted(p.name for p in (ROOT / "lessons").glob("*.ipynb"))
    assert lessons, "no lessons found"
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"\]\(lessons/([^)]+\.ipynb)\)", readme))
    assert set(lessons) == table, f"missing from README: {set(lessons) - table}; stale: {table - set(lessons)}"
    numbered = [int(m.group(1)) for name in lessons if (m := re.match(r"(\d\d)_", name))]
    assert numbered == list(range(len(numbered))), f"lesson numbers have gaps: {numbered}"
    appendices = [n for n in lessons if not re.match(r"\d\d_", n)]
    assert all(re.match(r"A\d+_", n) for n in appendices), f"unexpected lesson names: {appendices}"
