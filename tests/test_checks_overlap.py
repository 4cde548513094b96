"""The checker of exercise 14 (forward prefetching) passes the reference solution and fails planted mistakes with the
diagnosis that names them: each planted function is the reference with one thing wrong, as a learner would get it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from reference_solutions import fails, load, passes

from fsdp_course import RankContext
from fsdp_course.classroom.checks import check_forward_prefetch
from fsdp_course.classroom.checks.overlap import order_report, run_forward

OVERLAP = load("14_overlap")


def serial(ctx: RankContext, shards: list[torch.Tensor], compute, x: torch.Tensor) -> torch.Tensor:
    for i, shard in enumerate(shards):
        x = compute(i, ctx.all_gather(shard), x)
    return x


def async_after_compute(ctx, shards, compute, x):  # asynchronous, but the next gather is issued after the compute
    work = ctx.all_gather(shards[0], async_op=True)
    for i in range(len(shards)):
        full = work.wait()
        x = compute(i, full, x)
        if i + 1 < len(shards):
            work = ctx.all_gather(shards[i + 1], async_op=True)
    return x


def waits_at_once(ctx, shards, compute, x):  # issues the next gather before the compute, then waits for it at once
    full = ctx.all_gather(shards[0])
    for i in range(len(shards)):
        following = ctx.all_gather(shards[i + 1], async_op=True).wait() if i + 1 < len(shards) else None
        x = compute(i, full, x)
        full = following
    return x


def synchronous_prefetch(ctx, shards, compute, x):  # gathers the next unit before computing, but without async_op
    full = ctx.all_gather(shards[0])
    for i in range(len(shards)):
        following = ctx.all_gather(shards[i + 1]) if i + 1 < len(shards) else None
        x = compute(i, full, x)
        full = following
    return x


def everything_up_front(ctx, shards, compute, x):  # every unit's all-gather issued at the start
    works = [ctx.all_gather(s, async_op=True) for s in shards]
    for i, work in enumerate(works):
        x = compute(i, work.wait(), x)
    return x


def no_wait(ctx, shards, compute, x):  # gathers into its own buffers and uses them without waiting
    buffers = [torch.empty(s.numel() * ctx.world_size) for s in shards]
    ctx.all_gather(shards[0], out=buffers[0], async_op=True)
    for i in range(len(shards)):
        if i + 1 < len(shards):
            ctx.all_gather(shards[i + 1], out=buffers[i + 1], async_op=True)
        x = compute(i, buffers[i], x)
    return x


def wrong_handle(ctx, shards, compute, x):  # waits for the gather just issued instead of the one for unit i
    work = ctx.all_gather(shards[0], async_op=True)
    for i in range(len(shards)):
        if i + 1 < len(shards):
            work = ctx.all_gather(shards[i + 1], async_op=True)
        x = compute(i, work.wait(), x)
    return x


def passes_the_work(ctx, shards, compute, x):
    work = ctx.all_gather(shards[0], async_op=True)
    for i in range(len(shards)):
        current = work
        if i + 1 < len(shards):
            work = ctx.all_gather(shards[i + 1], async_op=True)
        x = compute(i, current, x)
    return x


def off_by_one(ctx, shards, compute, x):  # no guard at the last unit
    work = ctx.all_gather(shards[0], async_op=True)
    for i in range(len(shards)):
        full = work.wait()
        work = ctx.all_gather(shards[i + 1], async_op=True)
        x = compute(i, full, x)
    return x


def returns_nothing(ctx, shards, compute, x):
    OVERLAP["forward_prefetch"](ctx, shards, compute, x)


def skips_the_last_unit(ctx, shards, compute, x):
    return OVERLAP["forward_prefetch"](ctx, shards[:-1], compute, x)


def stub(ctx, shards, compute, x):
    raise NotImplementedError()


def test_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_forward_prefetch, OVERLAP["forward_prefetch"], capsys=capsys)
    assert "(world sizes 1, 2, 3)" in out


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (serial, "overlap.started_after", {"next": 1, "i": 0}),
    (serial, "overlap.issue_before", {"next": 1, "i": 0}),
    (async_after_compute, "overlap.started_after", {"next": 1, "i": 0}),
    (waits_at_once, "overlap.already_waited", {"next": 1, "i": 0}),
    (synchronous_prefetch, "overlap.already_waited", {"next": 1}),
    (everything_up_front, "overlap.three_units", {"ahead": 2, "i": 0}),
    (no_wait, "overlap.used_before_wait", {"i": 0}),
    (wrong_handle, "overlap.right_work", {}),  # compute(0, ...) got unit 1's gathered parameters
    (passes_the_work, "overlap.wait_returns", {}),  # compute(0, ...) got the CollectiveWork itself
    (off_by_one, "overlap.no_unit_after", {}),
    (returns_nothing, "overlap.not_output", {"kind": "NoneType"}),
    (skips_the_last_unit, "overlap.computed_units", {"computed": [0, 1, 2], "expected": [0, 1, 2, 3]}),
])
def test_planted_mistakes_are_named(fn: Callable, says: str, fields: dict, capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_forward_prefetch, fn, world_sizes=(2,), says=says, fields=fields, capsys=capsys)


@pytest.mark.parametrize(("fn", "problem"), [
    (no_wait, "unit 0's parameters were used before its all-gather was waited for"),
    (waits_at_once, "unit 1's all-gather had already been waited for"),
])
def test_a_problem_seen_by_compute_names_the_rank_once(fn: Callable, problem: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(AssertionError, match=f"failed at world size 2, rank 0: {problem}"):
        check_forward_prefetch(fn, world_sizes=(2,))
    out = capsys.readouterr().out
    assert f"check_forward_prefetch FAILED at world size 2, rank 0\n  {problem}" in out, out


def test_one_rank_is_checked_too(capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_forward_prefetch, serial, world_sizes=(1,), says="overlap.started_after", fields={"i": 0},
                capsys=capsys)
    assert "FAILED at world size 1, rank 0" in out


def test_the_stub_gives_one_short_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_forward_prefetch(stub, world_sizes=(2,))


def test_a_string_instead_of_the_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"check_forward_prefetch\(forward_prefetch\)"):
        check_forward_prefetch("forward_prefetch")


def test_run_forward_and_order_report_describe_both_orders() -> None:
    for fn, when, words in ((serial, "after", "after unit {p}'s compute ended"),
                            (OVERLAP["forward_prefetch"], "before", "before unit {p}'s compute began")):
        runs = run_forward(fn, world_size=2, batch=256)
        assert len(runs) == 2 and all(len(r.spans) == 4 and r.output.shape[0] == 256 for r in runs)
        assert torch.equal(runs[0].output, runs[1].output)
        assert all(r.gather_starts() == {1: when, 2: when, 3: when} for r in runs)
        assert order_report(runs[0]).splitlines() == [
            f"unit {i}'s all-gather started {words.format(p=i - 1)}" for i in (1, 2, 3)]
    with pytest.raises(ValueError, match="batch must be a positive int"):
        run_forward(serial, batch=0)
