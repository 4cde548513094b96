"""Checkers of exercise 02: DDP by hand, broadcast the initial parameters and average gradients with hooks.

Data parallelism (ZeRO, arXiv:1910.02054, section 2) keeps a full replica on every rank; two things
keep the replicas equal: one broadcast of rank 0's parameters at the start (the article does this
too), and an average of the gradients in every backward (PyTorch's DDP reduces them from autograd
hooks while backward is still running). Each rank here starts from a *different* random model, so
a missing broadcast shows, and trains on its slice of every global batch; the result must equal
one process training on the whole batch, step by step.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    Message,
    exception_hint,
    format_tensor,
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
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.context import RankContext

__all__ = ["check_broadcast_parameters", "check_ddp"]

SIZES = (6, 5, 3)  # Linear(6, 5) -> Tanh -> Linear(5, 3): parameters 0.weight, 0.bias, 2.weight, 2.bias
STEPS, GLOBAL_BATCH, LR = 3, 12, 0.5  # 12 splits evenly over 1, 2, 3 and 4 ranks

T = catalogue("ddp", {
    # the broadcast
    "not_broadcast": ("rank {rank}'s `{name}` differs from rank 0's initial value (max difference {diff:.4g})",
                      "rank {rank} 的 `{name}` 与 rank 0 的初始值不同（最大差值 {diff:.4g}）"),
    "own_values": ("rank {rank}'s `{name}` still holds its own initial values: broadcast every parameter from rank "
                   "0, in place (for p in model.parameters(): ctx.broadcast(p.data, src=0))",
                   "rank {rank} 的 `{name}` 还是它自己的初始值：从 rank 0 原地广播每个参数"
                   "（for p in model.parameters(): ctx.broadcast(p.data, src=0)）"),
    "other_rank": ("rank {rank}'s `{name}` holds rank {k}'s values: broadcast from src=0",
                   "rank {rank} 的 `{name}` 是 rank {k} 的值：从 src=0 广播"),
    "averaged": ("that is the average of the ranks' values: broadcast rank 0's values (ctx.broadcast), do not "
                 "all-reduce them", "这是各 rank 值的平均：应广播 rank 0 的值（ctx.broadcast），不要全归约它们"),
    "broadcast": ("broadcast copies rank 0's tensor into the same tensor on every rank: ctx.broadcast(p.data, src=0)",
                  "广播把 rank 0 的张量拷贝到每个 rank 上的同一个张量里：ctx.broadcast(p.data, src=0)"),
    "shows_more": ("{hint} (check_broadcast_parameters shows more)",
                   "{hint}（check_broadcast_parameters 会给出更多信息）"),
    "param_names": ("rank {rank}'s model has parameters {names}, expected {expected}",
                    "rank {rank} 的模型的参数是 {names}，应为 {expected}"),
    "in_place": ("change the parameters' values in place; do not add, remove or rename them",
                 "原地修改参数的值；不要添加、删除或重命名参数"),
    "new_object": ("rank {rank}'s `{name}` is a new tensor object", "rank {rank} 的 `{name}` 是一个新的张量对象"),
    "copy_in_place": ("copy into the existing parameters in place (ctx.broadcast(p.data, src=0)): an optimizer built "
                      "on model.parameters() still holds the old ones",
                      "原地拷贝到已有的参数里（ctx.broadcast(p.data, src=0)）："
                      "基于 model.parameters() 创建的优化器仍持有旧参数"),
    # the gradients and the step
    "no_grad": ("rank {rank}'s `{name}` has no gradient after backward", "反向之后，rank {rank} 的 `{name}` 没有梯度"),
    "fill_grad": ("let autograd fill p.grad: a hook averages it, it does not replace it with None",
                  "让 autograd 填充 p.grad：钩子对它求平均，而不是把它换成 None"),
    "one_process": ("compare with one process on the whole batch: the average over ranks of the slices' gradients",
                    "与单进程在整个批次上的结果比较：它等于各 rank 数据切片的梯度在各 rank 间的平均"),
    "summed": ("rank {rank}'s gradient is {n}x the one-process gradient: the hooks summed it over the ranks; average "
               "it (op='mean', or divide by ctx.world_size)",
               "rank {rank} 的梯度是单进程梯度的 {n} 倍：钩子对各 rank 求了和；应求平均（op='mean'，或除以 "
               "ctx.world_size）"),
    "averaged_twice": ("rank {rank}'s gradient is {n}x too small: it was averaged twice (op='mean' and a division by "
                       "the world size?)",
                       "rank {rank} 的梯度只有应得值的 1/{n}：平均了两次（op='mean' 之外又除以了 world size？）"),
    "own_slice": ("rank {rank}'s gradient is its own slice's gradient, not averaged over the ranks: register a hook "
                  "on every parameter that all-reduces its gradient with op='mean' (p.register_hook(...) or "
                  "p.register_post_accumulate_grad_hook(...))",
                  "rank {rank} 的梯度只是它自己数据切片的梯度，没有在各 rank 间平均：给每个参数注册一个钩子，"
                  "用 op='mean' 全归约它的梯度（p.register_hook(...) 或 p.register_post_accumulate_grad_hook(...)）"),
    "grad_differs": ("rank {rank}'s gradient of `{name}` differs from one process's",
                     "rank {rank} 上 `{name}` 的梯度与单进程的结果不同"),
    "param_differs": ("rank {rank}'s `{name}` after the step differs from one process's (max difference {diff:.3g} "
                      "relative)", "更新之后，rank {rank} 上的 `{name}` 与单进程的结果不同（相对最大差值 {diff:.3g}）"),
    "step_unused": ("the gradients matched, so the step did not use them: do not change p.grad or the parameters "
                    "after backward",
                    "梯度是对的，所以是这一步更新没有用上它们：反向之后不要再修改 p.grad 或参数"),
    # what passed
    "broadcast_passed": ("  every rank started from its own random model; after the call all hold rank 0's values, in "
                         "the same parameter objects",
                         "  每个 rank 都从自己的随机模型开始；调用之后，所有 rank 都持有 rank 0 的值，"
                         "而且仍是原来那些参数对象"),
    "ddp_passed": ("  {steps} SGD steps, global batch {batch} split over the ranks: every rank's gradients and "
                   "parameters equal one process's, at every step",
                   "  {steps} 步 SGD，全局批大小 {batch}，分给各 rank：每一步里，每个 rank 的梯度和参数"
                   "都与单进程的结果相同"),
})


def _rank_models(world_size: int) -> list[nn.Module]:
    """A different random model per rank (seed 100 + rank): only a broadcast makes them equal."""
    return [seeded_mlp(SIZES, seed=100 + r) for r in range(world_size)]


def _broadcast_problem(rank: int, name: str, got: torch.Tensor, models: list[nn.Module]) -> tuple[Message, Message]:
    """(problem, hint) for a parameter that does not hold rank 0's initial values after the broadcast."""
    originals = [dict(m.named_parameters())[name].detach() for m in models]
    problem = T("not_broadcast", rank=rank, name=name, diff=float((got - originals[0]).abs().max()))
    if close(got, originals[rank]):
        return problem, T("own_values", rank=rank, name=name)
    for k, original in enumerate(originals):
        if k and close(got, original):
            return problem, T("other_rank", rank=rank, name=name, k=k)
    if close(got, torch.stack(originals).mean(0)):
        return problem, T("averaged")
    return problem, T("broadcast")


