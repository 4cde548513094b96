"""Checkers of exercise 10: gradient clipping by the global norm, and a data-parallel step debugged.

Clipping. `torch.nn.utils.clip_grad_norm_` scales all gradients by max_norm / ||g|| when the
norm of *all* gradients together exceeds max_norm. With sharded gradients each rank holds a piece
of g; the article clips each shard by its own norm (`shardedGrad.norm()`), so every rank scales by
a different factor and the update is no longer the one-process update. The fix: every rank sums
its squared norms, one all-reduce adds them up, the root is the global norm, identical on all ranks.

Debugging. A training step that (1) all-reduces the loss for logging inside `if ctx.rank == 0:`,
so the other ranks never join that collective (a hang, or a mismatch with their next call), and
(2) sums the gradients over the ranks instead of averaging them, so at world size N every step is
N times too long (divergence). The learner's fixed step must train exactly like one process.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_course.classroom.checks._common import (
    CheckFailure,
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
from fsdp_course.engines.equivalence import (
    close,
    global_batches,
    local_slice,
    max_rel_diff,
    one_process,
    seeded_mlp,
)
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch

__all__ = ["check_clip_grad_norm", "check_train_step"]

CLIP_NUMELS = (30, 17)  # two flat gradients; 17 needs padding for 2, 3 and 4 ranks
CLIP_CASES = (("clipping", 1.0), ("no clipping", 1e6))
STEP_SIZES = (6, 5, 3)
STEP_STEPS, STEP_BATCH, STEP_LR = 4, 12, 0.5

T = catalogue("pitfalls", {
    "not_norm": ("returned {kind}, not the norm", "返回了 {kind}，而不是范数"),
    "return_norm": ("return the global norm (a 0-d tensor or a float)", "返回全局范数（0 维张量或 float）"),
    "wrong_norm": ("rank {rank} returned the norm {norm:.6g}, the global norm is {total:.6g}",
                   "rank {rank} 返回的范数是 {norm:.6g}，全局范数是 {total:.6g}"),
    "own_norm": ("{norm:.6g} is rank {rank}'s own shard's norm: the article's bug. Sum the squared norms of the shards "
                 "over all ranks (ctx.all_reduce, op='sum'), then take the square root",
                 "{norm:.6g} 是 rank {rank} 自己分片的范数：这是文章的 bug。要在所有 rank 上对各分片的范数平方求和"
                 "（ctx.all_reduce，op='sum'），再开平方"),
    "norms_add": ("norms do not add up: all-reduce the squared norms (sum), then take the square root",
                  "范数不能直接相加：全归约范数的平方（求和），再开平方"),
    "sqrt_mean": ("that is sqrt(mean of the squared norms): all-reduce the squares with op='sum', not 'mean'",
                  "这是 sqrt(范数平方的平均)：全归约平方时用 op='sum'，不是 'mean'"),
    "norm_formula": ("the global norm is sqrt(sum over ranks and shards of (shard ** 2).sum())",
                     "全局范数是 sqrt(对所有 rank 的所有分片求 (shard ** 2).sum() 之和)"),
    "not_scaled": ("the shards were not scaled: multiply each in place (g.mul_(coef)), coef = max_norm / (norm + 1e-6)",
                   "分片没有被缩放：对每个分片原地相乘（g.mul_(coef)），coef = max_norm / (norm + 1e-6)"),
    "below_max": ("the global norm is below max_norm: clip only when it exceeds it (clamp the factor at 1)",
                  "全局范数低于 max_norm：只有超过时才做梯度裁剪（把系数限制在 1 以内）"),
    "own_scale": ("rank {rank} scaled by max_norm / its own norm ({own:.4g}): the article's bug; every rank must scale "
                  "by max_norm / the global norm ({total:.4g})",
                  "rank {rank} 用 max_norm / 它自己的范数（{own:.4g}）缩放：这是文章的 bug；每个 rank 都必须用 "
                  "max_norm / 全局范数（{total:.4g}）缩放"),
    "same_factor": ("scale every shard in place by the same factor: min(1, max_norm / (global norm + 1e-6))",
                    "用同一个系数原地缩放每个分片：min(1, max_norm / (全局范数 + 1e-6))"),
    "clipped_differs": ("shard {i} after clipping differs from one process's", "裁剪之后，分片 {i} 与单进程的结果不同"),
    "collective_on_rank0": ("a rank made a collective that the others did not (a collective under "
                            "`if ctx.rank == 0:`?): every rank must call every collective, in the same order; compute "
                            "on all ranks, print on rank 0 only",
                            "有一个 rank 做了其他 rank 没做的集合通信（集合通信写在了 `if ctx.rank == 0:` 下？）："
                            "每个 rank 都必须按相同顺序调用每个集合通信；在所有 rank 上计算，只在 rank 0 上打印"),
    "average_then_step": ("after backward, average every gradient over the ranks (op='mean'), then step, then zero the "
                          "gradients", "反向之后，在各 rank 间平均每个梯度（op='mean'），然后更新一步，再把梯度清零"),
    "grads_summed": ("the parameters moved {n}x as far as one process's at world size {n}: the gradients are summed "
                     "over the ranks, not averaged; use op='mean' (or divide by ctx.world_size)",
                     "world size {n} 时参数移动的距离是单进程的 {n} 倍：梯度在各 rank 间求了和而不是平均；用 op='mean'"
                     "（或除以 ctx.world_size）"),
    "averaged_twice": ("the parameters moved 1/{n} as far as one process's: the gradients were averaged twice",
                       "参数移动的距离只有单进程的 1/{n}：梯度被平均了两次"),
    "stepped_twice": ("the step was taken twice (or the gradients were not zeroed after the previous step)",
                      "这一步更新执行了两次（或者上一步之后没有把梯度清零）"),
    "param_differs": ("rank {rank}'s `{pname}` after the step differs from one process's",
                      "更新之后，rank {rank} 上的 `{pname}` 与单进程的结果不同"),
    "not_loss": ("rank {rank} returned {kind}, not the loss", "rank {rank} 返回了 {kind}，而不是损失"),
    "return_loss": ("return the global loss as a float (loss.item() after the all-reduce)",
                    "以 float 返回全局损失（全归约之后调用 loss.item()）"),
    "mean_loss": ("return the mean over the ranks of their losses (ctx.all_reduce(..., op='mean') on every rank)",
                  "返回各 rank 损失的平均（在每个 rank 上调用 ctx.all_reduce(..., op='mean')）"),
    "own_loss": ("rank {rank} returned its own slice's loss: all-reduce the loss (op='mean') on every rank to get the "
                 "global one",
                 "rank {rank} 返回的是它自己那份数据的损失：在每个 rank 上全归约损失（op='mean'）得到全局损失"),
    "loss_summed": ("that is {n}x the global loss: average the losses (op='mean'), do not sum them",
                    "这是全局损失的 {n} 倍：要对损失求平均（op='mean'），不要求和"),
    "wrong_loss": ("rank {rank} returned the loss {loss:.6g}, one process's is {ref:.6g}",
                   "rank {rank} 返回的损失是 {loss:.6g}，单进程的是 {ref:.6g}"),
    # what passed
    "clip_passed": ("  every rank returns the global norm of all shards and scales its shards by the same factor, as "
                    "torch.nn.utils.clip_grad_norm_ does on one process; nothing changes when the norm is below "
                    "max_norm",
                    "  每个 rank 都返回所有分片的全局范数，并用同一个系数缩放自己的分片，"
                    "与 torch.nn.utils.clip_grad_norm_ 在单进程上的做法一致；范数低于 max_norm 时什么都不改变"),
    "step_passed": ("  {steps} SGD steps, global batch {batch} split over the ranks: every rank returns the global "
                    "loss and holds one process's parameters after every step",
                    "  {steps} 步 SGD，全局批大小 {batch}，分给各 rank：每一步之后，每个 rank 都返回全局损失，"
                    "并持有与单进程相同的参数"),
})


def _clip_inputs(n: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Full padded flat gradients (zeros in the padding), and each rank's shards of them."""
    g = torch.Generator().manual_seed(21)
    return padded_flat_grads(CLIP_NUMELS, n,
                             lambda numel: torch.randn(numel, generator=g) * torch.linspace(0.1, 3.0, numel))


