"""Checker of exercise 06: the FSDP unit, checked by training equivalence against one process.

The life cycle of one unit (PyTorch FSDP, arXiv:2304.11277, section 3; the names follow FSDP2):
pre_forward gathers the flat parameter (unshard), post_forward frees it (reshard), pre_backward
gathers it again because the unit's backward needs its weights, post_backward reduce-scatters the
gradient so each rank keeps the average of its own chunk, and frees the full buffers again.

The learner's class is constructed as `Unit(module, ctx)` on each Linear layer of a small MLP
(three units, world sizes 1 to 4, so 3 ranks need padding); the checker trains 3 SGD steps on
each rank's slice of the global batches and compares with one process on the whole batches:
each rank's gradient chunk after every backward, its parameter shard after every step. It also
watches memory: after a unit's forward and after the backward, its gathered buffer must be freed.
The unit must expose `shard` (this rank's chunk, an `nn.Parameter`), `full` (the gathered buffer)
and `layout` (its `FlatParamLayout`). Step 2 runs two forward and backward passes, each on half the
loss, before the optimizer step (gradient accumulation): a post_backward that overwrites `shard.grad`
instead of adding to it leaves half the gradient. Every forward must point the module at fresh views
of `full`: views kept from an earlier forward belong to that forward's autograd graph (made under
`torch.no_grad()`, in an evaluation pass, they would carry no gradient at all).
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
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.runtime.context import RankContext

__all__ = ["check_fsdp_unit"]

SIZES = (5, 7, 4, 3)  # Linear(5, 7) 42, Linear(7, 4) 32, Linear(4, 3) 15 parameters: units 0, 2, 4
UNIT_INDICES = (0, 2, 4)
STEPS, GLOBAL_BATCH, LR = 3, 12, 0.5
ACCUMULATE_STEP = 2  # this step runs two forward/backward passes (each on half the loss) before the step

T = catalogue("fsdp_unit", {
    "freed_backward": ("a unit's backward ran while its parameters were freed: post_forward must make backward call "
                       "pre_backward first (output.register_hook(lambda grad: self.pre_backward())), and pre_backward "
                       "must gather them again (self.unshard())",
                       "一个单元在参数已被释放时执行了反向：post_forward 必须让反向先调用 pre_backward"
                       "（output.register_hook(lambda grad: self.pre_backward())），pre_backward 必须重新全聚合参数"
                       "（self.unshard()）"),
    "full_data": ("gather into self.full.data, not self.full: self.full is a leaf that requires grad (its views are "
                  "saved for backward), so autograd forbids writing into it in place",
                  "全聚合到 self.full.data，而不是 self.full：self.full 是 requires grad 的叶子张量（它的视图被保存"
                  "用于反向），所以 autograd 禁止原地写入它"),
    "grad_size": ("self.shard.grad must have the shard's shape (padded_numel // N,): reduce-scatter self.full.grad "
                  "(op='mean') so that each rank keeps its own chunk",
                  "self.shard.grad 必须是分片的形状 (padded_numel // N,)：对 self.full.grad 做归约分散（op='mean'），"
                  "让每个 rank 保留自己的分块"),
    "point_views": ("in pre_forward, point the module at views of self.full (self.layout.unflatten(self.full))",
                    "在 pre_forward 里让模块使用 self.full 的视图（self.layout.unflatten(self.full)）"),
    "lost_params": ("the module lost its parameters when the unit was built: pre_forward must set them "
                    "(self.set_params(self.layout.unflatten(self.full)))",
                    "构建单元时模块失去了它的参数：pre_forward 必须重新设置它们"
                    "（self.set_params(self.layout.unflatten(self.full))）"),
    "full_grad_holds": ("self.full.grad holds the unit's gradient when post_backward runs: reduce-scatter it",
                        "post_backward 运行时，self.full.grad 持有该单元的梯度：对它做归约分散"),
    "same_views": ("unit {k}'s module used the same parameter views as in its previous forward",
                   "单元 {k} 的模块使用了与上一次前向相同的参数视图"),
    "fresh_views": ("make fresh views in every pre_forward (self.set_params(self.layout.unflatten(self.full))): views "
                    "kept from an earlier forward belong to that forward's autograd graph; made under torch.no_grad() "
                    "(an evaluation pass) they would carry no gradient at all",
                    "在每次 pre_forward 里重新生成视图（self.set_params(self.layout.unflatten(self.full))）：之前前向"
                    "留下的视图属于那次前向的 autograd 图；在 torch.no_grad()（评估）下生成的视图根本不带梯度"),
    "held_after_forward": ("after its forward, unit {k} still holds its gathered parameters ({held} B)",
                           "前向之后，单元 {k} 仍持有全聚合的参数（{held} B）"),
    "free_post_forward": ("free them in post_forward: self.reshard() (self.full.untyped_storage().resize_(0))",
                          "在 post_forward 里释放它们：self.reshard()（self.full.untyped_storage().resize_(0)）"),
    "full_grad_alive": ("after backward, unit {k}'s full gradient (self.full.grad) is still alive",
                        "反向之后，单元 {k} 的完整梯度（self.full.grad）仍然存在"),
    "drop_full_grad": ("after the reduce-scatter, drop it: self.full.grad = None (only the chunk is kept)",
                       "归约分散之后丢掉它：self.full.grad = None（只保留分块）"),
    "held_after_backward": ("after backward, unit {k} still holds its gathered parameters ({held} B)",
                            "反向之后，单元 {k} 仍持有全聚合的参数（{held} B）"),
    "free_post_backward": ("free them at the end of post_backward: self.reshard()",
                           "在 post_backward 的末尾释放它们：self.reshard()"),
    "no_grad": ("unit {k}'s shard has no gradient after backward", "反向之后，单元 {k} 的分片没有梯度"),
    "reduce_into": ("in post_backward, reduce-scatter self.full.grad (op='mean') into self.shard.grad",
                    "在 post_backward 里把 self.full.grad 归约分散（op='mean'）到 self.shard.grad"),
    "shard_grad_shape": ("unit {k}'s shard.grad has shape {shape}", "单元 {k} 的 shard.grad 形状是 {shape}"),
    "reduce_full": ("shard.grad must have the shard's shape ({numel},): reduce-scatter the full gradient, so each rank "
                    "keeps its chunk",
                    "shard.grad 必须是分片的形状 ({numel},)：对完整梯度做归约分散，让每个 rank 保留自己的分块"),
    "averaged_chunk": ("the averaged gradient's chunk r: ctx.reduce_scatter(self.full.grad, op='mean'), with the "
                       "forward and backward both using the gathered parameters",
                       "应为平均梯度的分块 r：ctx.reduce_scatter(self.full.grad, op='mean')，且前向和反向都使用全聚合"
                       "的参数"),
    "half": ("rank {rank}'s gradient chunk is half of one process's after two backward passes: the second overwrote "
             "the first's gradient; accumulate, as autograd does: self.shard.grad = chunk if self.shard.grad is None "
             "else self.shard.grad + chunk",
             "两次反向之后，rank {rank} 的梯度分块只有单进程的一半：第二次覆盖了第一次的梯度；要像 autograd 那样累加："
             "self.shard.grad = chunk if self.shard.grad is None else self.shard.grad + chunk"),
    "too_large": ("rank {rank}'s gradient chunk is {n}x too large: did you average over the world size (op='mean')?",
                  "rank {rank} 的梯度分块是应得值的 {n} 倍：是否按 world size 取了平均（op='mean'）？"),
    "too_small": ("rank {rank}'s gradient chunk is {n}x too small: it was averaged twice",
                  "rank {rank} 的梯度分块只有应得值的 1/{n}：平均了两次"),
    "chunk_differs": ("unit {k}'s gradient chunk differs from one process's", "单元 {k} 的梯度分块与单进程的结果不同"),
    "shard_differs": ("unit {k}'s parameter shard after the step differs from one process's",
                      "更新之后，单元 {k} 的参数分片与单进程的结果不同"),
    "step_shard": ("the optimizer steps self.shard: keep the shard an nn.Parameter, and gather from it",
                   "优化器更新的是 self.shard：让分片保持为 nn.Parameter，并从它全聚合"),
    # what passed
    "passed_steps": ("  3 units (Linear {sizes}), {steps} SGD steps, global batch {batch}: every rank's gradient chunk "
                     "and parameter shard equal one process's, at every step",
                     "  3 个单元（Linear {sizes}），{steps} 步 SGD，全局批大小 {batch}：每一步里，"
                     "每个 rank 的梯度分块和参数分片都与单进程的结果相同"),
    "passed_accumulate": ("  step {step} accumulated two backward passes in shard.grad; every forward made fresh views",
                          "  第 {step} 步在 shard.grad 中累加了两次反向传播的梯度；每次前向都创建了新的视图"),
    "passed_freed": ("  after each unit's forward and after backward, the gathered parameters were freed",
                     "  每个单元的前向之后和反向之后，全聚合得到的参数都被释放了"),
})


def _unit_hint(exc: BaseException) -> Message:
    text = str(exc)
    if "out of bounds for storage of size 0" in text:
        return T("freed_backward")
    if "modified inplace" in text or "modified by an inplace operation" in text:
        return T("full_data")
    if "attempting to assign a gradient of size" in text:
        return T("grad_size")
    if "does not require grad" in text or "grad_fn" in text:
        return T("point_views")
    if "has no attribute 'weight'" in text or "has no attribute 'bias'" in text:
        return T("lost_params")
    if "'NoneType'" in text and "grad" in text:
        return T("full_grad_holds")
    return exception_hint(exc)


def _reference_chunks(model: nn.Module, n: int) -> list[FlatParamLayout]:
    return [FlatParamLayout.build(list(model[i].named_parameters()), n) for i in UNIT_INDICES]


def check_fsdp_unit(unit_class: Callable[[nn.Module, RankContext], Any],
                    world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `unit_class(module, ctx)`: three units over an MLP train exactly like one process.

    Per world size: every rank deep-copies the same model, wraps each Linear in a unit, trains
    3 SGD steps (optimizer over the units' `shard`s) on its slice of 12 samples; compared with one
    process on all 12 samples: the chunk of the averaged gradient each rank holds in `shard.grad`,
    and its `shard` after each step. Also: after each unit's forward and after the backward,
    `unit.full` holds no memory, and no `full.grad` is left.
    """
    check = "check_fsdp_unit"
    name = require_callable(check, unit_class, "FSDPUnit")
    sizes = require_world_sizes(world_sizes)
    model = seeded_mlp(SIZES, seed=11)
    batches = global_batches(STEPS, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=12)
    reference = one_process(model, batches, functools.partial(torch.optim.SGD, lr=LR)).steps(model)
    for n in sizes:
        state = [(0, "building the units")] * n

        def body(ctx: RankContext, n: int = n, state: list = state) -> list[Any]:
            m = copy.deepcopy(model)
            state[ctx.rank] = (0, "building the units")
            units = [unit_class(m[i], ctx) for i in UNIT_INDICES]
            freed_after_forward: list[tuple[int, int]] = []  # (unit, bytes still held)
            last_views: list[Any] = [None] * len(units)  # each unit's module.weight in its previous forward
            reused: list[int] = []  # units whose forward used the previous forward's views again

            def after_forward(mod: nn.Module, k: int, unit: Any) -> None:  # after the unit's own post_forward
                freed_after_forward.append((k, unit.full.untyped_storage().nbytes()))
                weight = mod.__dict__.get("weight", mod._parameters.get("weight"))
                if weight is not None and weight is last_views[k]:
                    reused.append(k)
                last_views[k] = weight

            for k, i in enumerate(UNIT_INDICES):
                m[i].register_forward_hook(lambda mod, args, out, u=units[k], k=k: after_forward(mod, k, u))
            opt = torch.optim.SGD([u.shard for u in units], lr=LR)
            steps = []
            for step, batch in enumerate(batches, 1):
                x, y = local_slice(batch, ctx.rank, n)
                freed_after_forward.clear()
                reused.clear()
                passes = 2 if step == ACCUMULATE_STEP else 1
                for p in range(passes):
                    state[ctx.rank] = (step, "forward" if passes == 1 else f"forward {p + 1} of {passes}")
                    loss = F.cross_entropy(m(x), y) / passes
                    state[ctx.rank] = (step, "backward" if passes == 1 else f"backward {p + 1} of {passes}")
                    loss.backward()
                after_backward = [(u.full.untyped_storage().nbytes(), u.full.grad is not None) for u in units]
                grads = [None if u.shard.grad is None else u.shard.grad.detach().clone() for u in units]
                state[ctx.rank] = (step, "optimizer step")
                opt.step()
                opt.zero_grad()
                steps.append((list(freed_after_forward), after_backward, grads,
                              [u.shard.detach().clone() for u in units], sorted(set(reused))))
            return steps

        def where(r: int, n: int = n, state: list = state) -> str:
            return f"world size {n}, rank {r}, step {state[r][0]} ({state[r][1]})"

        per_rank = run_checked(check, name, body, n, where, _unit_hint)
        layouts = _reference_chunks(model, n)
        for step in range(STEPS):
            for rank in range(n):
                _compare(check, n, rank, step + 1, per_rank[rank][step], reference[step], layouts)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("passed_steps", sizes="->".join(map(str, SIZES)), steps=STEPS, batch=GLOBAL_BATCH),
        T("passed_accumulate", step=ACCUMULATE_STEP), T("passed_freed"))


