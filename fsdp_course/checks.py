"""Exercise checkers: run a learner's function on simulated ranks and compare it with a pure computation.

A checker takes the learner's function, runs it under `run_ranks` for several world sizes and
inputs (including sizes that do not divide by the world size, so padding is needed), and either
prints what passed, or prints exactly what failed (world size, rank, tensor, max difference) with a
hint and raises `AssertionError`, so that nbgrader scores the cell 0. A function that still raises
the stub's `NotImplementedError` gets one short `NotImplementedError` saying so, instead of a wall
of rank tracebacks.

The style follows ARENA's checkers ("All tests in `test_mv` passed!"). The first exercise builds
all-reduce from reduce-scatter + all-gather, the decomposition behind ZeRO's communication analysis
(arXiv:1910.02054, section 7) and behind FSDP's split of one all-reduce into a reduce-scatter of
gradients and an all-gather of parameters (arXiv:2304.11277). Later exercises add their checkers
here, reusing `compare_tensor`, `run_checked` and `CheckFailure`.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from fsdp_course.context import RankContext
from fsdp_course.ledger import Record
from fsdp_course.monitor import CollectiveHang, CollectiveMismatch
from fsdp_course.simulate import RankError, run_ranks

__all__ = ["CheckFailure", "check_all_reduce", "compare_tensor", "format_tensor", "run_checked"]

_LIBRARY_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
CHECK_TIMEOUT = 10.0  # seconds per run_ranks call: a correct solution needs well under one


# -- shared machinery ----------------------------------------------------------------------------
@dataclass
class CheckFailure:
    """What a checker found wrong, printed for the learner before the AssertionError."""

    check: str  # e.g. "check_all_reduce"
    where: str  # e.g. "world size 3, input shape (5,)"
    problem: str  # one line: what differs
    hint: str
    details: list[str] = field(default_factory=list)  # tensors, differences, traceback lines

    def report(self) -> str:
        lines = [f"{self.check} FAILED at {self.where}", f"  {self.problem}"]
        lines += [f"  {line}" for line in self.details]
        lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def fail(self) -> NoReturn:
        """Print the report and raise AssertionError (a grader scores the cell 0)."""
        print(self.report())
        raise AssertionError(f"{self.check} failed at {self.where}: {self.problem} (hint: {self.hint})")


def format_tensor(t: torch.Tensor, limit: int = 16) -> str:
    """A short, deterministic rendering of a tensor's values: integers without '.0', at most `limit`."""
    flat = t.detach().reshape(-1).tolist()
    shown = [f"{v:g}" if isinstance(v, float) else str(v) for v in flat[:limit]]
    more = f", ... ({len(flat)} values)" if len(flat) > limit else ""
    return f"[{', '.join(shown)}{more}] shape {tuple(t.shape)}"


