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

`run_forward(fn, world_size)` runs any such function on simulated ranks and returns, per rank, its output, the
compute spans and the ledger, for `viz.plot_overlap`; `order_report(run)` says in words when each gather started.
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
)
from fsdp_course.engines.equivalence import close, max_rel_diff
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.fsdp.param_group import Span
from fsdp_course.runtime.collectives import CollectiveWork
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Record

__all__ = ["ForwardRun", "check_forward_prefetch", "order_report", "run_forward"]

WIDTHS = (48, 80, 32, 64, 16)  # four units: Linear(48, 80), Linear(80, 32), Linear(32, 64), Linear(64, 16)
BATCH = 64
SEED = 13


class ComputeMisuse(Exception):
    """`compute` was called with something it cannot run (the message says what, `hint` how to fix it)."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass
class ForwardRun:
    """One rank's run of a forward function: its output, each unit's compute span, and its collectives."""

    output: Any
    spans: list[Span]  # one per compute call, unit "unit i", in call order
    records: list[Record]  # the rank's ledger
    gathered: dict[int, list[Record]] = field(default_factory=dict)  # unit -> its all-gathers (told by their bytes)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (problem, hint) seen by compute, in order


class _Chain:
    """The units: Linear layers with tanh between them, each one flat parameter (weight, bias) padded for N ranks."""

    def __init__(self, world_size: int) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.params = []
        for fan_in, fan_out in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
            w = torch.randn(fan_out, fan_in, generator=g) / math.sqrt(fan_in)
            self.params.append((w, torch.randn(fan_out, generator=g) * 0.1))
        self.layouts = [FlatParamLayout.build([("weight", w), ("bias", b)], world_size) for w, b in self.params]
        self.fulls = [layout.flatten([w, b]) for layout, (w, b) in zip(self.layouts, self.params, strict=True)]
        self.x = torch.randn(BATCH, WIDTHS[0], generator=g)
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

    def note(problem: str, hint: str) -> None:
        if not run.problems:  # the first one explains the rest
            run.problems.append((problem, hint))

    def compute(i: int, full: Any, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ComputeMisuse(f"compute's first argument must be a unit index 0..{n - 1}, got {i!r}",
                                "call compute(i, full, x) with the index i of the unit that runs")
        if isinstance(full, CollectiveWork):
            raise ComputeMisuse(f"compute({i}, ...) got the CollectiveWork itself, not unit {i}'s parameters",
                                "work.wait() returns the gathered tensor: pass what it returns")
        if not isinstance(full, torch.Tensor):
            raise ComputeMisuse(f"compute({i}, ...) got {type(full).__name__}, not a tensor",
                                "pass the tensor the all-gather returns (work.wait() returns it)")
        expected = chain.layouts[i].padded_numel
        if tuple(full.shape) != (expected,):
            other = chain.bytes_of.get(4 * full.numel()) if full.dim() == 1 else None
            if other is not None and other != i:
                raise ComputeMisuse(f"compute({i}, ...) got unit {other}'s gathered parameters ({full.numel()} "
                                    f"elements), unit {i} has {expected}",
                                    "keep each unit's CollectiveWork and wait for the right one: unit i's wait() "
                                    "returns unit i's parameters")
            if full.numel() * chain.world_size == expected:
                raise ComputeMisuse(f"compute({i}, ...) got a shard ({full.numel()} elements), not the gathered "
                                    f"parameters ({expected})",
                                    "all-gather shards[i] first: ctx.all_gather(shards[i], async_op=True).wait() "
                                    "returns every rank's shards, concatenated")
            raise ComputeMisuse(f"compute({i}, ...) got a tensor of shape {tuple(full.shape)}, expected "
                                f"({expected},): unit {i}'s gathered flat parameter",
                                "pass what ctx.all_gather(shards[i], ...) returns, unchanged")
        if waited(i) == 0:
            note(f"unit {i}'s parameters were used before its all-gather was waited for",
                 "an async all-gather fills its output in the background: call work.wait() before using the "
                 "parameters, and use what it returns")
        elif not torch.equal(full, chain.fulls[i]):
            note(f"compute({i}, ...) got values that are not unit {i}'s gathered parameters",
                 f"pass what unit {i}'s all-gather returns, unchanged (the concatenation of every rank's "
                 f"shards[{i}])")
        if i + 1 < n and waited(i + 1) > 0:
            note(f"unit {i + 1}'s all-gather had already been waited for (or run without "
                 f"async_op=True) when unit {i}'s compute started, so nothing overlaps",
                 f"issue unit {i + 1}'s all-gather with async_op=True before computing unit {i}, and call wait() "
                 f"only just before unit {i + 1} needs its parameters")
        out = chain.unit(i, full, x)
        run.spans.append(Span(f"unit {i}", "forward", start, time.perf_counter()))
        return out

    return compute


def _hint(exc: BaseException) -> str:
    if isinstance(exc, ComputeMisuse):
        return exc.hint
    if isinstance(exc, IndexError):
        return ("there is no unit after the last one: issue the next unit's all-gather only if i + 1 < "
                "len(shards)")
    if "has no attribute 'wait'" in str(exc):
        return "ctx.all_gather returns a tensor unless you pass async_op=True; with it, a CollectiveWork to wait() on"
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


def run_forward(fn: Callable[..., Any], world_size: int = 2) -> list[ForwardRun]:
    """Run `fn(ctx, shards, compute, x)` on `world_size` simulated ranks with the exercise's units; per rank its
    output, its compute spans and its collectives (draw them with `viz.plot_overlap([(r.spans, r.records) ...])`)."""
    name = require_callable("run_forward", fn, "forward_serial")
    return _run("run_forward", name, fn, _Chain(world_size))


def order_report(run: ForwardRun) -> str:
    """In words, for one rank's run: when each unit's all-gather started, against the previous unit's compute."""
    spans = {int(s.unit.split()[-1]): s for s in run.spans}
    lines = []
    for i in sorted(run.gathered):
        if i == 0 or i - 1 not in spans:
            continue
        start, before = run.gathered[i][0].start, spans[i - 1]
        when = ("before unit {p}'s compute began" if start < before.start else
                "while unit {p} computed" if start < before.end else "after unit {p}'s compute ended")
        lines.append(f"unit {i}'s all-gather started {when.format(p=i - 1)}")
    return "\n".join(lines)


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
    print(f"All tests in {check} passed (world sizes {', '.join(map(str, sizes))})")
    print(f"  {len(WIDTHS) - 1} units: each unit's all-gather started before the previous unit's compute and was "
          "waited for just before use, one unit ahead; the output equals one process's")


