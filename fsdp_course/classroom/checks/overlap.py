"""Checker of exercise 14: forward prefetching with asynchronous all-gathers.

Cites PyTorch FSDP (arXiv:2304.11277, section 3.3, forward prefetching); FSDP2.
Design notes: docs/CLASSROOM.md, "Checkers", `overlap.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    exception_hint,
    format_tensor,
    require_callable,
    require_learner,
    run_checked,
    say_passed,
)
from fsdp_course.engines.equivalence import close, max_rel_diff
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.fsdp.param_group import Span
from fsdp_course.i18n import language
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.collectives import CollectiveWork
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Record

__all__ = ["ForwardRun", "check_forward_prefetch", "order_report", "run_forward"]

WIDTHS = (48, 80, 32, 64, 16)  # four units: Linear(48, 80), Linear(80, 32), Linear(32, 64), Linear(64, 16)
BATCH = 64  # the checker's batch; a picture of overlap wants units that compute longer than a gather takes
SEED = 13

T = catalogue("overlap")  # fsdp_course/i18n/catalogues/overlap.yml


class ComputeMisuse(Exception):
    """`compute` was called with something it cannot run (the message says what, `hint` how to fix it)."""

    def __init__(self, message: str, hint: Message) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass
class ForwardRun:
    """One rank's run of a forward function: its output, each unit's compute span, and its collectives."""

    output: Any
    spans: list[Span]  # one per compute call, unit "unit i", in call order
    records: list[Record]  # the rank's ledger
    gathered: dict[int, list[Record]] = field(default_factory=dict)  # unit -> its all-gathers (told by their bytes)
    problems: list[tuple[Message, Message]] = field(default_factory=list)  # (problem, hint) seen by compute, in order

    def gather_starts(self) -> dict[int, str]:
        """Unit i (from 1) -> when its all-gather started against unit i-1's compute: "before" it began, "during" it,
        or "after" it ended. Prefetching one unit ahead gives "before" for every unit."""
        spans = {int(s.unit.split()[-1]): s for s in self.spans}
        starts = {}
        for i in sorted(self.gathered):
            if i > 0 and i - 1 in spans:
                start, before = self.gathered[i][0].start, spans[i - 1]
                starts[i] = "before" if start < before.start else "during" if start < before.end else "after"
        return starts


class _Chain:
    """The units: Linear layers with tanh between them, each one flat parameter (weight, bias) padded for N ranks."""

    def __init__(self, world_size: int, batch: int = BATCH) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.params = []
        for fan_in, fan_out in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
            w = torch.randn(fan_out, fan_in, generator=g) / math.sqrt(fan_in)
            self.params.append((w, torch.randn(fan_out, generator=g) * 0.1))
        self.layouts = [FlatParamLayout.build([("weight", w), ("bias", b)], world_size) for w, b in self.params]
        self.fulls = [layout.flatten([w, b]) for layout, (w, b) in zip(self.layouts, self.params, strict=True)]
        self.x = torch.randn(batch, WIDTHS[0], generator=g)
        self.world_size = world_size
        self.bytes_of = {4 * layout.padded_numel: i for i, layout in enumerate(self.layouts)}
        assert len(self.bytes_of) == len(self.layouts), "units of distinct sizes: a gather's bytes name its unit"

    def shards(self, rank: int) -> list[torch.Tensor]:
        return [layout.shard(full, rank).clone() for layout, full in zip(self.layouts, self.fulls, strict=True)]

    def unit(self, i: int, full: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w, b = self.layouts[i].unflatten(full)
        y = F.linear(x, w, b)
        return torch.tanh(y) if i < len(self.layouts) - 1 else y

    def reference(self) -> torch.Tensor:
        """One process: every unit with its full parameters."""
        x = self.x
        for i, full in enumerate(self.fulls):
            x = self.unit(i, full, x)
        return x

    def unit_of(self, record: Record) -> int | None:
        return self.bytes_of.get(record.payload_bytes) if record.op == "all_gather" else None


def _compute_for(chain: _Chain, ctx: RankContext, run: ForwardRun) -> Callable[[int, Any, torch.Tensor], torch.Tensor]:
    """The `compute(i, full, x)` handed to the learner on this rank: it checks what it is given and times the unit."""
    n = len(chain.layouts)

    def waited(i: int) -> int:  # how many all-gathers of unit i this rank has waited for (or run synchronously)
        return sum(1 for r in ctx.ledger.records if chain.unit_of(r) == i)

    def note(problem: Message, hint: Message) -> None:
        if not run.problems:  # the first one explains the rest
            run.problems.append((problem, hint))

    def compute(i: int, full: Any, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ComputeMisuse(f"compute's first argument must be a unit index 0..{n - 1}, got {i!r}",
                                T("call_with_index"))
        if isinstance(full, CollectiveWork):
            raise ComputeMisuse(f"compute({i}, ...) got the CollectiveWork itself, not unit {i}'s parameters",
                                T("wait_returns"))
        if not isinstance(full, torch.Tensor):
            raise ComputeMisuse(f"compute({i}, ...) got {type(full).__name__}, not a tensor",
                                T("pass_tensor"))
        expected = chain.layouts[i].padded_numel
        if tuple(full.shape) != (expected,):
            other = chain.bytes_of.get(4 * full.numel()) if full.dim() == 1 else None
            if other is not None and other != i:
                raise ComputeMisuse(f"compute({i}, ...) got unit {other}'s gathered parameters ({full.numel()} "
                                    f"elements), unit {i} has {expected}", T("right_work"))
            if full.numel() * chain.world_size == expected:
                raise ComputeMisuse(f"compute({i}, ...) got a shard ({full.numel()} elements), not the gathered "
                                    f"parameters ({expected})", T("gather_first"))
            raise ComputeMisuse(f"compute({i}, ...) got a tensor of shape {tuple(full.shape)}, expected "
                                f"({expected},): unit {i}'s gathered flat parameter", T("unchanged"))
        if waited(i) == 0:
            note(T("used_before_wait", i=i), T("async_fills"))
        elif not torch.equal(full, chain.fulls[i]):
            note(T("other_values", i=i), T("pass_unchanged", i=i))
        if i + 1 < n and waited(i + 1) > 0:
            note(T("already_waited", next=i + 1, i=i), T("issue_async", next=i + 1, i=i))
        out = chain.unit(i, full, x)
        run.spans.append(Span(f"unit {i}", "forward", start, time.perf_counter()))
        return out

    return compute


def _hint(exc: BaseException) -> Message:
    if isinstance(exc, ComputeMisuse):
        return exc.hint
    if isinstance(exc, IndexError):
        return T("no_unit_after")
    if "has no attribute 'wait'" in str(exc):
        return T("async_op")
    return exception_hint(exc)


def _run(check: str, name: str, fn: Callable[..., Any], chain: _Chain) -> list[ForwardRun]:
    # Every asynchronous all-gather handed out is kept here until the check is over, and one the learner never waited
    # for is waited for once the learner's function has ended (it completes: every rank issued it). A CollectiveWork
    # dropped while in flight is otherwise freed on Gloo's own thread when it completes (its completion callback
    # holds it), and can take the rank's process group with it there: an abort of the whole process.
    kept: list[Any] = []

    def body(ctx: RankContext) -> ForwardRun:
        run = ForwardRun(None, [], [])
        mine: list[Any] = []
        all_gather = ctx.all_gather

        def keeping_all_gather(tensor: torch.Tensor, out: torch.Tensor | None = None, *,
                               async_op: bool = False) -> Any:
            result = all_gather(tensor, out, async_op=async_op)
            if async_op:
                mine.append(result)
                kept.append(result)
            return result

        ctx.all_gather = keeping_all_gather  # type: ignore[method-assign]
        ctx.ledger.clear()
        try:
            run.output = fn(ctx, chain.shards(ctx.rank), _compute_for(chain, ctx, run), chain.x.clone())
            run.records = list(ctx.ledger.records)
        finally:
            for work in mine:
                if not work.is_completed():
                    work.wait()
        for r in run.records:
            unit = chain.unit_of(r)
            if unit is not None:
                run.gathered.setdefault(unit, []).append(r)
        return run

    try:
        return run_checked(check, name, body, chain.world_size,
                           lambda r: f"world size {chain.world_size}, rank {r}", _hint)
    finally:
        kept.clear()  # here, in the caller's thread


def run_forward(fn: Callable[..., Any], world_size: int = 2, *, batch: int = BATCH) -> list[ForwardRun]:
    """Run `fn(ctx, shards, compute, x)` on `world_size` simulated ranks with the exercise's units on `batch` rows;
    per rank its output, its compute spans and its collectives (draw them with
    `viz.plot_overlap([(r.spans, r.records) ...])`). A large batch makes each unit compute longer than a gather."""
    name = require_callable("run_forward", fn, "forward_serial")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"run_forward: batch must be a positive int (rows of x), got {batch!r}")
    return _run("run_forward", name, fn, _Chain(world_size, batch))


def order_report(run: ForwardRun) -> str:
    """In words, in the course's language, for one rank's run: when each unit's all-gather started, against the
    previous unit's compute (`run.gather_starts()` says it as data)."""
    lang = language()
    return "\n".join(T({"before": "started_before", "during": "started_during", "after": "started_after_end"}[when],
                       i=i, p=i - 1).render(lang) for i, when in run.gather_starts().items())


