"""Shared look of the course's figures: one colour per rank, per memory category, per collective; byte axes.

Rank r is always drawn in `rank_color(r)` (matplotlib's tab10, repeating after 10 ranks); bytes are
written in binary units (KiB = 1024 B) with three significant digits. Figures are built without
pyplot (`CourseFigure`), so rank threads can draw and nothing is shown twice in a notebook.
"""

from __future__ import annotations

import io
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from fsdp_course.i18n import figure_language
from fsdp_course.i18n.messages import CATALOGUE, catalogue, text

RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
               "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # tab10: rank r -> RANK_COLORS[r % 10]
CATEGORY_COLORS = {"params": "#4c72b0", "sharded_params": "#64b5cd", "gathered_params": "#8172b3",
                   "grads": "#dd8452", "sharded_grads": "#ccb974", "optimizer": "#55a868",
                   "buffers": "#937860", "gathered": "#8172b3", "other": "#b0b0b0", "total": "#8c8c8c"}
CATEGORY_HATCHES = {"sharded_params": "///", "sharded_grads": "///"}  # a shard: its family's colour, hatched

T = catalogue("viz")  # fsdp_course/i18n/catalogues/viz.yml
WORD = catalogue("viz.words")  # the names figures write as words; in English a word is its name


def word(name: str) -> str:
    """A memory category's, a phase's or an engine event's name as a figure writes it (in Chinese: 分片参数 for
    sharded_params, 优化器更新 for optimizer step); any other name (a unit, "forward: unshard root") as it is."""
    return text(WORD(name)) if f"viz.words.{name}" in CATALOGUE else name


def category_style(category: str) -> dict[str, str]:
    """The bar colour of a memory category, and a hatch for the sharded ones (a shard of params is not params)."""
    style = {"color": CATEGORY_COLORS.get(category, "#b0b0b0")}
    if category in CATEGORY_HATCHES:
        style |= {"hatch": CATEGORY_HATCHES[category], "edgecolor": "white"}
    return style


OP_COLORS = {"all_gather": "#4c72b0", "reduce_scatter": "#c44e52", "all_reduce": "#dd8452",
             "broadcast": "#55a868", "barrier": "#b0b0b0"}
EVENT_STYLES = {"unshard": ("#2ca02c", "--"), "reshard": ("#d62728", ":"), "reduce_scatter": ("#9467bd", "-."),
                "all_reduce": ("#ff7f0e", "-."), "all_gather": ("#17becf", "--")}  # events marked on timelines
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


class CourseFigure(Figure):
    """A Figure that shows itself as a PNG in IPython even when pyplot was never imported."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        figure_language()  # in Chinese: the CJK font joins matplotlib's list before the figure makes any text
        super().__init__(*args, **kwargs)

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()


def rank_color(rank: int) -> str:
    """The fixed colour of rank `rank` (tab10; repeats after 10 ranks)."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (three significant digits, binary units)."""
    for unit, size in _UNITS:
        if abs(n) >= size or unit == "B":
            v = n / size
            return f"{v:.0f} {unit}" if unit == "B" or abs(v) >= 100 else f"{v:#.3g} {unit}"
    raise AssertionError("unreachable")


def byte_axis(ax: Any, top: float) -> None:
    """Start the y axis at 0 with headroom above `top`, ticks at round numbers of its largest unit."""
    unit, size = next((u, s) for u, s in _UNITS if top >= s or u == "B")
    limit = max(top, 1) * 1.15
    ax.set_ylim(0, limit)
    ax.set_yticks([t * size for t in MaxNLocator(nbins=5).tick_values(0, limit / size) if 0 <= t * size <= limit])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / size:g}"))
    ax.set_ylabel(text(T("bytes_axis", unit=unit)))


def new_figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (9, 3.5), **kw: Any) -> tuple:
    """A CourseFigure with constrained layout and a 2-D array of axes (always 2-D, even 1 x 1)."""
    fig = CourseFigure(figsize=size, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes
