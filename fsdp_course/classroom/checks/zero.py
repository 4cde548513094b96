"""Checker of exercise 04: ZeRO-2's bucketed gradient reduction.

Cites ZeRO (arXiv:1910.02054, section 5.2); DDP's buckets (torch/nn/parallel/distributed.py).
Design notes: docs/CLASSROOM.md, "Checkers", `zero.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    format_tensor,
    hints,
    known_mistake,
    require_learner,
    run_checked,
    say_passed,
    scale_ratio,
)
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext

__all__ = ["CASES", "check_zero2_reduce", "cut_buckets", "expected_chunks"]

# (gradient shapes in the order they become ready, bucket_numel)
CASES: tuple[tuple[tuple[tuple[int, ...], ...], int], ...] = (
    (((7, 3), (5,), (4, 4), (30,), (3,), (2, 5)), 24),  # buckets of 21, 21, 30 (larger than a bucket), 13 elements
    (((2, 4), (2,), (5,), (3, 3), (1,)), 10),  # 10 (exactly full), 5, 10: padded at N = 3
)
SEED = 4
RTOL, ATOL = 1e-5, 1e-6

T = catalogue("zero")  # fsdp_course/i18n/catalogues/zero.yml
_hint = hints(("must divide by the world size", T("pad_bucket")))


def cut_buckets(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """The gradients' indices, cut into buckets as `bucket_parameters` cuts the parameters."""
    buckets: list[list[int]] = []
    size = 0
    for i, numel in enumerate(numels):
        if not buckets or size + numel > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += numel
    return buckets


def rank_grads(shapes: Sequence[tuple[int, ...]], world_size: int) -> list[list[torch.Tensor]]:
    """Every rank's gradients (different values on every rank)."""
    g = torch.Generator().manual_seed(SEED + 10 * world_size + len(shapes))
    return [[torch.randn(shape, generator=g) for shape in shapes] for _ in range(world_size)]


def expected_chunks(grads: list[list[torch.Tensor]], bucket_numel: int) -> list[list[torch.Tensor]]:
    """One process: per rank, per bucket, chunk r of the bucket's gradient averaged over the ranks, padded."""
    n = len(grads)
    buckets = cut_buckets([g.numel() for g in grads[0]], bucket_numel)
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for bucket in buckets:
        numel = sum(grads[0][i].numel() for i in bucket)
        flat = torch.zeros(padded_numel(numel, n))
        flat[:numel] = torch.stack([torch.cat([r[i].reshape(-1) for i in bucket]) for r in grads]).mean(0)
        for r, chunk in enumerate(flat.chunk(n)):
            out[r].append(chunk.clone())
    return out


@dataclass
class _Run:
    chunks: Any
    records: list[tuple[str, int]]  # (op, payload bytes) from the rank's ledger
    reduced_before: list[int] = field(default_factory=list)  # reduce-scatters done when gradient k was asked for


def _span(bucket: list[int], **rest: Message) -> Message:
    """"gradient i" or "gradients i to j"; with `rest=`, followed by a comma and `rest` (the next buckets' spans)."""
    if len(bucket) == 1:
        return T("span_one_then" if rest else "span_one", i=bucket[0], **rest)
    return T("span_many_then" if rest else "span_many", first=bucket[0], last=bucket[-1], **rest)


def _spans(buckets: list[list[int]]) -> Message:
    """Every bucket's span, separated by commas."""
    out = _span(buckets[-1])
    for bucket in reversed(buckets[:-1]):
        out = _span(bucket, rest=out)
    return out


def check_zero2_reduce(fn: Callable[[RankContext, Iterator[torch.Tensor], int], list[torch.Tensor]],
                       world_sizes: Sequence[int] = (1, 2, 3)) -> None:
    """Check `fn(ctx, grads, bucket_numel) -> chunks`: buckets cut as ZeRO-2 cuts them, each reduce-scattered
    (mean) as soon as it is complete, this rank's chunk of each bucket returned, in order."""
    check = "check_zero2_reduce"
    name, sizes = require_learner(check, fn, "zero2_reduce", world_sizes)
    for n in sizes:
        for case, (shapes, bucket_numel) in enumerate(CASES):
            grads = rank_grads(shapes, n)
            expected = expected_chunks(grads, bucket_numel)
            buckets = cut_buckets([g.numel() for g in grads[0]], bucket_numel)

            def rank_fn(ctx: RankContext, grads: list[list[torch.Tensor]] = grads,
                        bucket_numel: int = bucket_numel) -> _Run:
                ctx.ledger.clear()
                run = _Run(None, [])

                def arriving() -> Iterator[torch.Tensor]:
                    for g in grads[ctx.rank]:
                        run.reduced_before.append(sum(r.op == "reduce_scatter" for r in ctx.ledger.records))
                        yield g.clone()

                out = fn(ctx, arriving(), bucket_numel)
                run.chunks = [c.detach().clone() if isinstance(c, torch.Tensor) else c for c in out] \
                    if isinstance(out, list | tuple) else out
                run.records = [(r.op, r.payload_bytes) for r in ctx.ledger.records]
                return run

            where_case = f"world size {n}, case {case} ({len(shapes)} gradients, bucket_numel={bucket_numel})"
            runs = run_checked(check, name, rank_fn, n, lambda r, w=where_case: f"{w}, rank {r}", _hint)
            for rank, run in enumerate(runs):
                _judge(check, f"{where_case}, rank {rank}", n, rank, run, expected, buckets, grads[0])
    say_passed(check, sizes, T("passed", cases=len(CASES)))


