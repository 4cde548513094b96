"""The overlap timeline (fsdp_course/viz/overlap.py) and the interval arithmetic under it (runtime/timing.py).

The figure is checked by what it contains: one bar per compute span and one per collective (gids "span:..." and
"comm:..."), placed at their times relative to the step's start, coloured by phase and by operation, overlapping
intervals in separate sub-lanes; bad input fails with a message that says what to pass. `overlap_seconds` is checked
on intervals whose answer is known by hand (nested, concurrent, disjoint), and on a real FSDP run: zero without
prefetching, more than zero with it.
"""

from __future__ import annotations

import copy

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_course import viz  # noqa: E402
from fsdp_course.fsdp.api import FSDP  # noqa: E402
from fsdp_course.fsdp.param_group import Span  # noqa: E402
from fsdp_course.runtime.ledger import Ledger, Record  # noqa: E402
from fsdp_course.runtime.simulate import run_ranks  # noqa: E402
from fsdp_course.runtime.timing import busy_seconds, intervals, merge, overlap_seconds  # noqa: E402
from fsdp_course.viz.overlap import PHASE_COLORS  # noqa: E402
from fsdp_course.viz.style import OP_COLORS  # noqa: E402

MS = 1e-3


def bars(fig, prefix):
    return [a for ax in fig.axes for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def record(op: str, start: float | None, end: float | None, seq: int = 1) -> Record:
    return Record(op, seq, "float32", ((4,),), 16, 8.0, 8.0, "", start, end)


# ---------------------------------------------------------------- runtime.timing

def test_merge_and_busy_seconds() -> None:
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert busy_seconds([Span("a", "forward", 0.0, 2.0), Span("b", "forward", 1.0, 3.0)]) == 3.0


def test_overlap_counts_each_moment_once() -> None:
    spans = [Span("outer", "forward", 0.0, 10.0), Span("inner", "forward", 2.0, 4.0), Span("late", "backward",
                                                                                         20.0, 30.0)]
    records = [record("all_gather", 3.0, 6.0), record("reduce_scatter", 5.0, 12.0), record("all_gather", 15.0, 16.0)]
    assert overlap_seconds(spans, records) == 7.0  # [3, 10]: nested spans and concurrent collectives, once each
    assert overlap_seconds(spans, records, ops={"all_gather"}) == 3.0  # [3, 6]
    assert overlap_seconds(spans, [record("all_gather", 10.0, 20.0)]) == 0.0  # touching ends overlap nothing
    assert overlap_seconds([], records) == 0.0


def test_intervals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"record 1 \(all_gather\) has no start/end time"):
        intervals([record("all_gather", 0.0, 1.0), record("all_gather", None, None)], "record")
    with pytest.raises(ValueError, match="ends .* before it starts"):
        intervals([Span("a", "forward", 2.0, 1.0)], "span")


# ---------------------------------------------------------------- the figure, on intervals known by hand

def hand_made() -> list[tuple[list[Span], list[Record]]]:
    t0 = 100.0
    rank0 = ([Span("encoder.layers.0", "forward", t0 + 2 * MS, t0 + 6 * MS),
              Span("encoder.layers.0", "backward", t0 + 8 * MS, t0 + 12 * MS)],
             [record("all_gather", t0, t0 + 2 * MS, 1), record("all_gather", t0 + 4 * MS, t0 + 9 * MS, 2),
              record("reduce_scatter", t0 + 5 * MS, t0 + 7 * MS, 3)])
    rank1 = ([Span("encoder.layers.0", "forward", t0 + 3 * MS, t0 + 5 * MS)],
             [record("all_gather", t0 + 1 * MS, t0 + 3 * MS, 1)])
    return [rank0, rank1]


def test_one_bar_per_span_and_per_collective_at_its_time() -> None:
    fig = viz.plot_overlap(hand_made())
    assert len(bars(fig, "span:")) == 3 and len(bars(fig, "comm:")) == 4
    rank0 = fig.axes[0]
    spans = [a for a in rank0.get_children() if (a.get_gid() or "").startswith("span:")]
    assert [a.get_gid() for a in spans] == ["span:encoder.layers.0:forward", "span:encoder.layers.0:backward"]
    assert [(round(a.get_x(), 9), round(a.get_width(), 9)) for a in spans] == [(2.0, 4.0), (8.0, 4.0)]  # ms after t0
    assert [to_hex(a.get_facecolor()) for a in spans] == [PHASE_COLORS["forward"], PHASE_COLORS["backward"]]
    comms = [a for a in rank0.get_children() if (a.get_gid() or "").startswith("comm:")]
    assert [to_hex(a.get_facecolor()) for a in comms] == [OP_COLORS["all_gather"]] * 2 + [OP_COLORS["reduce_scatter"]]
    assert {t.get_text() for t in rank0.texts} == {"layers.0"}
    title = rank0.get_title(loc="left")
    assert "all-gathers run 7.0 ms, 3.0 ms of it while a unit computes" in title  # under compute: [4, 6] and [8, 9]


