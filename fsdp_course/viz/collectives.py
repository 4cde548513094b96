"""Lesson 01's pictures and tables of collectives: each rank's values before and after a collective, the ring's
bytes per rank as N grows, and collectives timed on this machine beside the α–β model.

    show_ranks("all_gather", (STAGE("before_shards"), shards), (STAGE("after"), gathered))  # prints, then draws
    plot_ring_cost()                         # bytes sent per rank / payload, all_reduce and all_gather, N = 1 .. 64
    print_fit(samples, model); plot_alpha_beta(samples, model)    # fsdp_course.runtime.cost_model's fit

Figures are built without pyplot (`CourseFigure`); a notebook shows the one a cell returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import matplotlib
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.runtime.cost_model import CostFit, Sample
from fsdp_course.runtime.ledger import ring_bytes
from fsdp_course.viz.style import new_figure

__all__ = ["STAGE", "plot_alpha_beta", "plot_ring_cost", "print_fit", "print_growth", "show_ranks"]

STAGE = catalogue("viz.collectives")  # fsdp_course/i18n/catalogues/viz.collectives.yml
T = catalogue("viz.ring")  # fsdp_course/i18n/catalogues/viz.ring.yml

Panel = tuple[str | Message, Sequence[Sequence[float]]]  # (label, one row of values per rank)


def show_ranks(title: str | Message, *panels: Panel) -> Figure:
    """Print each rank's values at each stage, then draw them as rows of boxes, one row per rank. A title or label
    is a name from code ("all_gather", "op='sum'") or a catalogued `STAGE(...)`, written in the course's language."""
    for label, rows in panels:  # printed in English, as every printed output of a lesson (the Chinese edition copies
        print(f"{label}:")      # them); drawn in the figures' language
        for rank, row in enumerate(rows):
            print(f"  rank {rank}: [{', '.join(f'{v:g}' for v in row)}]")
    widths = [max(len(row) for row in rows) for _, rows in panels]
    values = [v for _, rows in panels for row in rows for v in row]
    ranks = max(len(rows) for _, rows in panels)
    shade = Normalize(min(values), max(values) + 1e-9)
    blues = matplotlib.colormaps["Blues"]
    fig, axes = new_figure(1, len(panels), (1.2 + 0.5 * sum(widths) + 0.4 * len(panels), 0.5 * ranks + 0.9),
                           gridspec_kw={"width_ratios": widths})
    for k, (ax, (label, rows), width) in enumerate(zip(axes[0], panels, widths, strict=True)):
        for rank, row in enumerate(rows):
            for i, v in enumerate(row):
                ax.add_patch(Rectangle((i, rank), 0.92, 0.88, color=blues(0.12 + 0.55 * shade(v))))
                ax.text(i + 0.46, rank + 0.44, f"{v:g}", ha="center", va="center", fontsize=9)
        ax.set_xlim(0, width)
        ax.set_ylim(len(rows), 0)
        ax.set_xticks([])
        ax.set_yticks([r + 0.44 for r in range(len(rows))], [f"rank {r}" for r in range(len(rows))] if k == 0 else [])
        ax.tick_params(length=0)
        ax.set_title(text(label), fontsize=10)
        for spine in ax.spines.values():
            spine.set_visible(False)
    fig.suptitle(text(title))
    return fig


def plot_ring_cost(max_world_size: int = 64) -> Figure:
    """Bytes each rank sends under the ring model, over the payload, for N = 1 .. `max_world_size` (log scale):
    2(N−1)/N for an all-reduce, (N−1)/N for an all-gather or a reduce-scatter."""
    ns = list(range(1, max_world_size + 1))
    fig, axes = new_figure(size=(6, 3))
    ax = axes[0, 0]
    ax.plot(ns, [ring_bytes("all_reduce", 1, n)[0] for n in ns], label=text(T("all_reduce")))
    ax.plot(ns, [ring_bytes("all_gather", 1, n)[0] for n in ns], label=text(T("ag_rs")))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(text(T("world_size")))
    ax.set_ylabel(text(T("per_payload")))
    ax.set_ylim(0, 2.1)
    ax.legend()
    ax.set_title(text(T("ring_cost")))
    return fig


def print_fit(samples: Sequence[Sample], model: CostFit) -> None:
    """α, β and the quality of the fit, then every timed sample beside the model's prediction."""
    print(f"α = {model.alpha * 1e6:.0f} µs per step, β = {model.beta * 1e9:.2f} ns per byte "
          f"({1e-6 / model.beta:.0f} MB/s); α/β = {model.alpha / model.beta / 1e3:.0f} kB")
    print(f"R² = {model.r2:.2f}; measured / predicted within a factor {model.median_ratio:.1f} (median), "
          f"{model.worst_ratio:.1f} (worst)\n")
    print(" N  op            payload B  steps  sent B/rank   measured   α-β model")
    for s in samples:
        print(f"{s.world_size:>2}  {s.op:<12} {s.payload_bytes:>10,}  {s.steps:>5}  {s.bytes:>11,.0f}  "
              f"{s.seconds * 1e3:>6.2f} ms  {model.predict(s.op, s.payload_bytes, s.world_size) * 1e3:>6.2f} ms")
    if model.r2 < 0.3 or model.median_ratio > 2.5:  # not a failure: a busy machine times noise, not the network
        print("a rough fit: other work ran while the collectives were timed; run this cell again on an idle machine")


def print_growth(model: CostFit, payloads: dict[str, int], world_sizes: Iterable[int]) -> dict[tuple[str, int], float]:
    """The model's all-reduce time for each named payload (bytes) and world size, with the share of it that is
    latency (2(N−1) α); returns the times in seconds by (name, N)."""
    times = {}
    width = {name: max(len(name) + 6, 12) for name in payloads}  # "<name>: time" over the time column
    print("the model's all-reduce time as N grows")
    print("    N" + "".join(f"   {name + ': time':>{width[name]}}  latency share" for name in payloads))
    for n in world_sizes:
        row = ""
        for name, payload in payloads.items():
            t = times[name, n] = model.predict("all_reduce", payload, n)
            row += f"   {t * 1e3:>{width[name] - 3}.2f} ms  {2 * (n - 1) * model.alpha / t:>13.0%}"
        print(f"{n:>5}{row}")
    return times


def plot_alpha_beta(samples: Sequence[Sample], model: CostFit) -> Figure:
    """The timed samples (points) and steps·α + bytes·β (lines), per world size and collective, on log axes."""
    fig, axes = new_figure(size=(7.5, 4.2))
    ax = axes[0, 0]
    sent = [10 ** (3 + 4.2 * i / 39) for i in range(40)]  # bytes sent per rank, for the lines
    world_sizes = sorted({s.world_size for s in samples})
    for n, color in zip(world_sizes, (f"C{i}" for i in range(10)), strict=False):
        for op, marker, style in (("all_reduce", "o", "-"), ("all_gather", "s", "--"), ("reduce_scatter", "^", ":")):
            mine = [s for s in samples if s.world_size == n and s.op == op]
            if not mine:
                continue
            ax.scatter([s.bytes for s in mine], [s.seconds * 1e3 for s in mine], color=color, marker=marker,
                       label=f"{op}, N={n}")
            ax.plot(sent, [(mine[0].steps * model.alpha + b * model.beta) * 1e3 for b in sent], color=color,
                    linestyle=style, linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(text(T("sent_ring")))
    ax.set_ylabel(text(T("time_per_call")))
    ax.set_title(text(T("timed")))
    ax.legend(fontsize=8, ncol=2)
    return fig
