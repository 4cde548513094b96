"""Lesson 01's pictures and tables (fsdp_course.viz.collectives): what the lesson's saved outputs do not pin down."""

import pytest

from fsdp_course.runtime.cost_model import CostFit, Sample
from fsdp_course.viz.collectives import plot_alpha_beta, plot_ring_cost, print_fit, print_growth, show_ranks


def test_show_ranks_prints_every_rank_and_draws_one_panel_per_stage(capsys: pytest.CaptureFixture[str]) -> None:
    fig = show_ranks("all_gather", ("before", [[0], [1]]), ("after", [[0, 1], [0, 1]]))
    assert capsys.readouterr().out.splitlines() == ["before:", "  rank 0: [0]", "  rank 1: [1]",
                                                    "after:", "  rank 0: [0, 1]", "  rank 1: [0, 1]"]
    assert [ax.get_title() for ax in fig.axes] == ["before", "after"]


def test_the_ring_cost_levels_off_below_two_and_one() -> None:
    reduce_line, gather_line = plot_ring_cost(8).axes[0].get_lines()
    assert list(reduce_line.get_ydata()) == [2 * (n - 1) / n for n in range(1, 9)]
    assert max(gather_line.get_ydata()) < 1


def test_the_fit_tables_and_figure(capsys: pytest.CaptureFixture[str]) -> None:
    model = CostFit(alpha=1e-3, beta=1e-9, r2=0.2, rms=0.0, median_ratio=3.0, worst_ratio=5.0, samples=2)
    samples = [Sample("all_reduce", 2, 4096, 2e-3), Sample("reduce_scatter", 2, 4096, 1e-3)]
    print_fit(samples, model)
    assert "a rough fit" in capsys.readouterr().out  # R² below 0.3: the note, not a failure
    times = print_growth(model, {"4 KiB": 4096}, (2, 4))
    assert times["4 KiB", 4] == pytest.approx(6e-3 + 1.5 * 4096e-9)
    assert capsys.readouterr().out.splitlines()[2].split()[:2] == ["2", "2.00"]
    labels = [c.get_label() for c in plot_alpha_beta(samples, model).axes[0].collections]
    assert labels == ["all_reduce, N=2", "reduce_scatter, N=2"]
