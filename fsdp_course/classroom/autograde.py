"""Grade one submitted notebook with nbgrader's own preprocessors: the worker behind `fsdp-course grade`.

Design notes: docs/CLASSROOM.md, "Grading a class", `autograde.py`.
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import json
import os
import re
import secrets
import sqlite3
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode
from nbgrader.api import Gradebook
from nbgrader.preprocessors import (
    CheckCellMetadata,
    ClearHiddenTests,
    ClearOutput,
    ClearSolutions,
    ComputeChecksums,
    DeduplicateIds,
    LimitOutput,
    OverwriteCells,
    OverwriteKernelspec,
    SaveAutoGrades,
    SaveCells,
)

from fsdp_course.classroom.timed_execute import NOT_RUN, TimedExecute, error_output, kernel_manager, kill_tree, shutdown

ASSIGNMENT = "fsdp-course"

__all__ = ["ASSIGNMENT", "build_gradebook", "cell_order", "exercise_ids", "grade_notebook", "gradebook_sql",
           "main"]


def build_gradebook(solutions: Sequence[Path], db_path: Path) -> dict[str, float]:
    """An nbgrader gradebook (sqlite) of the exercises, as `generate_assignment` records them; max score each."""
    bindir = os.path.dirname(sys.executable)  # nbgrader creates a gradebook by running this interpreter's `alembic`
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    db_url = f"sqlite:///{db_path}"
    with Gradebook(db_url) as gb:
        gb.update_or_create_assignment(ASSIGNMENT)
    for path in solutions:
        nb = nbformat.read(path, as_version=4)
        resources = {"nbgrader": {"notebook": Path(path).stem, "assignment": ASSIGNMENT, "db_url": db_url}}
        for pp in (ClearSolutions(), ClearOutput(), ComputeChecksums(), SaveCells()):
            nb, resources = pp.preprocess(nb, resources)
    with Gradebook(db_url) as gb:
        return {nb.name: float(nb.max_score) for nb in gb.find_assignment(ASSIGNMENT).notebooks}


def gradebook_sql(db_path: Path) -> str:
    """A gradebook file as SQL text, what `grade_notebook` takes (each worker loads it into memory)."""
    with closing(sqlite3.connect(db_path)) as con:
        return "\n".join(con.iterdump())


@contextmanager
def _memory_gradebook(sql: str) -> Iterator[str]:
    """This process's own in-memory copy of the gradebook, for the block; yields its URL for nbgrader."""
    name = f"fsdp_gradebook_{uuid.uuid4().hex}"
    keeper = sqlite3.connect(f"file:{name}?mode=memory&cache=shared", uri=True)  # the database lives while
    try:  # a connection to it is open
        keeper.executescript(sql)
        yield f"sqlite:///file:{name}?mode=memory&cache=shared&uri=true"
    finally:
        keeper.close()


def exercise_ids(db_url: str) -> dict[str, dict[str, Any]]:
    """Per exercise: its checker cells' points ("graded") and its recorded cells' sources ("sources"), by id."""
    out: dict[str, dict[str, Any]] = {}
    with Gradebook(db_url) as gb:
        for nb in gb.find_assignment(ASSIGNMENT).notebooks:
            out[nb.name] = {"graded": {c.name: float(c.max_score) for c in nb.grade_cells},
                            "solutions": sorted(c.name for c in nb.solution_cells),
                            "sources": {c.name: c.source for c in nb.source_cells}}
    return out


def cell_order(notebook: Path) -> list[str]:
    """The nbgrader ids of a notebook's cells, in order (the gradebook does not keep the order)."""
    return [gid for c in nbformat.read(notebook, as_version=4).cells if (gid := _nbgrader_id(c))]


# -- one submission ----------------------------------------------------------------------------------
def _nbgrader_id(cell: NotebookNode) -> str | None:
    meta = cell.metadata.get("nbgrader")
    return meta.get("grade_id") if isinstance(meta, dict) else None


def _strip_hidden(source: str) -> str:
    cell = nbformat.v4.new_code_cell(source)
    ClearHiddenTests()._remove_hidden_test_region(cell)
    return cell.source


def _order_checks_after_sources(nb: NotebookNode, source_order: list[str], graded: dict[str, float]) -> list[str]:
    """Move each checker cell below the instructor's cells that come before it (a checker moved up runs too early)."""
    moved = []
    for gid in (g for g in source_order if g in graded):
        ids = [_nbgrader_id(c) for c in nb.cells]
        if gid not in ids:
            continue
        before = source_order[:source_order.index(gid)]
        later = [i for i, x in enumerate(ids) if x in before and i > ids.index(gid)]
        if later:
            cell = nb.cells.pop(ids.index(gid))
            nb.cells.insert(max(later), cell)  # the pop shifted the later cells up by one
            moved.append(gid)
    return moved


