"""Model state per rank as the world size N grows: ZeRO's formulas as lines, measured bytes as dots.

DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N (fp32 Adam; `memory.zero_formula`, ZeRO
arXiv:1910.02054 section 5.1): the first three level off at 16Ψ, 8Ψ and 4Ψ, only ZeRO-3 falls towards zero.
"""

from __future__ import annotations

from collections.abc import Mapping

from matplotlib.figure import Figure

from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.memory import zero_formula
from fsdp_course.viz.style import STAGES, new_figure

T = catalogue("viz.zero_scaling")  # fsdp_course/i18n/catalogues/viz.zero_scaling.yml

__all__ = ["T", "plot_zero_over_n"]

_COLORS = ("C0", "C1", "C2", "C3")


def plot_zero_over_n(psi: int, measured: Mapping[str, Mapping[int, float]], max_world_size: int = 8, *,
                     title: str | Message | None = None) -> Figure:
    """The four formulas for N = 1 .. `max_world_size`, and `measured` bytes per rank as dots, by stage name and
    world size ({"DDP": {1: bytes, 2: bytes, ...}, "ZeRO-1": {...}}); in KiB."""
    unknown = set(measured) - set(STAGES)
    if unknown:
        raise ValueError(f"measured stages must be among {', '.join(STAGES)}, got {sorted(unknown)}")
    ns = list(range(1, max_world_size + 1))
    fig, axes = new_figure(size=(7, 3.6))
    ax = axes[0, 0]
    for stage, (name, color) in enumerate(zip(STAGES, _COLORS, strict=True)):
        ax.plot(ns, [zero_formula(psi, n, stage)["total"] / 1024 for n in ns], color=color, linewidth=1,
                label=text(T("formula", name=name)))
        if name in measured:
            points = sorted(measured[name].items())
            ax.plot([n for n, _ in points], [b / 1024 for _, b in points], "o", color=color,
                    label=text(T("measured", name=name)))
    ax.set_xlabel(text(T("world_size")))
    ax.set_ylabel(text(T("kib")))
    ax.set_ylim(0, None)
    ax.set_title(text(title or T("title", psi=psi)))
    ax.legend(fontsize=8, ncol=2)
    return fig