def _run_broadcast(check: str, name: str, fn: Callable[[RankContext, nn.Module], Any], n: int) -> None:
    models = _rank_models(n)

    def body(ctx: RankContext) -> list[tuple[str, torch.Tensor, bool]]:
        model = copy.deepcopy(models[ctx.rank])
        before = {n_: id(p) for n_, p in model.named_parameters()}
        fn(ctx, model)
        return [(n_, p.detach().clone(), id(p) == before.get(n_)) for n_, p in model.named_parameters()]

    per_rank = run_checked(check, name, body, n, lambda r: f"world size {n}, rank {r}", exception_hint)
    for rank, params in enumerate(per_rank):
        names = [n_ for n_, _, _ in params]
        expected = [n_ for n_, _ in models[0].named_parameters()]
        if names != expected:
            CheckFailure(check, f"world size {n}", T("param_names", rank=rank, names=names, expected=expected),
                         T("in_place")).fail()
        for pname, got, same_object in params:
            if not same_object:
                CheckFailure(check, f"world size {n}", T("new_object", rank=rank, name=pname),
                             T("copy_in_place")).fail()
            if not close(got, dict(models[0].named_parameters())[pname].detach(), 0.0):
                problem, hint = _broadcast_problem(rank, pname, got, models)
                CheckFailure(check, f"world size {n}", problem, hint).fail()


