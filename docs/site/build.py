"""The course as a website (`make site`): the saved notebooks, both languages, built by Sphinx with MyST-NB.

Each language's pages are staged in build/site-src/LANG/ (a banner that says how to run the page and links its
twin, folded answers and hints, links rewritten to the staged pages) and built into build/site/LANG/; nothing
is executed and nothing is fetched. build/site/index.html lets a reader choose a language."""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONF = Path(__file__).resolve().parent
GUIDES = ("INSTRUCTORS.md", "AUTHORS.md", "TRANSLATING.md", "ARCHITECTURE.md",
          "CLASSROOM.md")  # docs/ pages, English only
DEEPER = ("## Going deeper", "## 深入一步")
TEXT = {
    "en": {"title": "FSDP from scratch", "twin": "中文", "home_twin": "中文版",
           "run": "Run it yourself: <code>make lab</code> in a clone of the course opens JupyterLab; this page is "
                  "<code>{path}</code>.",
           "map": "The course map", "lesson": "lesson", "exercise": "exercise", "minutes": "minutes (spine / all)",
           "lessons": "Lessons", "exercises": "Exercises", "guides": "Guides",
           "guide_names": {"INSTRUCTORS.md": "Instructor's guide: exercises and grading a class",
                           "AUTHORS.md": "Author's guide: notebooks are claims, re-running, saving",
                           "TRANSLATING.md": "The Chinese edition: how it is made and kept in step",
                           "ARCHITECTURE.md": "The library's architecture",
                           "CLASSROOM.md": "The classroom: checkers, grading, the authors' tools"}},
    "zh": {"title": "从零实现 FSDP", "twin": "English", "home_twin": "English",
           "run": "自己运行：在课程的克隆中执行 <code>make lab-zh</code> 打开中文版 JupyterLab；本页是 "
                  "<code>{path}</code>。",
           "map": "课程地图", "lesson": "课", "exercise": "练习", "minutes": "分钟（主线 / 全部）",
           "lessons": "课程", "exercises": "练习", "guides": "指南（英文）",
           "guide_names": {"INSTRUCTORS.md": "教师指南：练习与批改（英文）",
                           "AUTHORS.md": "作者指南：笔记本即断言、重新运行与保存（英文）",
                           "TRANSLATING.md": "中文版是怎样生成并保持同步的（英文）",
                           "ARCHITECTURE.md": "库的架构（英文）",
                           "CLASSROOM.md": "课堂层：检查器、批改与作者工具（英文）"}},
}
_LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")


@cache
def pages(lang: str) -> dict[Path, str]:
    """{notebook or doc in the repository: its path in the staged site of `lang`} (read once per build: every link
    of every page is resolved against it)."""
    sub = "" if lang == "en" else "zh/"
    found = {p: f"lessons/{p.name}" for p in sorted((ROOT / "lessons" / sub).glob("*.ipynb"))}
    found |= {p: f"exercises/{p.name}" for p in sorted((ROOT / "exercises" / sub).glob("*.ipynb"))}
    if lang == "en":
        found |= {ROOT / "docs" / g: f"guides/{g}" for g in GUIDES if (ROOT / "docs" / g).exists()}
    return found


def _relative(target: str, start: str) -> str:
    return os.path.relpath(target, os.path.dirname(start) or ".").replace(os.sep, "/")


def rewrite_links(text: str, source: Path, staged: str, lang: str) -> str:
    """Links to staged pages point at them; README points at the home page, a guide of the English site at it;
    any other file of the repository is named in code (it is in the reader's clone, not on the site)."""
    here = pages(lang)
    english = pages("en")

    def one(m: re.Match) -> str:
        label, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+:|#", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve()
        anchor = f"#{anchor}" if anchor else ""
        if resolved in here:
            return f"[{label}]({_relative(here[resolved], staged)}{anchor})"
        if resolved.name in ("README.md", "README.zh.md") and resolved.parent == ROOT:
            return f"[{label}]({_relative('index.md', staged)})"
        if resolved in english:  # a guide, from the Chinese site: the English page
            url = _relative(f"../en/{english[resolved]}".replace(".md", ".html"), staged)
            return f'<a href="{url}">{html.escape(label)}</a>'
        try:
            shown = resolved.relative_to(ROOT).as_posix()
        except ValueError:
            return label
        return f"{label} (`{shown}`)" if label.strip("`") != shown else f"`{shown}`"

    return _LINK.sub(one, text)