def check_clip_grad_norm(fn: Callable[[RankContext, list[torch.Tensor], float], Any],
                         world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, shards, max_norm) -> total_norm`: clip this rank's gradient shards in place by the global norm.

    Compared with `torch.nn.utils.clip_grad_norm_` on the full gradients in one process: the
    returned norm (on every rank) and every rank's shards after clipping, with max_norm = 1
    (clipping) and 1e6 (no clipping).
    """
    check = "check_clip_grad_norm"
    name = require_callable(check, fn, "clip_grad_norm_sharded")
    sizes = require_world_sizes(world_sizes)
    for case, max_norm in CLIP_CASES:
        for n in sizes:
            fulls, shards = _clip_inputs(n)
            holders = [torch.nn.Parameter(torch.zeros_like(f)) for f in fulls]  # clip_grad_norm_ clips .grad
            for holder, f in zip(holders, fulls, strict=True):
                holder.grad = f.clone()
            total = float(torch.nn.utils.clip_grad_norm_(holders, max_norm))
            reference = [h.grad for h in holders]

            def body(ctx: RankContext, shards: list = shards, max_norm: float = max_norm) -> tuple[Any, list]:
                mine = [s.clone() for s in shards[ctx.rank]]
                norm = fn(ctx, mine, max_norm)
                return norm, mine

            per_rank = run_checked(check, name, body, n, lambda r, n=n, c=case: f"world size {n}, {c}, rank {r}",
                                   exception_hint)
            for rank, (norm, clipped) in enumerate(per_rank):
                _compare_clip(check, n, case, max_norm, rank, norm, clipped, total, reference, shards)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("clip_passed"))


def _compare_clip(check: str, n: int, case: str, max_norm: float, rank: int, norm: Any, clipped: list,
                  total: float, reference: list[torch.Tensor], shards: list[list[torch.Tensor]]) -> None:
    where = f"world size {n}, {case} (max_norm {max_norm:g}), rank {rank}"
    if isinstance(norm, torch.Tensor) and norm.numel() == 1:
        norm = float(norm)
    if isinstance(norm, bool) or not isinstance(norm, (int, float)):
        CheckFailure(check, where, T("not_norm", kind=type(norm).__name__), T("return_norm")).fail()
    own = math.sqrt(sum(float(s.pow(2).sum()) for s in shards[rank]))
    if abs(norm - total) > 1e-5 * total:
        summed = sum(math.sqrt(sum(float(s.pow(2).sum()) for s in shards[r])) for r in range(n))
        problem = T("wrong_norm", rank=rank, norm=norm, total=total)
        if n > 1 and abs(norm - own) <= 1e-5 * own:
            hint = T("own_norm", norm=norm, rank=rank)
        elif n > 1 and abs(norm - summed) <= 1e-5 * summed:
            hint = T("norms_add")
        elif n > 1 and abs(norm * math.sqrt(n) - total) <= 1e-5 * total:
            hint = T("sqrt_mean")
        else:
            hint = T("norm_formula")
        CheckFailure(check, where, problem, hint).fail()
    for i, (got, full) in enumerate(zip(clipped, reference, strict=True)):
        expected = full.chunk(n)[rank]
        if close(got, expected):
            continue
        details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(got, 8)}",
                   f"max difference {max_rel_diff(got, expected):.3g} relative"]
        c = scale_ratio(got, shards[rank][i], rtol=1e-4)
        if torch.equal(got, shards[rank][i]) and total > max_norm:
            hint = T("not_scaled")
        elif total <= max_norm:
            hint = T("below_max")
        elif c is not None and own > 0 and abs(c - max_norm / (own + 1e-6)) <= 1e-4 * c:
            hint = T("own_scale", rank=rank, own=own, total=total)
        else:
            hint = T("same_factor")
        CheckFailure(check, where, T("clipped_differs", i=i), hint, details).fail()


# -- the debugging exercise ------------------------------------------------------------------------


def _step_hint(exc: BaseException) -> Message:
    if isinstance(exc, (CollectiveMismatch, CollectiveHang)):
        return T("collective_on_rank0")
    return exception_hint(exc)


def check_train_step(fn: Callable[[RankContext, Any, torch.optim.Optimizer, torch.Tensor, torch.Tensor], Any],
                     world_sizes: Sequence[int] = (1, 2, 4)) -> None:
    """Check `fn(ctx, model, optimizer, x, y) -> loss`: one data-parallel SGD step that matches one process.

    Every rank holds the same model (a deep copy) and calls `fn` on its slice of each of 4 global
    batches of 12; `fn` does forward, backward, averages the gradients, steps, zeroes the
    gradients and returns the global loss (mean over the ranks) as a float, on every rank.
    Compared with one process on the whole batches: the returned loss and the parameters, per step.
    """
    check = "check_train_step"
    name = require_callable(check, fn, "train_step")
    sizes = require_world_sizes(world_sizes)
    model = seeded_mlp(STEP_SIZES, seed=31)
    batches = global_batches(STEP_STEPS, STEP_BATCH, STEP_SIZES[0], STEP_SIZES[-1], seed=32)
    reference = one_process(model, batches, functools.partial(torch.optim.SGD, lr=STEP_LR)).steps(model)
    for n in sizes:
        current = [1] * n

        def body(ctx: RankContext, n: int = n, current: list = current) -> list[tuple[Any, dict, float]]:
            m = copy.deepcopy(model)
            opt = torch.optim.SGD(m.parameters(), lr=STEP_LR)
            out = []
            for step, batch in enumerate(batches, 1):
                current[ctx.rank] = step
                x, y = local_slice(batch, ctx.rank, n)
                with torch.no_grad():
                    local_loss = float(F.cross_entropy(m(x), y))
                loss = fn(ctx, m, opt, x, y)
                out.append((loss, {k: p.detach().clone() for k, p in m.named_parameters()}, local_loss))
            return out

        per_rank = run_checked(check, name, body, n, lambda r, n=n, c=current: f"world size {n}, rank {r}, step {c[r]}",
                               _step_hint)
        for step in range(STEP_STEPS):
            before = dict(model.named_parameters()) if step == 0 else reference[step - 1].params
            for rank in range(n):
                loss, params, local_loss = per_rank[rank][step]
                _compare_step(check, n, rank, step + 1, loss, params, local_loss, reference[step], before)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("step_passed", steps=STEP_STEPS, batch=STEP_BATCH))


def _compare_step(check: str, n: int, rank: int, step: int, loss: Any, params: dict, local_loss: float,
                  ref: Any, before: dict) -> None:
    where = f"world size {n}, rank {rank}, step {step}"
    for pname, expected in ref.params.items():
        got = params[pname]
        if close(got, expected):
            continue
        start = before[pname].detach()
        c = scale_ratio(got - start, expected - start, rtol=1e-3)
        hint = T("average_then_step")
        if c is not None and n > 1 and abs(c / n - 1) < 1e-3:
            hint = T("grads_summed", n=n)
        elif c is not None and abs(c - 1 / n) < 1e-3 and n > 1:
            hint = T("averaged_twice", n=n)
        elif c is not None and abs(c - 2) < 1e-3:
            hint = T("stepped_twice")
        CheckFailure(check, where, T("param_differs", rank=rank, pname=pname), hint,
                     [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(got, 8)}",
                      f"max difference {max_rel_diff(got, expected):.3g} relative"]).fail()
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = float(loss)
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        CheckFailure(check, where, T("not_loss", rank=rank, kind=type(loss).__name__), T("return_loss")).fail()
    if abs(loss - ref.loss) > 1e-5 * max(1.0, abs(ref.loss)):
        hint = T("mean_loss")
        if n > 1 and abs(loss - local_loss) <= 1e-6 * max(1.0, abs(local_loss)):
            hint = T("own_loss", rank=rank)
        elif n > 1 and abs(loss - n * ref.loss) <= 1e-5 * n * abs(ref.loss):
            hint = T("loss_summed", n=n)
        CheckFailure(check, where, T("wrong_loss", rank=rank, loss=loss, ref=ref.loss), hint).fail()
