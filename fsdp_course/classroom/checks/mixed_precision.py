"""Checkers of exercise 13: fp16 loss scaling over sharded gradients (the found-inf check, then the scale's update).

Loss scaling (Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740, section 3.2) multiplies the loss by
S before backward so that fp16 gradients do not flush to zero, divides the gradients by S before the step, and skips
the step when some gradient came out inf or NaN (S was too large). Under FSDP each rank holds only its shard of every
gradient, so an inf may sit on one rank alone. If each rank decides from its own shards, that rank skips while the
others step: the model's shards then belong to different steps, and the ranks' scales part. The fix is one
all-reduce of the flags with op max (torch's `ShardedGradScaler`, torch/distributed/fsdp/sharded_grad_scaler.py,
all-reduces them with op sum and skips when the sum is positive: the same decision).

`check_found_inf` runs the learner's `unscale_and_check(ctx, shards, scale)` on simulated ranks, against torch's
own one-process kernel on the full gradients (`torch._amp_foreach_non_finite_check_and_unscale_`, what
`torch.amp.GradScaler.unscale_` calls): the unscaled shards when nothing overflowed, and one answer on every rank
when an inf or a NaN is planted on one rank only. `check_update_scale` compares the learner's
`update_scale(scale, found_inf, clean_steps, growth_interval)` with torch's kernel `torch._amp_update_scale_` (what
`GradScaler.update` calls) along a sequence of skipped and clean steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    exception_hint,
    format_tensor,
    padded_flat_grads,
    require_callable,
    require_world_sizes,
    run_checked,
    say,
    scale_ratio,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.engines.equivalence import close, max_rel_diff
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch

__all__ = ["check_found_inf", "check_update_scale"]

NUMELS = (30, 17)  # two flat gradients; 17 needs padding for 2, 3 and 4 ranks
SCALE = 1024.0  # a power of two, as GradScaler's scales are: dividing by it is exact
# (name, what is planted): the order matters, each case's hint assumes the cases before it passed
CASES = (("no inf or NaN", None), ("an inf on every rank", "inf everywhere"),
         ("an inf on the last rank only", "inf"), ("a NaN on the last rank only", "nan"))

T = catalogue("mixed_precision", {
    "returned_tensor": ("rank {rank} returned a tensor, {value!r}, not a Python bool",
                        "rank {rank} 返回了一个张量（{value!r}），不是 Python 的 bool"),
    "returned_number": ("rank {rank} returned {value!r} ({kind}), not a Python bool",
                        "rank {rank} 返回了 {value!r}（{kind}），不是 Python 的 bool"),
    "return_bool": ("return a Python bool, e.g. bool(flag.item())", "返回 Python 的 bool，例如 bool(flag.item())"),
    "not_true_or_false": ("rank {rank} returned {value!r} ({kind}), not True or False",
                          "rank {rank} 返回了 {value!r}（{kind}），不是 True 或 False"),
    "true_or_false": ("return True (some rank found an inf or NaN: skip the step) or False (every shard is finite)",
                      "返回 True（某个 rank 发现了 inf 或 NaN：跳过这一步）或 False（每个分片都是有限值）"),
    "all_reduce_under_if": ("some ranks made a collective that others did not (an all-reduce under `if found:`?): "
                            "every rank must call the all-reduce, with its flag 0 or 1, whether or not it found an inf",
                            "有的 rank 做了其他 rank 没做的集合通信（全归约写在了 `if found:` 下？）：每个 rank 都必须"
                            "调用全归约，带上它的标志 0 或 1，不论是否发现 inf"),
    "flag_max": ("a flag of 1.0 (found) or 0.0 (not) on each rank, all-reduced with op='max', is 1.0 on every rank "
                 "exactly when some rank found an inf or NaN",
                 "每个 rank 上的标志取 1.0（发现）或 0.0（未发现），用 op='max' 全归约后，当且仅当某个 rank 发现了 "
                 "inf 或 NaN 时，每个 rank 上的结果都是 1.0"),
    "disagree": ("the ranks disagree: {stepped}, {skipped}", "各 rank 的结果不一致：{stepped}，{skipped}"),
    "stepped_one": ("rank {ranks} returned False", "rank {ranks} 返回了 False"),
    "stepped_many": ("ranks {ranks} returned False", "rank {ranks} 返回了 False"),
    "skipped_one": ("rank {ranks} True", "rank {ranks} 返回了 True"),
    "skipped_many": ("ranks {ranks} True", "rank {ranks} 返回了 True"),
    "decision_local": ("rank {a} would step while rank {b} skips: the decision was local. All-reduce the flag with "
                       "op='max' (every rank, found or not), so that every rank skips when any rank found an inf",
                       "rank {a} 会执行这一步更新，而 rank {b} 会跳过：这个决定是各 rank 在本地各自做出的。"
                       "用 op='max' 全归约这个标志（每个 rank 都要调用，不论是否发现 inf），这样只要有一个 rank 发现 "
                       "inf，所有 rank 都会跳过"),
    "finite_false": ("with every shard finite, return False: True only when some shard holds an inf or NaN "
                     "(torch.isfinite(g).all() is True for a clean shard)",
                     "所有分片都有限时返回 False：只有某个分片含 inf 或 NaN 时才返回 True"
                     "（干净分片的 torch.isfinite(g).all() 为 True）"),
    "no_rank_found": ("no rank found the inf in its own shards: after dividing, test each shard with torch.isfinite "
                      "(or look for inf/NaN in it) and turn that into a flag",
                      "没有 rank 在自己的分片里发现 inf：相除之后用 torch.isfinite 检查每个分片"
                      "（或查找其中的 inf/NaN），再把结果转成标志"),
    "nan_missed": ("an inf is found, a NaN is not: torch.isinf misses NaN. Use ~torch.isfinite(g), which is True for "
                   "inf, -inf and NaN",
                   "inf 能被发现，NaN 不能：torch.isinf 漏掉了 NaN。用 ~torch.isfinite(g)，它对 inf、-inf 和 NaN "
                   "都为 True"),
    "min_not_max": ("every rank agreed, but an inf on one rank did not make them skip, while an inf on every rank did: "
                    "that is op='min' (or a product): skip if ANY rank found one, op='max' (or 'sum', then > 0)",
                    "各 rank 的结果一致，但一个 rank 上的 inf 没有让它们跳过，而每个 rank 上都有 inf 时却跳过了："
                    "这是 op='min'（或乘积）的行为：只要有任何一个 rank 发现 inf 就要跳过，用 op='max'"
                    "（或 'sum'，再判断 > 0）"),
    "every_shard": ("test every shard, not only the first: any shard with an inf or NaN means skip",
                    "检查每个分片，而不只是第一个：任何一个分片含有 inf 或 NaN 都意味着跳过"),
    "every_rank_returned": ("every rank returned {got}, one process finds {found} ({expected})",
                            "每个 rank 都返回了 {got}，而单进程{found}（{expected}）"),
    "found_some": ("an inf or NaN", "发现了 inf 或 NaN"),
    "found_none": ("nothing", "什么也没发现"),
    "left_scaled": ("the shards were left scaled because an inf was found: the contract is to divide every shard in "
                    "place first, whatever the flag, as torch's kernel does (GradScaler unscales, then checks)",
                    "因为发现了 inf，这些分片没有被反缩放：约定是无论标志如何，都先把每个分片原地除以 scale，"
                    "与 torch 的 kernel 一样（GradScaler 先反缩放，再检查）"),
    "not_unscaled": ("the shards were not unscaled: divide each one in place (g.div_(scale) or g.mul_(1 / scale)); "
                     "a new tensor (g = g / scale) leaves the optimizer's .grad as it was",
                     "分片没有反缩放：对每个分片原地相除（g.div_(scale) 或 g.mul_(1 / scale)）；新建张量"
                     "（g = g / scale）不会改变优化器的 .grad"),
    "divided_twice": ("divided by the scale twice: once is enough", "除以了 scale 两次：一次就够了"),
    "multiplied": ("multiplied by the scale: unscaling divides by it (the loss was multiplied before backward)",
                   "乘了 scale：反缩放应除以它（损失在反向之前被乘过）"),
    "divide_in_place": ("divide every shard of this rank by `scale`, in place, and nothing else",
                        "把这个 rank 的每个分片原地除以 `scale`，别的什么都不做"),
    "shard_differs": ("shard {i} after unscaling differs from one process's",
                      "反缩放之后，分片 {i} 与单进程的结果不同"),
    "not_pair": ("returned {got!r}, not a pair", "返回了 {got!r}，不是一对值"),
    "return_pair": ("return (new_scale, new_clean_steps)", "返回 (new_scale, new_clean_steps)"),
    "update_differs": ("returned (scale {new_scale:g}, clean_steps {new_clean}), torch's GradScaler gives (scale "
                       "{scale:g}, clean_steps {clean})",
                       "返回了 (scale {new_scale:g}, clean_steps {new_clean})，而 torch 的 GradScaler 给出 (scale "
                       "{scale:g}, clean_steps {clean})"),
    "backoff": ("after a skipped step (found_inf True) the scale is multiplied by backoff_factor = 0.5",
                "跳过一步（found_inf 为 True）之后，scale 乘以 backoff_factor = 0.5"),
    "reset_after_skip": ("after a skipped step the count of clean steps starts again from 0",
                         "跳过一步之后，无溢出步的计数从 0 重新开始"),
    "double_now": ("this clean step makes {n} in a row, which reaches growth_interval: the scale doubles now. "
                   "Count this step first, then compare the count with >= (or ==) growth_interval: comparing the old "
                   "count, or with >, doubles one step late",
                   "这是连续第 {n} 个无溢出步，达到了 growth_interval：scale 现在就翻倍。先计入这一步，再用 >=（或 ==）"
                   "与 growth_interval 比较：用旧的计数比较，或者用 >，都会晚一步翻倍"),
    "not_yet": ("only {n} clean steps in a row: the scale doubles when the count reaches growth_interval, not before",
                "连续的无溢出步只有 {n} 个：计数达到 growth_interval 时 scale 才翻倍，不会提前"),
    "reset_after_growth": ("when the scale grows, the count of clean steps starts again from 0",
                           "scale 增长时，无溢出步的计数从 0 重新开始"),
    "count_up": ("after a clean step (found_inf False) the count of clean steps goes up by one",
                 "干净的一步（found_inf 为 False）之后，无溢出步的计数加一"),
    "rule": ("halve the scale and reset the count on found_inf; else count the step and double at growth_interval",
             "found_inf 为 True 时把 scale 减半并把计数清零；否则计入这一步，并在计数达到 growth_interval 时"
             "把 scale 翻倍"),
    # what passed
    "found_inf_passed": ("  every rank unscales its shards as torch's kernel does on the full gradients, and every "
                         "rank skips when any one rank holds an inf or a NaN",
                         "  每个 rank 对自己分片的反缩放都与 torch 的 kernel 对完整梯度的做法一致；"
                         "只要有一个 rank 持有 inf 或 NaN，每个 rank 都会跳过这一步"),
    "update_steps": ("{steps} steps against torch._amp_update_scale_", "与 torch._amp_update_scale_ 对照了 {steps} 步"),
    "update_passed": ("  the scale halves after every skipped step and doubles after {growth} clean steps in a row, "
                      "the count of clean steps restarting after each change; every rank runs this rule on the same "
                      "decision",
                      "  每跳过一步，scale 减半；连续 {growth} 个正常步（没有 inf 或 NaN）之后，scale 翻倍；"
                      "每次变化之后，正常步的计数从零重新开始；每个 rank 都按同一个决定执行这条规则"),
})


def _inputs(n: int, plant: str | None) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The full scaled flat gradients (zeros in the padding), something non-finite planted, and each rank's shards."""
    g = torch.Generator().manual_seed(12)
    fulls, _ = padded_flat_grads(NUMELS, n, lambda numel: torch.randn(numel, generator=g) * SCALE)
    chunk = fulls[0].numel() // n
    if plant in ("inf", "nan"):  # in the last rank's chunk of the first flat gradient, not in its padding
        fulls[0][(n - 1) * chunk] = float("inf") if plant == "inf" else float("nan")
    elif plant == "inf everywhere":
        for r in range(n):
            fulls[0][r * chunk + 1] = float("inf")
    return fulls, [[f.chunk(n)[r].clone() for f in fulls] for r in range(n)]


