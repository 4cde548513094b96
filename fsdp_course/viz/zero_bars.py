"""The ZeRO stages side by side: model-state bytes per rank from the formulas, measured bars beside them.

ZeRO (arXiv:1910.02054, section 5.1 and figure 1) with fp32 values and Adam (K = 8 bytes of optimizer
state per parameter), Psi parameters, N ranks:
  DDP 16 Psi,  ZeRO-1 (P_os) 8 Psi + 8 Psi/N,  ZeRO-2 (P_os+g) 4 Psi + 12 Psi/N,  ZeRO-3 (P_os+g+p) 16 Psi/N;
ZeRO-3 is what PyTorch FSDP implements (arXiv:2304.11277). The numbers come from
`memory.zero_formula`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from fsdp_course.i18n.messages import Message, catalogue, text
from fsdp_course.memory import stage_index, zero_formula
from fsdp_course.viz.style import CATEGORY_COLORS, STAGES, byte_axis, format_bytes, new_figure, word

T = catalogue("viz.zero_bars")  # fsdp_course/i18n/catalogues/viz.zero_bars.yml

_FORMULA_PARTS = ("params", "grads", "optimizer", "gathered")


def zero_bytes(numel: int, world_size: int, stage: int | str, *, optimizer: str = "adam",
               bytes_per_param: int = 4, gathered_numel: int = 0) -> dict[str, float]:
    """Model-state bytes per rank by category ("params", "grads", "optimizer", "gathered", "total")."""
    return zero_formula(int(numel), int(world_size), stage, bytes_per_param=bytes_per_param,
                        optimizer=optimizer.lower(), gathered_numel=gathered_numel)


def zero_formula_text(stage: int | str, optimizer: str = "adam", bytes_per_param: int = 4) -> str:
    """The formula as text: stage 1, Adam, fp32 -> '8Ψ + 8Ψ/N'."""
    f = zero_bytes(1, 1, stage, optimizer=optimizer, bytes_per_param=bytes_per_param)  # per Psi, N = 1
    s = stage_index(stage)
    sharded = [("params", 3), ("grads", 2), ("optimizer", 1)]
    full = sum(f[c] for c, at in sharded if s < at)
    part = sum(f[c] for c, at in sharded if s >= at)
    terms = ([f"{full:g}Ψ"] if full else []) + ([f"{part:g}Ψ/N"] if part else [])
    return " + ".join(terms) or "0"


def _measured_groups(value: int | float | Mapping[str, int]) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {"total": float(value)}
    groups = {"params": ("params", "sharded_params"), "gathered": ("gathered_params",),
              "grads": ("grads", "sharded_grads"), "optimizer": ("optimizer",)}
    out = {g: float(sum(value.get(c, 0) for c in cs)) for g, cs in groups.items()}
    known = {c for cs in groups.values() for c in cs}
    out["other"] = float(sum(b for c, b in value.items() if c not in known))
    return out


def plot_zero_bars(numel: int, world_size: int, measured: Mapping[Any, Any] | None = None, *,
                   optimizer: str = "adam", bytes_per_param: int = 4, gathered_numel: int = 0,
                   highlight: int | str | None = None, title: str | Message | None = None) -> Figure:
    """Bytes per rank for DDP and ZeRO-1/2/3 from the formulas, stacked by category; `measured`
    ({"DDP": bytes or a memory.measure() snapshot, "FSDP": ...}) drawn hatched beside them."""
    formulas = [zero_bytes(numel, world_size, s, optimizer=optimizer, bytes_per_param=bytes_per_param,
                           gathered_numel=gathered_numel) for s in range(4)]
    meas: dict[int, dict[str, float]] = {}
    for key, value in (measured or {}).items():
        if stage_index(key) in meas:
            raise ValueError(f"measured has two entries for {STAGES[stage_index(key)]} (FSDP is ZeRO-3): keep one")
        meas[stage_index(key)] = _measured_groups(value)
    hi = None if highlight is None else stage_index(highlight)
    fig, axes = new_figure(size=(8, 4))
    ax = axes[0, 0]
    width = 0.38 if meas else 0.6
    shift = width / 2 if meas else 0.0
    top = 0.0
    for s, f in enumerate(formulas):
        bottom, alpha = 0.0, 1.0 if hi in (None, s) else 0.35
        for c in _FORMULA_PARTS:
            if f[c]:
                ax.bar(s - shift, f[c], bottom=bottom, width=width, color=CATEGORY_COLORS[c], alpha=alpha,
                       edgecolor="black" if hi == s else "none", gid=f"formula:{STAGES[s]}:{c}")
                bottom += f[c]
        ax.annotate(format_bytes(f["total"]), (s - shift, f["total"]), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
        top = max(top, f["total"])
        if s in meas:
            mb = 0.0
            for c, v in meas[s].items():
                if v:
                    ax.bar(s + shift, v, bottom=mb, width=width, color=CATEGORY_COLORS.get(c, "#b0b0b0"),
                           hatch="//", edgecolor="white", gid=f"measured:{STAGES[s]}:{c}")
                    mb += v
            ax.annotate(text(T("measured_bytes", bytes=format_bytes(mb))), (s + shift, mb), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize=7)
            top = max(top, mb)
    ax.set_xticks(range(4), [f"{name}\n{zero_formula_text(s, optimizer, bytes_per_param)}"
                             for s, name in enumerate(STAGES)])
    byte_axis(ax, top * 1.05)
    used = [c for c in CATEGORY_COLORS if any(f[c] for f in formulas if c in _FORMULA_PARTS)
            or any(m.get(c) for m in meas.values())]
    handles = [Patch(facecolor=CATEGORY_COLORS[c], label=word(c)) for c in used]
    if meas:
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//", label=word("measured")))
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    opt = {"adam": "Adam", "adamw": "AdamW", "sgd_momentum": T("sgd_momentum"), "sgd": "SGD"}[optimizer.lower()]
    default = T("title", numel=numel, n=world_size, optimizer=opt, size=bytes_per_param)
    ax.set_title(text(title or default), fontsize=10)
    return fig


def zero_table(columns: Mapping[str, tuple[int, int]], optimizer: str = "adam") -> str:
    """The ZeRO formulas as text: one row per stage (its name and formula), one column per `{heading: (numel, N)}`,
    the bytes per rank in binary units (`format_bytes`)."""
    widths = [max(len(heading) + 2, 11) for heading in columns]
    lines = [f"{'stage':<8}{'formula':<14}" + "".join(f"{h:>{w}}" for h, w in zip(columns, widths, strict=True))]
    for stage, name in enumerate(STAGES):
        cells = [format_bytes(zero_formula(numel, n, stage, optimizer=optimizer)["total"])
                 for numel, n in columns.values()]
        lines.append(f"{name:<8}{zero_formula_text(stage, optimizer):<14}"
                     + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)