def _sanitize(nb: NotebookNode, exercise: str, db_url: str, info: dict[str, Any]) -> list[str]:
    """nbgrader's sanitizing pass plus the additions above; returns what was restored, for the feedback."""
    graded, sources = info["graded"], info["sources"]
    submitted = {_nbgrader_id(c): c.source for c in nb.cells if _nbgrader_id(c) in graded}
    notes = []
    for gid in graded:
        if gid not in submitted:
            notes.append(f"checker cell {gid} was missing: the instructor's was added back")
        elif submitted[gid] != _strip_hidden(sources[gid]):
            notes.append(f"checker cell {gid} was edited: the instructor's was put back")
    for cell in nb.cells:
        gid = _nbgrader_id(cell)
        if "nbgrader" in cell.metadata and gid not in sources:  # naming no cell of this exercise: it would crash
            del cell.metadata["nbgrader"]  # SaveAutoGrades
        elif gid is not None:  # the instructor's flags: a solution cell turned into a checker gains nothing
            cell.metadata["nbgrader"] = {"grade": gid in graded, "grade_id": gid, "locked": gid in graded,
                                         "schema_version": 3, "solution": gid in info["solutions"], "task": False,
                                         **({"points": graded[gid]} if gid in graded else {})}
    resources = {"nbgrader": {"notebook": exercise, "assignment": ASSIGNMENT, "db_url": db_url}}
    overwrite = OverwriteCells(add_missing_cells=True)
    for pp in (ClearOutput(), DeduplicateIds(), OverwriteKernelspec()):
        nb, resources = pp.preprocess(nb, resources)
    try:
        nb, resources = overwrite.preprocess(nb, resources)
    except (KeyError, ValueError):  # nbgrader re-inserts a missing checker after the cell before it; if that
        overwrite.add_missing_cells = False  # one is gone too, it fails: put the missing checkers at the end
        nb, resources = overwrite.preprocess(nb, resources)
        present = {_nbgrader_id(c) for c in nb.cells}
        with Gradebook(db_url) as gb:
            for gc in gb.find_notebook(exercise, ASSIGNMENT).grade_cells:
                if gc.name not in present:
                    source_cell = gb.find_source_cell(gc.name, exercise, ASSIGNMENT)
                    nb.cells.append(overwrite.missing_cell_transform(source_cell, gc.max_score))
    order = [cid for cid in info["order"] if cid in sources]
    for gid in _order_checks_after_sources(nb, order, graded):
        notes.append(f"checker cell {gid} stood above the cells it checks: it was moved back below them")
    CheckCellMetadata().preprocess(nb, resources)
    return notes


# -- the grader's own checks, and what tampering it notices ---------------------------------------------------
GUARD_MIME = "application/vnd.fsdp-course.grader+json"  # the guard's reports: display data, removed before scoring
CHECKS_PACKAGE = "fsdp_course.classroom.checks"  # the guard itself is guard.py: the first cell runs its make_guard


