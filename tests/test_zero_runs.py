"""Lesson 04's bookkeeping (fsdp_course.engines.zero_runs, fsdp_course.viz.zero_scaling): the branches the lesson
does not run."""

import pytest
import torch

from fsdp_course.engines import zero_runs
from fsdp_course.engines.equivalence import Trace
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.viz.zero_scaling import plot_zero_over_n


def test_an_unknown_engine_is_named() -> None:
    with pytest.raises(ValueError, match="unknown engine 'ZeRO-3': one of DDP, ZeRO-1, ZeRO-2"):
        zero_runs.make_trainee("ZeRO-3", torch.nn.Linear(2, 2), None, torch.optim.SGD)  # type: ignore[arg-type]


def test_replicas_that_differ_in_one_bit_are_not_identical() -> None:
    def trace(value: float) -> Trace:
        return Trace(params=[{"w": [(0, 2, torch.tensor([1.0, value]))]}])

    assert zero_runs.replicas_identical([trace(2.0), trace(2.0)])
    assert not zero_runs.replicas_identical([trace(2.0), trace(torch.nextafter(torch.tensor(2.0),
                                                                                  torch.tensor(3.0)).item())])


def test_a_peak_at_no_bucket_names_none() -> None:
    assert zero_runs.StepEvents([], 0, "optimizer step").peak_bucket is None
    assert zero_runs.StepEvents([], 0, "reduce_scatter bucket 3").peak_bucket == 3


def test_chunks_are_printed_one_line_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    layout = FlatParamLayout.build([("a", torch.zeros(3)), ("b", torch.zeros(4))], 2)
    zero_runs.print_chunks(layout)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["flat buffer: Ψ = 7 elements, padded to 8 (1 zeros), 4 per rank",
                     "rank 0: chunk [    0,     4):  2 parameter pieces, from a[0:] to b[:1]",
                     "rank 1: chunk [    4,     8):  1 parameter pieces, from b[1:] to b[:4]"]


def test_the_scaling_figure_draws_the_four_formulas_and_refuses_an_unknown_stage() -> None:
    fig = plot_zero_over_n(1000, {"ZeRO-1": {1: 16000, 2: 12000}})
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["DDP formula", "ZeRO-1 formula", "ZeRO-1 measured", "ZeRO-2 formula", "ZeRO-3 formula"]
    with pytest.raises(ValueError, match="measured stages must be among"):
        plot_zero_over_n(1000, {"FSDP": {1: 0}})