def test_overlapping_collectives_get_their_own_sub_lane() -> None:
    fig = viz.plot_overlap(hand_made())
    comms = [a for a in fig.axes[0].get_children() if (a.get_gid() or "").startswith("comm:")]
    first, second, third = comms  # [0, 2], [4, 9], [5, 7]: the third overlaps the second
    assert first.get_y() == second.get_y() != third.get_y()
    assert first.get_height() == second.get_height() == third.get_height() < 0.8  # two sub-lanes share the lane
    spans = [a for a in fig.axes[1].get_children() if (a.get_gid() or "").startswith("span:")]
    assert len(spans) == 1 and spans[0].get_height() == pytest.approx(0.72)  # alone: the whole lane (0.9 of 0.8)


def test_ranks_share_one_clock_unless_given_t0() -> None:
    fig = viz.plot_overlap({1: hand_made()[1], 0: hand_made()[0]})  # a mapping: drawn in rank order
    assert [ax.get_title(loc="left")[:6] for ax in fig.axes] == ["rank 0", "rank 1"]
    rank1_gather = next(a for a in fig.axes[1].get_children() if (a.get_gid() or "").startswith("comm:"))
    assert rank1_gather.get_x() == pytest.approx(1.0)  # rank 1's all-gather began 1 ms after rank 0's
    fig = viz.plot_overlap(hand_made(), t0=100.0 + 1 * MS)
    rank1_gather = next(a for a in fig.axes[1].get_children() if (a.get_gid() or "").startswith("comm:"))
    assert rank1_gather.get_x() == pytest.approx(0.0)


def test_a_ledger_stands_for_its_records_and_ops_filters() -> None:
    ledger = Ledger(0, 2)
    ledger.add("all_gather", 1, "float32", ((4,),), 16, start=1.0, end=1.001)
    ledger.add("all_reduce", 2, "float32", ((1,),), 4, start=1.002, end=1.003)
    spans = [Span("unit", "forward", 1.0005, 1.0025)]
    assert len(bars(viz.plot_overlap([(spans, ledger)]), "comm:")) == 2
    assert [a.get_gid() for a in bars(viz.plot_overlap([(spans, ledger)], ops=["all_gather"]), "comm:")] == [
        "comm:all_gather"]


@pytest.mark.parametrize(("per_rank", "message"), [
    ([], "nothing to draw"),
    ([[Span("a", "forward", 0.0, 1.0)]], r"rank 0: expected a pair \(spans, records\)"),
    ([([], [])], "rank 0 has no compute spans and no collectives"),
    ([([], [record("all_gather", None, None)])], r"rank 0: record 0 \(all_gather\) has no start/end time"),
    ([([Span("a", "forward", 1.0, 0.5)], [])], r"rank 0: span 0 \(a\) ends"),
])
def test_bad_input_says_what_to_pass(per_rank: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        viz.plot_overlap(per_rank)


# ---------------------------------------------------------------- a real run

class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_real_step_draws_every_span_and_collective_and_prefetch_overlaps() -> None:
    torch.manual_seed(0)
    model = Chain()

    def rank_fn(ctx):
        out = {}
        for prefetch in (0, 1):
            fsdp = FSDP(copy.deepcopy(model), ctx, wrap={nn.Sequential}, prefetch=prefetch)
            g = torch.Generator().manual_seed(ctx.rank)
            for _ in range(2):  # the second step: the forward has an order to prefetch in
                ctx.ledger.clear()
                fsdp(torch.randn(8, 32, generator=g)).sum().backward()
            out[prefetch] = (list(fsdp.trace), list(ctx.ledger))
        return out

    results = run_ranks(rank_fn, 2)
    for prefetch in (0, 1):
        per_rank = [r[prefetch] for r in results]
        fig = viz.plot_overlap(per_rank)
        assert len(bars(fig, "span:")) == sum(len(spans) for spans, _ in per_rank) == 2 * 2 * 3  # 3 blocks, 2 passes
        assert len(bars(fig, "comm:")) == sum(len(records) for _, records in per_rank)
        overlaps = [overlap_seconds(spans, records) for spans, records in per_rank]
        assert all(o > 0 for o in overlaps) if prefetch else overlaps == [0.0, 0.0]