def _judge(check: str, where: str, n: int, rank: int, run: _Run, expected: list[list[torch.Tensor]],
           buckets: list[list[int]], shapes: list[torch.Tensor]) -> None:
    def fail(problem: Message, hint: Message, details: list[str] | None = None) -> None:
        CheckFailure(check, where, problem, hint, details or []).fail()

    mine = expected[rank]
    count = len(buckets)
    scatters = sum(op == "reduce_scatter" for op, _ in run.records)
    if len(run.reduced_before) < len(shapes):  # one entry per gradient the function asked for
        fail(T("asked_for", handed=len(run.reduced_before), total=len(shapes)), T("loop_every"))
    if not isinstance(run.chunks, list | tuple) or not all(isinstance(c, torch.Tensor) for c in run.chunks):
        fail(T("not_list", kind=type(run.chunks).__name__), T("return_list"))
    got = list(run.chunks)
    sizes = [sum(shapes[i].numel() for i in b) for b in buckets]
    if len(got) != count:
        if len(got) == len(shapes) or scatters == len(shapes):
            fail(T("reduced_alone", scatters=scatters, grads=len(shapes), count=count, sizes=sizes),
                 T("collect_bucket"))
        if len(got) == count - 1 and scatters == count - 1:
            fail(T("last_never", got=len(got), count=count, span=_span(buckets[-1])), T("last_waiting"))
        chunks = T("chunk_one" if len(got) == 1 else "chunk_many", n=len(got))
        fail(T("chunk_count", chunks=chunks, count=count, spans=_spans(buckets)), T("bucket_rule"))
    for b, (chunk, want) in enumerate(zip(got, mine, strict=True)):
        label = T("bucket", b=b, span=_span(buckets[b]))
        details = [f"expected {format_tensor(want)}", f"got      {format_tensor(chunk)}"]
        if tuple(chunk.shape) != tuple(want.shape):
            numel, padded = sizes[b], padded_numel(sizes[b], n)
            hint = known_mistake(chunk.numel(), [  # the whole bucket; the last rank's chunk cut at the padding
                (padded, lambda: T("whole_bucket")),
                (numel - (n - 1) * (padded // n) if n > 1 and rank == n - 1 else None, lambda: T("keep_whole")),
            ]) or T("flatten_pad", numel=numel, padded=padded, n=n, each=padded // n)
            fail(T("chunk_shape", label=label, got=tuple(chunk.shape), expected=tuple(want.shape)), hint, details)
        if torch.allclose(chunk.double(), want.double(), rtol=RTOL, atol=ATOL):
            continue
        other = [r for r in range(n) if r != rank
                 and torch.allclose(chunk.double(), expected[r][b].double(), rtol=RTOL, atol=ATOL)]
        if other:
            fail(T("other_chunk", label=label, rank=rank, other=other[0]), T("chunk_r", n=n), details)
        ratio = scale_ratio(chunk, want)
        if ratio is not None and n > 1 and abs(ratio / n - 1) < 1e-3:
            fail(T("summed", label=label, rank=rank, n=n), T("mean_op"), details)
        diff = (chunk.double() - want.double()).abs()
        details.append(f"max difference {diff.max().item():g} at index {int(diff.argmax())}")
        fail(T("differs", label=label, rank=rank), T("flatten_order"), details)
    others = sorted({op for op, _ in run.records} - {"reduce_scatter"})
    if others:
        fail(T("other_ops", ops=", ".join(others)), T("one_per_bucket"))
    sent = [payload for op, payload in run.records if op == "reduce_scatter"]
    want_bytes = [4 * padded_numel(s, n) for s in sizes]
    if sent != want_bytes:
        fail(T("bytes", sent=sent, want=want_bytes), T("each_once"))
    for b, bucket in enumerate(buckets):
        k = bucket[-1] + 2  # the bucket can be reduced once gradient bucket[-1] + 1 arrived: before k is asked for
        if k < len(run.reduced_before) and run.reduced_before[k] <= b:
            fail(T("held", label=T("bucket", b=b, span=_span(bucket)), k=k), T("as_soon"))
