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
    say,
    scale_ratio,
)
from fsdp_course.classroom.checks._common import T as COMMON
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

T = catalogue("zero", {
    "span_one": ("gradient {i}", "梯度 {i}"),
    "span_many": ("gradients {first} to {last}", "梯度 {first} 到 {last}"),
    "span_one_then": ("gradient {i}, {rest}", "梯度 {i}、{rest}"),  # a span followed by the next ones
    "span_many_then": ("gradients {first} to {last}, {rest}", "梯度 {first} 到 {last}、{rest}"),
    "bucket": ("bucket {b} ({span})", "桶 {b}（{span}）"),
    "chunk_one": ("{n} chunk", "{n} 个分块"),
    "chunk_many": ("{n} chunks", "{n} 个分块"),
    "pad_bucket": ("pad each bucket's flattened gradient with zeros to a multiple of ctx.world_size before the "
                   "reduce-scatter (torch.cat([flat, flat.new_zeros(pad)]))",
                   "在归约分散之前，用零把每个桶展平后的梯度填充到 ctx.world_size 的整数倍"
                   "（torch.cat([flat, flat.new_zeros(pad)])）"),
    "asked_for": ("your function asked for {handed} of the {total} gradients",
                  "你的函数只取了 {total} 个梯度中的 {handed} 个"),
    "loop_every": ("loop over every gradient: for grad in grads: ...", "遍历每一个梯度：for grad in grads: ..."),
    "not_list": ("returned {kind}, not a list of tensors", "返回了 {kind}，不是张量列表"),
    "return_list": ("return a list with this rank's chunk of each bucket, in the order the buckets were reduced",
                    "返回一个列表，依次放入这个 rank 在每个桶中的分块，顺序与各桶被归约的顺序相同"),
    "reduced_alone": ("every gradient was reduced alone: the ledger holds {scatters} reduce-scatters for {grads} "
                      "gradients, expected {count}, one per bucket (buckets of {sizes} elements)",
                      "每个梯度都被单独归约了：对 {grads} 个梯度，通信账本里有 {scatters} 次归约分散，应为 {count} 次，"
                      "每个桶一次（各桶的元素个数为 {sizes}）"),
    "collect_bucket": ("collect gradients in a bucket while it holds at most bucket_numel elements, and reduce-scatter "
                       "the whole bucket at once: fewer, larger collectives pay the latency fewer times",
                       "桶里的元素不超过 bucket_numel 时就继续往里收集梯度，再对整个桶一次性做归约分散："
                       "集合通信次数更少、每次更大，付出延迟的次数也就更少"),
    "last_never": ("returned {got} chunks for {count} buckets: the last bucket ({span}) was never reduced",
                   "对 {count} 个桶只返回了 {got} 个分块：最后一个桶（{span}）从未被归约"),
    "last_waiting": ("after the loop over the gradients, the last bucket is still waiting: reduce-scatter what is "
                     "left in it (if anything) and append its chunk",
                     "遍历完梯度之后，最后一个桶还在等待：对其中剩下的部分（如果有）做归约分散，并追加它的分块"),
    "chunk_count": ("returned {chunks}, expected {count}: one per bucket (buckets: {spans})",
                    "返回了 {chunks}，应为 {count} 个：每个桶一个（各桶：{spans}）"),
    "bucket_rule": ("a bucket takes gradients while it holds at most bucket_numel elements; the gradient that would "
                    "overflow it starts the next bucket, and one larger than bucket_numel is a bucket alone",
                    "桶在元素不超过 bucket_numel 时接收梯度；会让它溢出的那个梯度开启下一个桶，大于 bucket_numel 的"
                    "梯度单独成桶"),
    "whole_bucket": ("that is the whole bucket: reduce_scatter returns this rank's chunk, keep only that (not an "
                     "all_reduce of the bucket)",
                     "这是整个桶：reduce_scatter 返回这个 rank 的分块，只保留它（不要对桶做 all_reduce）"),
    "keep_whole": ("keep the chunk reduce_scatter returns whole: the padding belongs to the last rank's chunk",
                   "完整保留 reduce_scatter 返回的分块：填充属于最后一个 rank 的分块"),
    "flatten_pad": ("flatten the bucket's gradients into one 1-D tensor of {numel} elements, pad it to {padded} (a "
                    "multiple of {n}) and reduce-scatter it: each rank keeps {each}",
                    "把桶内的梯度展平成一个 {numel} 个元素的一维张量，填充到 {padded}（{n} 的倍数），再做归约分散："
                    "每个 rank 保留 {each} 个"),
    "chunk_shape": ("{label}: the chunk has shape {got}, expected {expected}",
                    "{label}：分块的形状是 {got}，应为 {expected}"),
    "other_chunk": ("{label}: rank {rank} kept rank {other}'s chunk of the averaged bucket",
                    "{label}：rank {rank} 保留的是平均后的桶中 rank {other} 的分块"),
    "chunk_r": ("rank r keeps chunk r: ctx.reduce_scatter(flat, op='mean') returns exactly this rank's chunk (after an "
                "all_reduce it would be flat.chunk({n})[ctx.rank])",
                "rank r 保留分块 r：ctx.reduce_scatter(flat, op='mean') 返回的正是这个 rank 的分块"
                "（如果用 all_reduce，则是 flat.chunk({n})[ctx.rank]）"),
    "summed": ("{label}: rank {rank}'s chunk is {n}x the average: the gradients were summed",
               "{label}：rank {rank} 的分块是平均值的 {n} 倍：梯度被求和了"),
    "mean_op": ("reduce-scatter with op='mean': ZeRO-2 averages the gradients over the ranks, as DDP does",
                "用 op='mean' 做归约分散：ZeRO-2 与 DDP 一样在各 rank 间平均梯度"),
    "differs": ("{label}: rank {rank}'s chunk differs from one process's average",
                "{label}：rank {rank} 的分块与单进程的平均值不同"),
    "flatten_order": ("flatten the bucket's gradients in the order they arrived (torch.cat of each grad.reshape(-1)), "
                      "pad with zeros at the end, then reduce-scatter (mean)",
                      "按梯度到达的顺序展平桶内的梯度（对每个 grad.reshape(-1) 做 torch.cat），在末尾补零，再做归约分散"
                      "（mean）"),
    "other_ops": ("the ledger holds {ops} besides the reduce-scatters", "除了归约分散，通信账本里还有 {ops}"),
    "one_per_bucket": ("one reduce-scatter per bucket is all ZeRO-2 needs: an all_reduce sends twice the bytes and "
                       "gives every rank the whole bucket, of which it keeps 1/N",
                       "ZeRO-2 每个桶只需要一次归约分散：all_reduce 发送两倍的字节，并让每个 rank 都拿到整个桶，"
                       "而它只保留其中的 1/N"),
    "bytes": ("the ledger's reduce-scatters carried {sent} bytes, expected {want}: one per bucket, in order",
              "通信账本中的归约分散传输了 {sent} 字节，应为 {want}：每个桶一次，按顺序"),
    "each_once": ("reduce-scatter each padded bucket once, in the order the buckets fill",
                  "按各桶填满的顺序，对每个填充后的桶各做一次归约分散"),
    "held": ("{label} was still not reduced when gradient {k} was asked for: the gradients were held instead of "
             "reduced as each bucket filled",
             "取梯度 {k} 时，{label}仍未被归约：梯度被攒了下来，而不是在每个桶填满时就归约"),
    "as_soon": ("reduce-scatter a bucket as soon as the next gradient does not fit into it, then start a new one: "
                "ZeRO-2 holds one bucket of full gradients at a time, not all of them",
                "一旦下一个梯度放不进桶，就对这个桶做归约分散，再开始新桶：ZeRO-2 一次只持有一个桶的完整梯度，"
                "而不是全部"),
    # what passed
    "passed": ("  {cases} gradient lists: one reduce-scatter (mean) per bucket, each issued as soon as its bucket was "
               "complete; every rank's chunks equal one process's average, padding included",
               "  {cases} 组梯度列表：每个桶一次归约分散（mean），每次都在桶一凑齐就立即发出；每个 rank 的分块都等于"
               "单进程的平均值，填充部分也一样"),
})


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


