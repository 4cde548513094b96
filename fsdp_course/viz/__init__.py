"""Figures of the course: the sharding map, per-rank memory over a step, traffic per step, the ZeRO bars.

matplotlib only (no pyplot, no Jupyter): every function builds a fresh figure and returns it, so it
is safe from rank threads and shows as a static PNG when a notebook runs headless (nbval, GitHub).
Rank r always has the colour `rank_color(r)`; byte axes are in B / KiB / MiB / GiB / TiB.

  plot_sharding         a unit's flat parameter, coloured by owning rank   (sharding.py; FSDP paper
                        arXiv:2304.11277 section 3.2.1)
  plot_per_param_sharding  FSDP2's dim-0 shards, one bar per parameter, padding rows hatched
                        (sharding.py; torch _fsdp_param.py)
  plot_memory_timeline  measured bytes per rank at each event of a step    (timeline.py)
  plot_memory_compare   the same, DDP vs FSDP side by side
  plot_traffic          ledger bytes per collective per step vs 2Ψ(N-1)/N and 3Ψ(N-1)/N elements
                        (traffic.py; ZeRO arXiv:1910.02054 section 7)
  plot_zero_bars        DDP 16Ψ, ZeRO-1 8Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, ZeRO-3 16Ψ/N (fp32 Adam), measured
                        bars beside them   (zero_bars.py; ZeRO arXiv:1910.02054 section 5.1)
  plot_overlap          per rank, each unit's compute (fsdp.trace) above each collective (ledger start/end):
                        what prefetching overlaps   (overlap.py; FSDP paper arXiv:2304.11277 section 3.3)
The interactive calculator lives in `fsdp_course.viz.widgets` (it needs ipywidgets).
"""

from fsdp_course.viz.overlap import plot_overlap
from fsdp_course.viz.sharding import plot_per_param_sharding, plot_sharding
from fsdp_course.viz.style import (
    CATEGORY_COLORS,
    RANK_COLORS,
    STAGES,
    CourseFigure,
    format_bytes,
    rank_color,
)
from fsdp_course.viz.timeline import plot_memory_compare, plot_memory_timeline
from fsdp_course.viz.traffic import plot_traffic, traffic_formula
from fsdp_course.viz.zero_bars import plot_zero_bars, stage_index, zero_bytes, zero_formula_text

__all__ = [
    "plot_per_param_sharding",
    "CATEGORY_COLORS",
    "RANK_COLORS",
    "STAGES",
    "CourseFigure",
    "format_bytes",
    "plot_memory_compare",
    "plot_memory_timeline",
    "plot_overlap",
    "plot_sharding",
    "plot_traffic",
    "plot_zero_bars",
    "rank_color",
    "stage_index",
    "traffic_formula",
    "zero_bytes",
    "zero_formula_text",
]
