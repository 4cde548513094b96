"""Checkers of exercise 01: all-reduce built from reduce-scatter + all-gather, and a ring all-reduce.

The first builds all-reduce from reduce-scatter + all-gather, the decomposition behind ZeRO's
communication analysis (arXiv:1910.02054, section 7) and behind FSDP's split of one all-reduce into
a reduce-scatter of gradients and an all-gather of parameters (arXiv:2304.11277). The second builds
the same all-reduce from point-to-point messages around a ring (the "ring all-reduce" of Baidu's
allreduce and of NCCL/Gloo): N - 1 steps that reduce-scatter, N - 1 steps that all-gather, each
rank sending one chunk to its right neighbour per step. The checker watches every send and recv
(a recording wrapper around `ctx.group`), so it can tell a ring from, say, everyone sending
everything to rank 0; their waits go through the referee, so a ring where every rank waits on its
send before receiving is named as a deadlock, with the step ("reduce-scatter step 1 of 2").

Both checkers explain wrong values chunk by chunk (`chunk_diagnosis`: the inputs are small integers,
so each wrong chunk is solved for as a combination of the ranks' inputs: which rank's contribution
a chunk lacks or has twice, or which other chunk's values it holds), and fail a function that
changes the tensor it was given.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    Message,
    compare_tensor,
    exception_hint,
    format_tensor,
    known_mistake,
    require_callable,
    require_world_sizes,
    run_checked,
    say,
)
from fsdp_course.classroom.checks._common import T as shared
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.collectives import P2PWork
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Record
from fsdp_course.runtime.monitor import CollectiveMismatch

__all__ = ["check_all_reduce", "check_ring_all_reduce"]

T = catalogue("collectives", {
    # all-reduce from reduce-scatter + all-gather
    "mismatch": ("the ranks made different calls (or used different shapes): every rank must pad to the same length "
                 "and call the same collectives in the same order",
                 "各 rank 的调用不一致（或形状不同）：每个 rank 都必须填充到相同长度，并以相同顺序调用相同的集合通信"),
    "called_all_reduce": ("rank {rank} called ctx.all_reduce (calls: {ops})",
                          "rank {rank} 调用了 ctx.all_reduce（调用：{ops}）"),
    "only_rs_ag": ("build it from ctx.reduce_scatter and ctx.all_gather only",
                   "只用 ctx.reduce_scatter 和 ctx.all_gather 来实现"),
    "made_calls": ("rank {rank} made the calls [{ops}]", "rank {rank} 的调用是 [{ops}]"),
    "rs_then_ag": ("use ctx.reduce_scatter (sum the chunks), then ctx.all_gather (share them)",
                   "先用 ctx.reduce_scatter（对各分块求和），再用 ctx.all_gather（把分块分享给所有 rank）"),
    # the ring: exceptions
    "deadlock": ("every rank waited for its send to finish before posting its recv, so no send could finish: per "
                 "step, start the send without waiting (work = ctx.group.send([chunk], right, tag)), then "
                 "ctx.group.recv([incoming], left, tag).wait(), then work.wait()",
                 "每个 rank 都在发出 recv 之前等待自己的 send 完成，所以没有 send 能完成：每一步先启动 send 而不等待"
                 "（work = ctx.group.send([chunk], right, tag)），再 ctx.group.recv([incoming], left, tag).wait()，"
                 "最后 work.wait()"),
    "unmatched": ("a rank finished while another still waited in a send or recv with it: every send needs the "
                  "matching recv on its peer (same tag, same number of elements), and every recv its send",
                  "一个 rank 已经结束，而另一个 rank 还在等待与它配对的 send 或 recv：每个 send 都需要对等方上有匹配的 "
                  "recv（相同 tag、相同元素个数），每个 recv 也都需要对应的 send"),
    "timed_out": ("a send or recv waited for a partner that never came: per step, every rank starts its send "
                  "(work = ctx.group.send([chunk], right, tag)), waits for its recv from the left, then waits for "
                  "the send; rank r sends to (r + 1) % N and receives from (r - 1) % N, with matching tags",
                  "一个 send 或 recv 在等待一个永远不会出现的对等方：每一步，每个 rank 先启动 send（work = "
                  "ctx.group.send([chunk], right, tag)），再等待从左邻居接收的 recv 完成，然后等待 send 完成；"
                  "rank r 发给 (r + 1) % N，从 (r - 1) % N 接收，tag 要匹配"),
    "contiguous": ("send and recv need contiguous tensors: use the chunks of a 1-D buffer (flat.chunk(n))",
                   "send 和 recv 需要连续的张量：使用一维缓冲区的分块（flat.chunk(n)）"),
    "cut_short": ("the result is reshaped from {got} elements to a shape of {need}: elements were cut off, not "
                  "padded. Round the length up to a multiple of the world size with zeros (which change no sum), "
                  "never down: every element of the input must reach the collectives",
                  "结果要从 {got} 个元素 reshape 成 {need} 个元素的形状：元素被截掉了，而不是被填充。"
                  "用零把长度向上补到 world size 的整数倍（零不改变任何和），决不要向下截断："
                  "输入的每个元素都必须进入集合通信"),
    # the ring: its messages
    "called_collectives": ("rank {rank} called the collective(s) {ops}", "rank {rank} 调用了集合通信 {ops}"),
    "only_send_recv": ("build it from ctx.group.send and ctx.group.recv only: no ctx.all_reduce, "
                       "ctx.reduce_scatter, ctx.all_gather or ctx.broadcast",
                       "只用 ctx.group.send 和 ctx.group.recv 来实现：不用 ctx.all_reduce、ctx.reduce_scatter、"
                       "ctx.all_gather 或 ctx.broadcast"),
    "send_to": ("send to rank {peer}", "向 rank {peer} 的 send"),
    "recv_from": ("recv from rank {peer}", "来自 rank {peer} 的 recv"),
    "made_p2p": ("rank {rank} made {what}", "rank {rank} 发起了一次{what}"),
    "neighbours": ("in a ring, rank r sends only to its right neighbour (r + 1) % N (here {right}) and "
                   "receives only from its left neighbour (r - 1) % N (here {left})",
                   "在环中，rank r 只发给右邻居 (r + 1) % N（这里是 {right}），只从左邻居 (r - 1) % N"
                   "（这里是 {left}）接收"),
    "ring_steps": ("a ring all-reduce is N - 1 steps of reduce-scatter, then N - 1 steps of all-gather, one chunk "
                   "each", "环形全归约是 N - 1 步归约分散，再 N - 1 步全聚合，每步一个分块"),
    "one_chunk_per_step": ("each step sends one chunk (padded numel / N elements), not the whole tensor: N - 1 "
                           "steps to reduce-scatter, then N - 1 steps to all-gather",
                           "每一步只发送一个分块（填充后的 numel / N 个元素），而不是整个张量：N - 1 步归约分散，"
                           "再 N - 1 步全聚合"),
    "too_few": ("too few messages: after the N - 1 reduce-scatter steps each rank holds one finished chunk; N - 1 "
                "more steps pass the finished chunks round the ring (the all-gather half)",
                "消息太少：N - 1 步归约分散之后，每个 rank 持有一个已完成的分块；还要再走 N - 1 步，"
                "把这些已完成的分块沿环传递（全聚合那一半）"),
    "send_count": ("rank {rank} made {sends} sends of {sent} elements in all, {recvs} recvs",
                   "rank {rank} 发起了 {sends} 次 send，共 {sent} 个元素，以及 {recvs} 次 recv"),
    # both: the caller's input, the values chunk by chunk
    "input_modified": ("rank {rank}'s result is right, but your function changed the tensor it was given",
                       "rank {rank} 的结果正确，但你的函数修改了传给它的张量"),
    "work_on_copy": ("an all-reduce returns the sum and leaves the caller's tensor as it was (the caller may still "
                     "need it): work on a copy, e.g. torch.cat of the flattened input and its padding, which is a new "
                     "tensor even when the padding is empty (reshape(-1) and chunk() are views of the input)",
                     "全归约返回总和，并保持调用者的张量不变（调用者可能还要用它）：在副本上计算，例如用 torch.cat "
                     "拼接展平的输入和它的填充，即使填充为空，结果也是新张量（reshape(-1) 和 chunk() 都是输入的视图）"),
    "chunk_moved": ("chunk {k} holds chunk {m}'s values: an index is off, most likely in the all-gather half; the "
                    "chunk a rank receives from its left neighbour belongs at the index the neighbour sent it from",
                    "分块 {k} 里是分块 {m} 的值：某个下标错了，最可能错在全聚合那一半；从左邻居收到的分块，"
                    "应放到邻居发送它时所用的那个下标上"),
    "added_twice": ("a contribution was added twice: in the all-gather half the finished chunks are received into "
                    "place (overwriting), not added; and each rank's own chunk is added once",
                    "有一份贡献被加了两次：在全聚合那一半，已完成的分块应直接接收到原位（覆盖原值），而不是相加；"
                    "并且每个 rank 自己的分块只加一次"),
    "missing": ("contributions are missing from a chunk: a recv overwrites its tensor, so in the reduce-scatter half "
                "receive into a separate buffer and add it (chunk.add_(incoming)); each chunk must travel N - 1 steps "
                "round the ring, collecting one contribution per step",
                "某个分块缺少一些 rank 的贡献：recv 会覆盖接收它的那个张量，所以在归约分散那一半要接收到单独的缓冲区"
                "再相加（chunk.add_(incoming)）；每个分块都要沿环走 N - 1 步，每步收集一份贡献"),
    "or_unfinished": ("{missing}; or the all-gather half sent chunks that were not finished: after the "
                      "reduce-scatter half, rank r holds the whole sum of chunk (r + 1) % N, the chunk it sends first",
                      "{missing}；也可能是全聚合那一半发出了尚未完成的分块：归约分散那一半结束后，"
                      "rank r 持有分块 (r + 1) % N 的完整总和，也就是它最先发送的那一块"),
    "ring_added_into_sent": ("in the reduce-scatter half, the chunk received at step s is added into the chunk "
                             "this rank has just sent, (r - s) % N; it is the left neighbour's chunk "
                             "(r - s - 1) % N, and that is where it belongs",
                             "在归约分散那一半，第 s 步收到的分块被加到了本 rank 刚刚发出的分块 (r - s) % N 上；"
                             "它是左邻居的分块 (r - s - 1) % N，应当加到那里"),
    # what passed
    "exact_sum": ("  input shapes {shapes}: every rank holds the exact sum",
                  "  输入形状 {shapes}：每个 rank 都得到了精确的和"),
    "rs_ag_calls": ("  calls per rank: reduce_scatter and all_gather, no all_reduce",
                    "  每个 rank 的调用：reduce_scatter 和 all_gather，没有 all_reduce"),
    "rs_ag_traffic": ("  traffic of rank 0 at world size {n} for a {shape} float32 tensor, padded to {payload} B "
                      "(ring model):",
                      "  world size 为 {n} 时，rank 0 处理一个形状为 {shape}、填充到 {payload} B 的 float32 张量的"
                      "通信量（环形模型）："),
    "rs_ag_sent": ("    reduce_scatter {scatter:g} B + all_gather {gather:g} B = {both:g} B sent = 2(N-1)/N x "
                   "{payload} B, what one all_reduce sends",
                   "    reduce_scatter {scatter:g} B + all_gather {gather:g} B = 发送 {both:g} B = 2(N-1)/N x "
                   "{payload} B，正是一次 all_reduce 发送的量"),
    "ring_only": ("  rank r sends only to (r + 1) % N and receives only from (r - 1) % N; no collectives",
                  "  rank r 只向 (r + 1) % N 发送，只从 (r - 1) % N 接收；没有集合通信"),
    "ring_traffic": ("  traffic of rank 0 at world size {n} for a {shape} float32 tensor, padded to {padded} B:",
                     "  world size 为 {n} 时，rank 0 处理一个形状为 {shape}、填充到 {padded} B 的 float32 张量的"
                     "通信量："),
    "ring_sent": ("    2(N-1) = {count} messages of one {chunk} B chunk = {sent} B sent = 2(N-1)/N x {padded} B, the "
                  "ring model's all_reduce",
                  "    2(N-1) = {count} 条消息，每条是一个 {chunk} B 的分块 = 发送 {sent} B = 2(N-1)/N x {padded} B，"
                  "即环形模型中一次 all_reduce 的量"),
})


# -- exercise 01: all-reduce from reduce-scatter + all-gather --------------------------------------
ALL_REDUCE_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (5,), (8,), (13,), (3, 5))


def _all_reduce_inputs(world_size: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Per-rank inputs: positive small integers as float32, so sums are exact and ratios are defined."""
    g = torch.Generator().manual_seed(1_000 * world_size + sum(shape) * 7 + len(shape))
    return [torch.randint(1, 10, shape, generator=g).float() for _ in range(world_size)]


