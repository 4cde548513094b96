"""Time intervals of a training step: when units computed, when collectives ran, and how much of it overlapped.

Two kinds of interval come out of one step, both in `time.perf_counter()` seconds:

- compute spans: FSDP's `fsdp.trace` (`fsdp_course.fsdp.param_group.Span`: unit, phase, start, end), or anything
  else with `start` and `end`;
- collectives: the ledger's `Record`s, whose `start` is when every rank had joined the call and whose `end` is when
  it completed (an async all-gather: when Gloo finished it, not when it was waited for).

Overlapping communication with computation is what FSDP's prefetching is for (PyTorch FSDP, arXiv:2304.11277,
section 3.3: "overlap communication and computation"). `overlap_seconds(spans, records)` measures it: the time
during which at least one collective runs while at least one unit computes, i.e. the length of the intersection of
the two unions. Pure functions on numbers: nothing here is timed, and it works on records of any world size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["busy_seconds", "intervals", "merge", "overlap_seconds"]


def intervals(items: Iterable[Any], what: str = "interval") -> list[tuple[float, float]]:
    """(start, end) of every item that has `start` and `end` (Spans, ledger Records, or (start, end) pairs).

    Raises ValueError, naming the item, when one has no time (a Record from an old ledger) or ends before it starts."""
    out = []
    for i, item in enumerate(items):
        start, end = (item if isinstance(item, tuple) else (getattr(item, "start", None), getattr(item, "end", None)))
        name = getattr(item, "op", None) or getattr(item, "unit", None) or type(item).__name__
        if start is None or end is None:
            raise ValueError(f"{what} {i} ({name}) has no start/end time: pass the ledger's Records and fsdp.trace's "
                             "Spans of a run made with this version of the course (they carry time.perf_counter())")
        if end < start:
            raise ValueError(f"{what} {i} ({name}) ends ({end}) before it starts ({start})")
        out.append((float(start), float(end)))
    return out


def merge(pairs: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as disjoint intervals in time order: [(0, 2), (1, 3), (5, 6)] -> [(0, 3), (5, 6)]."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(pairs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_seconds(items: Iterable[Any]) -> float:
    """Seconds during which at least one of the items runs (the length of their union)."""
    return sum(end - start for start, end in merge(intervals(items)))


def overlap_seconds(spans: Iterable[Any], records: Iterable[Any], ops: Iterable[str] | None = None) -> float:
    """Seconds during which some collective of `records` runs while some compute span of `spans` runs.

    `ops` keeps only the records of those operations (e.g. {"all_gather"}); default: every record. Both sides are
    merged first, so nested or concurrent intervals are not counted twice: the result is at most
    min(busy_seconds(spans), busy_seconds(records))."""
    keep = None if ops is None else set(ops)
    chosen = [r for r in records if keep is None or getattr(r, "op", None) in keep]
    compute, comm = merge(intervals(spans, "span")), merge(intervals(chosen, "record"))
    total, i, j = 0.0, 0, 0
    while i < len(compute) and j < len(comm):  # sweep the two sorted disjoint lists
        lo, hi = max(compute[i][0], comm[j][0]), min(compute[i][1], comm[j][1])
        if hi > lo:
            total += hi - lo
        if compute[i][1] < comm[j][1]:
            i += 1
        else:
            j += 1
    return total
