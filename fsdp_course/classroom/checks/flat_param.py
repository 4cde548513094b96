"""Checker of exercise 05: the flat parameter, flattened with padding, cut into equal shards, unflattened as views.

PyTorch FSDP (arXiv:2304.11277, section 3.2.1) lays a unit's parameters end to end in one 1-D
FlatParameter, pads it to a multiple of the world size N and gives rank r the r-th of N equal
chunks. The article the course follows computed `shardSize = ceil(total / worldSize)` but let the
last rank keep a shorter slice, which Gloo's all-gather and reduce-scatter refuse; the padding
fixes it. The model then computes with *views* of the gathered buffer, so that gathering once
refreshes every parameter and autograd sums all their gradients into one flat gradient.

The learner's three functions are compared with `fsdp_course.fsdp.flat_param.FlatParamLayout`, then
used together on simulated ranks: every rank's shard, all-gathered, must rebuild the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    exception_hint,
    format_tensor,
    require_callable,
    run_checked,
)
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.runtime.context import RankContext

__all__ = ["check_flat_param"]

SHAPE_CASES: tuple[tuple[tuple[int, ...], ...], ...] = (
    ((3, 4), (4,)),  # a Linear(3, 4) transposed: 16 elements
    ((5, 3), (5,), (2, 5), (2,)),  # two Linear layers: 32 elements
    ((7,),),
    ((2, 3, 2), (1,), (5,)),  # 18 elements
)
WORLD_SIZES = (1, 2, 3, 4, 5)
GATHER_WORLD_SIZES = (2, 3, 4)


def _tensors(shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Tensors holding 1, 2, 3, ... in order, so a value tells where it came from (0 is padding)."""
    out, start = [], 1
    for shape in shapes:
        n = math.prod(shape)
        out.append(torch.arange(start, start + n, dtype=torch.float32).reshape(shape))
        start += n
    return out


def _layout(shapes: Sequence[tuple[int, ...]], n: int) -> FlatParamLayout:
    return FlatParamLayout.build([(f"p{i}", t) for i, t in enumerate(_tensors(shapes))], n)


def check_flat_param(flatten_with_padding: Callable[[list[torch.Tensor], int], torch.Tensor],
                     shard_range: Callable[[int, int, int], tuple[int, int]],
                     unflatten_views: Callable[[torch.Tensor, list[tuple[int, ...]]], list[torch.Tensor]]) -> None:
    """Check the three functions of a flat parameter, for world sizes 1 to 5 and the shapes in SHAPE_CASES.

    - `flatten_with_padding(tensors, world_size)`: one 1-D tensor, the tensors end to end (row by
      row), then zeros up to a multiple of world_size;
    - `shard_range(numel, world_size, rank)`: [start, end) of rank's shard in that padded buffer,
      for `numel` elements before padding: equal shards, in rank order;
    - `unflatten_views(flat, shapes)`: tensors of the given shapes that are views of `flat`.
    """
    check = "check_flat_param"
    names = [require_callable(check, fn, example) for fn, example in (
        (flatten_with_padding, "flatten_with_padding"), (shard_range, "shard_range"),
        (unflatten_views, "unflatten_views"))]
    for shapes in SHAPE_CASES:
        for n in WORLD_SIZES:
            _check_flatten(check, names[0], flatten_with_padding, shapes, n)
            _check_ranges(check, names[1], shard_range, shapes, n)
        _check_views(check, names[2], unflatten_views, shapes)
    for n in GATHER_WORLD_SIZES:
        _check_round_trip(check, flatten_with_padding, shard_range, unflatten_views, n)
    print(f"All tests in {check} passed (world sizes {', '.join(map(str, WORLD_SIZES))})")
    print(f"  {len(SHAPE_CASES)} lists of shapes: flattened in order, padded with zeros to a multiple of N; "
          "equal shards in rank order; views that share the flat buffer's memory")
    print(f"  on simulated ranks (world sizes {', '.join(map(str, GATHER_WORLD_SIZES))}): all-gathering every "
          "rank's shard rebuilds every parameter")
    layout = _layout(SHAPE_CASES[1], 3)
    print(f"  e.g. shapes {', '.join(map(str, SHAPE_CASES[1]))} over 3 ranks: {layout.numel} elements padded to "
          f"{layout.padded_numel}, shards {', '.join(str(layout.shard_range(r)) for r in range(3))}")