def check_forward_prefetch(fn: Callable[..., Any], world_sizes: Sequence[int] = (1, 2, 3)) -> None:
    """Check `fn(ctx, shards, compute, x) -> output`: the units run in order, each unit's all-gather issued before
    the previous unit computes and waited for just before use; the output equals one process's."""
    check = "check_forward_prefetch"
    name, sizes = require_learner(check, fn, "forward_prefetch", world_sizes)
    for n in sizes:
        chain = _Chain(n)
        reference = chain.reference()
        for rank, run in enumerate(_run(check, name, fn, chain)):
            _judge(check, chain, n, rank, run, reference)
    say_passed(check, sizes, T("passed", units=len(WIDTHS) - 1))


def _judge(check: str, chain: _Chain, n: int, rank: int, run: ForwardRun, reference: torch.Tensor) -> None:
    where = f"world size {n}, rank {rank}"
    units = len(chain.layouts)
    if run.problems:
        problem, hint = run.problems[0]
        CheckFailure(check, where, problem, hint).fail()
    computed = [int(s.unit.split()[-1]) for s in run.spans]
    if computed != list(range(units)):
        CheckFailure(check, where, T("computed_units", computed=computed, expected=list(range(units))),
                     T("call_in_order")).fail()
    gathered = run.gathered
    for i in range(units):
        count = len(gathered.get(i, []))
        if count != 1:
            CheckFailure(check, where, T("gathered_times", i=i, count=count), T("gather_once")).fail()
    start = {i: gathered[i][0].start for i in range(units)}
    spans = {int(s.unit.split()[-1]): s for s in run.spans}
    for i in range(units - 1):
        if not start[i + 1] < spans[i].start:
            CheckFailure(check, where, T("started_after", next=i + 1, i=i), T("issue_before", next=i + 1, i=i)).fail()
        if i + 2 < units and start[i + 2] < spans[i].start:
            CheckFailure(check, where, T("three_units", ahead=i + 2, i=i), T("one_ahead")).fail()
    got = run.output
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, T("not_output", kind=type(got).__name__), T("return_last")).fail()
    if not close(got, reference):
        CheckFailure(check, where, T("output_differs"), T("pass_on"),
                     [f"expected {format_tensor(reference, 8)}", f"got      {format_tensor(got, 8)}"]
                     + ([f"max difference {max_rel_diff(got, reference):.3g} relative"]
                        if got.shape == reference.shape else [])).fail()
