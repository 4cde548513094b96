"""Bytes per collective per step, from the ledger, against the ZeRO paper's communication volumes.

Under the ring model the ledger uses, every rank sends per step (Psi = the number of parameters, N ranks;
ZeRO, arXiv:1910.02054, section 7; PyTorch FSDP, arXiv:2304.11277, section 3):
  DDP (one all-reduce of the gradients)                               2 Psi (N-1)/N elements
  FSDP / ZeRO-3 (all-gather in forward, again in backward, reduce-scatter)  3 Psi (N-1)/N elements
times the bytes per element (4 in fp32).
These are the logical volumes counted at the call; Gloo's own algorithms may move more. The formulas live beside
the cost model they follow from (`fsdp_course.runtime.ledger.traffic_formula`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.figure import Figure

from fsdp_course.i18n.messages import catalogue, text
from fsdp_course.runtime.ledger import traffic_formula
from fsdp_course.viz.style import OP_COLORS, byte_axis, format_bytes, new_figure

T = catalogue("viz.traffic")  # fsdp_course/i18n/catalogues/viz.traffic.yml

__all__ = ["plot_traffic", "traffic_formula"]  # traffic_formula lives beside ring_bytes, in the ledger


def _rank_records(obj: Any) -> dict[int, tuple[list[Any], int | None]]:
    """{rank: (records, world_size or None)} from a Ledger, a list of Ledgers, a list of Records, or lists."""
    if hasattr(obj, "records"):
        obj = [obj]
    items = list(obj)
    if items and all(hasattr(x, "op") and hasattr(x, "sent_bytes") for x in items):
        return {0: (items, None)}
    return {getattr(x, "rank", i): (list(getattr(x, "records", x)), getattr(x, "world_size", None))
            for i, x in enumerate(items)}


def plot_traffic(ledgers_or_records: Any, psi_bytes: float, world_size: int, *, rank: int = 0,
                 direction: str = "sent", steps: Sequence[str] | None = None, title: str | None = None) -> Figure:
    """Bytes per collective in each phase (`Ledger.mark` label) of one rank, stacked by operation, with the
    2 Psi (N-1)/N and 3 Psi (N-1)/N lines. `psi_bytes` = number of parameters x bytes per parameter.
    `ledgers_or_records`: one Ledger, the Ledgers of all ranks (`rank` picks one), or Records."""
    formula = traffic_formula(psi_bytes, world_size)
    if direction not in ("sent", "recv"):
        raise ValueError(f"direction must be 'sent' or 'recv', got {direction!r}")
    by_rank = _rank_records(ledgers_or_records)
    if rank not in by_rank:
        raise ValueError(f"no ledger for rank {rank} (ranks {sorted(by_rank)})")
    records, recorded_n = by_rank[rank]
    if recorded_n is not None and recorded_n != world_size:
        raise ValueError(f"the ledger of rank {rank} was recorded on {recorded_n} ranks, not world_size={world_size}")
    table: dict[str, dict[str, float]] = {}
    for r in records:
        label = r.label or "(no label)"
        if r.op != "barrier" and (steps is None or label in steps):
            row = table.setdefault(label, {})
            row[r.op] = row.get(r.op, 0.0) + float(r.sent_bytes if direction == "sent" else r.recv_bytes)
    if not table:
        raise ValueError("no collectives to draw: the ledger is empty (or `steps` matched no label)")
    labels = list(table)
    ops = [op for op in OP_COLORS if any(op in row for row in table.values())]
    fig, axes = new_figure(size=(max(6.0, 1.1 * len(labels) + 4), 4))
    ax = axes[0, 0]
    bottom = [0.0] * len(labels)
    for op in ops:
        values = [table[label].get(op, 0.0) for label in labels]
        ax.bar(range(len(labels)), values, bottom=bottom, width=0.6, color=OP_COLORS[op], label=op, gid=f"op:{op}")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(format_bytes(total), (x, total), xytext=(0, 3), textcoords="offset points",
                    ha="center", fontsize=8)
    for key, style in (("ddp", "--"), ("fsdp", ":")):
        line = T("ddp" if key == "ddp" else "fsdp", bytes=format_bytes(formula[key]))
        ax.axhline(formula[key], color="black", linestyle=style, linewidth=1, label=text(line), gid=f"formula:{key}")
    tilt = len(labels) > 4
    ax.set_xticks(range(len(labels)), labels, rotation=30 if tilt else 0, ha="right" if tilt else "center",
                  fontsize=8)
    ax.set_xlabel(text(T("x_axis")))
    byte_axis(ax, max(max(bottom), formula["fsdp"]))
    ax.legend(fontsize=8, loc="best")
    default = T("sent" if direction == "sent" else "received", rank=rank, n=world_size, payload=format_bytes(psi_bytes))
    ax.set_title(text(title or default), fontsize=10)
    return fig
