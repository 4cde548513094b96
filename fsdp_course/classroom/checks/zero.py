"""Checker of exercise 04: ZeRO-2's bucketed gradient reduction.

The learner writes `zero2_reduce(ctx, grads, bucket_numel)`: `grads` hands over this rank's gradients one at a time,
in the order the backward pass makes them ready (an iterator, as autograd's hooks deliver them). The function fills
buckets the way `fsdp_course.engines.zero.bucket_parameters` cuts them (a bucket takes gradients while it holds at
most `bucket_numel` elements; the gradient that would overflow it starts the next one; a gradient larger than
`bucket_numel` is a bucket alone), and as soon as a bucket is complete it flattens it, pads it with zeros to a
multiple of the world size and reduce-scatters it (op="mean"): rank r keeps chunk r of the bucket's averaged
gradient, which is what `ZeRO2` leaves in `bucket.shard.grad` (ZeRO, arXiv:1910.02054, section 5.2, P_os+g; the
buckets are DDP's, torch/nn/parallel/distributed.py). It returns those chunks, one per bucket, in order.

The checker hands out the gradients itself (random, different on every rank) and notes, each time it hands one
over, how many reduce-scatters the rank's ledger holds. Checked on every rank at world sizes 1 to 3, on two gradient
lists whose buckets need padding (one with a gradient larger than a bucket, one with a bucket filled exactly):

- the number of chunks returned, against the buckets (every gradient reduced alone, the last bucket never reduced);
- each chunk against one process's mean over the ranks of the bucket, cut at chunk r (another rank's chunk, a sum
  instead of a mean, the padding left out);
- the ledger: exactly one reduce-scatter per bucket, of the padded bucket's bytes, and nothing else (an all-reduce
  sends twice the bytes);
- the timing: a bucket is reduced before the gradient after the one that closed it is asked for, so that one bucket
  of gradients is alive at a time, not all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    exception_hint,
    format_tensor,
    require_callable,
    require_world_sizes,
    run_checked,
    scale_ratio,
)
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.runtime.context import RankContext

__all__ = ["CASES", "check_zero2_reduce", "cut_buckets", "expected_chunks"]

# (gradient shapes in the order they become ready, bucket_numel)
CASES: tuple[tuple[tuple[tuple[int, ...], ...], int], ...] = (
    (((7, 3), (5,), (4, 4), (30,), (3,), (2, 5)), 24),  # buckets of 21, 21, 30 (larger than a bucket), 13 elements
    (((2, 4), (2,), (5,), (3, 3), (1,)), 10),  # 10 (exactly full), 5, 10: padded at N = 3
)
SEED = 4
RTOL, ATOL = 1e-5, 1e-6


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
    handed: int = 0  # how many gradients the function asked for


def _hint(exc: BaseException) -> str:
    if "must divide by the world size" in str(exc):
        return ("pad each bucket's flattened gradient with zeros to a multiple of ctx.world_size before the "
                "reduce-scatter (torch.cat([flat, flat.new_zeros(pad)]))")
    return exception_hint(exc)


def _span(bucket: list[int]) -> str:
    return f"gradient {bucket[0]}" if len(bucket) == 1 else f"gradients {bucket[0]} to {bucket[-1]}"


def check_zero2_reduce(fn: Callable[[RankContext, Iterator[torch.Tensor], int], list[torch.Tensor]],
                       world_sizes: Sequence[int] = (1, 2, 3)) -> None:
    """Check `fn(ctx, grads, bucket_numel) -> chunks`: buckets cut as ZeRO-2 cuts them, each reduce-scattered
    (mean) as soon as it is complete, this rank's chunk of each bucket returned, in order."""
    check = "check_zero2_reduce"
    name = require_callable(check, fn, "zero2_reduce")
    sizes = require_world_sizes(world_sizes)
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
                        run.handed += 1
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
    print(f"All tests in {check} passed (world sizes {', '.join(map(str, sizes))})")
    print(f"  {len(CASES)} gradient lists: one reduce-scatter (mean) per bucket, each issued as soon as its bucket "
          "was complete; every rank's chunks equal one process's average, padding included")


