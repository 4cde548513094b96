"""Checkers of exercise 02: DDP by hand, broadcast the initial parameters and average gradients with hooks.

Cites ZeRO (arXiv:1910.02054, section 2); PyTorch's DDP (torch/nn/parallel/distributed.py).
Design notes: docs/CLASSROOM.md, "Checkers", `ddp.py`.
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
    factor_mistake,
    format_tensor,
    known_mistake,
    require_callable,
    require_learner,
    require_world_sizes,
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
from fsdp_course.i18n.messages import catalogue
from fsdp_course.runtime.context import RankContext

__all__ = ["check_broadcast_parameters", "check_ddp"]

SIZES = (6, 5, 3)  # Linear(6, 5) -> Tanh -> Linear(5, 3): parameters 0.weight, 0.bias, 2.weight, 2.bias
STEPS, GLOBAL_BATCH, LR = 3, 12, 0.5  # 12 splits evenly over 1, 2, 3 and 4 ranks

T = catalogue("ddp")  # fsdp_course/i18n/catalogues/ddp.yml


def _rank_models(world_size: int) -> list[nn.Module]:
    """A different random model per rank (seed 100 + rank): only a broadcast makes them equal."""
    return [seeded_mlp(SIZES, seed=100 + r) for r in range(world_size)]


def _broadcast_problem(rank: int, name: str, got: torch.Tensor, models: list[nn.Module]) -> tuple[Message, Message]:
    """(problem, hint) for a parameter that does not hold rank 0's initial values after the broadcast."""
    originals = [dict(m.named_parameters())[name].detach() for m in models]
    hint = known_mistake(got, [(originals[rank], lambda: T("own_values", rank=rank, name=name)),
                               *((o, lambda k=k: T("other_rank", rank=rank, name=name, k=k))
                                 for k, o in enumerate(originals) if k),
                               (torch.stack(originals).mean(0), lambda: T("averaged"))], close)
    problem = T("not_broadcast", rank=rank, name=name, diff=float((got - originals[0]).abs().max()))
    return problem, hint or T("broadcast")


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
    name, sizes = require_learner(check, fn, "broadcast_parameters", world_sizes)
    for n in sizes:
        _run_broadcast(check, name, fn, n)
    say_passed(check, sizes, T("broadcast_passed"))


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
    say_passed(check, sizes, T("ddp_passed", steps=STEPS, batch=GLOBAL_BATCH))


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
        hint = factor_mistake(got, expected, [(n, lambda: T("summed", rank=rank, n=n)),
                                              (1 / n, lambda: T("averaged_twice", rank=rank, n=n))])
        if hint is None and step == 1 and n > 1:  # the gradient of this rank's slice alone: one process on that slice
            alone = one_process(base, [local_slice(batches[0], rank, n)], functools.partial(torch.optim.SGD, lr=LR))
            if close(got, alone.steps(base)[0].grads[pname]):
                hint = T("own_slice", rank=rank)
        CheckFailure(check, where, T("grad_differs", rank=rank, name=pname), hint or T("one_process"), details).fail()
    for pname, expected in ref.params.items():
        got = params[pname]
        if not close(got, expected):
            CheckFailure(check, where, T("param_differs", rank=rank, name=pname, diff=max_rel_diff(got, expected)),
                         T("step_unused")).fail()

