"""Checkers of exercise 01: all-reduce built from reduce-scatter + all-gather, and a ring all-reduce.

Cites ZeRO (arXiv:1910.02054, section 7); PyTorch FSDP (arXiv:2304.11277); the ring all-reduce of NCCL and Gloo.
Design notes: docs/CLASSROOM.md, "Checkers", `collectives.py`.
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
    require_learner,
    run_checked,
    say,
    say_passed,
)
from fsdp_course.classroom.checks._common import T as shared
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.collectives import P2PWork
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Record
from fsdp_course.runtime.monitor import CollectiveMismatch

__all__ = ["check_all_reduce", "check_ring_all_reduce"]

T = catalogue("collectives")  # fsdp_course/i18n/catalogues/collectives.yml


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


Ran = tuple[Any, list[Record], list[tuple[str, int, int]], bool]  # result, ledger, sends and recvs, input changed


def _run_shapes(check: str, name: str, fn: Callable[..., Any], n: int, shapes: tuple[tuple[int, ...], ...],
                inputs: dict[tuple[int, tuple[int, ...]], list[torch.Tensor]], hint: Callable[[BaseException], Message],
                watch_p2p: bool = False) -> list[list[Ran]]:
    """`fn(ctx, tensor)` on `n` ranks for each shape in turn: per shape, every rank's `Ran` (`watch_p2p`: its sends
    and recvs logged and waited for under the referee)."""
    current = [shapes[0]] * n  # the case each rank is in

    def body(ctx: RankContext) -> list[Ran]:
        out, group = [], ctx.group
        try:
            for shape in shapes:
                current[ctx.rank] = shape
                ctx.ledger.clear()
                log: list[tuple[str, int, int]] = []
                if watch_p2p:
                    ctx.group = _RecordingGroup(group, log, ctx)
                given = inputs[n, shape][ctx.rank].clone()
                result = fn(ctx, given)
                out.append((result, list(ctx.ledger.records), log, not torch.equal(given, inputs[n, shape][ctx.rank])))
        finally:
            ctx.group = group
        return out

    per_rank = run_checked(check, name, body, n, lambda r: f"world size {n}, input shape {current[r]}", hint)
    return [[per_rank[r][i] for r in range(n)] for i in range(len(shapes))]


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
    name, sizes = require_learner(check, fn, "my_all_reduce", world_sizes)

    inputs = {(n, shape): _all_reduce_inputs(n, shape) for n in sizes for shape in ALL_REDUCE_SHAPES}
    outputs = {(n, shape): results for n in sizes for shape, results in zip(
        ALL_REDUCE_SHAPES, _run_shapes(check, name, fn, n, ALL_REDUCE_SHAPES, inputs, _all_reduce_hint), strict=True)}
    for shape in ALL_REDUCE_SHAPES:
        for n in sizes:
            _check_one_all_reduce(check, n, shape, inputs[n, shape], outputs[n, shape])

    say_passed(check, sizes, T("exact_sum", shapes=", ".join(map(str, ALL_REDUCE_SHAPES))), T("rs_ag_calls"))
    n, shape = max(sizes), (13,)
    if n > 1:
        records = outputs[n, shape][0][1]
        sent = {r.op: r.sent_bytes for r in records}
        payload = next(r.payload_bytes for r in records if r.op == "all_gather")
        both = sent["reduce_scatter"] + sent["all_gather"]
        say(T("rs_ag_traffic", n=n, shape=shape, payload=payload),
            T("rs_ag_sent", scatter=sent["reduce_scatter"], gather=sent["all_gather"], both=both, payload=payload))


def _check_one_all_reduce(check: str, n: int, shape: tuple[int, ...], inputs: list[torch.Tensor],
                          outputs: list[Ran]) -> None:
    expected = torch.stack(inputs).sum(0)
    padded = padded_numel(expected.numel(), n)
    where = f"world size {n}, input shape {shape}"
    for rank, (got, records, _, modified) in enumerate(outputs):
        _check_values(check, where, n, rank, inputs, expected, got, padded)
        if modified:
            CheckFailure(check, where, T("input_modified", rank=rank), T("work_on_copy")).fail()
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
    if "timed out" in text.lower():
        return T("timed_out")
    if "contiguous" in text:
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
    name, sizes = require_learner(check, fn, "ring_all_reduce", world_sizes)
    inputs = {(n, shape): _all_reduce_inputs(n, shape) for n in sizes for shape in RING_SHAPES}
    for n in sizes:
        for shape, ran in zip(RING_SHAPES, _run_shapes(check, name, fn, n, RING_SHAPES, inputs, _ring_hint, True),
                              strict=True):
            _check_one_ring(check, n, shape, inputs[n, shape], ran)

    say_passed(check, sizes, T("exact_sum", shapes=", ".join(map(str, RING_SHAPES))), T("ring_only"))
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
    # (a mistake is listed only where its numbers are its own: an overwriting reduce-scatter and an all-gather one
    # chunk early give the same ones, so that hint, or_unfinished, names both)
    ({"rs_add": lambda r, s, n: (r - s) % n}, lambda: T("ring_added_into_sent")),
]


def ring_schedule(inputs: list[torch.Tensor], n: int, **changed: RingIndex) -> list[torch.Tensor]:
    """Every rank's result of a ring all-reduce that follows RING's chunk indices (or `changed` ones), computed
    without communication: what a learner's ring with that schedule returns."""
    index = {**RING, **changed}
    shape, numel = inputs[0].shape, inputs[0].numel()
    c = padded_numel(numel, n) // n
    bufs = [list(torch.cat([x.reshape(-1), x.new_zeros(c * n - numel)]).chunk(n)) for x in inputs]
    for s in range(n - 1):
        sent = [bufs[r][index["rs_send"](r, s, n)].clone() for r in range(n)]
        for r in range(n):
            k = index["rs_add"](r, s, n)
            bufs[r][k] = bufs[r][k] + sent[(r - 1) % n]
    for s in range(n - 1):
        sent = [bufs[r][index["ag_send"](r, s, n)].clone() for r in range(n)]
        for r in range(n):
            bufs[r][index["ag_recv"](r, s, n)] = sent[(r - 1) % n]
    return [torch.cat(b)[:numel].reshape(shape) for b in bufs]


