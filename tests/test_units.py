"""fsdp_course.demos.units and fsdp_course.viz.units: lesson 07's bookkeeping (the lesson exercises the runs; these
check the pricing and the trade-off curve it no longer asserts itself)."""

from __future__ import annotations

import pytest

from fsdp_course.demos.units import price
from fsdp_course.runtime.cost_model import CostFit
from fsdp_course.viz.units import plot_unit_tradeoff, unit_tradeoff

COST = CostFit(alpha=1e-4, beta=1e-9, r2=1.0, rms=0.0, median_ratio=1.0, worst_ratio=1.0, samples=4)


def test_price_splits_a_step_into_latency_and_bytes() -> None:
    latency, data = price([("all_gather", 4000), ("reduce_scatter", 4000), ("all_reduce", 4000)], COST, 4)
    assert latency == pytest.approx((3 + 3 + 6) * COST.alpha)
    assert data == pytest.approx((3000 + 3000 + 6000) * COST.beta)  # ring bytes: (N-1)/N, twice for an all-reduce


def test_smaller_units_cost_time_and_save_memory() -> None:
    sizes, seconds, peak = unit_tradeoff(10**7, 4, COST)
    assert sizes[0] == pytest.approx(1e4) and sizes[-1] == pytest.approx(1e7)
    assert all(a > b for a, b in zip(seconds, seconds[1:], strict=False)), "larger units: less latency"
    assert all(a < b for a, b in zip(peak, peak[1:], strict=False)), "larger units: 8U more bytes"
    assert peak[-1] == pytest.approx(16 * 10**7 / 4 + 8 * 10**7)


def test_the_figure_marks_u_star_and_the_layer() -> None:
    fig = plot_unit_tradeoff(10**7, 4, COST, 3 * 10**6)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "U* = Nα/(4β)" in labels and "one layer of the article's model" in labels
