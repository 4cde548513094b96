"""Checker of exercise 19: one unit's gathered flat parameter, cut into each parameter's `Shard(0)` rows for rank r.

The learner writes `dim0_chunks(layout, flat, rank, world_size)`: `flat` is a unit's gathered flat parameter
`(padded_numel,)` (lesson 05's layout: the parameters end to end, then zeros), and the result is, for every parameter
in `layout.infos` order, the rows rank `rank` holds when the parameter is sharded as `fully_shard` shards it (a
DTensor with placement `Shard(0)`): torch.chunk's `rank`-th chunk on dim 0, rows [r * c, min((r + 1) * c, d0)) with
c = ceil(d0 / N), and an empty `(0, *shape[1:])` tensor for a rank torch.chunk has no chunk for. This is the step
`fsdp_course.fsdp.dcp.save` takes for every unit before torch.distributed.checkpoint writes the chunks.

A pure function: no ranks are started. Checked for every rank at world sizes 1 to 5 on units whose first dimensions
divide by none of them (and one shorter than the world size): the shape of each chunk, its values (torch.chunk of the
parameter, the reference), and that it is a copy, not a view of `flat` (a view would keep the whole gathered unit
alive after the gather is freed, which is what cutting one unit at a time avoids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    format_tensor,
    require_callable,
    require_world_sizes,
)
from fsdp_course.fsdp.flat_param import FlatParamLayout, flatten_params

__all__ = ["UNITS", "check_dim0_chunks", "reference_chunks"]

# Units of parameters (name, shape): first dimensions of 17, 7, 3, 5, 2 rows, divisible by none of 2 to 5 (2 by 2)
UNITS: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "embedding and head": [("embedding.weight", (17, 4)), ("fc.weight", (3, 4)), ("fc.bias", (3,))],
    "an MLP layer": [("linear.weight", (7, 5)), ("linear.bias", (7,)), ("norm.weight", (5,)), ("gate", (2, 3))],
}


def reference_chunks(named: Sequence[tuple[str, torch.Tensor]], rank: int, world_size: int) -> list[torch.Tensor]:
    """torch.chunk's `rank`-th chunk of each tensor on dim 0, empty where torch.chunk gives fewer chunks."""
    out = []
    for _, t in named:
        chunks = torch.chunk(t, world_size, dim=0)
        out.append(chunks[rank].clone() if rank < len(chunks) else t[:0].clone())
    return out