def _compare(check: str, n: int, rank: int, step: int, record: Any, ref: Any, layouts: list[FlatParamLayout]) -> None:
    freed_after_forward, after_backward, grads, shards, reused = record
    where = f"world size {n}, rank {rank}, step {step}"
    if step == ACCUMULATE_STEP:
        where += " (two forward and backward passes, each on half the loss, before the optimizer step)"
    for k in reused:
        CheckFailure(check, where, T("same_views", k=k), T("fresh_views")).fail()
    for k, held in freed_after_forward:
        if held:
            CheckFailure(check, where, T("held_after_forward", k=k, held=held), T("free_post_forward")).fail()
    for k, (held, has_grad) in enumerate(after_backward):
        if has_grad:
            CheckFailure(check, where, T("full_grad_alive", k=k), T("drop_full_grad")).fail()
        if held:
            CheckFailure(check, where, T("held_after_backward", k=k, held=held), T("free_post_backward")).fail()
    for k, layout in enumerate(layouts):
        infos = layout.infos
        full_grad = layout.flatten([ref.grads[f"{UNIT_INDICES[k]}.{i.name}"] for i in infos])
        expected = layout.shard(full_grad, rank)
        got = grads[k]
        if got is None:
            CheckFailure(check, where, T("no_grad", k=k), T("reduce_into")).fail()
        details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(got, 8)}"]
        if tuple(got.shape) != tuple(expected.shape):
            CheckFailure(check, where, T("shard_grad_shape", k=k, shape=tuple(got.shape)),
                         T("reduce_full", numel=layout.shard_numel), details).fail()
        if not close(got, expected):
            c = scale_ratio(got, expected, rtol=1e-3)
            hint = T("averaged_chunk")
            if c is not None and step == ACCUMULATE_STEP and abs(c * 2 - 1) < 1e-3:  # step 1 was right
                hint = T("half", rank=rank)
            elif c is not None and n > 1 and abs(c / n - 1) < 1e-3:
                hint = T("too_large", rank=rank, n=n)
            elif c is not None and n > 1 and abs(c * n - 1) < 1e-3:
                hint = T("too_small", rank=rank, n=n)

            details.append(f"max difference {max_rel_diff(got, expected):.3g} relative to the largest value")
            CheckFailure(check, where, T("chunk_differs", k=k), hint, details).fail()
        expected_shard = layout.shard(layout.flatten([ref.params[f"{UNIT_INDICES[k]}.{i.name}"] for i in infos]), rank)
        if not close(shards[k], expected_shard):
            CheckFailure(check, where, T("shard_differs", k=k), T("step_shard"),
                         [f"expected {format_tensor(expected_shard, 8)}", f"got      {format_tensor(shards[k], 8)}"]
                         ).fail()