def _preload() -> list[str]:
    """The modules the checks import, also inside functions: the guard imports them before any student cell."""
    names = {CHECKS_PACKAGE, "fsdp_course"}
    for path in sorted(Path(__file__).with_name("checks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_course"):
                names.add(node.module)
    return sorted(names)


def _rewrite_checker(source: str, guard: str, grade_id: str, nonce: str) -> str:
    """A checker cell that imports its checks from the grader's private copy, and reports before and after."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # the instructor's cell fails as it is
    lines = source.splitlines()
    for node in ast.walk(tree):  # the private copy is the package's: a submodule's import would get the public one
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(CHECKS_PACKAGE + "."):
            raise ValueError(f"checker cell {grade_id} imports from {node.module}: import its checks from "
                             f"{CHECKS_PACKAGE} (`from {CHECKS_PACKAGE} import ...`) in the solution notebook")
    for node in sorted((n for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 0
                        and n.module == CHECKS_PACKAGE), key=lambda n: -n.lineno):
        if any(a.name == "*" for a in node.names):
            continue
        targets = ", ".join(a.asname or a.name for a in node.names)
        value = f"{guard}.get({', '.join(repr(a.name) for a in node.names)})"
        indent = lines[node.lineno - 1][:node.col_offset]
        lines[node.lineno - 1:node.end_lineno] = [f"{indent}{targets} = {value}  # the grader's own copy"]
    return "\n".join([f"{guard}.begin({grade_id!r})", *lines, f"{guard}.done({grade_id!r}, {nonce!r})"])


def _install_guard(nb: NotebookNode, graded: dict[str, float]) -> dict[str, tuple[str, str]]:
    """Rewrite the checker cells to go through the guard, and put the guard's cell first; returns each checker
    cell's nonce and original source, by grade id."""
    name, receipts = f"_grader_{secrets.token_hex(6)}", {}
    for cell in nb.cells:
        gid = _nbgrader_id(cell)
        if cell.cell_type == "code" and gid in graded:
            receipts[gid] = (secrets.token_hex(16), cell.source)
            cell.source = _rewrite_checker(cell.source, name, gid, receipts[gid][0])
    path = Path(__file__).with_name("guard.py")  # its text, run in a namespace of its own: nothing of it is importable
    setup = (f"{name} = (lambda ns: exec(compile({path.read_text(encoding='utf-8')!r}, {str(path)!r}, 'exec'), "
             f"ns) or ns['make_guard']({_preload()!r}, {GUARD_MIME!r}, {CHECKS_PACKAGE!r}))({{}})\n")
    nb.cells.insert(0, nbformat.v4.new_code_cell(setup, metadata={"fsdp_course_grader": True}))
    return receipts


def _collect_receipts(nb: NotebookNode, receipts: dict[str, tuple[str, str]]) -> list[str]:
    """Remove the guard's reports from the checker cells; return its findings. A checker cell without its
    closing report and without an error did not run as the grader wrote it: it gets an error (scores 0)."""
    flags: set[str] = set()
    for cell in nb.cells:
        gid = _nbgrader_id(cell)
        if gid not in receipts:
            continue
        nonce, original = receipts[gid]
        outputs = cell.get("outputs", [])
        cell.outputs = [o for o in outputs if GUARD_MIME not in o.get("data", {})]
        reports = [r for o in outputs if isinstance(r := o.get("data", {}).get(GUARD_MIME), dict)]
        for r in reports:
            flags.update(str(f) for f in r.get("flags", []))
        done = any(r.get("stage") == "done" and r.get("nonce") == nonce and r.get("grade_id") == gid for r in reports)
        if not done and not any(o.output_type == "error" for o in cell.outputs):
            why = "the checker cell did not run to its end as the grader wrote it (was its code changed as it ran?)"
            cell.outputs.append(error_output("GraderCheckIncomplete", why))
            flags.add(f"checker cell {gid}: {why}")
        cell.source = original
    return sorted(flags)


# what a student's cell has no honest reason to write: each is flagged for the instructor (the score is not changed)
_SUSPECT = [
    (re.compile(r"set_custom_exc|CustomTB"), "sets an IPython custom exception handler"),
    (re.compile(r"\bexcepthook\b"), "sets sys.excepthook"),
    (re.compile(r"input_transformers|ast_transformers|\.events\.register"), "changes how IPython runs cells"),
    (re.compile(r"\bshowtraceback\b|\brun_cell\b|\bdo_execute\b"), "touches IPython's execution"),
    (re.compile(r"sys\.modules\s*\["), "edits sys.modules"),
    (re.compile(r"setattr\([^)]*['\"]check_"), "rebinds a check_* name"),
    (re.compile(r"\bfsdp_course(\.\w+)+\s*=(?!=)"), "assigns to an fsdp_course module's attribute"),
]


def _static_flags(nb: NotebookNode, graded: dict[str, float]) -> list[str]:
    """The student's cells that touch the checking machinery, by what their source says (before anything runs)."""
    import fsdp_course.classroom.checks as checks  # noqa: PLC0415

    names = "|".join(n for n in checks.__all__ if n.startswith("check_"))
    rebinding = re.compile(rf"(?<![\w.])(?:\w+\.)*(?:{names})\s*(?:,[^=\n]*)?=(?!=)")  # check_x = ..., m.check_x = ...
    flags = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or _nbgrader_id(cell) in graded:
            continue
        code = "\n".join(line.split("#", 1)[0] for line in cell.source.splitlines())
        for pattern, what in [*_SUSPECT, (rebinding, "rebinds a check_* name")]:
            if pattern.search(code):
                flags.append(f"cell {index + 1} {what}")
    return flags


def _package_digest() -> str:
    """A digest of the course's files on disk (its code and message catalogues): a notebook that edits them is
    flagged."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _adopt_orphans() -> None:
    """Linux: a process whose parent ends (a notebook's double-forked daemon) becomes this process's child, not
    init's, so that `kill_tree` below still finds it. Elsewhere nothing happens."""
    try:
        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _kernel_env(tmpdir: Path) -> dict[str, str]:
    """This process's environment less the grader's working folder, with the sandbox's TMPDIR."""
    env = {k: v for k, v in os.environ.items() if k not in ("PWD", "OLDPWD")}
    env.setdefault("OMP_NUM_THREADS", "1")  # several kernels share the machine's cores
    env.setdefault("MPLBACKEND", "Agg")
    return {**env, "TMPDIR": str(tmpdir)}  # the kernel's temporary files (run_ranks' stores...) stay in the sandbox


def grade_notebook(job: dict[str, Any], gradebook: str) -> dict[str, Any]:
    """Grade `job["submission"]` as exercise `job["exercise"]` against `gradebook` (SQL text); never raises.
    The kernel runs in the folder `job["sandbox"]`; its connection file goes to `job["private"]`. The caller is a
    process of its own that grades this one notebook: it adopts orphans, and afterwards kills all its descendants."""
    started = time.monotonic()
    exercise = job["exercise"]
    result: dict[str, Any] = {"exercise": exercise, "status": "ok", "notes": [], "checks": [], "errors": []}
    try:
        nb = nbformat.read(job["submission"], as_version=4)
        if not isinstance(nb.get("cells"), list):
            raise ValueError("no list of cells")
    except Exception as exc:  # noqa: BLE001
        result.update(status="invalid", notes=[f"not a readable notebook ({type(exc).__name__}: {exc})"[:300]])
        return result
    try:
        with _memory_gradebook(gradebook) as db_url:
            return _grade(nb, job, db_url, result, started)
    except Exception as exc:  # noqa: BLE001  (a grader problem: reported, never silent)
        result["status"] = "grader-error"
        result["notes"].append(f"grading failed: {type(exc).__name__}: {exc}"[:500])
        result["traceback"] = traceback.format_exc()[-3000:]
        return result


def _grade(nb: NotebookNode, job: dict[str, Any], db_url: str, result: dict[str, Any],
           started: float) -> dict[str, Any]:
    exercise, student = job["exercise"], job["student"]
    infos = exercise_ids(db_url)
    info = dict(infos[exercise], order=job["order"][exercise])
    present = {_nbgrader_id(c) for c in nb.cells} - {None}
    if not present & set(info["sources"]):
        others = sorted(name for name, other in infos.items() if present & set(other["sources"]))
        why = f"it holds the cells of {', '.join(others)}" if others else "it holds no cell of this exercise"
        result.update(status="invalid", notes=[f"not exercise {exercise}: {why}"])
        return result
    result["notes"] += _sanitize(nb, exercise, db_url, info)
    flags = _static_flags(nb, info["graded"])

    # a level down, so that a notebook that deletes '..' (its work folder) keeps its TMPDIR
    work, tmpdir = Path(job["sandbox"]) / "work" / exercise, Path(job["sandbox"]) / "tmp"
    work.mkdir(parents=True)
    tmpdir.mkdir()
    nbformat.write(nb, work / f"{exercise}.ipynb")  # the copy the kernel runs beside (it runs the one in memory)
    receipts = _install_guard(nb, info["graded"])  # after that copy: the kernel's files name no nonce of the guard's
    digest = _package_digest()
    executor = TimedExecute(timeout=None, notebook_timeout=float(job["timeout"]), raise_on_iopub_timeout=False)
    executor.kernel_env = _kernel_env(tmpdir)
    _adopt_orphans()
    km = kernel_manager(Path(job["private"]))
    try:
        nb, _ = executor.preprocess(nb, {"metadata": {"path": str(work)}}, km=km)
    except Exception as exc:  # noqa: BLE001  (e.g. the kernel never started)
        executor.stopped = executor.stopped or f"{type(exc).__name__}: {exc}"
    finally:
        kill_tree(os.getpid(), include_root=False)  # the kernel and all below it: we have no other child
        shutdown(km)
    setup = nb.cells.pop(0)  # the guard's cell: not the student's
    if 0 not in executor.executed or any(o.output_type == "error" for o in setup.get("outputs", [])):
        if not executor.stopped:
            raise RuntimeError(f"the grader's first cell failed: {_cell_text(setup)}"[:1000])
    executed = {i - 1 for i in executor.executed if i > 0}
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and index not in executed and not cell.get("outputs"):
            cell.outputs = [error_output(NOT_RUN, executor.stopped or "not run")]
    flags += _collect_receipts(nb, receipts)
    if _package_digest() != digest:
        flags.append("the course's files on disk changed while this notebook ran (grade in a container)")
    nb, _ = LimitOutput().preprocess(nb, {})

    with Gradebook(db_url) as gb:
        gb.update_or_create_student(student)
        gb.update_or_create_submission(ASSIGNMENT, student)
    resources = {"nbgrader": {"notebook": exercise, "assignment": ASSIGNMENT, "student": student, "db_url": db_url}}
    SaveAutoGrades().preprocess(nb, resources)
    cells = {_nbgrader_id(c): c for c in nb.cells if _nbgrader_id(c)}
    with Gradebook(db_url) as gb:
        for gid, points in info["graded"].items():
            score = gb.find_grade(gid, exercise, ASSIGNMENT, student).auto_score
            cell = cells.get(gid)
            result["checks"].append({"grade_id": gid, "score": float(score or 0.0), "max_score": points,
                                     "output": _cell_text(cell) if cell is not None else "(missing)"})
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and _nbgrader_id(cell) not in info["graded"]:
            for o in cell.outputs:
                if o.output_type == "error" and o.ename != NOT_RUN:
                    result["errors"].append(f"cell {index + 1}: {o.ename}: {o.evalue}"[:300])
    if executor.stopped:
        result["status"] = "timeout" if executor.stopped.startswith("time limit") else "error"
        result["notes"].append(f"stopped: {executor.stopped}; the cells after it were not run")
    elif result["errors"]:
        result["status"] = "error"
    result["flags"] = list(dict.fromkeys(flags))
    try:
        result["html"] = feedback_html(nb, resources)
    except Exception as exc:  # noqa: BLE001  (the scores stand; only this page is missing)
        result["notes"].append(f"no HTML feedback for this notebook: {type(exc).__name__}: {exc}"[:300])
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def feedback_html(nb: NotebookNode, resources: dict[str, Any]) -> str:
    """The graded notebook as nbgrader's `generate_feedback` renders it (its `feedback` template, scores per cell
    from the gradebook by its GetGrades preprocessor): a whole HTML page."""
    import nbgrader
    from nbconvert.exporters import HTMLExporter
    from nbgrader.preprocessors import GetGrades
    from traitlets.config import Config

    nb = nbformat.from_dict(nb)  # cells nbgrader added back hold plain dicts; its templates want attributes
    nb, resources = GetGrades().preprocess(nb, {**resources, "nbgrader": dict(resources["nbgrader"])})
    formgrader = Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
    config = Config()  # what nbgrader's GenerateFeedback configures
    config.HTMLExporter.template_name = "feedback"
    config.HTMLExporter.extra_template_basedirs = [str(formgrader / "templates")]
    config.HTMLExporter.extra_template_paths = [str(formgrader / "static" / "node_modules" / "bootstrap" / "dist"
                                                    / "css")]
    html, _ = HTMLExporter(config=config).from_notebook_node(nb, resources=resources)
    return html


_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the colours of a rendered traceback


def _cell_text(cell: NotebookNode, max_lines: int = 40) -> str:
    """What a checker cell printed, and its error, as plain text (the feedback shows it)."""
    parts = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type == "error" and o.ename == "CheckFailed" and o.get("traceback"):
            # a checker's failure renders as the learner's frames plus the report (checks/_common.CheckFailed)
            parts.append(_ANSI.sub("", "\n".join(o.traceback)) + "\n")
        elif o.output_type == "error":
            parts.append(f"{o.ename}: {o.evalue}\n")
        elif "data" in o and "text/plain" in o.data:
            parts.append(o.data["text/plain"] + "\n")
    lines = "".join(parts).splitlines()
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m fsdp_course.classroom.autograde JOB.json`: grade one notebook, write the result JSON, exit 0."""
    args = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(args[0]).read_text())
    with tempfile.TemporaryDirectory(prefix="fsdp_grade_", ignore_cleanup_errors=True) as sandbox, \
            tempfile.TemporaryDirectory(prefix="fsdp_grade_") as private:
        result = grade_notebook({**job, "sandbox": sandbox, "private": private}, gradebook_sql(Path(job["gradebook"])))
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