def _reference(fulls: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """One process: torch's own unscale-and-check kernel on the full gradients."""
    grads = [f.clone() for f in fulls]
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.full((1,), 1.0 / SCALE))
    return grads, bool(found.item())


def _as_bool(check: str, where: str, rank: int, value: Any) -> bool:
    """The learner's answer, which must be a Python bool, as the stub's `-> bool` promises: a tensor or a number is
    refused, even one holding 0 or 1."""
    if isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor | int | float):
        problem = (T("returned_tensor", rank=rank, value=value) if isinstance(value, torch.Tensor) else
                   T("returned_number", rank=rank, value=value, kind=type(value).__name__))
        CheckFailure(check, where, problem, T("return_bool")).fail()
    CheckFailure(check, where, T("not_true_or_false", rank=rank, value=value, kind=type(value).__name__),
                 T("true_or_false")).fail()


def _hint_for(exc: BaseException) -> Message:
    if isinstance(exc, (CollectiveMismatch, CollectiveHang)):
        return T("all_reduce_under_if")
    if "op must be one of" in str(exc):
        return T("flag_max")
    return exception_hint(exc)


def check_found_inf(fn: Callable[[RankContext, list[torch.Tensor], float], Any],
                    world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, shards, scale) -> bool`: unscale this rank's gradient shards in place and say, the same on
    every rank, whether any rank's shards hold an inf or NaN.

    Compared with torch's one-process kernel on the full gradients: with nothing planted, every rank returns False
    and holds its chunk of the unscaled gradients; with an inf on every rank, an inf on the last rank only and a NaN
    on the last rank only, every rank returns True.
    """
    check = "check_found_inf"
    name = require_callable(check, fn, "unscale_and_check")
    sizes = require_world_sizes(world_sizes)
    for case, plant in CASES:
        for n in sizes:
            fulls, shards = _inputs(n, plant)
            reference, expected = _reference(fulls)

            def body(ctx: RankContext, shards: list = shards) -> tuple[Any, list[torch.Tensor]]:
                mine = [s.clone() for s in shards[ctx.rank]]
                return fn(ctx, mine, SCALE), mine

            per_rank = run_checked(check, name, body, n, lambda r, n=n, c=case: f"world size {n}, {c}, rank {r}",
                                   _hint_for)
            where = f"world size {n}, {case}"
            flags = [_as_bool(check, f"{where}, rank {r}", r, flag) for r, (flag, _) in enumerate(per_rank)]
            _judge_flags(check, where, n, plant, flags, expected)
            for rank, (_, got) in enumerate(per_rank):  # unscaled in place whatever was found, as torch's kernel
                _compare_shards(check, f"{where}, rank {rank}", n, rank, got, shards[rank], reference, found=expected)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("found_inf_passed"))


def _judge_flags(check: str, where: str, n: int, plant: str | None, flags: list[bool], expected: bool) -> None:
    if len(set(flags)) > 1:
        stepped = [r for r, f in enumerate(flags) if not f]
        skipped = [r for r, f in enumerate(flags) if f]
        a, b = stepped[0], skipped[0]
        CheckFailure(check, where, T("disagree", stepped=_who("stepped", stepped), skipped=_who("skipped", skipped)),
                     T("decision_local", a=a, b=b), [f"returned, by rank: {flags}"]).fail()
    got = flags[0]
    if got == expected:
        return
    if not expected:
        hint = T("finite_false")
    elif plant == "inf everywhere":
        hint = T("no_rank_found")
    elif plant == "nan":
        hint = T("nan_missed")
    elif n > 1:
        hint = T("min_not_max")
    else:
        hint = T("every_shard")
    found = T("found_some") if expected else T("found_none")
    CheckFailure(check, where, T("every_rank_returned", got=got, found=found, expected=expected), hint).fail()


def _who(returned: str, ranks: list[int]) -> Message:
    """"rank 0 returned False", "ranks 1, 2 True": `returned` is "stepped" or "skipped"."""
    shown, many = ", ".join(map(str, ranks)), len(ranks) > 1
    if returned == "stepped":
        return T("stepped_many" if many else "stepped_one", ranks=shown)
    return T("skipped_many" if many else "skipped_one", ranks=shown)


def _compare_shards(check: str, where: str, n: int, rank: int, got: list[torch.Tensor],
                    before: list[torch.Tensor], reference: list[torch.Tensor], found: bool = False) -> None:
    for i, (g, scaled, full) in enumerate(zip(got, before, reference, strict=True)):
        expected = full.chunk(n)[rank]
        finite = torch.isfinite(expected)  # where an inf or NaN was planted, it stays one: compare the rest
        same_shape = tuple(g.shape) == tuple(expected.shape)
        if same_shape and torch.equal(finite, torch.isfinite(g)) and close(g[finite], expected[finite], tol=1e-6):
            continue
        untouched = same_shape and torch.equal(g[finite], scaled[finite])
        ratio = scale_ratio(g[finite], expected[finite], rtol=1e-6) if same_shape else None
        if untouched and found:
            hint = T("left_scaled")
        elif untouched:
            hint = T("not_unscaled")
        elif ratio is not None and math.isclose(ratio, 1 / SCALE, rel_tol=1e-6):
            hint = T("divided_twice")
        elif ratio is not None and math.isclose(ratio, SCALE * SCALE, rel_tol=1e-6):
            hint = T("multiplied")
        else:
            hint = T("divide_in_place")
        details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(g, 8)}"]
        if same_shape:
            details.append(f"max difference {max_rel_diff(g[finite], expected[finite]):.3g} relative (finite values)")
        CheckFailure(check, where, T("shard_differs", i=i), hint, details).fail()


# -- the scale's update ----------------------------------------------------------------------------------
GROWTH_INTERVAL = 3
# found_inf along the steps: growth after 3 clean steps, backoff, the count restarting after each, twice in a row
SEQUENCE = (False, False, False, False, True, False, False, True, True, False, False, False, False, False, False)


def _torch_update(scale: float, found: bool, tracker: int, interval: int) -> tuple[float, int]:
    s, t = torch.tensor([scale]), torch.tensor([tracker], dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor([1.0 if found else 0.0]), 2.0, 0.5, interval)
    return float(s.item()), int(t.item())


def check_update_scale(fn: Callable[[float, bool, int, int], Any], init_scale: float = 2.0**16) -> None:
    """Check `fn(scale, found_inf, clean_steps, growth_interval) -> (scale, clean_steps)` against torch's kernel
    `torch._amp_update_scale_` (growth factor 2, backoff 0.5), step after step along a fixed sequence of skipped and
    clean steps with growth_interval 3."""
    check = "check_update_scale"
    name = require_callable(check, fn, "update_scale")
    scale, clean = init_scale, 0
    history = []
    for step, found in enumerate(SEQUENCE, 1):
        where = f"step {step} (found_inf={found}, scale {scale:g}, clean_steps {clean}, growth_interval " \
                f"{GROWTH_INTERVAL})"
        got = call_learner(check, name, fn, scale, found, clean, GROWTH_INTERVAL, where=where)
        expected = _torch_update(scale, found, clean, GROWTH_INTERVAL)
        if not (isinstance(got, tuple | list) and len(got) == 2):
            CheckFailure(check, where, T("not_pair", got=got), T("return_pair")).fail()
        new_scale, new_clean = float(got[0]), got[1]
        if (new_scale, int(new_clean)) != expected or new_clean != int(new_clean):
            CheckFailure(check, where, T("update_differs", new_scale=new_scale, new_clean=new_clean,
                                         scale=expected[0], clean=expected[1]),
                         _update_hint(scale, found, clean, (new_scale, new_clean), expected),
                         [f"the steps so far (found_inf, scale after): {history}"] if history else []).fail()
        scale, clean = expected
        history.append((found, scale))
    say(COMMON("passed", check=check, what=T("update_steps", steps=len(SEQUENCE))),
        T("update_passed", growth=GROWTH_INTERVAL))


def _update_hint(scale: float, found: bool, clean: int, got: tuple[float, Any],
                 expected: tuple[float, int]) -> Message:
    new_scale, new_clean = got
    if found and new_scale != scale * 0.5:
        return T("backoff")
    if found:
        return T("reset_after_skip")
    if expected[0] == scale * 2 and new_scale == scale:
        return T("double_now", n=clean + 1)
    if expected[0] == scale and new_scale == scale * 2:
        return T("not_yet", n=clean + 1)
    if expected[0] == scale * 2 and new_clean != 0:
        return T("reset_after_growth")
    if new_clean != clean + 1:
        return T("count_up")
    return T("rule")