def run_checked(check: str, name: str, fn: Callable[[RankContext], Any], world_size: int,
                where: Callable[[int], str], hint_for: Callable[[BaseException], str]) -> list[Any]:
    """`run_ranks(fn, world_size)`, turning failures into a learner-facing report.

    `name` is the learner's function; `where(rank)` says which case that rank was in when it
    failed; `hint_for(exc)` suggests a fix for an exception raised inside the learner's code.
    Raises NotImplementedError if every failing rank is still at the stub, else AssertionError.
    """
    try:
        return run_ranks(fn, world_size, timeout=CHECK_TIMEOUT)
    except RankError as err:
        failures = err.failures
        if all(isinstance(e, NotImplementedError) for e in failures.values()):
            raise NotImplementedError(
                f"{name} is not implemented yet: replace `raise NotImplementedError()` in its cell with your "
                f"code, run that cell, then run this one again") from None
        rank = min(failures)
        exc = failures[rank]
        first, *rest = f"rank {rank} raised {type(exc).__name__}: {exc}".splitlines()
        others = sorted(set(failures) - {rank})
        details = list(rest)  # the rest of a multi-line message, e.g. each rank's call in a mismatch
        if others:
            details.append(f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed too")
        details += _learner_frames(exc)
        CheckFailure(check, where(rank), first, hint_for(exc), details).fail()


def _learner_frames(exc: BaseException) -> list[str]:
    """The traceback lines that are in the learner's code (not in this library), innermost last."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_LIBRARY_DIR)]
    lines = [f"line {f.lineno} in {f.name}: {(f.line or '').strip()}" for f in frames[-3:]]
    return ["where, in your code:"] + [f"  {line}" for line in lines] if lines else []


def compare_tensor(expected: torch.Tensor, got: object, *, world_size: int, rank: int,
                   padded_numel: int | None = None, rtol: float = 1e-5,
                   atol: float = 1e-6) -> tuple[str, str, list[str]] | None:
    """None if `got` matches `expected`, else (problem, hint, detail lines) for a CheckFailure.

    The hints recognise the usual mistakes of a sharded collective: a result N times too small
    (averaged instead of summed), N times too large (summed twice), the padding left on, only this
    rank's chunk returned, a lost shape or dtype.
    """
    n = world_size
    if not isinstance(got, torch.Tensor):
        return (f"rank {rank} returned {type(got).__name__}, not a tensor",
                "return the result tensor at the end of your function", [])
    details = [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"]
    if tuple(got.shape) != tuple(expected.shape):
        problem = f"rank {rank}: shape differs: got {tuple(got.shape)}, expected {tuple(expected.shape)}"
        if padded_numel is not None and got.numel() == padded_numel != expected.numel():
            hint = (f"shape differs: did you remove the padding? keep only the first tensor.numel() "
                    f"(here {expected.numel()}) elements of the gathered tensor, then reshape to tensor.shape")
        elif padded_numel is not None and n > 1 and got.numel() == padded_numel // n:
            hint = "that is one chunk: all_gather the reduced chunks so every rank holds all of them"
        elif got.numel() == expected.numel():
            hint = "same number of elements, different shape: reshape to the input's shape (tensor.shape)"
        else:
            hint = "shape differs: pad the flattened input, and cut the padding off the result"
        return problem, hint, details
    if got.dtype != expected.dtype:
        return (f"rank {rank}: dtype differs: got {got.dtype}, expected {expected.dtype}",
                "keep the input's dtype: pad with tensor.new_zeros(...) rather than torch.zeros(...)", details)
    got_f, exp_f = got.detach().double(), expected.double()
    if torch.allclose(got_f, exp_f, rtol=rtol, atol=atol):
        return None
    diff = (got_f - exp_f).abs()
    index = int(diff.reshape(-1).argmax())
    details.append(f"max difference {diff.max().item():g} at flat index {index}")
    problem = f"rank {rank}: values differ"
    hint = "look at the first element that differs, and at which chunk (index // chunk size) it falls in"
    if exp_f.ne(0).all() and n > 1:
        ratio = got_f / exp_f
        if torch.allclose(ratio, torch.full_like(ratio, 1 / n), rtol=1e-4):
            hint = (f"rank {rank}'s result is {n}x too small: did you average (op='mean' or divide by the "
                    f"world size) instead of summing?")
        elif torch.allclose(ratio, torch.full_like(ratio, float(n)), rtol=1e-4):
            hint = (f"rank {rank}'s result is {n}x too large: did you sum twice (e.g. an all_reduce on top "
                    f"of the reduce_scatter)?")
    return problem, hint, details


def _exception_hint(exc: BaseException) -> str:
    text = str(exc)
    if "must divide by the world size" in text:
        return ("reduce_scatter needs a length that divides by ctx.world_size: flatten the tensor and pad "
                "it with zeros to a multiple of the world size first")
    if isinstance(exc, CollectiveMismatch):
        return ("the ranks made different calls (or used different shapes): every rank must pad to the same "
                "length and call the same collectives in the same order")
    if isinstance(exc, CollectiveHang):
        return "some rank skipped a collective that the others called: every rank must make every call"
    if "is invalid for input of size" in text:
        return ("the gathered tensor still has the padding: keep only the first tensor.numel() elements, "
                "then reshape to tensor.shape")
    if "must have at least one dimension" in text:
        return "flatten the tensor with tensor.reshape(-1) before the collectives"
    return "read the end of the traceback above: the last line of your code in it is where it went wrong"


# -- exercise 01: all-reduce from reduce-scatter + all-gather --------------------------------------
ALL_REDUCE_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (5,), (8,), (13,), (3, 5))


def _all_reduce_inputs(world_size: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Per-rank inputs: positive small integers as float32, so sums are exact and ratios are defined."""
    g = torch.Generator().manual_seed(1_000 * world_size + sum(shape) * 7 + len(shape))
    return [torch.randint(1, 10, shape, generator=g).float() for _ in range(world_size)]


def check_all_reduce(fn: Callable[[RankContext, torch.Tensor], torch.Tensor],
                     world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, tensor) -> tensor`: the element-wise sum over ranks, same shape and dtype.

    Runs `fn` for every world size in `world_sizes` on the shapes in ALL_REDUCE_SHAPES (some do
    not divide by the world size), compares every rank's result with the sum computed directly,
    and checks through the ledger that it used reduce_scatter and all_gather but not all_reduce.
    Results are checked shape by shape (1-D shapes first), so padding mistakes show up before
    reshaping ones.
    """
    check = "check_all_reduce"
    if not callable(fn):
        raise TypeError(f"{check} takes your function itself, e.g. {check}(my_all_reduce); "
                        f"got {type(fn).__name__}")
    name = getattr(fn, "__name__", "your function")
    sizes = list(world_sizes)
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"world_sizes must be positive ints, got {world_sizes!r}")

    inputs = {(n, shape): _all_reduce_inputs(n, shape) for n in sizes for shape in ALL_REDUCE_SHAPES}
    outputs: dict[tuple[int, tuple[int, ...]], list[tuple[Any, list[Record]]]] = {}
    for n in sizes:
        current: list[tuple[int, ...]] = [ALL_REDUCE_SHAPES[0]] * n  # the case each rank is in

        def body(ctx: RankContext, n: int = n, current: list = current) -> list[tuple[Any, list[Record]]]:
            out = []
            for shape in ALL_REDUCE_SHAPES:
                current[ctx.rank] = shape
                ctx.ledger.clear()
                result = fn(ctx, inputs[n, shape][ctx.rank].clone())
                out.append((result, list(ctx.ledger.records)))
            return out

        def where(rank: int, n: int = n, current: list = current) -> str:
            return f"world size {n}, input shape {current[rank]}"

        per_rank = run_checked(check, name, body, n, where, _exception_hint)
        for i, shape in enumerate(ALL_REDUCE_SHAPES):
            outputs[n, shape] = [per_rank[r][i] for r in range(n)]

    for shape in ALL_REDUCE_SHAPES:
        for n in sizes:
            _check_one_all_reduce(check, n, shape, inputs[n, shape], outputs[n, shape])

    print(f"All tests in {check} passed (world sizes {', '.join(map(str, sizes))})")
    print(f"  input shapes {', '.join(map(str, ALL_REDUCE_SHAPES))}: every rank holds the exact sum")
    print("  calls per rank: reduce_scatter and all_gather, no all_reduce")
    n, shape = max(sizes), (13,)
    if n > 1:
        records = outputs[n, shape][0][1]
        sent = {r.op: r.sent_bytes for r in records}
        payload = next(r.payload_bytes for r in records if r.op == "all_gather")
        both = sent["reduce_scatter"] + sent["all_gather"]
        print(f"  traffic of rank 0 at world size {n} for a {shape} float32 tensor, padded to {payload} B "
              f"(ring model):")
        print(f"    reduce_scatter {sent['reduce_scatter']:g} B + all_gather {sent['all_gather']:g} B = "
              f"{both:g} B sent = 2(N-1)/N x {payload} B, what one all_reduce sends")


def _check_one_all_reduce(check: str, n: int, shape: tuple[int, ...], inputs: list[torch.Tensor],
                          outputs: list[tuple[Any, list[Record]]]) -> None:
    expected = torch.stack(inputs).sum(0)
    padded = -(-expected.numel() // n) * n
    where = f"world size {n}, input shape {shape}"
    for rank, (got, records) in enumerate(outputs):
        found = compare_tensor(expected, got, world_size=n, rank=rank, padded_numel=padded)
        if found is not None:
            problem, hint, details = found
            details = [f"rank {r} input {format_tensor(x)}" for r, x in enumerate(inputs)] + details
            CheckFailure(check, where, problem, hint, details).fail()
        ops = [r.op for r in records]
        if "all_reduce" in ops:
            CheckFailure(check, where, f"rank {rank} called ctx.all_reduce (calls: {', '.join(ops)})",
                         "build it from ctx.reduce_scatter and ctx.all_gather only").fail()
        if "reduce_scatter" not in ops or "all_gather" not in ops:
            CheckFailure(check, where, f"rank {rank} made the calls [{', '.join(ops)}]",
                         "use ctx.reduce_scatter (sum the chunks), then ctx.all_gather (share them)").fail()
