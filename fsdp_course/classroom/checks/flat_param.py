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
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
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

T = catalogue("flat_param", {
    "changed_input": ("{name} changed its input tensors", "{name} 修改了传给它的输入张量"),
    "new_tensor": ("build a new tensor (torch.cat) and leave the parameters as they are",
                   "新建一个张量（torch.cat），保持参数不变"),
    "not_tensor": ("{name} returned {kind}, not a tensor", "{name} 返回了 {kind}，不是张量"),
    "return_flat": ("return the flat, padded 1-D tensor", "返回填充后的一维展平张量"),
    "not_1d": ("the flat tensor has shape {shape}, not 1-D", "展平参数的形状是 {shape}，不是一维的"),
    "flatten_cat": ("flatten every tensor with t.reshape(-1) and concatenate them with torch.cat",
                    "用 t.reshape(-1) 展平每个张量，再用 torch.cat 把它们拼接起来"),
    "pad_to": ("{numel} elements over {n} ranks: pad with zeros to the next multiple of {n}, ceil({numel} / {n}) * {n} "
               "= {padded}",
               "{numel} 个元素分给 {n} 个 rank：用零填充到 {n} 的下一个倍数，即 ceil({numel} / {n}) * {n} = {padded}"),
    "one_rank": ("one rank holds everything, so there is nothing to pad: the flat tensor is the {numel} elements laid "
                 "end to end (pad by (-numel) % world_size zeros, which is 0 here)",
                 "只有一个 rank 时它持有全部元素，所以无需填充：展平参数就是首尾相接的 {numel} 个元素（填充 (-numel) % "
                 "world_size 个零，这里是 0）"),
    "no_padding": ("no padding: {hint}", "没有填充：{hint}"),
    "numel": ("the flat tensor has {got} elements, expected {expected}", "展平参数有 {got} 个元素，应为 {expected}"),
    "dtype": ("dtype {got}, expected {expected}", "dtype 是 {got}，应为 {expected}"),
    "keep_dtype": ("keep the parameters' dtype: pad with flat.new_zeros(k)",
                   "保持参数的 dtype：用 flat.new_zeros(k) 来填充"),
    "padding_zeros": ("the padding must be zeros, at the end (its gradient is then 0 and it changes no sum)",
                      "填充必须是零，且放在末尾（这样它的梯度为 0，不改变任何求和）"),
    "wrong_order": ("right values, wrong order: lay the tensors end to end in the order given, each row by row",
                    "数值对，顺序错：按给定顺序把张量首尾相接，每个张量按行展开"),
    "holds_values": ("the flat tensor holds each tensor's values, in order (t.reshape(-1)), then zeros",
                     "展平参数依次包含每个张量的值（t.reshape(-1)），然后是零"),
    "values_differ": ("the flat tensor's values differ", "展平参数的值不对"),
    "range_returned": ("shard_range(..., rank={r}) returned {got}", "shard_range(..., rank={r}) 返回了 {got}"),
    "return_pair": ("return a pair of ints (start, end)", "返回一对 int：(start, end)"),
    "article_bug": ("rank {last}'s shard has {short} elements, the others {size}: this is the article's bug. Every "
                    "shard must have ceil(numel / N) = {shard} elements: the padding fills the last",
                    "rank {last} 的分片有 {short} 个元素，其余分片有 {size} 个：这正是文章的 bug。"
                    "每个分片都必须有 ceil(numel / N) = {shard} 个元素：最后一个分片由填充补齐"),
    "not_whole": ("{numel} / {n} is not whole: shards have ceil(numel / N) = {shard} elements, not floor(numel / N), "
                  "or the last elements belong to no rank",
                  "{numel} / {n} 不是整数：分片应有 ceil(numel / N) = {shard} 个元素，而不是 floor(numel / N)，"
                  "否则最后几个元素不属于任何 rank"),
    "rank_r": ("rank r's shard is [r * s, (r + 1) * s) with s = ceil(numel / N) = {shard}: equal shards, in rank "
               "order, covering the padded buffer",
               "rank r 的分片是 [r * s, (r + 1) * s)，其中 s = ceil(numel / N) = {shard}：大小相等，按 rank 顺序，"
               "覆盖填充后的缓冲区"),
    "range": ("rank {r}'s range is {got}, expected {expected}", "rank {r} 的区间是 {got}，应为 {expected}"),
    "returned_length": ("{name} returned {kind} of length {length}", "{name} 返回了长度为 {length} 的 {kind}"),
    "returned_kind": ("{name} returned {kind} ", "{name} 返回了 {kind}"),  # the space: as the English always was
    "one_per_shape": ("return a list with one tensor per shape ({count})",
                      "返回一个列表，每个形状一个张量（共 {count} 个）"),
    "tensor_shape": ("tensor {i} is {got}, expected shape {shape}", "张量 {i} 是 {got}，应为形状 {shape}"),
    "cut_view": ("cut numel elements for each shape, then .view(shape)",
                 "为每个形状切出 numel 个元素，再 .view(shape)"),
    "other_values": ("tensor {i} holds other values", "张量 {i} 的值不对"),
    "running_offset": ("tensor i starts where tensor i - 1 ended: keep a running offset",
                       "张量 i 从张量 i - 1 结束的位置开始：维护一个累加的偏移量"),
    "copy": ("tensor {i} is a copy, not a view of the flat buffer", "张量 {i} 是副本，不是展平缓冲区的视图"),
    "shares_memory": ("flat[a:b].view(shape) shares flat's memory; torch.tensor(...), .clone() or torch.cat copy, and "
                      "then gathering into the flat buffer no longer updates the parameters",
                      "flat[a:b].view(shape) 与 flat 共享内存；torch.tensor(...)、.clone() 或 torch.cat 都会拷贝，"
                      "之后全聚合到展平缓冲区就不再更新参数了"),
    "views_unchanged": ("after flat.add_(100) the views did not change", "执行 flat.add_(100) 之后，视图没有跟着变化"),
    "return_views": ("return views of flat (flat[a:b].view(shape)), not copies",
                     "返回 flat 的视图（flat[a:b].view(shape)），而不是副本"),
    "rebuilt_differs": ("parameter {i} rebuilt from the gathered shards differs",
                        "由全聚合的分片重建出的参数 {i} 不对"),
    "each_step": ("flatten, take the shard, all_gather, unflatten: each step must agree",
                  "展平、取分片、all_gather、还原成视图：每一步都必须彼此一致"),
    # what passed
    "passed_layout": ("  {cases} lists of shapes: flattened in order, padded with zeros to a multiple of N; equal "
                      "shards in rank order; views that share the flat buffer's memory",
                      "  {cases} 组形状：按顺序展平，用零填充到 N 的整数倍；按 rank 顺序切成大小相等的分片；"
                      "视图与展平缓冲区共享内存"),
    "passed_gather": ("  on simulated ranks (world sizes {sizes}): all-gathering every rank's shard rebuilds every "
                      "parameter",
                      "  在模拟的 rank 上（world size 为 {sizes}）：全聚合每个 rank 的分片，就能重建每个参数"),
    "passed_example": ("  e.g. shapes {shapes} over {n} ranks: {numel} elements padded to {padded}, shards {shards}",
                       "  例如形状 {shapes} 分到 {n} 个 rank 上：{numel} 个元素填充到 {padded}，分片为 {shards}"),
})


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
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, WORLD_SIZES)))),
        T("passed_layout", cases=len(SHAPE_CASES)),
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
    for r, (g, e) in enumerate(zip(got, expected, strict=True)):
        if not (isinstance(g, tuple | list) and len(g) == 2 and all(isinstance(v, int) for v in g)):
            CheckFailure(check, where, T("range_returned", r=r, got=repr(g)), T("return_pair")).fail()
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
