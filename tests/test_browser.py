"""The student's view: lessons run in the course's JupyterLab in headless Chromium.

Checks what nbval cannot see: Run All through JupyterLab's own command finishes with no error
output (but in cells tagged `raises-exception`), figures appear as images on the page, every
ipywidgets control renders and moving it (the keyboard on its slider) changes what it drives, and
the simulator's per-rank output appears in rank order in the cell that ran it. Screenshots go to
.browser-screenshots/ (git-ignored) for a person to look at. Skipped, with one line saying why,
where Debian's chromium is missing.
"""

import re
from pathlib import Path

import nbformat
import pytest
from browser import CourseLab, chromium_missing_reason

from fsdp_course.i18n import cjk_font
from fsdp_course.viz.widgets import BROWSER_SELECTORS

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / ".browser-screenshots"
reason = chromium_missing_reason()
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")


def widget_lessons() -> list[Path]:
    return sorted(p for p in (ROOT / "lessons").glob("*.ipynb") if "zero_calculator(" in p.read_text())


def lessons_to_run() -> list[Path]:
    """Lesson 00 (rank output in cells) and the calculator's lessons (a widget, figures): nbval runs the rest."""
    first = [ROOT / "lessons" / "00_welcome.ipynb"]
    return first + [p for p in widget_lessons() if p not in first]


CHINESE_LESSON = ROOT / "lessons" / "zh" / "05_flat_param.ipynb"  # figures with text: the sharding plots


def check_widget(lab: CourseLab, timeout: float = 30) -> list[str]:
    """Move the calculator's world-size slider with the keyboard; its readout and figure must change (within
    `timeout` seconds each: a working calculator answers in about one)."""
    page = lab.page
    figure = page.locator(BROWSER_SELECTORS["figure"]).first
    if page.locator(BROWSER_SELECTORS["readout"]).count() == 0:
        return ["the calculator's readout did not render"]
    src_before = figure.get_attribute("src") if figure.count() else None
    before, after = lab.move_slider(BROWSER_SELECTORS["world_size_handle"], BROWSER_SELECTORS["readout"],
                                    timeout=timeout)
    problems = []
    if before == after:
        problems.append(f"moving the world-size slider did not change the readout ({before.splitlines()[0]!r})")
    elif re.search(r"N = (\d+)", before) and re.search(r"N = (\d+)", before)[1] == re.search(r"N = (\d+)", after)[1]:
        problems.append("the readout changed but still shows the old world size")
    if src_before is not None:
        try:  # the figure is redrawn just after the readout
            page.wait_for_function("([sel, src]) => document.querySelector(sel).getAttribute('src') !== src",
                                   arg=[BROWSER_SELECTORS["figure"], src_before], timeout=timeout * 500)
        except Exception:  # noqa: BLE001  (playwright's TimeoutError)
            problems.append("the calculator's figure did not change with the slider")
    return problems


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lab")
    notebooks = lessons_to_run() + [CHINESE_LESSON, broken_widget_notebook(workdir)]
    try:  # a cold start (first JupyterLab build of its settings, a first kernel) may be slow: retry once
        with CourseLab(notebooks, workdir) as lab:
            yield lab
            return
    except (TimeoutError, RuntimeError):
        pass
    with CourseLab(notebooks, workdir) as lab:
        yield lab


def broken_widget_notebook(workdir: Path) -> Path:
    """A calculator alone, its slider cut off from its readout, which the check must catch (the lessons' calculators
    are the working ones it must pass)."""
    lines = ["from fsdp_course.viz.widgets import zero_calculator", "calc = zero_calculator()",
             'calc.world_slider.unobserve(calc._refresh, names="value")  # planted bug']
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("\n".join([*lines, "calc"]))]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = workdir / "zz_broken_widget.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("lesson", [p.name for p in lessons_to_run()])
def test_lesson_runs_in_jupyterlab(lab: CourseLab, lesson: str) -> None:
    run = lab.run_all(lesson, screenshots=SHOTS)
    assert run.cells, f"{lesson}: no code cells seen"
    assert run.problems() == []
    assert run.images() >= run.png_outputs(), f"{lesson}: {run.png_outputs()} figures, {run.images()} images shown"
    if lesson != "00_welcome.ipynb":
        assert run.png_outputs() > 0, f"{lesson} draws figures: no figure came back"
    rank_cells = [c for c in run.cells if "[rank 0]" in c["text"]]
    for cell in rank_cells:
        ranks = [int(r) for r in re.findall(r"^\[rank (\d+)\]", cell["text"], re.M)]
        assert ranks == sorted(ranks), f"{lesson} cell {cell['index']}: rank output out of order: {ranks}"
    if lesson == "00_welcome.ipynb":
        assert rank_cells, "lesson 00 shows no per-rank output in its cells"
    if "zero_calculator(" in (ROOT / "lessons" / lesson).read_text():
        assert check_widget(lab) == []
        lab.page.screenshot(path=str(SHOTS / f"{Path(lesson).stem}_widget.png"))  # the calculator, moved


def test_a_chinese_lesson_runs_with_its_figures_in_chinese(lab: CourseLab) -> None:
    name = f"lessons/zh/{CHINESE_LESSON.name}"
    run = lab.run_all(name, screenshots=SHOTS / "zh")
    assert run.problems() == []
    assert run.png_outputs() > 0 and run.images() >= run.png_outputs()
    chinese = nbformat.read(CHINESE_LESSON, as_version=4)
    title = next(c.source for c in chinese.cells if c.cell_type == "markdown").splitlines()[0].lstrip("# ")
    shown_title = lab.first_cell_text()
    assert title in shown_title, f"the Chinese title {title!r} is not what the first cell shows: {shown_title[:200]!r}"
    english = {o["data"]["image/png"] for c in nbformat.read(ROOT / "lessons" / CHINESE_LESSON.name, 4).cells
               if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})}
    shown = lab.figure_sources()
    assert len(shown) == run.images()
    if cjk_font() is not None:  # without one the figures keep their English text (and say so once)
        assert not set(shown) & english, "a figure came out as the English lesson's: the kernel did not speak Chinese"


def test_a_broken_widget_is_caught(lab: CourseLab) -> None:
    run = lab.run_all("zz_broken_widget.ipynb")
    assert run.problems() == []
    problems = check_widget(lab, timeout=6)  # it never changes: do not wait the working calculator's 30 s
    assert problems and "did not change the readout" in problems[0]