def _judge(check: str, where: str, n: int, rank: int, run: _Run, expected: list[list[torch.Tensor]],
           buckets: list[list[int]], shapes: list[torch.Tensor]) -> None:
    def fail(problem: str, hint: str, details: list[str] | None = None) -> None:
        CheckFailure(check, where, problem, hint, details or []).fail()

    mine = expected[rank]
    count = len(buckets)
    scatters = sum(op == "reduce_scatter" for op, _ in run.records)
    if run.handed < len(shapes):
        fail(f"your function asked for {run.handed} of the {len(shapes)} gradients",
             "loop over every gradient: for grad in grads: ...")
    if not isinstance(run.chunks, list | tuple) or not all(isinstance(c, torch.Tensor) for c in run.chunks):
        fail(f"returned {type(run.chunks).__name__}, not a list of tensors",
             "return a list with this rank's chunk of each bucket, in the order the buckets were reduced")
    got = list(run.chunks)
    numels = [g.numel() for g in shapes]
    if len(got) != count:
        if len(got) == len(shapes) or scatters == len(shapes):
            fail(f"every gradient was reduced alone: the ledger holds {scatters} reduce-scatters for "
                 f"{len(shapes)} gradients, expected {count}, one per bucket (buckets of "
                 f"{[sum(numels[i] for i in b) for b in buckets]} elements)",
                 "collect gradients in a bucket while it holds at most bucket_numel elements, and reduce-scatter the "
                 "whole bucket at once: fewer, larger collectives pay the latency fewer times")
        if len(got) == count - 1 and scatters == count - 1:
            fail(f"returned {len(got)} chunks for {count} buckets: the last bucket ({_span(buckets[-1])}) was never "
                 "reduced",
                 "after the loop over the gradients, the last bucket is still waiting: reduce-scatter what is left "
                 "in it (if anything) and append its chunk")
        fail(f"returned {len(got)} chunk{'s' if len(got) != 1 else ''}, expected {count}: one per bucket (buckets: "
             f"{', '.join(_span(b) for b in buckets)})",
             "a bucket takes gradients while it holds at most bucket_numel elements; the gradient that would "
             "overflow it starts the next bucket, and one larger than bucket_numel is a bucket alone")
    for b, (chunk, want) in enumerate(zip(got, mine, strict=True)):
        label = f"bucket {b} ({_span(buckets[b])})"
        details = [f"expected {format_tensor(want)}", f"got      {format_tensor(chunk)}"]
        if tuple(chunk.shape) != tuple(want.shape):
            numel = sum(numels[i] for i in buckets[b])
            if chunk.numel() == padded_numel(numel, n):
                hint = ("that is the whole bucket: reduce_scatter returns this rank's chunk, keep only that "
                        "(not an all_reduce of the bucket)")
            elif n > 1 and chunk.numel() * n == numel:
                hint = "keep the chunk reduce_scatter returns whole: the padding belongs to the last rank's chunk"
            else:
                hint = (f"flatten the bucket's gradients into one 1-D tensor of {numel} elements, pad it to "
                        f"{padded_numel(numel, n)} (a multiple of {n}) and reduce-scatter it: each rank keeps "
                        f"{padded_numel(numel, n) // n}")
            fail(f"{label}: the chunk has shape {tuple(chunk.shape)}, expected {tuple(want.shape)}", hint, details)
        if torch.allclose(chunk.double(), want.double(), rtol=RTOL, atol=ATOL):
            continue
        other = [r for r in range(n) if r != rank
                 and torch.allclose(chunk.double(), expected[r][b].double(), rtol=RTOL, atol=ATOL)]
        if other:
            fail(f"{label}: rank {rank} kept rank {other[0]}'s chunk of the averaged bucket",
                 f"rank r keeps chunk r: ctx.reduce_scatter(flat, op='mean') returns exactly this rank's chunk "
                 f"(after an all_reduce it would be flat.chunk({n})[ctx.rank])", details)
        ratio = scale_ratio(chunk, want)
        if ratio is not None and n > 1 and abs(ratio / n - 1) < 1e-3:
            fail(f"{label}: rank {rank}'s chunk is {n}x the average: the gradients were summed",
                 "reduce-scatter with op='mean': ZeRO-2 averages the gradients over the ranks, as DDP does",
                 details)
        diff = (chunk.double() - want.double()).abs()
        details.append(f"max difference {diff.max().item():g} at index {int(diff.argmax())}")
        fail(f"{label}: rank {rank}'s chunk differs from one process's average",
             "flatten the bucket's gradients in the order they arrived (torch.cat of each grad.reshape(-1)), pad "
             "with zeros at the end, then reduce-scatter (mean)", details)
    others = sorted({op for op, _ in run.records} - {"reduce_scatter"})
    if others:
        fail(f"the ledger holds {', '.join(others)} besides the reduce-scatters",
             "one reduce-scatter per bucket is all ZeRO-2 needs: an all_reduce sends twice the bytes and gives every "
             "rank the whole bucket, of which it keeps 1/N")
    sent = [payload for op, payload in run.records if op == "reduce_scatter"]
    want_bytes = [4 * padded_numel(sum(numels[i] for i in b), n) for b in buckets]
    if sent != want_bytes:
        fail(f"the ledger's reduce-scatters carried {sent} bytes, expected {want_bytes}: one per bucket, in order",
             "reduce-scatter each padded bucket once, in the order the buckets fill")
    for b, bucket in enumerate(buckets):
        k = bucket[-1] + 2  # the bucket can be reduced once gradient bucket[-1] + 1 arrived: before k is asked for
        if k < len(run.reduced_before) and run.reduced_before[k] <= b:
            fail(f"bucket {b} ({_span(bucket)}) was still not reduced when gradient {k} was asked for: "
                 "the gradients were held instead of reduced as each bucket filled",
                 "reduce-scatter a bucket as soon as the next gradient does not fit into it, then start a new one: "
                 "ZeRO-2 holds one bucket of full gradients at a time, not all of them")
