"""Checker of exercise 14: forward prefetching with asynchronous all-gathers.

The learner writes `forward_prefetch(ctx, shards, compute, x)`: `shards[i]` is this rank's shard of unit i's flat
parameter, `compute(i, full, x)` runs unit i with its gathered flat parameter `full` and returns its output. One unit
at a time, as FSDP does, but with the next unit's all-gather issued (`ctx.all_gather(..., async_op=True)`) *before*
the current unit computes, and waited for just before the next unit needs it: the communication of unit i+1 runs
while unit i computes (PyTorch FSDP, arXiv:2304.11277, section 3.3, forward prefetching; FSDP2's
`set_modules_to_forward_prefetch`; the course's `FSDP(..., prefetch=1)`).

The checker supplies `compute`, which times each unit's compute (a `Span`) and looks at what it is given; the
ledger gives each all-gather's start (every rank had joined it) and the moment it was waited for (the ledger records
an asynchronous collective when it is waited for). Units have different sizes, so a gather's bytes say which unit it
was. What is checked, on each rank, at world sizes 1 to 3:

- the output equals one process running the same units with the full parameters;
- each unit is gathered once, and `compute(i, ...)` gets unit i's gathered parameters, after its all-gather was
  waited for;
- the all-gather of unit i+1 starts before unit i's compute, and is not waited for before it (that would serialize
  the two again); and no unit further ahead is gathered yet (prefetch one unit: two units' parameters at once).

`run_forward(fn, world_size, batch=...)` runs any such function on simulated ranks and returns, per rank, its output,
the compute spans and the ledger, for `viz.plot_overlap`; `ForwardRun.gather_starts()` says when each gather started
against the previous unit's compute, and `order_report(run)` says it in words, in the course's language.
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
    require_world_sizes,
    run_checked,
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
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

T = catalogue("overlap", {
    "call_with_index": ("call compute(i, full, x) with the index i of the unit that runs",
                        "调用 compute(i, full, x) 时，传入正在运行的单元的下标 i"),
    "wait_returns": ("work.wait() returns the gathered tensor: pass what it returns",
                     "work.wait() 返回全聚合后的张量：传入它的返回值"),
    "pass_tensor": ("pass the tensor the all-gather returns (work.wait() returns it)",
                    "传入全聚合返回的张量（work.wait() 会返回它）"),
    "right_work": ("keep each unit's CollectiveWork and wait for the right one: unit i's wait() returns unit i's "
                   "parameters",
                   "保存每个单元的 CollectiveWork 并等待正确的那个：单元 i 的 wait() 返回单元 i 的参数"),
    "gather_first": ("all-gather shards[i] first: ctx.all_gather(shards[i], async_op=True).wait() returns every "
                     "rank's shards, concatenated",
                     "先全聚合 shards[i]：ctx.all_gather(shards[i], async_op=True).wait() 返回所有 rank 的分片，"
                     "首尾相接"),
    "unchanged": ("pass what ctx.all_gather(shards[i], ...) returns, unchanged",
                  "把 ctx.all_gather(shards[i], ...) 的返回值原样传入"),
    "used_before_wait": ("unit {i}'s parameters were used before its all-gather was waited for",
                         "单元 {i} 的全聚合还没有被等待，它的参数就被使用了"),
    "async_fills": ("an async all-gather fills its output in the background: call work.wait() before using the "
                    "parameters, and use what it returns",
                    "异步全聚合在后台填充输出：使用参数之前调用 work.wait()，并使用它返回的结果"),
    "other_values": ("compute({i}, ...) got values that are not unit {i}'s gathered parameters",
                     "compute({i}, ...) 得到的值不是单元 {i} 全聚合后的参数"),
    "pass_unchanged": ("pass what unit {i}'s all-gather returns, unchanged (the concatenation of every rank's "
                       "shards[{i}])",
                       "把单元 {i} 的全聚合的返回值原样传入（所有 rank 的 shards[{i}] 首尾相接）"),
    "already_waited": ("unit {next}'s all-gather had already been waited for (or run without async_op=True) when "
                       "unit {i}'s compute started, so nothing overlaps",
                       "单元 {i} 开始计算时，单元 {next} 的全聚合已经被等待过了（或者没有用 async_op=True 运行），"
                       "所以没有任何重叠"),
    "issue_async": ("issue unit {next}'s all-gather with async_op=True before computing unit {i}, and call wait() "
                    "only just before unit {next} needs its parameters",
                    "在计算单元 {i} 之前用 async_op=True 发起单元 {next} 的全聚合，等单元 {next} 即将用到参数时才调用 "
                    "wait()"),
    "no_unit_after": ("there is no unit after the last one: issue the next unit's all-gather only if i + 1 < "
                      "len(shards)",
                      "最后一个单元之后没有单元了：只有 i + 1 < len(shards) 时才发起下一个单元的全聚合"),
    "async_op": ("ctx.all_gather returns a tensor unless you pass async_op=True; with it, a CollectiveWork to wait() "
                 "on",
                 "不传 async_op=True 时，ctx.all_gather 返回一个张量；传了它，则返回一个要对它调用 wait() 的 "
                 "CollectiveWork"),
    "computed_units": ("compute was called for units {computed}, expected {expected}",
                       "compute 被调用的单元是 {computed}，应为 {expected}"),
    "call_in_order": ("call compute(i, full, x) once for every unit, in order, passing each output on as the next "
                      "unit's x",
                      "对每个单元按顺序调用一次 compute(i, full, x)，把每个输出作为下一个单元的 x 传下去"),
    "gathered_times": ("unit {i} was gathered {count} times", "单元 {i} 被全聚合了 {count} 次"),
    "gather_once": ("all-gather each unit's shard exactly once, and wait for each all-gather",
                    "每个单元的分片恰好全聚合一次，并等待每一次全聚合"),
    "started_after": ("unit {next}'s all-gather started after unit {i}'s compute",
                      "单元 {next} 的全聚合在单元 {i} 的计算之后才开始"),
    "issue_before": ("issue it before computing: ctx.all_gather(shards[{next}], async_op=True) before compute({i}, "
                     "...), and wait just before use, when unit {next} runs",
                     "在计算之前发起它：在 compute({i}, ...) 之前调用 ctx.all_gather(shards[{next}], async_op=True)，"
                     "等到单元 {next} 运行、即将使用时再 wait"),
    "three_units": ("unit {ahead}'s all-gather started before unit {i}'s compute: three units' parameters are "
                    "gathered at once",
                    "单元 {ahead} 的全聚合在单元 {i} 的计算之前就开始了：三个单元的参数同时处于全聚合状态"),
    "one_ahead": ("prefetch one unit ahead only (FSDP's prefetch=1): issue unit i+1's all-gather while unit i is about "
                  "to compute, not all of them at the start",
                  "只预取下一个单元（FSDP 的 prefetch=1）：在单元 i 即将计算时发起单元 i+1 的全聚合，"
                  "而不是一开始就发起全部"),
    "not_output": ("returned {kind}, not the output", "返回了 {kind}，而不是输出"),
    "return_last": ("return the last unit's output (what compute returned for the last unit)",
                    "返回最后一个单元的输出（compute 对最后一个单元的返回值）"),
    "output_differs": ("the output differs from one process's", "输出与单进程的结果不同"),
    "pass_on": ("pass each unit's output on as the next unit's x, and return the last one",
                "把每个单元的输出作为下一个单元的 x 传下去，并返回最后一个输出"),
    # order_report's lines
    "started_before": ("unit {i}'s all-gather started before unit {p}'s compute began",
                       "单元 {i} 的全聚合在单元 {p} 开始计算之前就已启动"),
    "started_during": ("unit {i}'s all-gather started while unit {p} computed",
                       "单元 {i} 的全聚合在单元 {p} 计算期间启动"),
    "started_after_end": ("unit {i}'s all-gather started after unit {p}'s compute ended",
                          "单元 {i} 的全聚合在单元 {p} 计算结束之后才启动"),
    # what passed
    "passed": ("  {units} units: each unit's all-gather started before the previous unit's compute and was waited for "
               "just before use, one unit ahead; the output equals one process's",
               "  {units} 个单元：每个单元的全聚合都在前一个单元计算之前就已启动，直到使用前才等待它完成，"
               "即提前一个单元；输出与单进程的结果相同"),
})


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
    name = require_callable(check, fn, "forward_prefetch")
    sizes = require_world_sizes(world_sizes)
    for n in sizes:
        chain = _Chain(n)
        reference = chain.reference()
        for rank, run in enumerate(_run(check, name, fn, chain)):
            _judge(check, chain, n, rank, run, reference)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("passed", units=len(WIDTHS) - 1))


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