def _hint(exc: BaseException) -> Message:
    if "must divide by the world size" in str(exc):
        return T("pad_bucket")
    return exception_hint(exc)


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
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("passed", cases=len(CASES)))


def _judge(check: str, where: str, n: int, rank: int, run: _Run, expected: list[list[torch.Tensor]],
           buckets: list[list[int]], shapes: list[torch.Tensor]) -> None:
    def fail(problem: Message, hint: Message, details: list[str] | None = None) -> None:
        CheckFailure(check, where, problem, hint, details or []).fail()

    mine = expected[rank]
    count = len(buckets)
    scatters = sum(op == "reduce_scatter" for op, _ in run.records)
    if run.handed < len(shapes):
        fail(T("asked_for", handed=run.handed, total=len(shapes)), T("loop_every"))
    if not isinstance(run.chunks, list | tuple) or not all(isinstance(c, torch.Tensor) for c in run.chunks):
        fail(T("not_list", kind=type(run.chunks).__name__), T("return_list"))
    got = list(run.chunks)
    numels = [g.numel() for g in shapes]
    if len(got) != count:
        if len(got) == len(shapes) or scatters == len(shapes):
            fail(T("reduced_alone", scatters=scatters, grads=len(shapes), count=count,
                   sizes=[sum(numels[i] for i in b) for b in buckets]), T("collect_bucket"))
        if len(got) == count - 1 and scatters == count - 1:
            fail(T("last_never", got=len(got), count=count, span=_span(buckets[-1])), T("last_waiting"))
        chunks = T("chunk_one" if len(got) == 1 else "chunk_many", n=len(got))
        fail(T("chunk_count", chunks=chunks, count=count, spans=_spans(buckets)), T("bucket_rule"))
    for b, (chunk, want) in enumerate(zip(got, mine, strict=True)):
        label = T("bucket", b=b, span=_span(buckets[b]))
        details = [f"expected {format_tensor(want)}", f"got      {format_tensor(chunk)}"]
        if tuple(chunk.shape) != tuple(want.shape):
            numel = sum(numels[i] for i in buckets[b])
            if chunk.numel() == padded_numel(numel, n):
                hint = T("whole_bucket")
            elif n > 1 and rank == n - 1 and chunk.numel() == numel - (n - 1) * (padded_numel(numel, n) // n):
                hint = T("keep_whole")  # the last rank cut its chunk's padding off
            else:
                hint = T("flatten_pad", numel=numel, padded=padded_numel(numel, n), n=n,
                         each=padded_numel(numel, n) // n)
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
    want_bytes = [4 * padded_numel(sum(numels[i] for i in b), n) for b in buckets]
    if sent != want_bytes:
        fail(T("bytes", sent=sent, want=want_bytes), T("each_once"))
    for b, bucket in enumerate(buckets):
        k = bucket[-1] + 2  # the bucket can be reduced once gradient bucket[-1] + 1 arrived: before k is asked for
        if k < len(run.reduced_before) and run.reduced_before[k] <= b:
            fail(T("held", label=T("bucket", b=b, span=_span(bucket)), k=k), T("as_soon"))
