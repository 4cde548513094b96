"""The Chinese edition: `lessons/zh/` and `exercises/zh/`, generated from the English notebooks and catalogs.

Design notes: docs/CLASSROOM.md, "The authors' tools", `translations.py`.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

__all__ = ["KINDS", "Problem", "build", "catalog_path", "load_catalog", "main", "sha", "status", "target_path",
           "template"]

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("lessons", "exercises")
LANG = "zh"
_IMAGE = "image/png"
_META = "fsdp_course_i18n"  # cell metadata of a re-drawn figure: the sha of the English figure it replaces
LOCALIZED = "localized"  # the tag of a code cell whose outputs the Chinese run gives, whole


@cache
def figure_texts_sha() -> str:
    """The sha of what writes the figures' text: the source of `fsdp_course/viz/` (the code that picks a message) and
    its catalogues (`fsdp_course/i18n/catalogues/viz*.yml`). A Chinese figure drawn with other sources is redrawn."""
    package = Path(__file__).resolve().parents[1]
    sources = sorted(package.glob("viz/*.py")) + sorted(package.glob("i18n/catalogues/viz*.yml"))
    return sha("\n".join(p.read_text(encoding="utf-8") for p in sources))


def _drawn(cell: Any, shas: list[str]) -> bool:
    """Whether a Chinese cell's figures were drawn from these English figures with the current figure texts."""
    return cell.metadata.get(_META, {}) == {"from": shas, "texts": figure_texts_sha()}


def sha(text: str) -> str:
    """The first 12 hex digits of the SHA-256 of `text` (UTF-8): what a catalog entry records of its English."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def english_notebooks(root: Path = ROOT) -> list[Path]:
    """Every English lesson and exercise notebook, in course order."""
    return [p for kind in KINDS for p in sorted((root / kind).glob("*.ipynb"))]


def catalog_path(notebook: Path, root: Path = ROOT) -> Path:
    """`lessons/03_memory.ipynb` -> `i18n/zh/lessons/03_memory.yml`."""
    notebook = Path(notebook).resolve()
    return root / "i18n" / LANG / notebook.parent.name / (notebook.stem + ".yml")


def target_path(notebook: Path) -> Path:
    """`lessons/03_memory.ipynb` -> `lessons/zh/03_memory.ipynb`."""
    notebook = Path(notebook).resolve()
    return notebook.parent / LANG / notebook.name


def load_catalog(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of a catalog file, `{cell_id: {"sha": ..., "zh": ..., "same": bool}}`; {} if there is none.
    A malformed file raises ValueError naming the file and what is wrong."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except Exception as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, dict):
        raise ValueError(f"{path}: expected a mapping `cells:` of cell id -> {{sha, zh}}")
    for cell_id, entry in cells.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("zh"), str) or not isinstance(entry.get("sha"), str):
            raise ValueError(f"{path}: entry {cell_id!r} needs `sha:` (text) and `zh:` (text)")
    return {str(k): v for k, v in cells.items()}


class _Block(str):
    """A string that YAML writes as a literal block (`|`), so a catalog reads like the markdown it holds."""


def _dump(notebook: Path, cells: dict[str, dict[str, Any]], root: Path) -> str:
    class Dumper(yaml.SafeDumper):
        pass

    def block(dumper: Any, data: _Block) -> Any:
        return dumper.represent_scalar("tag:yaml.org,2002:str", str(data), style="|")

    Dumper.add_representer(_Block, block)
    body = {"notebook": Path(notebook).resolve().relative_to(root).as_posix(),
            "cells": {k: {kk: (_Block(vv) if kk == "zh" else vv) for kk, vv in v.items()} for k, v in cells.items()}}
    header = ("# Chinese text of the notebook's markdown cells, keyed by cell id. sha: what `sha` gives for the\n"
              "# English source this translates. Written by `python -m fsdp_course.classroom.translations template`.\n")
    return header + yaml.dump(body, Dumper=Dumper, allow_unicode=True, sort_keys=False, width=10_000)


def _markdown(nb: Any) -> list[Any]:
    return [c for c in nb.cells if c.cell_type == "markdown"]


def template(notebook: Path, root: Path = ROOT) -> Path:
    """Create or extend the catalog of `notebook`: every markdown cell without an entry gets one whose `zh` is
    the English text, to be replaced. Existing entries are kept as they are (a stale sha stays stale)."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    path = catalog_path(notebook, root)
    cells = load_catalog(path)
    for cell in _markdown(nb):
        cells.setdefault(cell.id, {"sha": sha(cell.source), "zh": cell.source})
    order = [c.id for c in _markdown(nb)]
    cells = {k: cells[k] for k in order} | {k: v for k, v in cells.items() if k not in order}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_dump(notebook, cells, root), encoding="utf-8")
    return path