def _cut_short(exc: BaseException) -> Message | None:
    """An all-reduce that rounded the length down instead of padding it up fails reshaping the result back to the
    input's shape: fewer elements than the shape needs (torch's message gives both)."""
    sizes = re.search(r"shape '\[([\d, ]*)\]' is invalid for input of size (\d+)", str(exc))
    if sizes is None:
        return None
    need, got = math.prod(int(d) for d in sizes.group(1).split(", ") if d), int(sizes.group(2))
    return T("cut_short", got=got, need=need) if got < need else None


def _all_reduce_hint(exc: BaseException) -> Message:
    if isinstance(exc, CollectiveMismatch):
        return T("mismatch")
    return _cut_short(exc) or exception_hint(exc)


def check_all_reduce(fn: Callable[[RankContext, torch.Tensor], torch.Tensor],
                     world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, tensor) -> tensor`: the element-wise sum over ranks, same shape and dtype.

    Runs `fn` for every world size in `world_sizes` on the shapes in ALL_REDUCE_SHAPES (some do
    not divide by the world size), compares every rank's result with the sum computed directly,
    and checks through the ledger that it used reduce_scatter and all_gather but not all_reduce.
    Results are checked shape by shape (1-D shapes first), so padding mistakes show up before
    reshaping ones. The caller's tensor must be left unchanged.
    """
    check = "check_all_reduce"
    name = require_callable(check, fn, "my_all_reduce")
    sizes = require_world_sizes(world_sizes)

    inputs = {(n, shape): _all_reduce_inputs(n, shape) for n in sizes for shape in ALL_REDUCE_SHAPES}
    outputs: dict[tuple[int, tuple[int, ...]], list[tuple[Any, list[Record], bool]]] = {}
    for n in sizes:
        current: list[tuple[int, ...]] = [ALL_REDUCE_SHAPES[0]] * n  # the case each rank is in

        def body(ctx: RankContext, n: int = n, current: list = current) -> list[tuple[Any, list[Record], bool]]:
            out = []
            for shape in ALL_REDUCE_SHAPES:
                current[ctx.rank] = shape
                ctx.ledger.clear()
                given = inputs[n, shape][ctx.rank].clone()
                result = fn(ctx, given)
                out.append((result, list(ctx.ledger.records), not torch.equal(given, inputs[n, shape][ctx.rank])))
            return out

        def where(rank: int, n: int = n, current: list = current) -> str:
            return f"world size {n}, input shape {current[rank]}"

        per_rank = run_checked(check, name, body, n, where, _all_reduce_hint)
        for i, shape in enumerate(ALL_REDUCE_SHAPES):
            outputs[n, shape] = [per_rank[r][i] for r in range(n)]

    for shape in ALL_REDUCE_SHAPES:
        for n in sizes:
            _check_one_all_reduce(check, n, shape, inputs[n, shape], outputs[n, shape])

    say(shared("passed", check=check, what=shared("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("exact_sum", shapes=", ".join(map(str, ALL_REDUCE_SHAPES))), T("rs_ag_calls"))
    n, shape = max(sizes), (13,)
    if n > 1:
        records = outputs[n, shape][0][1]
        sent = {r.op: r.sent_bytes for r in records}
        payload = next(r.payload_bytes for r in records if r.op == "all_gather")
        both = sent["reduce_scatter"] + sent["all_gather"]
        say(T("rs_ag_traffic", n=n, shape=shape, payload=payload),
            T("rs_ag_sent", scatter=sent["reduce_scatter"], gather=sent["all_gather"], both=both, payload=payload))


def _check_one_all_reduce(check: str, n: int, shape: tuple[int, ...], inputs: list[torch.Tensor],
                          outputs: list[tuple[Any, list[Record], bool]]) -> None:
    expected = torch.stack(inputs).sum(0)
    padded = padded_numel(expected.numel(), n)
    where = f"world size {n}, input shape {shape}"
    for rank, (got, records, modified) in enumerate(outputs):
        _check_values(check, where, n, rank, inputs, expected, got, padded)
        if modified:
            _input_modified(check, where, rank)
        ops = [r.op for r in records]
        if "all_reduce" in ops:
            CheckFailure(check, where, T("called_all_reduce", rank=rank, ops=", ".join(ops)),
                         T("only_rs_ag")).fail()
        if "reduce_scatter" not in ops or "all_gather" not in ops:
            CheckFailure(check, where, T("made_calls", rank=rank, ops=", ".join(ops)), T("rs_then_ag")).fail()


# -- exercise 01b: ring all-reduce from point-to-point messages ------------------------------------
class _WatchedWork(P2PWork):
    """A send or recv the learner started on `ctx.group`, waited for under the referee (which names a deadlock)."""

    def wait(self, timeout: Any = None) -> bool:
        super().wait()
        return True

    def __getattr__(self, name: str) -> Any:  # is_completed, ... of Gloo's work
        return getattr(self._work, name)


class _RecordingGroup:
    """Wraps a process group: send / recv are passed through, logged as (op, peer, numel), and waited for under
    the referee, each named by its place in the ring ("reduce-scatter step 1 of 2")."""

    def __init__(self, group: Any, log: list[tuple[str, int, int]], ctx: RankContext) -> None:
        self._group = group
        self._log = log
        self._ctx = ctx

    def _what(self, op: str, peer: int, tensors: list[torch.Tensor], tag: int) -> str:
        i, n = sum(1 for o, _, _ in self._log if o == op), self._ctx.world_size
        if i < n - 1:
            point = f"reduce-scatter step {i + 1} of {n - 1}"
        elif i < 2 * (n - 1):
            point = f"all-gather step {i - n + 2} of {n - 1}"
        else:
            point = f"{op} #{i + 1}, past the ring's 2(N-1) = {2 * (n - 1)}"
        numel = sum(t.numel() for t in tensors)
        return f"{op} {'to' if op == 'send' else 'from'} rank {peer} ({point}, tag {tag}, {numel} elements)"

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        what = self._what("send", dst, tensors, tag)
        self._log.append(("send", dst, sum(t.numel() for t in tensors)))
        return _WatchedWork(self._ctx, self._group.send(tensors, dst, tag), what)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        what = self._what("recv", src, tensors, tag)
        self._log.append(("recv", src, sum(t.numel() for t in tensors)))
        return _WatchedWork(self._ctx, self._group.recv(tensors, src, tag), what)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)


RING_SHAPES: tuple[tuple[int, ...], ...] = ((13,), (3, 5), (8,), (5,), (1,))  # large first: traffic shows


def _ring_hint(exc: BaseException) -> Message:
    text = str(exc)
    if "deadlock: every rank" in text and "waits in send" in text:
        return T("deadlock")
    if "ended without posting the matching send or recv" in text:
        return T("unmatched")
    if "Timed out waiting" in text or "timed out" in text.lower():
        return T("timed_out")
    if "must be contiguous" in text or "contiguous" in text:
        return T("contiguous")
    return _cut_short(exc) or exception_hint(exc)


def check_ring_all_reduce(fn: Callable[[RankContext, torch.Tensor], torch.Tensor],
                          world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, tensor) -> tensor`: the element-wise sum over ranks, built from send / recv around a ring.

    Besides the values (as in `check_all_reduce`), checks that no collective was called, that rank r
    only sends to (r + 1) % N and only receives from (r - 1) % N, and that it sends 2 (N - 1)
    messages of one chunk (padded numel / N) each: the ring's traffic, what the ring model charges an
    all-reduce. The caller's tensor must be left unchanged.
    """
    check = "check_ring_all_reduce"
    name = require_callable(check, fn, "ring_all_reduce")
    sizes = require_world_sizes(world_sizes)
    inputs = {(n, shape): _all_reduce_inputs(n, shape) for n in sizes for shape in RING_SHAPES}
    for n in sizes:
        current: list[tuple[int, ...]] = [RING_SHAPES[0]] * n

        def body(ctx: RankContext, n: int = n, current: list = current) -> list[tuple[Any, list, list[str], bool]]:
            out = []
            group = ctx.group
            try:
                for shape in RING_SHAPES:
                    current[ctx.rank] = shape
                    ctx.ledger.clear()
                    log: list[tuple[str, int, int]] = []
                    ctx.group = _RecordingGroup(group, log, ctx)
                    given = inputs[n, shape][ctx.rank].clone()
                    result = fn(ctx, given)
                    out.append((result, log, [r.op for r in ctx.ledger.records],
                                not torch.equal(given, inputs[n, shape][ctx.rank])))
            finally:
                ctx.group = group
            return out

        def where(rank: int, n: int = n, current: list = current) -> str:
            return f"world size {n}, input shape {current[rank]}"

        per_rank = run_checked(check, name, body, n, where, _ring_hint)
        for i, shape in enumerate(RING_SHAPES):
            _check_one_ring(check, n, shape, inputs[n, shape], [per_rank[r][i] for r in range(n)])

    say(shared("passed", check=check, what=shared("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("exact_sum", shapes=", ".join(map(str, RING_SHAPES))), T("ring_only"))
    n = max(sizes)
    if n > 1:
        padded = padded_numel(13, n)
        chunk_bytes = padded // n * 4
        say(T("ring_traffic", n=n, shape=(13,), padded=padded * 4),
            T("ring_sent", count=2 * (n - 1), chunk=chunk_bytes, sent=2 * (n - 1) * chunk_bytes, padded=padded * 4))


RingIndex = Callable[[int, int, int], int]  # (rank, step, N) -> a chunk index
RING = {"rs_send": lambda r, s, n: (r - s) % n, "rs_add": lambda r, s, n: (r - s - 1) % n,
        "ag_send": lambda r, s, n: (r + 1 - s) % n, "ag_recv": lambda r, s, n: (r - s) % n}
RING_MISTAKES: list[tuple[dict[str, Any], Callable[[], Message]]] = [  # RING's indices changed, and the hint
    # (a mistake is listed only where its numbers are its own: see ring_schedule's `overwrite`)
    ({"rs_add": lambda r, s, n: (r - s) % n}, lambda: T("ring_added_into_sent")),
]


def ring_schedule(inputs: list[torch.Tensor], n: int, overwrite: bool = False,
                  **changed: RingIndex) -> list[torch.Tensor]:
    """Every rank's result of a ring all-reduce that follows RING's chunk indices (or `changed` ones), computed
    without communication: what a learner's ring with that schedule returns. `overwrite`: the reduce-scatter half
    receives into the chunk instead of adding to it (the same numbers as an all-gather half that starts one chunk
    early, which is why that mistake's hint names both)."""
    index = {**RING, **changed}
    shape, numel = inputs[0].shape, inputs[0].numel()
    c = padded_numel(numel, n) // n
    bufs = [list(torch.cat([x.reshape(-1), x.new_zeros(c * n - numel)]).chunk(n)) for x in inputs]
    for s in range(n - 1):
        sent = [bufs[r][index["rs_send"](r, s, n)].clone() for r in range(n)]
        for r in range(n):
            k = index["rs_add"](r, s, n)
            bufs[r][k] = sent[(r - 1) % n] if overwrite else bufs[r][k] + sent[(r - 1) % n]
    for s in range(n - 1):
        sent = [bufs[r][index["ag_send"](r, s, n)].clone() for r in range(n)]
        for r in range(n):
            bufs[r][index["ag_recv"](r, s, n)] = sent[(r - 1) % n]
    return [torch.cat(b)[:numel].reshape(shape) for b in bufs]


def _ring_mistake(inputs: list[torch.Tensor], n: int, rank: int, got: Any) -> Message | None:
    """The hint of the known wrong schedule whose result is `got` on this rank, if exactly one is (two mistakes can
    give the same numbers: then the chunk-by-chunk diagnosis speaks)."""
    if not isinstance(got, torch.Tensor) or got.shape != inputs[0].shape:
        return None
    return known_mistake(got.detach().to(inputs[0].dtype),
                         [(ring_schedule(inputs, n, **changed)[rank], hint) for changed, hint in RING_MISTAKES],
                         torch.equal)


def _check_one_ring(check: str, n: int, shape: tuple[int, ...], inputs: list[torch.Tensor],
                    outputs: list[tuple[Any, list[tuple[str, int, int]], list[str], bool]]) -> None:
    expected = torch.stack(inputs).sum(0)
    padded = padded_numel(expected.numel(), n)
    chunk = padded // n
    where = f"world size {n}, input shape {shape}"
    for rank, (got, log, ops, modified) in enumerate(outputs):
        if ops:
            CheckFailure(check, where, T("called_collectives", rank=rank, ops=", ".join(ops)),
                         T("only_send_recv")).fail()
        right, left = (rank + 1) % n, (rank - 1) % n
        sends = [(peer, k) for op, peer, k in log if op == "send"]
        recvs = [(peer, k) for op, peer, k in log if op == "recv"]
        wrong = [T("send_to", peer=peer) if op == "send" else T("recv_from", peer=peer) for op, peer, _ in log
                 if (op == "send" and peer != right) or (op == "recv" and peer != left)]
        if wrong:
            CheckFailure(check, where, T("made_p2p", rank=rank, what=wrong[0]),
                         T("neighbours", right=right, left=left)).fail()
        sent = sum(k for _, k in sends)
        if len(sends) != 2 * (n - 1) or sent != 2 * (n - 1) * chunk:
            expect = f"2(N-1) = {2 * (n - 1)} sends of one chunk of {chunk} elements ({2 * (n - 1) * chunk} in all)"
            hint = T("ring_steps")
            if any(k != chunk for _, k in sends):
                hint = T("one_chunk_per_step")
            elif len(sends) < 2 * (n - 1):
                hint = T("too_few")
            CheckFailure(check, where, T("send_count", rank=rank, sends=len(sends), sent=sent, recvs=len(recvs)),
                         hint, [f"expected {expect}"]).fail()
        _check_values(check, where, n, rank, inputs, expected, got, padded,
                      lambda rank=rank, got=got: _ring_mistake(inputs, n, rank, got))
        if modified:
            _input_modified(check, where, rank)


# -- shared by both: the values, chunk by chunk, and the caller's input ------------------------------
def _input_modified(check: str, where: str, rank: int) -> None:
    CheckFailure(check, where, T("input_modified", rank=rank), T("work_on_copy")).fail()


def _check_values(check: str, where: str, n: int, rank: int, inputs: list[torch.Tensor], expected: torch.Tensor,
                  got: Any, padded: int, known: Callable[[], Message | None] | None = None) -> None:
    """Fail unless `got` is the sum; `known()`: the hint of a known mistake that `got` is, which names it best."""
    found = compare_tensor(expected, got, world_size=n, rank=rank, padded_numel=padded)
    if found is None:
        return
    problem, hint, details = found
    details = [f"rank {r} input {format_tensor(x)}" for r, x in enumerate(inputs)] + details
    if hint == shared("first_difference"):  # values differ and no simple scale explains them
        diagnosis = chunk_diagnosis(inputs, got, n)
        if diagnosis is not None:
            lines, hint = diagnosis
            details += [f"on rank {rank}: {line}" for line in lines]
    hint = (known() if known is not None else None) or hint
    CheckFailure(check, where, problem, hint, details).fail()


def chunk_diagnosis(inputs: list[torch.Tensor], got: torch.Tensor, n: int) -> tuple[list[str], Message] | None:
    """What each wrong chunk of an all-reduce's result holds, in terms of the ranks' inputs, and a hint.

    The result is cut into the N chunks of the padded flat tensor. A wrong chunk k is solved for as a combination
    sum_j a_j x_j of the ranks' inputs restricted to chunk m (m = k first, then the others): the inputs are small
    integers, so a combination with integer coefficients that matches exactly says which rank's contribution is
    missing (a_j = 0), there twice (a_j = 2), or that the chunk holds another chunk's values. Chunks with fewer
    elements than ranks cannot be solved for and are skipped. None when no wrong chunk is explained.
    """
    numel = got.numel()
    c = padded_numel(numel, n) // n
    x = torch.zeros(n, c * n, dtype=torch.float64)
    x[:, :numel] = torch.stack([t.reshape(-1).double() for t in inputs])
    g = got.detach().reshape(-1).double()
    total = x.sum(0)
    found: list[tuple[int, int, list[int]]] = []  # (chunk, source chunk, coefficient per rank)
    for k in range(n):
        lo, hi = k * c, min((k + 1) * c, numel)
        if lo >= hi or torch.equal(g[lo:hi], total[lo:hi]):
            continue
        for m in [k] + [m for m in range(n) if m != k]:
            a = x[:, m * c: m * c + hi - lo].T  # (elements, ranks)
            if int(torch.linalg.matrix_rank(a)) < n:
                continue
            coeffs = torch.linalg.lstsq(a, g[lo:hi].unsqueeze(1)).solution.squeeze(1)
            rounded = coeffs.round()
            if (coeffs - rounded).abs().max() < 1e-6 and torch.equal(a @ rounded, g[lo:hi]):
                found.append((k, m, [int(v) for v in rounded]))
                break
    if not found:
        return None
    lines = []
    for k, m, coeffs in found:
        span = f"chunk {k} (flat elements {k * c}..{min((k + 1) * c, numel) - 1})"
        if m != k:
            held = "the sum" if all(v == 1 for v in coeffs) else _contributions(coeffs)
            lines.append(f"{span} holds chunk {m}'s values ({held} of chunk {m})")
        else:
            lines.append(f"{span} {_contributions(coeffs, own=True)}")
    if any(m != k for k, m, _ in found):
        k, m, _ = next(f for f in found if f[1] != f[0])
        hint = T("chunk_moved", k=k, m=m)
    elif any(v > 1 for _, _, coeffs in found for v in coeffs):
        hint = T("added_twice")
    else:
        hint = T("missing")
        if all(sorted(coeffs) == [0] * (n - 1) + [1] for _, _, coeffs in found):  # each holds one rank's values
            hint = T("or_unfinished", missing=hint)
    return lines, hint


def _contributions(coeffs: list[int], own: bool = False) -> str:
    """What a combination of the ranks' inputs holds: "is missing rank 1's contribution (it holds only rank 0's)",
    "has rank 2's contribution twice" (own chunk), or "rank 1's values" (another chunk)."""
    def ranks(js: list[int]) -> str:
        return f"rank{'s' if len(js) > 1 else ''} {', '.join(map(str, js))}'s"

    if not own:
        parts = [f"{v} x rank {j}'s" if v != 1 else f"rank {j}'s" for j, v in enumerate(coeffs) if v]
        return " + ".join(parts) + " values" if parts else "zeros"
    missing = [j for j, v in enumerate(coeffs) if v == 0]
    kept = [j for j, v in enumerate(coeffs) if v == 1]
    said = [f"has rank {j}'s contribution {'twice' if v == 2 else f'{v} times'}"
            for j, v in enumerate(coeffs) if v not in (0, 1)]
    if missing:
        said.insert(0, f"is missing {ranks(missing)} contribution" + (f" (it holds only {ranks(kept)})"
                                                                       if kept and len(said) == 0 else ""))
    return ", and ".join(said)
