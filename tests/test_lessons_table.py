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


def test_the_course_map_reads_every_lesson_its_exercise_and_its_text(tmp_path: Path) -> None:
    import json

    import pytest

    from fsdp_course.classroom.course_map import Lesson, course_map

    lessons = course_map()
    assert [f"{m.number}_" for m in lessons] == [p.name[:3] for p in sorted((ROOT / "lessons").glob("*.ipynb"))]
    exercised = {p.name[:2] for p in (ROOT / "exercises").glob("*.ipynb")}
    assert all((m.exercise is not None) == (m.number in exercised) for m in lessons)
    assert lessons[0].title == "Welcome: how this course works" and lessons[0].exercise is None
    assert Lesson("01", "t", None, 151, 0, 151, 0).minutes == 5  # 1.01 minutes, rounded up to 5
    assert Lesson("01", "t", None, 1500, 100, 0, 0).minutes == 20  # 10 + 10: a multiple of 5 stays

    def notebook(heading: str, words: int) -> str:
        return json.dumps({"cells": [{"cell_type": "markdown", "source": [heading + "\n", "w " * words]}]})

    (tmp_path / "lessons").mkdir()
    (tmp_path / "exercises").mkdir()
    (tmp_path / "lessons" / "03_memory.ipynb").write_text(notebook("# 03 · Where the memory goes", 600))
    (tmp_path / "exercises" / "03_memory.ipynb").write_text(notebook("# Exercise 03 · A calculator", 0))
    assert course_map(tmp_path) == [Lesson("03", "Where the memory goes", "A calculator", 607, 0, 607, 0)]  # + heading
    deeper = json.loads(notebook("# 03 · Where the memory goes", 600))
    deeper["cells"].append({"cell_type": "markdown", "source": ["## Going deeper\n", "w " * 900]})
    (tmp_path / "lessons" / "03_memory.ipynb").write_text(json.dumps(deeper))
    (found,) = course_map(tmp_path)
    assert (found.spine_words, found.words, found.spine_minutes, found.minutes) == (607, 1510, 5, 15)
    with pytest.raises(FileNotFoundError, match="run it from a clone of the course"):
        course_map(tmp_path / "nowhere")


def test_each_exercise_shares_its_lessons_name_and_every_reference_resolves() -> None:
    """exercises/NN_name.ipynb goes with lessons/NN_name.ipynb; every "lesson NN" / "exercise NN" in the English
    notebooks' text names one that exists, and every link to a notebook resolves."""
    import json

    lessons = {p.name for p in (ROOT / "lessons").glob("*.ipynb")}
    exercises = {p.name for p in (ROOT / "exercises").glob("*.ipynb")}
    assert exercises <= lessons, f"exercises without a lesson of the same name: {sorted(exercises - lessons)}"
    numbers = {"lesson": {n[:2] for n in lessons}, "exercise": {n[:2] for n in exercises}}
    problems = []
    for path in sorted([*(ROOT / "lessons").glob("*.ipynb"), *(ROOT / "exercises").glob("*.ipynb"),
                        *(ROOT / "solutions").glob("*.ipynb")]):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            text = "".join(cell["source"])
            for kind, number in re.findall(r"\b([Ll]esson|[Ee]xercise)s? (\d\d)\b", text):
                if number not in numbers[kind.lower()]:
                    problems.append(f"{path.relative_to(ROOT)}: {kind} {number} does not exist")
            for target in re.findall(r"\]\(([^)\s#]+\.ipynb)", text):
                if not (path.parent / target).exists():
                    problems.append(f"{path.relative_to(ROOT)}: link to {target}, which does not exist")
    assert not problems, problems