def _banner(source: Path, staged: str, lang: str) -> str:
    twin_lang = "zh" if lang == "en" else "en"
    twin = pages(twin_lang)
    twin_source = (source.parent / "zh" / source.name) if lang == "en" else source.parent.parent / source.name
    link = ""
    if twin_source in twin:
        url = _relative(f"../{twin_lang}/{twin[twin_source]}".replace(".ipynb", ".html"), staged)
        link = f' · <a class="twin" href="{url}">{TEXT[lang]["twin"]}</a>'
    path = source.relative_to(ROOT).as_posix()
    return f'<div class="run-it">{TEXT[lang]["run"].format(path=path)}{link}</div>'


def stage_notebook(source: Path, staged: str, lang: str) -> dict:
    nb = json.loads(source.read_text(encoding="utf-8"))
    cells = [{"cell_type": "markdown", "id": "site-banner", "metadata": {},
              "source": _banner(source, staged, lang)}]
    for cell in nb["cells"]:
        cell = dict(cell)
        text = "".join(cell["source"])
        hidden = cell.get("metadata", {}).get("jupyter", {})
        if cell["cell_type"] == "markdown":
            text = rewrite_links(text, source, staged, lang)
            if text.startswith(DEEPER):  # fold.js folds the section that holds this marker
                heading, _, rest = text.partition("\n")
                text = f'{heading}\n\n<div class="going-deeper-marker"></div>\n{rest}'
            if hidden.get("source_hidden") and not text.lstrip().startswith("<details"):  # folded, as in Lab
                first, _, rest = text.partition("\n")
                title = re.sub(r"\*\*|__|<[^>]+>", "", first).strip().rstrip(".:：") or "…"
                text = f":::{{dropdown}} {title}\n{rest.strip()}\n:::"
        elif cell["cell_type"] == "code":
            tags = list(cell.get("metadata", {}).get("tags", []))
            if hidden.get("source_hidden") and "hide-input" not in tags:
                tags.append("hide-input")
            if hidden.get("outputs_hidden") and "hide-output" not in tags:
                tags.append("hide-output")
            cell["metadata"] = {**cell.get("metadata", {}), "tags": tags}
        cell["source"] = text
        cells.append(cell)
    nb["cells"] = cells
    return nb