def _check_flatten(check: str, name: str, fn: Callable, shapes: Sequence[tuple[int, ...]], n: int) -> None:
    where = f"world size {n}, shapes {', '.join(map(str, shapes))}"
    inputs = _tensors(shapes)
    layout = _layout(shapes, n)
    expected = layout.flatten(_tensors(shapes))
    got = call_learner(check, name, fn, inputs, n, where=where)
    if not all(torch.equal(t, e) for t, e in zip(inputs, _tensors(shapes), strict=True)):
        CheckFailure(check, where, f"{name} changed its input tensors",
                     "build a new tensor (torch.cat) and leave the parameters as they are").fail()
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, f"{name} returned {type(got).__name__}, not a tensor",
                     "return the flat, padded 1-D tensor").fail()
    details = [f"expected {format_tensor(expected, 20)}", f"got      {format_tensor(got, 20)}"]
    if got.dim() != 1:
        CheckFailure(check, where, f"the flat tensor has shape {tuple(got.shape)}, not 1-D", "flatten every tensor "
                     "with t.reshape(-1) and concatenate them with torch.cat", details).fail()
    if got.numel() != layout.padded_numel:
        hint = (f"{layout.numel} elements over {n} ranks: pad with zeros to the next multiple of {n}, "
                f"ceil({layout.numel} / {n}) * {n} = {layout.padded_numel}")
        if n == 1:
            hint = (f"one rank holds everything, so there is nothing to pad: the flat tensor is the {layout.numel} "
                    "elements laid end to end (pad by (-numel) % world_size zeros, which is 0 here)")
        elif got.numel() == layout.numel:
            hint = f"no padding: {hint}"
        CheckFailure(check, where, f"the flat tensor has {got.numel()} elements, expected {layout.padded_numel}",
                     hint, details).fail()
    if got.dtype != expected.dtype:
        CheckFailure(check, where, f"dtype {got.dtype}, expected {expected.dtype}",
                     "keep the parameters' dtype: pad with flat.new_zeros(k)", details).fail()
    if not torch.equal(got, expected):
        if not torch.equal(got[layout.numel:], expected[layout.numel:]):
            hint = "the padding must be zeros, at the end (its gradient is then 0 and it changes no sum)"
        elif torch.equal(got.sort().values, expected.sort().values):
            hint = "right values, wrong order: lay the tensors end to end in the order given, each row by row"
        else:
            hint = "the flat tensor holds each tensor's values, in order (t.reshape(-1)), then zeros"
        CheckFailure(check, where, "the flat tensor's values differ", hint, details).fail()


def _check_ranges(check: str, name: str, fn: Callable, shapes: Sequence[tuple[int, ...]], n: int) -> None:
    layout = _layout(shapes, n)
    got = [call_learner(check, name, fn, layout.numel, n, r, where=f"numel {layout.numel}, world size {n}, rank {r}")
           for r in range(n)]
    where = f"numel {layout.numel}, world size {n}"
    expected = [layout.shard_range(r) for r in range(n)]
    for r, (g, e) in enumerate(zip(got, expected, strict=True)):
        if not (isinstance(g, tuple | list) and len(g) == 2 and all(isinstance(v, int) for v in g)):
            CheckFailure(check, where, f"shard_range(..., rank={r}) returned {g!r}",
                         "return a pair of ints (start, end)").fail()
        if tuple(g) == e:
            continue
        sizes = [b - a for a, b in got]
        details = [f"expected {', '.join(map(str, expected))}", f"got      {', '.join(str(tuple(x)) for x in got)}"]
        if len(set(sizes)) > 1 and tuple(got[-1])[1] == layout.numel:
            hint = (f"rank {n - 1}'s shard has {sizes[-1]} elements, the others {sizes[0]}: this is the article's "
                    f"bug. Every shard must have ceil(numel / N) = {layout.shard_numel} elements: the padding fills "
                    "the last")
        elif sizes[r] == layout.numel // n and layout.numel % n:
            hint = (f"{layout.numel} / {n} is not whole: shards have ceil(numel / N) = {layout.shard_numel} elements, "
                    "not floor(numel / N), or the last elements belong to no rank")
        else:
            hint = (f"rank r's shard is [r * s, (r + 1) * s) with s = ceil(numel / N) = {layout.shard_numel}: equal "
                    "shards, in rank order, covering the padded buffer")
        CheckFailure(check, where, f"rank {r}'s range is {tuple(g)}, expected {e}", hint, details).fail()


