"""Checker of exercise 19: one unit's gathered flat parameter, cut into each parameter's `Shard(0)` rows for rank r.

Cites torch.distributed.checkpoint and DTensor's Shard(0) (torch.chunk's cut).
Design notes: docs/CLASSROOM.md, "Checkers", `dcp.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    format_tensor,
    require_learner,
    say_passed,
)
from fsdp_course.fsdp.flat_param import FlatParamLayout, flatten_params
from fsdp_course.i18n.messages import Message, catalogue

__all__ = ["UNITS", "check_dim0_chunks"]

# Units of parameters (name, shape): first dimensions of 17, 7, 3, 5, 2 rows, divisible by none of 2 to 5 (2 by 2)
UNITS: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "embedding and head": [("embedding.weight", (17, 4)), ("fc.weight", (3, 4)), ("fc.bias", (3,))],
    "an MLP layer": [("linear.weight", (7, 5)), ("linear.bias", (7,)), ("norm.weight", (5,)), ("gate", (2, 3))],
}

T = catalogue("dcp")  # fsdp_course/i18n/catalogues/dcp.yml


def _unit(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # integers as floats: every value is distinct and exact, so a chunk from the wrong rows shows at once
    return [(name, torch.randperm(10_000, generator=g)[: torch.Size(shape).numel()].float().reshape(shape))
            for name, shape in shapes]


def check_dim0_chunks(fn: Callable[..., Any], world_sizes: Sequence[int] = (1, 2, 3, 4, 5)) -> None:
    """Check `fn(layout, flat, rank, world_size) -> list of tensors`: rank `rank`'s dim-0 chunk of every parameter."""
    from fsdp_course.fsdp.dcp import dim0_chunks  # torch.chunk's rows (tests/test_dcp.py); imports torch's DCP

    check = "check_dim0_chunks"
    name, sizes = require_learner(check, fn, "dim0_chunks", world_sizes)
    for seed, (unit, shapes) in enumerate(UNITS.items()):
        named = _unit(shapes, seed)
        for n in sizes:
            layout, flat = flatten_params(named, n)
            for rank in range(n):
                where = f"world size {n}, rank {rank}, unit '{unit}'"
                given = flat.clone()  # (padded_numel,) the gathered flat parameter, the learner's own copy
                got = call_learner(check, name, fn, layout, given, rank, n, where=where,
                                   hint_for=lambda exc, layout=layout, rank=rank, n=n: _hint_for(exc, layout, rank, n))
                _judge(check, where, layout, given, got, dim0_chunks(layout, flat, rank, n), rank, n)
    say_passed(check, sizes, T("passed", units=len(UNITS)))


def _hint_for(exc: BaseException, layout: FlatParamLayout, rank: int, n: int) -> Message:
    def chunks(d0: int) -> int:  # how many chunks torch.chunk(p, n) gives: ceil(d0 / c) with c = ceil(d0 / n)
        return -(-d0 // -(-d0 // n))

    # the first parameter with no chunk for this rank: where torch.chunk(p, N)[rank] raised
    short = next((i for i in layout.infos if chunks(i.shape[0]) <= rank), None)
    if isinstance(exc, IndexError) and short is not None:
        d0, k = short.shape[0], chunks(short.shape[0])
        return T("fewer_chunks", name=short.name, d0=d0, n=n, c=-(-d0 // n),
                 chunks=T("chunks" if k > 1 else "chunk", k=k), rank=rank)
    return T("unflatten")


def _taken_from(layout: FlatParamLayout, flat: torch.Tensor, info: Any, got: torch.Tensor, expected_rows: range
                ) -> Message | None:
    """Which flat elements the learner's chunk holds, when they are one run of `flat` (every value of the units is
    distinct), and whether that run is the right one shifted back by info.offset; None if they are not one run."""
    where = {v: i for i, v in enumerate(flat[: layout.numel].tolist())}
    positions = [where.get(v) for v in got.reshape(-1).tolist()]
    if not positions or None in positions or positions != list(range(positions[0], positions[0] + len(positions))):
        return None
    first, last = positions[0], positions[-1]
    row = info.numel // info.shape[0]
    start, end = info.offset + expected_rows.start * row, info.offset + expected_rows.stop * row - 1
    if info.offset and first == start - info.offset:
        shard = T("flat_shard") if layout.world_size > 1 else ""
        return T("ignored_offset", first=first, last=last, name=info.name, offset=info.offset, start=start, end=end,
                 flat_shard=shard)
    return T("other_run", first=first, last=last, name=info.name, start=start, end=end)


def _judge(check: str, where: str, layout: FlatParamLayout, flat: torch.Tensor, got: Any,
           expected: list[torch.Tensor], rank: int, n: int) -> None:
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in got):
        CheckFailure(check, where, T("not_list", kind=type(got).__name__), T("return_list")).fail()
    if len(got) != len(expected):
        CheckFailure(check, where, T("count", got=len(got), expected=len(expected)), T("one_per_parameter")).fail()
    for info, g, e in zip(layout.infos, got, expected, strict=True):
        rows = -(-info.shape[0] // n)
        if tuple(g.shape) != tuple(e.shape):
            if g.dim() == 1 and len(info.shape) > 1 and g.numel() == e.numel():
                hint = T("keep_rows", rows=e.shape[0])
            elif tuple(g.shape) == (info.shape[0] // n, *e.shape[1:]):
                hint = T("ceil_rows", d0=info.shape[0], n=n, rows=rows)
            elif tuple(g.shape[1:]) == tuple(e.shape[1:]):
                hint = T("row_range", rows=rows)
            else:
                hint = T("dim0")
            CheckFailure(check, where, T("chunk_shape", name=info.name, shape=tuple(info.shape), got=tuple(g.shape),
                                         expected=tuple(e.shape)), hint).fail()
        if g.dtype != e.dtype or not torch.equal(g, e):
            first_row = min(rank * rows, info.shape[0])
            taken = _taken_from(layout, flat, info, g.detach(), range(first_row, first_row + e.shape[0]))
            CheckFailure(check, where, T("other_values", name=info.name, shape=tuple(info.shape)),
                         taken or T("own_elements"),
                         [f"expected {format_tensor(e, 8)}", f"got      {format_tensor(g, 8)}"]).fail()
        if g.numel() and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            CheckFailure(check, where, T("view", name=info.name), T("copy")).fail()
