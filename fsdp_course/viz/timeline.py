"""Measured memory per rank over one training step, by category, with the engine's events marked.

The data is what `memory.MemoryRecorder` appends to `engine.timeline`: one `(event_label,
{category: bytes})` per event, measured from the storages alive (not computed). The events whose label
names unshard / reshard / reduce_scatter / all_reduce / all_gather are marked: the moments where FSDP
(arXiv:2304.11277, section 3) gathers a unit, frees it, and shards its gradient, and where DDP / ZeRO
(arXiv:1910.02054) all-reduce or gather.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.viz.style import (
    CATEGORY_COLORS,
    EVENT_STYLES,
    byte_axis,
    category_style,
    format_bytes,
    new_figure,
    rank_color,
    word,
)
from fsdp_course.viz.style import T as STYLE

Timeline = Sequence[tuple[str, Mapping[str, int]]]

T = catalogue("viz.timeline")  # fsdp_course/i18n/catalogues/viz.timeline.yml


def _is_timeline(x: Any) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str) and (
        len(x) == 0 or (isinstance(x[0], (tuple, list)) and len(x[0]) == 2 and isinstance(x[0][0], str)))


def _rank_timelines(timelines: Any) -> list[tuple[int, Timeline]]:
    """[(rank, timeline)] from one timeline, a list per rank, a {rank: timeline} dict, or engines."""
    if hasattr(timelines, "timeline"):
        timelines = [timelines.timeline]
    elif _is_timeline(timelines):
        timelines = [timelines]
    pairs = sorted(timelines.items()) if isinstance(timelines, Mapping) else list(enumerate(timelines))
    if not pairs:
        raise ValueError("no timelines given: pass engine.timeline of each rank")
    out = []
    for rank, t in pairs:
        t = getattr(t, "timeline", t)
        if not _is_timeline(t) or len(t) == 0:
            raise ValueError(f"rank {rank}'s timeline is empty or not a list of (label, {{category: bytes}}): "
                             "attach a recorder (memory.attach(engine)) before the step")
        out.append((int(rank), t))
    return out


def _categories(timelines: list[tuple[int, Timeline]], categories: Sequence[str] | None) -> list[str]:
    if categories is not None:
        return list(categories)
    present = {c for _, t in timelines for _, snap in t for c, b in snap.items() if b}
    known = [c for c in CATEGORY_COLORS if c in present]
    return known + sorted(present - set(known))


def _event_kind(label: str) -> str | None:
    low = label.lower().replace("-", "_").replace(" ", "_")
    return next((k for k in EVENT_STYLES if k in low), None)


def _mark_events(ax: Any, labels: Sequence[str], legend: dict[str, Any]) -> None:
    for x, label in enumerate(labels):
        kind = _event_kind(label)
        if kind is not None:
            color, style = EVENT_STYLES[kind]
            legend[kind] = ax.axvline(x, color=color, linestyle=style, linewidth=1, alpha=0.7, label=kind)


def _phase(label: str) -> str:
    """The phase an event belongs to: "forward" (forward: ..., forward done), "backward" (pre_/post_backward: ...,
    backward done, and DDP's and ZeRO's gradient reductions), or itself."""
    if label.split(" ", 1)[0] in ("reduce_scatter", "all_reduce"):
        return "backward"
    head = label.split(":", 1)[0] if ":" in label else label.removesuffix(" done")
    return {"forward": "forward", "backward": "backward", "pre_backward": "backward", "post_backward": "backward"}.get(
        head, label)


def _event_ticks(ax: Any, labels: Sequence[str]) -> None:
    """One tick per phase (a run of events of one phase), at its middle; runs of several events are shaded."""
    runs: list[tuple[str, int, int]] = []  # (phase, first event, last event)
    for i, label in enumerate(labels):
        phase = _phase(label)
        if runs and runs[-1][0] == phase:
            runs[-1] = (phase, runs[-1][1], i)
        else:
            runs.append((phase, i, i))
    for phase, first, last in runs:
        if last > first:
            ax.axvspan(first - 0.5, last + 0.5, color="#f0f0f0", zorder=0, gid=f"phase:{phase}")
    tilt = len(runs) > 6
    ax.set_xticks([(first + last) / 2 for _, first, last in runs], [word(phase) for phase, _, _ in runs],
                  rotation=30 if tilt else 0, ha="right" if tilt else "center", fontsize=8)
    ax.set_xlim(-0.5, len(labels) - 0.5)


def _draw_stack(ax: Any, timeline: Timeline, categories: list[str], legend: dict[str, Any]) -> float:
    labels = [label for label, _ in timeline]
    bottom = [0.0] * len(timeline)
    for c in categories:
        values = [float(snap.get(c, 0)) for _, snap in timeline]
        legend[word(c)] = ax.bar(range(len(timeline)), values, bottom=bottom, width=0.85, label=word(c),
                                 gid=f"cat:{c}",
                           **category_style(c))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    _mark_events(ax, labels, legend)
    peak = max(bottom)
    at = bottom.index(peak)
    ax.annotate(text(STYLE("peak", what=format_bytes(peak))), (at, peak), xytext=(0, 3),
                textcoords="offset points", ha="center", fontsize=7)
    return peak


def _draw_lines(ax: Any, timelines: list[tuple[int, Timeline]], categories: list[str],
                legend: dict[str, Any]) -> float:
    """One line per group of ranks whose totals are equal at every event, labelled with all of them (so ranks
    that coincide are said to, instead of hiding under each other); the peak annotated with its event."""
    groups: dict[tuple[float, ...], list[int]] = {}
    for rank, t in timelines:
        groups.setdefault(tuple(float(sum(snap.get(c, 0) for c in categories)) for _, snap in t), []).append(rank)
    top = 0.0
    for totals, ranks in groups.items():
        name = f"rank {ranks[0]}" if len(ranks) == 1 else text(T("ranks_equal", ranks=", ".join(map(str, ranks))))
        legend[name], = ax.plot(range(len(totals)), totals, marker="o", markersize=3, drawstyle="steps-mid",
                                linewidth=1.6, color=rank_color(ranks[0]), label=name,
                                gid="rank" + "_".join(map(str, ranks)))
        top = max(top, *totals)
    labels = [label for label, _ in timelines[0][1]]
    first = next(iter(groups))
    at = first.index(max(first))
    ax.annotate(text(T("peak_at", bytes=format_bytes(first[at]), event=word(labels[at]))),
                (at, first[at]), xytext=(0, 4),
                textcoords="offset points", ha="center" if 0.2 < at / max(1, len(labels) - 1) < 0.8 else
                ("left" if at < len(labels) / 2 else "right"), fontsize=7, gid="peak")
    _mark_events(ax, labels, legend)
    return top


def plot_memory_timeline(timelines: Any, *, kind: str = "stack", categories: Sequence[str] | None = None,
                         title: str | Message | None = None) -> Figure:
    """Measured bytes per rank at each event of a step: `kind="stack"` (one panel per rank, bars stacked
    by category) or `kind="lines"` (one line per rank, the sum of `categories`, default all present).

    `timelines`: `engine.timeline` of every rank as a list (index = rank) or {rank: timeline}, engines
    themselves, or one timeline. Events whose label says unshard / reshard / reduce_scatter /
    all_reduce / all_gather are marked with vertical lines."""
    pairs = _rank_timelines(timelines)
    cats = _categories(pairs, categories)
    legend: dict[str, Any] = {}
    if kind == "stack":
        fig, axes = new_figure(len(pairs), 1, (10, 1.6 + 1.9 * len(pairs)), sharex=True, sharey=True)
        top = max(_draw_stack(axes[i, 0], t, cats, legend) for i, (_, t) in enumerate(pairs))
        for i, (rank, _) in enumerate(pairs):
            axes[i, 0].set_title(f"rank {rank}", fontsize=9, loc="left", color=rank_color(rank))
            byte_axis(axes[i, 0], top)
    elif kind == "lines":
        fig, axes = new_figure(size=(10, 4))
        top = _draw_lines(axes[0, 0], pairs, cats, legend)
        byte_axis(axes[0, 0], top)
    else:
        raise ValueError(f"kind must be 'stack' or 'lines', got {kind!r}")
    _event_ticks(axes[-1, 0], [label for label, _ in pairs[0][1]])
    fig.legend(legend.values(), legend.keys(), loc="outside right upper", fontsize=8)
    fig.suptitle(text(title or T("title")), fontsize=10)
    return fig


def plot_memory_compare(runs: Mapping[str, Any], *, kind: str = "lines", rank: int = 0,
                        categories: Sequence[str] | None = None, title: str | Message | None = None) -> Figure:
    """Side by side, one panel per engine ({"DDP": timelines, "FSDP": timelines}), on one byte scale:
    `kind="lines"` draws every rank's total, `kind="stack"` rank `rank`'s categories."""
    if not runs:
        raise ValueError('nothing to compare: pass {"DDP": timelines, "FSDP": timelines}')
    if kind not in ("lines", "stack"):
        raise ValueError(f"kind must be 'stack' or 'lines', got {kind!r}")
    parsed = {name: _rank_timelines(t) for name, t in runs.items()}
    cats = _categories([p for pairs in parsed.values() for p in pairs], categories)
    fig, axes = new_figure(1, len(parsed), (5 * len(parsed) + 1.5, 4), sharey=True)
    legend: dict[str, Any] = {}
    top = 0.0
    for ax, (name, pairs) in zip(axes[0], parsed.items(), strict=True):
        if kind == "lines":
            top = max(top, _draw_lines(ax, pairs, cats, legend))
        else:
            chosen = dict(pairs)
            if rank not in chosen:
                raise ValueError(f"{name}: no timeline for rank {rank} (ranks {sorted(chosen)})")
            top = max(top, _draw_stack(ax, chosen[rank], cats, legend))
        ax.set_title(text(name))
        _event_ticks(ax, [label for label, _ in pairs[0][1]])
    byte_axis(axes[0, 0], top)
    fig.legend(legend.values(), legend.keys(), loc="outside right upper", fontsize=8)
    fig.suptitle(text(title or (T("compare_rank", rank=rank) if kind == "stack" else T("compare"))), fontsize=10)
    return fig


TABLE_COLUMNS = {"params": "params", "gathered_params": "gathered", "grads": "grads", "sharded_params": "shard",
                 "sharded_grads": "sh.grad", "optimizer": "optimizer"}  # the model state, as a table names it


def timeline_table(timeline: Timeline, title: str = "event (KiB)", columns: Mapping[str, str] | None = None) -> str:
    """The recorded events of a step as text, one line each: the total of parameters, gradients and optimizer
    state, then each category of `columns` ({category: heading}, default `TABLE_COLUMNS`) that the snapshots hold,
    in KiB with one decimal (exact bytes, so the same text on every machine)."""
    from fsdp_course.memory import total_bytes

    names = columns if columns is not None else TABLE_COLUMNS
    shown = [c for c in names if any(c in snap for _, snap in timeline)]
    width = max([len(title), *(len(label) for label, _ in timeline)]) + 1
    heads = [("total", None)] + [(names[c], c) for c in shown]
    lines = [f"{title:<{width}}" + " ".join(f"{h:>{max(6, len(h))}}" for h, _ in heads)]
    for label, snap in timeline:
        values = [total_bytes(snap) if c is None else snap.get(c, 0) for _, c in heads]
        lines.append(f"{label:<{width}}" + " ".join(f"{v / 1024:>{max(6, len(h))}.1f}"
                                                    for (h, _), v in zip(heads, values, strict=True)))
    return "\n".join(lines)