def _check_views(check: str, name: str, fn: Callable, shapes: Sequence[tuple[int, ...]]) -> None:
    layout = _layout(shapes, 4)
    flat = layout.flatten(_tensors(shapes))
    where = f"shapes {', '.join(map(str, shapes))}, flat buffer of {flat.numel()} (padded for 4 ranks)"
    got = call_learner(check, name, fn, flat, [tuple(s) for s in shapes], where=where)
    if not isinstance(got, list | tuple) or len(got) != len(shapes):
        CheckFailure(check, where, f"{name} returned {type(got).__name__} "
                     f"{'of length ' + str(len(got)) if isinstance(got, list | tuple) else ''}",
                     f"return a list with one tensor per shape ({len(shapes)})").fail()
    for i, (v, shape, original) in enumerate(zip(got, shapes, _tensors(shapes), strict=True)):
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(shape):
            CheckFailure(check, where, f"tensor {i} is {format_tensor(v) if isinstance(v, torch.Tensor) else v!r}, "
                         f"expected shape {shape}", "cut numel elements for each shape, then .view(shape)").fail()
        if not torch.equal(v, original):
            CheckFailure(check, where, f"tensor {i} holds other values",
                         "tensor i starts where tensor i - 1 ended: keep a running offset",
                         [f"expected {format_tensor(original)}", f"got      {format_tensor(v)}"]).fail()
        if v.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            CheckFailure(check, where, f"tensor {i} is a copy, not a view of the flat buffer",
                         "flat[a:b].view(shape) shares flat's memory; torch.tensor(...), .clone() or torch.cat copy, "
                         "and then gathering into the flat buffer no longer updates the parameters").fail()
    flat.add_(100)
    if not all(torch.equal(v, t + 100) for v, t in zip(got, _tensors(shapes), strict=True)):
        CheckFailure(check, where, "after flat.add_(100) the views did not change",
                     "return views of flat (flat[a:b].view(shape)), not copies").fail()


def _check_round_trip(check: str, flatten: Callable, shard_range: Callable, unflatten: Callable, n: int) -> None:
    shapes = SHAPE_CASES[1]

    def body(ctx: RankContext) -> list[torch.Tensor]:
        flat = flatten(_tensors(shapes), ctx.world_size)
        start, end = shard_range(sum(math.prod(s) for s in shapes), ctx.world_size, ctx.rank)
        full = ctx.all_gather(flat[start:end].clone())  # (padded_numel,)
        return [v.clone() for v in unflatten(full, list(shapes))]

    per_rank = run_checked(check, "your functions", body, n, lambda r: f"world size {n}, rank {r}", exception_hint)
    for rank, tensors in enumerate(per_rank):
        for i, (got, expected) in enumerate(zip(tensors, _tensors(shapes), strict=True)):
            if not torch.equal(got, expected):
                CheckFailure(check, f"world size {n}, rank {rank}", f"parameter {i} rebuilt from the gathered shards "
                             "differs", "flatten, take the shard, all_gather, unflatten: each step must agree",
                             [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"]).fail()
