"""Checker of exercise 06: the FSDP unit, checked by training equivalence against one process.

Cites PyTorch FSDP (arXiv:2304.11277, section 3); FSDP2's names for the four moments.
Design notes: docs/CLASSROOM.md, "Checkers", `fsdp_unit.py`.
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
    factor_mistake,
    format_tensor,
    require_learner,
    run_checked,
    say_passed,
)
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

T = catalogue("fsdp_unit")  # fsdp_course/i18n/catalogues/fsdp_unit.yml


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
    name, sizes = require_learner(check, unit_class, "FSDPUnit", world_sizes)
    model = seeded_mlp(SIZES, seed=11)
    batches = global_batches(STEPS, GLOBAL_BATCH, SIZES[0], SIZES[-1], seed=12)
    reference = one_process(model, batches, functools.partial(torch.optim.SGD, lr=LR)).steps(model)
    for n in sizes:
        state = [(0, "building the units")] * n

        def body(ctx: RankContext, n: int = n, state: list = state) -> list[Any]:
            m = copy.deepcopy(model)
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
        layouts = [FlatParamLayout.build(list(model[i].named_parameters()), n) for i in UNIT_INDICES]
        for step in range(STEPS):
            for rank in range(n):
                _compare(check, n, rank, step + 1, per_rank[rank][step], reference[step], layouts)
    say_passed(check, sizes, T("passed_steps", sizes="->".join(map(str, SIZES)), steps=STEPS, batch=GLOBAL_BATCH),
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
            hint = factor_mistake(got, expected, [(0.5 if step == ACCUMULATE_STEP else None,  # step 1 was right
                                                   lambda: T("half", rank=rank)),
                                                  (n, lambda: T("too_large", rank=rank, n=n)),
                                                  (1 / n, lambda: T("too_small", rank=rank, n=n))])
            details.append(f"max difference {max_rel_diff(got, expected):.3g} relative to the largest value")
            CheckFailure(check, where, T("chunk_differs", k=k), hint or T("averaged_chunk"), details).fail()
        expected_shard = layout.shard(layout.flatten([ref.params[f"{UNIT_INDICES[k]}.{i.name}"] for i in infos]), rank)
        if not close(shards[k], expected_shard):
            CheckFailure(check, where, T("shard_differs", k=k), T("step_shard"),
                         [f"expected {format_tensor(expected_shard, 8)}", f"got      {format_tensor(shards[k], 8)}"]
                         ).fail()