def _judge(check: str, chain: _Chain, n: int, rank: int, run: ForwardRun, reference: torch.Tensor) -> None:
    where = f"world size {n}, rank {rank}"
    units = len(chain.layouts)
    if run.problems:
        problem, hint = run.problems[0]
        CheckFailure(check, where, problem, hint).fail()
    computed = [int(s.unit.split()[-1]) for s in run.spans]
    if computed != list(range(units)):
        CheckFailure(check, where, f"compute was called for units {computed}, expected {list(range(units))}",
                     "call compute(i, full, x) once for every unit, in order, passing each output on as the next "
                     "unit's x").fail()
    gathered = run.gathered
    for i in range(units):
        count = len(gathered.get(i, []))
        if count != 1:
            CheckFailure(check, where, f"unit {i} was gathered {count} times",
                         "all-gather each unit's shard exactly once, and wait for each all-gather").fail()
    start = {i: gathered[i][0].start for i in range(units)}
    spans = {int(s.unit.split()[-1]): s for s in run.spans}
    for i in range(units - 1):
        if not start[i + 1] < spans[i].start:
            CheckFailure(check, where, f"unit {i + 1}'s all-gather started after unit {i}'s compute",
                         f"issue it before computing: ctx.all_gather(shards[{i + 1}], async_op=True) before "
                         f"compute({i}, ...), and wait just before use, when unit {i + 1} runs").fail()
        if i + 2 < units and start[i + 2] < spans[i].start:
            CheckFailure(check, where, f"unit {i + 2}'s all-gather started before unit {i}'s compute: three units' "
                         "parameters are gathered at once",
                         "prefetch one unit ahead only (FSDP's prefetch=1): issue unit i+1's all-gather while unit "
                         "i is about to compute, not all of them at the start").fail()
    got = run.output
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, f"returned {type(got).__name__}, not the output",
                     "return the last unit's output (what compute returned for the last unit)").fail()
    if not close(got, reference):
        CheckFailure(check, where, "the output differs from one process's",
                     "pass each unit's output on as the next unit's x, and return the last one",
                     [f"expected {format_tensor(reference, 8)}", f"got      {format_tensor(got, 8)}"]
                     + ([f"max difference {max_rel_diff(got, reference):.3g} relative"]
                        if got.shape == reference.shape else [])).fail()
