"""Checker of exercise 05: the flat parameter, flattened with padding, cut into equal shards, unflattened as views.

Cites PyTorch FSDP (arXiv:2304.11277, section 3.2.1).
Design notes: docs/CLASSROOM.md, "Checkers", `flat_param.py`.
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
    say_passed,
)
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.i18n.messages import catalogue
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

T = catalogue("flat_param")  # fsdp_course/i18n/catalogues/flat_param.yml


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
    n = 3
    layout = _layout(SHAPE_CASES[1], n)
    say_passed(check, WORLD_SIZES, T("passed_layout", cases=len(SHAPE_CASES)),
               T("passed_gather", sizes=", ".join(map(str, GATHER_WORLD_SIZES))),
               T("passed_example", shapes=", ".join(map(str, SHAPE_CASES[1])), n=n, numel=layout.numel,
                 padded=layout.padded_numel, shards=", ".join(str(layout.shard_range(r)) for r in range(n))))


def _check_flatten(check: str, name: str, fn: Callable, shapes: Sequence[tuple[int, ...]], n: int) -> None:
    where = f"world size {n}, shapes {', '.join(map(str, shapes))}"
    inputs = _tensors(shapes)
    layout = _layout(shapes, n)
    expected = layout.flatten(_tensors(shapes))
    got = call_learner(check, name, fn, inputs, n, where=where)
    if not all(torch.equal(t, e) for t, e in zip(inputs, _tensors(shapes), strict=True)):
        CheckFailure(check, where, T("changed_input", name=name), T("new_tensor")).fail()
    if not isinstance(got, torch.Tensor):
        CheckFailure(check, where, T("not_tensor", name=name, kind=type(got).__name__), T("return_flat")).fail()
    details = [f"expected {format_tensor(expected, 20)}", f"got      {format_tensor(got, 20)}"]
    if got.dim() != 1:
        CheckFailure(check, where, T("not_1d", shape=tuple(got.shape)), T("flatten_cat"), details).fail()
    if got.numel() != layout.padded_numel:
        hint = T("pad_to", numel=layout.numel, n=n, padded=layout.padded_numel)
        if n == 1:
            hint = T("one_rank", numel=layout.numel)
        elif got.numel() == layout.numel:
            hint = T("no_padding", hint=hint)
        CheckFailure(check, where, T("numel", got=got.numel(), expected=layout.padded_numel), hint, details).fail()
    if got.dtype != expected.dtype:
        CheckFailure(check, where, T("dtype", got=got.dtype, expected=expected.dtype), T("keep_dtype"),
                     details).fail()
    if not torch.equal(got, expected):
        if not torch.equal(got[layout.numel:], expected[layout.numel:]):
            hint = T("padding_zeros")
        elif torch.equal(got.sort().values, expected.sort().values):
            hint = T("wrong_order")
        else:
            hint = T("holds_values")
        CheckFailure(check, where, T("values_differ"), hint, details).fail()


def _check_ranges(check: str, name: str, fn: Callable, shapes: Sequence[tuple[int, ...]], n: int) -> None:
    layout = _layout(shapes, n)
    got = [call_learner(check, name, fn, layout.numel, n, r, where=f"numel {layout.numel}, world size {n}, rank {r}")
           for r in range(n)]
    where = f"numel {layout.numel}, world size {n}"
    expected = [layout.shard_range(r) for r in range(n)]
    for r, g in enumerate(got):  # every rank's answer a pair before any is compared (the hints read them all)
        if not (isinstance(g, tuple | list) and len(g) == 2 and all(isinstance(v, int) for v in g)):
            CheckFailure(check, where, T("range_returned", r=r, got=repr(g)), T("return_pair")).fail()
    for r, (g, e) in enumerate(zip(got, expected, strict=True)):
        if tuple(g) == e:
            continue
        sizes = [b - a for a, b in got]
        details = [f"expected {', '.join(map(str, expected))}", f"got      {', '.join(str(tuple(x)) for x in got)}"]
        if len(set(sizes)) > 1 and tuple(got[-1])[1] == layout.numel:
            hint = T("article_bug", last=n - 1, short=sizes[-1], size=sizes[0], shard=layout.shard_numel)
        elif sizes[r] == layout.numel // n and layout.numel % n:
            hint = T("not_whole", numel=layout.numel, n=n, shard=layout.shard_numel)
        else:
            hint = T("rank_r", shard=layout.shard_numel)
        CheckFailure(check, where, T("range", r=r, got=tuple(g), expected=e), hint, details).fail()


def _check_views(check: str, name: str, fn: Callable, shapes: Sequence[tuple[int, ...]]) -> None:
    layout = _layout(shapes, 4)
    flat = layout.flatten(_tensors(shapes))
    where = f"shapes {', '.join(map(str, shapes))}, flat buffer of {flat.numel()} (padded for 4 ranks)"
    got = call_learner(check, name, fn, flat, [tuple(s) for s in shapes], where=where)
    if not isinstance(got, list | tuple) or len(got) != len(shapes):
        kind = type(got).__name__
        problem = (T("returned_length", name=name, kind=kind, length=len(got)) if isinstance(got, list | tuple)
                   else T("returned_kind", name=name, kind=kind))
        CheckFailure(check, where, problem, T("one_per_shape", count=len(shapes))).fail()
    for i, (v, shape, original) in enumerate(zip(got, shapes, _tensors(shapes), strict=True)):
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(shape):
            shown = repr(format_tensor(v) if isinstance(v, torch.Tensor) else v)  # a tensor's text in quotes, as ever
            CheckFailure(check, where, T("tensor_shape", i=i, got=shown, shape=shape), T("cut_view")).fail()
        if not torch.equal(v, original):
            CheckFailure(check, where, T("other_values", i=i), T("running_offset"),
                         [f"expected {format_tensor(original)}", f"got      {format_tensor(v)}"]).fail()
        if v.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            CheckFailure(check, where, T("copy", i=i), T("shares_memory")).fail()
    flat.add_(100)
    if not all(torch.equal(v, t + 100) for v, t in zip(got, _tensors(shapes), strict=True)):
        CheckFailure(check, where, T("views_unchanged"), T("return_views")).fail()


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
                CheckFailure(check, f"world size {n}, rank {rank}", T("rebuilt_differs", i=i), T("each_step"),
                             [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"]).fail()