@dataclass(frozen=True)
class Problem:
    """One thing that keeps the Chinese edition from being in step with the English one."""

    path: str  # the catalog or notebook concerned, relative to the course root
    cell: str  # cell id, or "" for the whole file
    what: str  # "missing catalog", "no translation", "stale", "untranslated", "orphan", "out of date", ...
    fix: str

    def __str__(self) -> str:
        where = f"{self.path} [{self.cell}]" if self.cell else self.path
        return f"{where}: {self.what}. {self.fix}"


_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _resolves(path: Path) -> bool:
    """A link from a Chinese notebook resolves: to a file, or to a Chinese notebook that the build will write."""
    path = path.resolve()
    return path.exists() or (path.parent.name == LANG and path.suffix == ".ipynb"
                             and (path.parent.parent / path.name).exists())


def _translated(nb: Any, catalog: dict[str, dict[str, Any]]) -> Any:
    out = copy.deepcopy(nb)
    for cell in _markdown(out):
        cell.source = catalog[cell.id]["zh"].rstrip("\n")
    out.metadata[_META] = {"language": LANG}
    return out


def _localized(cell: Any) -> bool:
    return cell.cell_type == "code" and LOCALIZED in cell.get("metadata", {}).get("tags", [])


def _strip_images(nb: Any) -> Any:
    """The notebook with every figure's pixels, localized outputs and re-draw records blanked: what must agree."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.get("metadata", {}).pop(_META, None)
        if _localized(cell):
            cell.outputs = []
        for out in cell.get("outputs", []):
            if _IMAGE in out.get("data", {}):
                out["data"][_IMAGE] = ""
    return nb


def _catalogs_sha(root: Path) -> str:
    """The sha of every catalog's text: a localized output (lesson 00's map prints the Chinese titles) follows them."""
    return sha("".join(p.read_text(encoding="utf-8") for p in sorted((root / "i18n" / LANG).glob("*/*.yml"))))


def _figure_shas(nb: Any, root: Path = ROOT) -> dict[int, list[str]]:
    """Per code cell, what the Chinese run must redo: its figures' shas, or, if localized, one sha of its English
    outputs and of the catalogs."""
    catalogs = _catalogs_sha(root) if any(_localized(c) for c in nb.cells) else ""
    return {i: [sha(json.dumps(c.outputs, sort_keys=True) + catalogs)] if _localized(c) else
            [sha(o["data"][_IMAGE]) for o in c.get("outputs", []) if _IMAGE in o.get("data", {})]
            for i, c in enumerate(nb.cells) if c.cell_type == "code"}


def _notebook_problems(notebook: Path, root: Path) -> list[Problem]:
    import nbformat

    rel_nb = notebook.relative_to(root).as_posix()
    cat = catalog_path(notebook, root)
    rel_cat = cat.relative_to(root).as_posix()
    if not cat.exists():
        return [Problem(rel_cat, "", "missing catalog",
                        f"run `python -m fsdp_course.classroom.translations template {rel_nb}` and translate it")]
    try:
        catalog = load_catalog(cat)
    except ValueError as exc:
        return [Problem(rel_cat, "", "unreadable", str(exc))]
    nb = nbformat.read(notebook, as_version=4)
    problems = []
    ids = set()
    for cell in _markdown(nb):
        ids.add(cell.id)
        entry = catalog.get(cell.id)
        if entry is None:
            problems.append(Problem(rel_cat, cell.id, "no translation",
                                    f"add an entry (`template {rel_nb}` adds it) with sha {sha(cell.source)}"))
        elif entry["sha"] != sha(cell.source):
            problems.append(Problem(rel_cat, cell.id, "stale: the English changed since it was translated",
                                    f"bring `zh` in step with the English cell and set sha: {sha(cell.source)}"))
        elif entry["zh"].rstrip("\n") == cell.source.rstrip("\n") and not entry.get("same"):
            problems.append(Problem(rel_cat, cell.id, "untranslated: `zh` is the English text",
                                    "translate it (or add `same: true` if it reads the same in Chinese)"))
        else:
            for link in _LINK.findall(entry["zh"]):
                if "://" in link or link.startswith("mailto:"):
                    continue
                if not _resolves(target_path(notebook).parent / link):
                    problems.append(Problem(rel_cat, cell.id, f"broken link {link!r} (seen from {LANG}/)",
                                            "a link to another lesson stays a sibling (`04_zero.ipynb`); one "
                                            "outside the folder needs one more `../`"))
    for orphan in sorted(set(catalog) - ids):
        problems.append(Problem(rel_cat, orphan, "orphan: no markdown cell has this id any more",
                                "move its text to the cell that replaced it, or delete the entry"))
    if problems:
        return problems
    target = target_path(notebook)
    rel_target = target.relative_to(root).as_posix()
    if not target.exists():
        return [Problem(rel_target, "", "missing", "run `make translations`")]
    built, saved = _translated(nb, catalog), nbformat.read(target, as_version=4)
    if _strip_images(built) != _strip_images(saved):
        return [Problem(rel_target, "", "out of date with its English notebook or catalog", "run `make translations`")]
    english = _figure_shas(nb, root)
    for i, cell in enumerate(saved.cells):
        if english.get(i) and not _drawn(cell, english[i]):
            problems.append(Problem(rel_target, cell.id, "a figure (or a localized output) is not made again from "
                                    "the current English one with the current Chinese texts",
                                    "run `make translations`"))
    return problems


def status(root: Path = ROOT) -> list[Problem]:
    """Every problem between the English notebooks, their catalogs and the Chinese notebooks; [] when in step."""
    root = Path(root).resolve()
    problems = [p for nb in english_notebooks(root) for p in _notebook_problems(nb, root)]
    wanted = {target_path(nb) for nb in english_notebooks(root)}
    for kind in KINDS:
        for extra in sorted((root / kind / LANG).glob("*.ipynb")):
            if extra not in wanted:
                problems.append(Problem(extra.relative_to(root).as_posix(), "", "has no English notebook",
                                        "delete it (`make translations` does)"))
    catalogs = {catalog_path(nb, root) for nb in english_notebooks(root)}
    for extra in sorted((root / "i18n" / LANG).glob("*/*.yml")):
        if extra not in catalogs:
            problems.append(Problem(extra.relative_to(root).as_posix(), "", "catalog of no English notebook",
                                    "rename it after its notebook or delete it"))
    return problems


def _redraw(nb: Any, workdir: Path) -> Any:
    """Run `nb` in a fresh kernel with FSDP_COURSE_LANG=zh and return it executed (for its figures)."""
    import nbformat

    from fsdp_course.classroom.notebooks import run_notebook

    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".ipynb", dir=workdir, delete=False, encoding="utf-8") as f:
        nbformat.write(nb, f)
        path = Path(f.name)
    try:
        with mock.patch.dict(os.environ, FSDP_COURSE_LANG=LANG):  # the kernel inherits it
            run_notebook(path)
        return nbformat.read(path, as_version=4)
    finally:
        path.unlink(missing_ok=True)


def build(notebook: Path, root: Path = ROOT, *, redraw: bool = True, log: Any = print) -> Path:
    """Write the Chinese notebook of `notebook`. Figures come from the saved Chinese notebook where the English
    figure is unchanged, else from a run of the Chinese notebook (if `redraw`; otherwise the English figure)."""
    import nbformat

    root = Path(root).resolve()
    notebook = Path(notebook).resolve()
    problems = [p for p in _notebook_problems(notebook, root) if p.path.endswith(".yml")]
    if problems:
        raise ValueError("\n".join(str(p) for p in problems))
    nb = nbformat.read(notebook, as_version=4)
    out = _translated(nb, load_catalog(catalog_path(notebook, root)))
    target = target_path(notebook)
    saved = nbformat.read(target, as_version=4) if target.exists() else None
    english = _figure_shas(nb, root)
    drawn = _figure_shas(saved, root) if saved is not None else {}
    stale = [i for i, shas in english.items() if shas and not (
        saved is not None and i < len(saved.cells) and _drawn(saved.cells[i], shas)
        and len(drawn.get(i, [])) == len(shas))]
    fresh = None
    if stale and redraw:
        from fsdp_course.i18n import INSTALL_FONT, cjk_font

        if cjk_font() is None:  # the figures would come out English, and be stamped as Chinese
            raise RuntimeError("no Chinese font on this machine, so the Chinese figures cannot be drawn. "
                               + INSTALL_FONT)
        log(f"  re-drawing {len(stale)} cell(s) of {notebook.name} in Chinese (figures, localized outputs; running it)")
        fresh = _redraw(out, target.parent / ".build")
    for i, shas in english.items():
        if not shas:
            continue
        source = fresh if (i in stale and fresh is not None) else (saved if i not in stale else None)
        if source is None:  # no re-draw asked for: the English figure, marked as such
            continue
        if _localized(out.cells[i]):
            out.cells[i].outputs = copy.deepcopy(source.cells[i].outputs)
            out.cells[i].metadata[_META] = {"from": shas, "texts": figure_texts_sha()}
            continue
        images = [o["data"][_IMAGE] for o in source.cells[i].get("outputs", []) if _IMAGE in o.get("data", {})]
        if len(images) != len(shas):
            raise ValueError(f"{notebook.name}, cell {out.cells[i].id}: the Chinese run drew {len(images)} "
                             f"figure(s) where the English notebook has {len(shas)}")
        pictures = iter(images)
        for o in out.cells[i].outputs:
            if _IMAGE in o.get("data", {}):
                o["data"][_IMAGE] = next(pictures)
        out.cells[i].metadata[_META] = {"from": shas, "texts": figure_texts_sha()}
    target.parent.mkdir(parents=True, exist_ok=True)
    text = nbformat.writes(out) + "\n"
    if not target.exists() or target.read_text(encoding="utf-8") != text:
        target.write_text(text, encoding="utf-8")
        log(f"wrote {target.relative_to(root)}")
    return target


def build_all(root: Path = ROOT, *, redraw: bool = True, log: Any = print) -> list[Path]:
    """`make translations`: every Chinese notebook, and no Chinese notebook without an English one."""
    import shutil

    root = Path(root).resolve()
    written = [build(nb, root, redraw=redraw, log=log) for nb in english_notebooks(root)]
    for kind in KINDS:
        shutil.rmtree(root / kind / LANG / ".build", ignore_errors=True)
        for extra in (root / kind / LANG).glob("*.ipynb"):
            if extra not in written:
                extra.unlink()
                log(f"removed {extra.relative_to(root)} (no English notebook)")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_course.classroom.translations", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("status", help="list what keeps the Chinese edition out of step (exit 1 if anything)")
    t = sub.add_parser("template", help="create or extend the catalogs of these English notebooks")
    t.add_argument("notebooks", nargs="+", type=Path)
    b = sub.add_parser("build", help="write the Chinese notebooks (all, or these English ones)")
    b.add_argument("notebooks", nargs="*", type=Path)
    b.add_argument("--no-redraw", action="store_true", help="keep English figures where a re-draw is due")
    args = parser.parse_args(argv)
    if args.command == "status":
        problems = status()
        for p in problems:
            print(p)
        print(f"{len(problems)} problem(s)" if problems else "the Chinese edition is in step with the English one")
        return 1 if problems else 0
    if args.command == "template":
        for nb in args.notebooks:
            if not nb.exists() or nb.suffix != ".ipynb":
                parser.error(f"{nb}: not an English notebook (e.g. lessons/03_memory.ipynb)")
            print(f"wrote {template(nb)}")
        return 0
    try:
        if args.notebooks:
            for nb in args.notebooks:
                build(nb, redraw=not args.no_redraw)
        else:
            build_all(redraw=not args.no_redraw)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
