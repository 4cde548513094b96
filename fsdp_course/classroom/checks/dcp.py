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
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.fsdp.flat_param import FlatParamLayout, flatten_params
from fsdp_course.i18n.messages import Message, catalogue

__all__ = ["UNITS", "check_dim0_chunks", "reference_chunks"]

# Units of parameters (name, shape): first dimensions of 17, 7, 3, 5, 2 rows, divisible by none of 2 to 5 (2 by 2)
UNITS: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "embedding and head": [("embedding.weight", (17, 4)), ("fc.weight", (3, 4)), ("fc.bias", (3,))],
    "an MLP layer": [("linear.weight", (7, 5)), ("linear.bias", (7,)), ("norm.weight", (5,)), ("gate", (2, 3))],
}

T = catalogue("dcp", {
    "fewer_chunks": ("torch.chunk(p, N, dim=0) returns fewer than N chunks when the first dimension is short: '{name}' "
                     "has d0 = {d0} rows; over {n} ranks c = ceil({d0} / {n}) = {c} rows each, so torch.chunk gives "
                     "{chunks} and rank {rank} none: give such a rank an empty (0, *shape[1:]) tensor, e.g. p[:0], or "
                     "compute the row range yourself",
                     "第一维较短时 torch.chunk(p, N, dim=0) 返回的分块少于 N 个：'{name}' 有 d0 = {d0} 行；"
                     "分给 {n} 个 rank 时每个 rank 得到 c = ceil({d0} / {n}) = {c} 行，"
                     "所以 torch.chunk 只给出 {chunks}，rank {rank} 一个也没有：给这样的 rank 一个空的 (0, *shape[1:]) "
                     "张量，例如 p[:0]，或者自己计算行范围"),
    "chunk": ("{k} chunk", "{k} 个分块"),
    "chunks": ("{k} chunks", "{k} 个分块"),
    "unflatten": ("cut each parameter out of flat with layout.unflatten(flat), then take this rank's rows of it",
                  "用 layout.unflatten(flat) 从 flat 中切出每个参数，再取其中这个 rank 的那几行"),
    "ignored_offset": ("these are flat elements {first}-{last}: you ignored info.offset: '{name}' starts at flat "
                       "element {offset}, and this rank's rows of it are flat elements {start}-{end} "
                       "(layout.unflatten(flat) cuts each parameter at its offset).{flat_shard}",
                       "这些是展平元素 {first}-{last}：你忽略了 info.offset：'{name}' 从展平元素 {offset} 开始，"
                       "这个 rank 的那几行是展平元素 {start}-{end}（layout.unflatten(flat) 会在每个参数的偏移处把它"
                       "切出来）。{flat_shard}"),
    "flat_shard": (" If you cut flat into N equal pieces first and read from this rank's piece: that is FSDP's flat "
                   "shard (lesson 05), and Shard(0) cuts each parameter on its own rows instead.",
                   "如果你先把 flat 切成 N 等份、再从本 rank 的那一份里读取：那是 FSDP 的展平分片（第 05 课），"
                   "而 Shard(0) 是把每个参数按它自己的行来切。"),
    "other_run": ("these are flat elements {first}-{last}, this rank's rows of '{name}' are flat elements "
                  "{start}-{end}",
                  "这些是展平元素 {first}-{last}，而这个 rank 的 '{name}' 的行是展平元素 {start}-{end}"),
    "not_list": ("returned {kind}, not a list of tensors", "返回了 {kind}，不是张量的列表"),
    "return_list": ("return a list with one tensor per parameter, in layout.infos order",
                    "返回一个列表，每个参数一个张量，按 layout.infos 的顺序"),
    "count": ("returned {got} tensors for {expected} parameters", "对 {expected} 个参数返回了 {got} 个张量"),
    "one_per_parameter": ("one tensor per parameter of layout.infos (the padding at the end of flat is no parameter)",
                          "layout.infos 的每个参数一个张量（flat 末尾的填充不是参数）"),
    "keep_rows": ("keep the rows' shape: ({rows}, *shape[1:]), not a flat run of elements",
                  "保持行的形状：({rows}, *shape[1:])，而不是一串展平的元素"),
    "ceil_rows": ("rows per rank are ceil(d0 / N) = ceil({d0} / {n}) = {rows}, as torch.chunk takes them (the last "
                  "ranks get fewer), not d0 // N",
                  "每个 rank 的行数是 ceil(d0 / N) = ceil({d0} / {n}) = {rows}，与 torch.chunk 的切法相同"
                  "（最后的 rank 分得更少），而不是 d0 // N"),
    "row_range": ("rank r holds rows [r * c, min((r + 1) * c, d0)) with c = ceil(d0 / N) = {rows}: the first ranks "
                  "get c rows each and the last ones the rest, or none",
                  "rank r 持有 [r * c, min((r + 1) * c, d0)) 行，其中 c = ceil(d0 / N) = {rows}：前面的 rank 每个"
                  "得到 c 行，最后的 rank 得到剩下的行，或者一行也没有"),
    "dim0": ("cut each parameter on dim 0 (rows), as fully_shard's Shard(0) does, not its flat elements",
             "按 dim 0（行）切分每个参数，与 fully_shard 的 Shard(0) 一样，而不是按展平元素切"),
    "chunk_shape": ("'{name}' {shape}: chunk of shape {got}, expected {expected}",
                    "'{name}' {shape}：分块的形状是 {got}，应为 {expected}"),
    "other_values": ("'{name}' {shape}: the chunk holds other values", "'{name}' {shape}：分块里是别的值"),
    "own_elements": ("take the parameter's own elements (layout.unflatten(flat), or flat[offset:offset + "
                     "numel].view(shape)), then rows [r * c, min((r + 1) * c, d0)) of it",
                     "取该参数自己的元素（layout.unflatten(flat)，或 flat[offset:offset + numel].view(shape)），"
                     "再取其中的 [r * c, min((r + 1) * c, d0)) 行"),
    "view": ("'{name}': the chunk is a view of the gathered flat parameter", "'{name}'：分块是全聚合后展平参数的视图"),
    "copy": ("return a copy (.clone()): a view keeps the whole gathered unit alive after the gather is freed, which "
             "is what cutting one unit at a time avoids",
             "返回副本（.clone()）：视图会让整个全聚合的单元在全聚合的结果被释放之后仍然存活，而逐个单元切分正是为了"
             "避免这一点"),
    # what passed
    "passed": ("  {units} units, every rank: each parameter's rows as torch.chunk cuts them on dim 0 (empty chunks "
               "included), copied out of the gathered flat parameter",
               "  {units} 个单元，每个 rank：每个参数的行都按 torch.chunk 在第 0 维上的切法切出（包括空分块），"
               "并从全聚合后的展平参数中拷贝出来"),
})


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
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("passed", units=len(UNITS)))


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
            elif tuple(g.shape[1:]) == tuple(e.shape[1:]) and g.shape[0] == info.shape[0] // n:
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
