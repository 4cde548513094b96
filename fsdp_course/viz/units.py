"""The size of an FSDP unit, traded: time per step (α-β model) against peak memory per rank (lesson 07).

A model of Ψ parameters cut into k equal units of U = Ψ/k: per step 3k collectives of N−1 ring steps each, and the
same 3 · 4Ψ(N−1)/N bytes whatever k (fp32; two all-gathers and a reduce-scatter per unit), so

    time = 3 (Ψ/U)(N−1) · α + 3 · 4Ψ (N−1)/N · β        peak = 16Ψ/N + 8U bytes (fp32 AdamW)

A unit's collectives spend as much on latency as on bytes at U* = Nα/(4β) parameters.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from fsdp_course.i18n.messages import catalogue, text
from fsdp_course.runtime.cost_model import CostFit
from fsdp_course.viz.style import CourseFigure

T = catalogue("viz.units")  # fsdp_course/i18n/catalogues/viz.units.yml

__all__ = ["unit_tradeoff", "plot_unit_tradeoff"]


def unit_tradeoff(psi: int, world_size: int, cost: CostFit, points: int = 60,
                  smallest: float = 1e4) -> tuple[list[float], list[float], list[float]]:
    """(unit sizes U from `smallest` to Ψ on a log scale, seconds per step, peak bytes per rank) for equal units."""
    n = world_size
    sizes = [smallest * (psi / smallest) ** (i / (points - 1)) for i in range(points)]
    seconds = [3 * (psi / u) * (n - 1) * cost.alpha + 3 * 4 * psi * (n - 1) / n * cost.beta for u in sizes]
    return sizes, seconds, [16 * psi / n + 8 * u for u in sizes]


def plot_unit_tradeoff(psi: int, world_size: int, cost: CostFit, layer_numel: int) -> Figure:
    """Seconds per step (left axis, log) and peak MB per rank (right axis) against the unit size U, with U* and
    one layer of the model (`layer_numel` parameters) marked."""
    sizes, seconds, peak = unit_tradeoff(psi, world_size, cost)
    fig = CourseFigure(figsize=(7.5, 4), layout="constrained")
    ax = fig.subplots()
    ax.plot(sizes, seconds, color="C0", label=text(T("collectives")))
    if cost.beta > 0 and math.isfinite(world_size * cost.alpha / (4 * cost.beta)):
        ax.axvline(world_size * cost.alpha / (4 * cost.beta), color="C0", linestyle=":", label="U* = Nα/(4β)")
    ax.axvline(layer_numel, color="grey", linestyle="--", label=text(T("one_layer")))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(text(T("per_unit")))
    ax.set_ylabel(text(T("seconds")))
    right = ax.twinx()
    right.plot(sizes, [p / 1e6 for p in peak], color="C3", label=text(T("peak")))
    right.set_ylabel(text(T("mb")))
    ax.legend(handles=ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0], fontsize=8,
              loc="upper center")
    ax.set_title(text(T("title", n=world_size)))
    return fig