def check_broadcast_parameters(fn: Callable[[RankContext, nn.Module], Any],
                               world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, model)`: afterwards every rank's parameters equal rank 0's, bit for bit, in place.

    Every rank starts from a different random Linear(6, 5) -> Tanh -> Linear(5, 3).
    """
    check = "check_broadcast_parameters"
    name = require_callable(check, fn, "broadcast_parameters")
    sizes = require_world_sizes(world_sizes)
    for n in sizes:
        _run_broadcast(check, name, fn, n)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("broadcast_passed"))


def check_ddp(broadcast_parameters: Callable[[RankContext, nn.Module], Any],
              add_gradient_hooks: Callable[[RankContext, nn.Module], Any],
              world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check DDP training: N ranks on slices of each global batch equal one process on the whole batch.

    Each rank deep-copies its own random model, calls `broadcast_parameters(ctx, model)` and
    `add_gradient_hooks(ctx, model)`, then trains 3 steps of SGD on its slice of 12 samples. After
    every backward each rank's gradients must equal one process's gradients on all 12 samples, and
    after every step its parameters must equal that process's parameters.
    """
    check = "check_ddp"
    require_callable(check, broadcast_parameters, "broadcast_parameters")
    hooks_name = require_callable(check, add_gradient_hooks, "add_gradient_hooks")
    sizes = require_world_sizes(world_sizes)
    batches = global_batches(STEPS, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=7)
    base = _rank_models(1)[0]
    reference = one_process(base, batches, functools.partial(torch.optim.SGD, lr=LR)).steps(base)
    for n in sizes:
        models = _rank_models(n)
        current = [0] * n

        def body(ctx: RankContext, n: int = n, models: list = models, current: list = current) -> list[Any]:
            model = copy.deepcopy(models[ctx.rank])
            broadcast_parameters(ctx, model)
            start = {k: p.detach().clone() for k, p in model.named_parameters()}
            add_gradient_hooks(ctx, model)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            steps = []
            for step, batch in enumerate(batches, 1):
                current[ctx.rank] = step
                x, y = local_slice(batch, ctx.rank, n)
                F.cross_entropy(model(x), y).backward()
                grads = {k: None if p.grad is None else p.grad.detach().clone() for k, p in model.named_parameters()}
                opt.step()
                opt.zero_grad()
                steps.append((grads, {k: p.detach().clone() for k, p in model.named_parameters()}))
            return [start, steps]

        per_rank = run_checked(check, hooks_name, body, n,
                               lambda r, n=n, c=current: f"world size {n}, rank {r}, step {c[r]}", exception_hint)
        for rank, (start, _) in enumerate(per_rank):
            for pname, value in start.items():
                if not close(value, dict(base.named_parameters())[pname].detach(), 0.0):
                    problem, hint = _broadcast_problem(rank, pname, value, models)
                    CheckFailure(check, f"world size {n}, before training", problem,
                                 T("shows_more", hint=hint)).fail()
        for step in range(1, STEPS + 1):
            for rank, (_, steps) in enumerate(per_rank):
                grads, params = steps[step - 1]
                _compare_step(check, n, rank, step, grads, params, reference[step - 1], base, batches)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("ddp_passed", steps=STEPS, batch=GLOBAL_BATCH))


def _compare_step(check: str, n: int, rank: int, step: int, grads: dict[str, torch.Tensor | None],
                  params: dict[str, torch.Tensor], ref: Any, base: nn.Module, batches: list) -> None:
    where = f"world size {n}, rank {rank}, step {step}"
    for pname, expected in ref.grads.items():
        got = grads.get(pname)
        if got is None:
            CheckFailure(check, where, T("no_grad", rank=rank, name=pname), T("fill_grad")).fail()
        if close(got, expected):
            continue
        details = [f"one process {format_tensor(expected, 8)}", f"rank {rank}    {format_tensor(got, 8)}",
                   f"max difference {max_rel_diff(got, expected):.3g} relative to the largest value"]
        c = scale_ratio(got, expected, rtol=1e-3)
        hint = T("one_process")
        if c is not None and n > 1 and abs(c / n - 1) < 1e-3:
            hint = T("summed", rank=rank, n=n)
        elif c is not None and n > 1 and abs(c * n - 1) < 1e-3:
            hint = T("averaged_twice", rank=rank, n=n)
        elif step == 1 and n > 1:  # the gradient of this rank's slice alone: one process on that slice
            alone = one_process(base, [local_slice(batches[0], rank, n)], functools.partial(torch.optim.SGD, lr=LR))
            if close(got, alone.steps(base)[0].grads[pname]):
                hint = T("own_slice", rank=rank)
        CheckFailure(check, where, T("grad_differs", rank=rank, name=pname), hint, details).fail()
    for pname, expected in ref.params.items():
        got = params[pname]
        if not close(got, expected):
            CheckFailure(check, where, T("param_differs", rank=rank, name=pname, diff=max_rel_diff(got, expected)),
                         T("step_unused")).fail()

