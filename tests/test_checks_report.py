"""How a failing check reaches the learner: its report shown once, without the checker's frames.

In a notebook (a real kernel, executed by nbclient as nbgrader executes it): a failing check cell gets one error
output whose traceback is the learner's cell line and the report, nothing from `fsdp_course`; the report is not
printed a second time; nbgrader's own `determine_grade` scores the cell 0. A stub's NotImplementedError is shown
the same way. What the learner's function prints is headed by the world size it ran at. In plain Python the report
is printed once and `str(exc)` is one line.
"""

from __future__ import annotations

import nbformat
import pytest
import torch
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbgrader.utils import determine_grade
from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager
from reference_solutions import ROOT

from fsdp_course import RankContext
from fsdp_course.classroom.checks import CheckFailure, check_all_reduce
from fsdp_course.classroom.checks._common import CheckFailed, T, render_for_ipython
from fsdp_course.runtime.ports import kernel_transport

PLANTED = '''\
import torch

def my_all_reduce(ctx, tensor):
    if ctx.rank == 0 and tensor.numel() == 1:
        print("hello from rank 0")
    flat = tensor.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % ctx.world_size)])
    full = ctx.all_gather(ctx.reduce_scatter(flat, op="mean"))  # the mistake: averages
    return full[: tensor.numel()].reshape(tensor.shape)

def stub(ctx, tensor):
    # YOUR CODE HERE
    raise NotImplementedError()
'''
REPORT_HEAD = "check_all_reduce FAILED at world size 2, input shape (1,)"
HINT = "rank 0's result is 2x too small: did you average"


def _grade_cell(source: str, grade_id: str) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    cell.metadata["nbgrader"] = {"grade": True, "grade_id": grade_id, "locked": True, "points": 1,
                                 "schema_version": 3, "solution": False, "task": False}
    return cell


@pytest.fixture(scope="module")
def executed() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(PLANTED),
        _grade_cell("from fsdp_course.classroom.checks import check_all_reduce\n\n"
                    "check_all_reduce(my_all_reduce, world_sizes=(1, 2))", "planted"),
        _grade_cell("from fsdp_course.classroom.checks import check_all_reduce\n\ncheck_all_reduce(stub)", "stub"),
    ])
    km = KernelManager(kernel_name=CURRENT_ENV_KERNEL_NAME, kernel_spec_manager=NbvalKernelspecManager(),
                       **kernel_transport())
    NotebookClient(nb, km=km, allow_errors=True, timeout=120, resources={"metadata": {"path": str(ROOT)}}).execute()
    return nb


def _text(cell: nbformat.NotebookNode) -> tuple[str, list[nbformat.NotebookNode]]:
    """Everything the cell shows (streams and tracebacks, as Jupyter renders them), and its error outputs."""
    errors = [o for o in cell.outputs if o.output_type == "error"]
    shown = "".join(o.text for o in cell.outputs if o.output_type == "stream")
    shown += "\n".join(line for o in errors for line in o.traceback)
    return shown, errors


def test_a_failing_check_shows_its_report_once_without_the_checkers_frames(executed: nbformat.NotebookNode) -> None:
    shown, errors = _text(executed.cells[1])
    assert len(errors) == 1 and errors[0].ename == "CheckFailed"
    assert shown.count(REPORT_HEAD) == 1, shown  # not printed, then repeated in the traceback
    assert shown.count(HINT) == 1, shown  # the exception's own one-line summary is not shown again
    assert "Cell In[2], line 3" in shown and "----> check_all_reduce(my_all_reduce, world_sizes=(1, 2))" in shown
    for library in ("fsdp_course/", "_common.py", "collectives.py", "simulate.py", "site-packages"):
        assert library not in shown, library
    evalue = errors[0].evalue  # what a grader reads: one line, the same diagnosis
    assert "\n" not in evalue and evalue.startswith("check_all_reduce failed at world size 2, input shape (1,)")
    assert HINT in evalue


def test_the_learners_prints_are_headed_by_world_size(executed: nbformat.NotebookNode) -> None:
    shown, _ = _text(executed.cells[1])
    assert "--- world size 1 ---\n[rank 0] hello from rank 0\n" in shown
    assert "--- world size 2 ---\n[rank 0] hello from rank 0\n" in shown


def test_a_stub_shows_one_short_error(executed: nbformat.NotebookNode) -> None:
    shown, errors = _text(executed.cells[2])
    assert len(errors) == 1 and errors[0].ename == "NotImplementedError"
    assert shown.count("stub is not implemented yet") == 1
    assert "fsdp_course/" not in shown and "----> check_all_reduce(stub)" in shown


def test_nbgrader_scores_the_failing_cells_zero(executed: nbformat.NotebookNode) -> None:
    for cell in executed.cells[1:]:
        assert determine_grade(cell) == (0, 1.0)
    passed = _grade_cell("print('All tests passed')", "passing")  # the control: no error, full marks
    passed.outputs = [nbformat.v4.new_output("stream", name="stdout", text="All tests passed\n")]
    assert determine_grade(passed) == (1.0, 1.0)


# -- plain Python ------------------------------------------------------------------------------------------
def averages(ctx: RankContext, tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % ctx.world_size)])
    return ctx.all_gather(ctx.reduce_scatter(flat, op="mean"))[: tensor.numel()].reshape(tensor.shape)


def test_plain_python_prints_the_report_once_and_raises_a_one_line_assertion(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError) as info:
        check_all_reduce(averages, world_sizes=(2,))
    out = capsys.readouterr().out
    assert out.count(REPORT_HEAD) == 1 and out.count(HINT) == 1
    assert isinstance(info.value, CheckFailed) and "\n" not in str(info.value)
    assert str(info.value) == info.value.failure.summary()


def test_render_keeps_only_the_learners_frames() -> None:
    def learner() -> None:
        CheckFailure("check_x", "world size 2", T("values_differ", rank=0), T("read_traceback")).fail()

    with pytest.raises(CheckFailed) as info:
        learner()
    lines = info.value._render_traceback_()
    text = "\n".join(lines)
    assert "in learner" not in text and "CheckFailure(\"check_x\"" in text  # the learner's line, shown as code
    assert text.endswith("check_x FAILED at world size 2\n  rank 0: values differ\n  hint: read the end of the "
                         "traceback above: the last line of your code in it is where it went wrong")
    assert "_common.py" not in text
    assert render_for_ipython(ValueError("no traceback"), "report") == ["report"]
