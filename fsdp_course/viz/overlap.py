"""The overlap timeline: per rank, a compute lane (each unit's forward and backward) above a communication lane
(each collective from its start to its end), on one time axis relative to the step's start.

The compute spans are FSDP's `fsdp.trace` (`Span`: unit, phase, start, end, in time.perf_counter() seconds); the
collectives are the ledger's `Record`s, which carry the same clock (`start` when every rank had joined the call,
`end` when it completed). Without prefetching, every all-gather sits in a gap between two units' compute; with
`FSDP(..., prefetch=1)` the next unit's all-gather runs under the current unit's bar: the overlap the FSDP paper
(arXiv:2304.11277, section 3.3) builds prefetching for. Each panel's title gives the measured overlap of the
all-gathers (`fsdp_course.runtime.timing.overlap_seconds`): their ends are Gloo's completion times, while an
asynchronous reduce-scatter's end is when it was waited for (Gloo reports no completion for it), so its bar can
stretch past the moment it really finished.

Intervals that overlap in one lane (a prefetched all-gather beside a reduce-scatter still in flight, or nested
spans) are stacked in sub-lanes, so that no bar hides another. Every bar carries a gid: "span:<unit>:<phase>" or
"comm:<op>".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.runtime.timing import busy_seconds, intervals, overlap_seconds
from fsdp_course.viz.style import OP_COLORS, new_figure, rank_color

__all__ = ["PHASE_COLORS", "T", "plot_overlap"]

T = catalogue("viz.overlap")  # fsdp_course/i18n/catalogues/viz.overlap.yml

PHASE_COLORS = {"forward": "#64b5cd", "backward": "#8172b3"}  # compute bars; collectives take OP_COLORS
_LANE = 0.8  # height of a lane, in y units (compute lane at y = 1, communication lane at y = 0)
_LABEL_MIN = 0.035  # a bar narrower than this fraction of the axis gets no text


def _pairs(per_rank: Any) -> list[tuple[int, list[Any], list[Any]]]:
    """[(rank, spans, records)] from a sequence (index = rank) or a {rank: (spans, records)} mapping; a Ledger
    stands for its records."""
    items = sorted(per_rank.items()) if isinstance(per_rank, Mapping) else list(enumerate(per_rank))
    if not items:
        raise ValueError("nothing to draw: pass one (fsdp.trace, ctx.ledger) pair per rank")
    out = []
    for rank, pair in items:
        if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
            raise ValueError(f"rank {rank}: expected a pair (spans, records), e.g. (fsdp.trace, ctx.ledger.records), "
                             f"got {type(pair).__name__}")
        spans, records = pair
        records = getattr(records, "records", records)
        out.append((int(rank), list(spans), list(records)))
    return out


def _sublanes(pairs: list[tuple[float, float]]) -> tuple[list[int], int]:
    """A sub-lane per interval so that overlapping ones never share one (greedy, in start order); and how many."""
    ends: list[float] = []  # last end in each sub-lane
    lanes = [0] * len(pairs)
    for i in sorted(range(len(pairs)), key=lambda k: pairs[k]):
        start, end = pairs[i]
        lane = next((k for k, last in enumerate(ends) if last <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        else:
            ends[lane] = end
        lanes[i] = lane
    return lanes, max(1, len(ends))


def _short(unit: str) -> tuple[str, str]:
    """A long and a short label: 'encoder.layers.3' -> ('layers.3', '3') (a bar too narrow for the first gets the
    second)."""
    parts = unit.split(".")
    return ".".join(parts[-2:]), parts[-1]


def _draw_lane(ax: Any, y: float, pairs: list[tuple[float, float]], colors: list[str], gids: list[str],
               texts: list[tuple[str, str]], t0: float, width: float) -> None:
    lanes, count = _sublanes(pairs)
    height = _LANE / count
    for (start, end), lane, color, gid, (long, short) in zip(pairs, lanes, colors, gids, texts, strict=True):
        bottom = y - _LANE / 2 + lane * height
        x, w = (start - t0) * 1e3, (end - start) * 1e3
        ax.barh(bottom, w, left=x, height=height * 0.9, align="edge", color=color, edgecolor="white",
                linewidth=0.4, gid=gid)
        text = long if w >= _LABEL_MIN * width else short if w >= _LABEL_MIN * width / 4 else ""
        if text:
            ax.text(x + w / 2, bottom + height * 0.45, text, ha="center", va="center", fontsize=6, clip_on=True)


def plot_overlap(per_rank: Any, *, t0: float | None = None, title: str | Message | None = None,
                 ops: Sequence[str] | None = None) -> Figure:
    """Per rank, compute (top lane: each unit's span, labelled by unit, coloured by forward / backward) and
    communication (bottom lane: each collective, coloured by operation), in milliseconds after `t0`.

    `per_rank`: one `(spans, records)` pair per rank, as a list (index = rank) or {rank: pair}; spans are
    `fsdp.trace`, records `ctx.ledger.records` (or the Ledger). `t0` (perf_counter seconds) defaults to the earliest
    start of all ranks, so every rank is drawn on one clock (simulated ranks are threads of one process; under
    torchrun pass each rank's own step start instead, or one figure per rank). `ops` keeps only those collectives.
    """
    pairs = _pairs(per_rank)
    keep = None if ops is None else set(ops)
    drawn = []
    for rank, spans, records in pairs:
        records = [r for r in records if keep is None or r.op in keep]
        span_times = intervals(spans, f"rank {rank}: span")
        record_times = intervals(records, f"rank {rank}: record")
        if not span_times and not record_times:
            raise ValueError(f"rank {rank} has no compute spans and no collectives: run a step with FSDP first "
                             "(fsdp.trace is cleared by the next forward)")
        drawn.append((rank, spans, span_times, records, record_times))
    starts = [s for _, _, st, _, rt in drawn for s, _ in st + rt]
    ends = [e for _, _, st, _, rt in drawn for _, e in st + rt]
    origin = min(starts) if t0 is None else float(t0)
    width = max(1e-9, (max(ends) - origin) * 1e3)

    fig, axes = new_figure(len(drawn), 1, (10, 0.6 + 1.5 * len(drawn)), sharex=True)
    legend: dict[str, Any] = {}
    for ax, (rank, spans, span_times, records, record_times) in zip(axes[:, 0], drawn, strict=True):
        phases = [getattr(s, "phase", "forward") for s in spans]
        units = [str(getattr(s, "unit", "")) for s in spans]
        _draw_lane(ax, 1, span_times, [PHASE_COLORS.get(p, "#b0b0b0") for p in phases],
                   [f"span:{u}:{p}" for u, p in zip(units, phases, strict=True)], [_short(u) for u in units],
                   origin, width)
        _draw_lane(ax, 0, record_times, [OP_COLORS.get(r.op, "#b0b0b0") for r in records],
                   [f"comm:{r.op}" for r in records], [("", "")] * len(records), origin, width)
        for p in dict.fromkeys(phases):
            label = (T("forward_compute") if p == "forward" else T("backward_compute") if p == "backward"
                     else T("phase_compute", phase=p))
            legend[p] = Patch(color=PHASE_COLORS.get(p, "#b0b0b0"), label=text(label))
        for op in dict.fromkeys(r.op for r in records):
            legend[op] = Patch(color=OP_COLORS.get(op, "#b0b0b0"), label=op)
        ax.set_yticks([0, 1], [text(T("comm")), text(T("compute"))], fontsize=8)
        ax.set_ylim(-0.6, 1.6)
        gathers = [r for r in records if r.op == "all_gather"]
        measured = gathers or records
        busy = busy_seconds(measured) * 1e3
        both = (overlap_seconds(spans, measured) if spans and measured else 0.0) * 1e3
        run = T("gathers_run" if gathers else "collectives_run", rank=rank, busy=busy, both=both)
        ax.set_title(text(run), fontsize=9, loc="left", color=rank_color(rank))
        ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    axes[-1, 0].set_xlim(0, width * 1.02)
    axes[-1, 0].set_xlabel(text(T("x_axis")))
    fig.legend(list(legend.values()), [h.get_label() for h in legend.values()], loc="outside right upper",
               fontsize=8)
    fig.suptitle(text(title or T("title")), fontsize=10)
    return fig