def _title(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    first = "".join(cells[0]["source"]).splitlines()[0] if cells else path.stem
    return re.sub(r"^#\s*", "", first).strip()


def home(lang: str) -> str:
    """The home page: what the course is, how to run it, and the course map with the minutes lesson 00 prints."""
    sys.path.insert(0, str(ROOT))
    from fsdp_course.classroom.course_map import course_map

    t = TEXT[lang]
    here = pages(lang)
    exercises = {p.name.split("_")[0]: (p, staged) for p, staged in here.items() if staged.startswith("exercises/")}
    lessons = {p.name.split("_")[0]: (p, staged) for p, staged in here.items() if staged.startswith("lessons/")}
    rows = []
    for lesson in course_map():
        source, staged = lessons[lesson.number]
        ex = exercises.get(lesson.number)
        ex_cell = f"[{_title(ex[0])}]({ex[1]})" if ex else "–"
        rows.append(f"| {lesson.number} | [{_title(source)}]({staged}) | {ex_cell} | "
                    f"{lesson.spine_minutes} / {lesson.minutes} |")
    intro = {"en": ("A course that teaches Fully Sharded Data Parallel training by building it, on a laptop CPU: "
                    "several ranks inside one notebook, each a thread with its own Gloo process group, then "
                    "PyTorch's own `fully_shard` under `torchrun`. Every page here is a notebook as the course "
                    "saved it; every number on it was computed, and checked, when the notebook ran."),
             "zh": ("一门通过亲手实现来讲授全分片数据并行（FSDP）训练的课程，在笔记本电脑的 CPU 上运行："
                    "一个笔记本中有多个 rank，每个是一个拥有自己 Gloo 进程组的线程；然后在 `torchrun` 下运行 PyTorch "
                    "自己的 `fully_shard`。这里的每一页都是课程保存的笔记本；"
                    "页上的每个数字都是笔记本运行时算出并核对过的。")}
    run = {"en": ("<div class=\"run-it\">Run it: <code>git clone</code> the course, then <code>make lab</code> "
                  "(creates <code>.venv</code>, installs, opens JupyterLab on lesson 00) and <code>make test</code> "
                  "(checks every notebook). <a class=\"twin\" href=\"../zh/index.html\">中文版</a></div>"),
           "zh": ("<div class=\"run-it\">运行：克隆课程后执行 <code>make lab-zh</code>（创建 <code>.venv</code>、安装，"
                  "并在 JupyterLab 中打开中文第 0 课）和 <code>make test</code>（检查每个笔记本）。"
                  "<a class=\"twin\" href=\"../en/index.html\">English</a></div>")}
    guides = "".join(
        f"- [{t['guide_names'][g]}]({'guides/' + g})\n" if lang == "en"
        else f"- <a href=\"../en/guides/{g.replace('.md', '.html')}\">{t['guide_names'][g]}</a>\n" for g in GUIDES)
    toc_lessons = "\n".join(staged.removesuffix(".ipynb") for _, staged in sorted(lessons.values()))
    toc_exercises = "\n".join(staged.removesuffix(".ipynb") for _, staged in sorted(exercises.values()))
    toc_guides = "\n".join(f"guides/{g.removesuffix('.md')}" for g in GUIDES) if lang == "en" else ""
    tocs = "".join(f"\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n{body}\n```\n"
                   for caption, body in ((t["lessons"], toc_lessons), (t["exercises"], toc_exercises),
                                         (t["guides"], toc_guides)) if body)
    return (f"# {t['title']}\n\n{intro[lang]}\n\n{run[lang]}\n\n## {t['map']}\n\n"
            f"| # | {t['lesson']} | {t['exercise']} | {t['minutes']} |\n|---|---|---|---|\n" + "\n".join(rows)
            + f"\n\n## {t['guides']}\n\n{guides}{tocs}")


def stage(lang: str, src: Path) -> None:
    if src.exists():
        shutil.rmtree(src)
    for source, staged in pages(lang).items():
        out = src / staged
        out.parent.mkdir(parents=True, exist_ok=True)
        if source.suffix == ".ipynb":
            out.write_text(json.dumps(stage_notebook(source, staged, lang), ensure_ascii=False), encoding="utf-8")
        else:
            out.write_text(rewrite_links(source.read_text(encoding="utf-8"), source, staged, lang), encoding="utf-8")
    (src / "index.md").write_text(home(lang), encoding="utf-8")


CHOOSER = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>FSDP from scratch</title></head>
<body><h1>FSDP from scratch · 从零实现 FSDP</h1>
<p><a href="en/index.html">English</a> · <a href="zh/index.html">中文</a></p></body></html>
"""


def build(out: Path, jobs: str = "auto", quiet: bool = True) -> Path:
    """Stage and build both languages into `out`; returns `out`. Raises RuntimeError with Sphinx's output when a
    build fails or warns (a broken link or page is a warning)."""
    src_root = out.parent / f"{out.name}-src"
    for lang in ("en", "zh"):
        stage(lang, src_root / lang)
        cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-c", str(CONF), "-j", jobs, "-W", "--keep-going",
               "-D", f"language={'en' if lang == 'en' else 'zh_CN'}", "-d", str(src_root / f".doctrees-{lang}"),
               *(["-q"] if quiet else []), str(src_root / lang), str(out / lang)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"sphinx failed for the {lang} site (exit {done.returncode}):\n"
                               f"{done.stdout[-3000:]}{done.stderr[-6000:]}")
    (out / "index.html").write_text(CHOOSER, encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "build" / "site"), help="where the site goes (build/site)")
    parser.add_argument("--jobs", default="auto", help="Sphinx's parallel jobs (auto: one per core)")
    args = parser.parse_args(argv)
    try:
        import myst_nb  # noqa: F401
        import sphinx_book_theme  # noqa: F401
        import sphinx_design  # noqa: F401
    except ImportError as exc:
        print(f"the site needs {exc.name}: pip install -e '.[site]' (make site does it)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        out = build(Path(args.out).resolve(), args.jobs)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"built {out} in {time.perf_counter() - start:.0f} s; read it with: "
          f"python -m http.server -d {out} 8000  (then http://127.0.0.1:8000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