def _unit(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    # integers as floats: every value is distinct and exact, so a chunk from the wrong rows shows at once
    return [(name, torch.randperm(10_000, generator=g)[: torch.Size(shape).numel()].float().reshape(shape))
            for name, shape in shapes]


def check_dim0_chunks(fn: Callable[..., Any], world_sizes: Sequence[int] = (1, 2, 3, 4, 5)) -> None:
    """Check `fn(layout, flat, rank, world_size) -> list of tensors`: rank `rank`'s dim-0 chunk of every parameter."""
    check = "check_dim0_chunks"
    name = require_callable(check, fn, "dim0_chunks")
    sizes = require_world_sizes(world_sizes)
    for seed, (unit, shapes) in enumerate(UNITS.items()):
        named = _unit(shapes, seed)
        for n in sizes:
            layout, flat = flatten_params(named, n)
            for rank in range(n):
                where = f"world size {n}, rank {rank}, unit '{unit}'"
                given = flat.clone()  # (padded_numel,) the gathered flat parameter, the learner's own copy
                got = call_learner(check, name, fn, layout, given, rank, n, where=where,
                                   hint_for=lambda exc, layout=layout, rank=rank, n=n: _hint_for(exc, layout, rank, n))
                _judge(check, where, layout, given, got, reference_chunks(named, rank, n), rank, n)
    print(f"All tests in {check} passed (world sizes {', '.join(map(str, sizes))})")
    print(f"  {len(UNITS)} units, every rank: each parameter's rows as torch.chunk cuts them on dim 0 (empty chunks "
          "included), copied out of the gathered flat parameter")


def _hint_for(exc: BaseException, layout: FlatParamLayout, rank: int, n: int) -> str:
    def chunks(d0: int) -> int:  # how many chunks torch.chunk(p, n) gives: ceil(d0 / c) with c = ceil(d0 / n)
        return -(-d0 // -(-d0 // n))

    # the first parameter with no chunk for this rank: where torch.chunk(p, N)[rank] raised
    short = next((i for i in layout.infos if chunks(i.shape[0]) <= rank), None)
    if isinstance(exc, IndexError) and short is not None:
        d0, k = short.shape[0], chunks(short.shape[0])
        return (f"torch.chunk(p, N, dim=0) returns fewer than N chunks when the first dimension is short: "
                f"'{short.name}' has d0 = {d0} rows; over {n} ranks c = ceil({d0} / {n}) = {-(-d0 // n)} rows each, "
                f"so torch.chunk gives {k} chunk{'s' if k > 1 else ''} and rank {rank} none: give such a rank an "
                "empty (0, *shape[1:]) tensor, e.g. p[:0], or compute the row range yourself")
    return "cut each parameter out of flat with layout.unflatten(flat), then take this rank's rows of it"


def _taken_from(layout: FlatParamLayout, flat: torch.Tensor, info: Any, got: torch.Tensor, expected_rows: range
                ) -> str | None:
    """Which flat elements the learner's chunk holds, when they are one run of `flat` (every value of the units is
    distinct), and whether that run is the right one shifted back by info.offset; None if they are not one run."""
    where = {v: i for i, v in enumerate(flat[: layout.numel].tolist())}
    positions = [where.get(v) for v in got.reshape(-1).tolist()]
    if not positions or None in positions or positions != list(range(positions[0], positions[0] + len(positions))):
        return None
    first, last = positions[0], positions[-1]
    row = info.numel // info.shape[0]
    start, end = info.offset + expected_rows.start * row, info.offset + expected_rows.stop * row - 1
    taken = f"these are flat elements {first}-{last}"
    if info.offset and first == start - info.offset:
        shard = (" If you cut flat into N equal pieces first and read from this rank's piece: that is FSDP's flat shard"
                 " (lesson 05), and Shard(0) cuts each parameter on its own rows instead."
                 if layout.world_size > 1 else "")
        return (f"{taken}: you ignored info.offset: '{info.name}' starts at flat element {info.offset}, and this "
                f"rank's rows of it are flat elements {start}-{end} (layout.unflatten(flat) cuts each parameter at its "
                f"offset).{shard}")
    return f"{taken}, this rank's rows of '{info.name}' are flat elements {start}-{end}"


def _judge(check: str, where: str, layout: FlatParamLayout, flat: torch.Tensor, got: Any,
           expected: list[torch.Tensor], rank: int, n: int) -> None:
    if not isinstance(got, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in got):
        CheckFailure(check, where, f"returned {type(got).__name__}, not a list of tensors",
                     "return a list with one tensor per parameter, in layout.infos order").fail()
    if len(got) != len(expected):
        CheckFailure(check, where, f"returned {len(got)} tensors for {len(expected)} parameters",
                     "one tensor per parameter of layout.infos (the padding at the end of flat is no parameter)"
                     ).fail()
    for info, g, e in zip(layout.infos, got, expected, strict=True):
        rows = -(-info.shape[0] // n)
        if tuple(g.shape) != tuple(e.shape):
            if g.dim() == 1 and len(info.shape) > 1 and g.numel() == e.numel():
                hint = f"keep the rows' shape: ({e.shape[0]}, *shape[1:]), not a flat run of elements"
            elif tuple(g.shape[1:]) == tuple(e.shape[1:]) and g.shape[0] == info.shape[0] // n:
                hint = (f"rows per rank are ceil(d0 / N) = ceil({info.shape[0]} / {n}) = {rows}, as torch.chunk "
                        "takes them (the last ranks get fewer), not d0 // N")
            elif tuple(g.shape[1:]) == tuple(e.shape[1:]):
                hint = (f"rank r holds rows [r * c, min((r + 1) * c, d0)) with c = ceil(d0 / N) = {rows}: the first "
                        "ranks get c rows each and the last ones the rest, or none")
            else:
                hint = "cut each parameter on dim 0 (rows), as fully_shard's Shard(0) does, not its flat elements"
            CheckFailure(check, where, f"'{info.name}' {tuple(info.shape)}: chunk of shape {tuple(g.shape)}, "
                         f"expected {tuple(e.shape)}", hint).fail()
        if g.dtype != e.dtype or not torch.equal(g, e):
            first_row = min(rank * rows, info.shape[0])
            taken = _taken_from(layout, flat, info, g.detach(), range(first_row, first_row + e.shape[0]))
            CheckFailure(check, where, f"'{info.name}' {tuple(info.shape)}: the chunk holds other values",
                         taken or "take the parameter's own elements (layout.unflatten(flat), or flat[offset:offset + "
                         "numel].view(shape)), then rows [r * c, min((r + 1) * c, d0)) of it",
                         [f"expected {format_tensor(e, 8)}", f"got      {format_tensor(g, 8)}"]).fail()
        if g.numel() and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            CheckFailure(check, where, f"'{info.name}': the chunk is a view of the gathered flat parameter",
                         "return a copy (.clone()): a view keeps the whole gathered unit alive after the gather is "
                         "freed, which is what cutting one unit at a time avoids").fail()