def _ring_mistake(inputs: list[torch.Tensor], n: int, rank: int, got: Any) -> Message | None:
    """The hint of the known wrong schedule whose result is `got` on this rank, if one is (else the chunk-by-chunk
    diagnosis speaks)."""
    if not isinstance(got, torch.Tensor) or got.shape != inputs[0].shape:
        return None
    return known_mistake(got.detach().to(inputs[0].dtype),
                         [(ring_schedule(inputs, n, **changed)[rank], hint) for changed, hint in RING_MISTAKES],
                         torch.equal)


def _check_one_ring(check: str, n: int, shape: tuple[int, ...], inputs: list[torch.Tensor],
                    outputs: list[Ran]) -> None:
    expected = torch.stack(inputs).sum(0)
    padded = padded_numel(expected.numel(), n)
    chunk = padded // n
    where = f"world size {n}, input shape {shape}"
    for rank, (got, records, log, modified) in enumerate(outputs):
        ops = [r.op for r in records]
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
            hint = (T("one_chunk_per_step") if any(k != chunk for _, k in sends)
                    else T("too_few") if len(sends) < 2 * (n - 1) else T("ring_steps"))
            CheckFailure(check, where, T("send_count", rank=rank, sends=len(sends), sent=sent, recvs=len(recvs)),
                         hint, [f"expected {expect}"]).fail()
        _check_values(check, where, n, rank, inputs, expected, got, padded,
                      lambda rank=rank, got=got: _ring_mistake(inputs, n, rank, got))
        if modified:
            CheckFailure(check, where, T("input_modified", rank=rank), T("work_on_copy")).fail()


# -- shared by both: the values, chunk by chunk, and the caller's input ------------------------------
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
