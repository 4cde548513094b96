"""Checkers of exercise 10: gradient clipping by the global norm, and a data-parallel step debugged.

Design notes: docs/CLASSROOM.md, "Checkers", `pitfalls.py`.
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
    factor_mistake,
    format_tensor,
    hints,
    known_mistake,
    padded_flat_grads,
    require_learner,
    run_checked,
    say_passed,
    scale_ratio,
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
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch

__all__ = ["check_clip_grad_norm", "check_train_step"]

CLIP_NUMELS = (30, 17)  # two flat gradients; 17 needs padding for 2, 3 and 4 ranks
CLIP_CASES = (("clipping", 1.0), ("no clipping", 1e6))
STEP_SIZES = (6, 5, 3)
STEP_STEPS, STEP_BATCH, STEP_LR = 4, 12, 0.5

T = catalogue("pitfalls")  # fsdp_course/i18n/catalogues/pitfalls.yml


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
    name, sizes = require_learner(check, fn, "clip_grad_norm_sharded", world_sizes)
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
    say_passed(check, sizes, T("clip_passed"))


def _compare_clip(check: str, n: int, case: str, max_norm: float, rank: int, norm: Any, clipped: list,
                  total: float, reference: list[torch.Tensor], shards: list[list[torch.Tensor]]) -> None:
    where = f"world size {n}, {case} (max_norm {max_norm:g}), rank {rank}"
    if isinstance(norm, torch.Tensor) and norm.numel() == 1:
        norm = float(norm)
    if isinstance(norm, bool) or not isinstance(norm, (int, float)):
        CheckFailure(check, where, T("not_norm", kind=type(norm).__name__), T("return_norm")).fail()
    norms = [math.sqrt(sum(float(s.pow(2).sum()) for s in mine)) for mine in shards]  # each rank's own norm
    own = norms[rank]
    if abs(norm - total) > 1e-5 * total:  # (at N = 1 no mistake below can give another norm than the total)
        hint = known_mistake(norm, [(own, lambda: T("own_norm", norm=norm, rank=rank)),
                                    (sum(norms), lambda: T("norms_add")),
                                    (total / math.sqrt(n), lambda: T("sqrt_mean"))],
                             lambda a, b: abs(a - b) <= 1e-5 * b)
        CheckFailure(check, where, T("wrong_norm", rank=rank, norm=norm, total=total), hint or T("norm_formula")).fail()
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


_step_hint = hints((CollectiveMismatch, T("collective_on_rank0")), (CollectiveHang, T("collective_on_rank0")))


def check_train_step(fn: Callable[[RankContext, Any, torch.optim.Optimizer, torch.Tensor, torch.Tensor], Any],
                     world_sizes: Sequence[int] = (1, 2, 4)) -> None:
    """Check `fn(ctx, model, optimizer, x, y) -> loss`: one data-parallel SGD step that matches one process.

    Every rank holds the same model (a deep copy) and calls `fn` on its slice of each of 4 global
    batches of 12; `fn` does forward, backward, averages the gradients, steps, zeroes the
    gradients and returns the global loss (mean over the ranks) as a float, on every rank.
    Compared with one process on the whole batches: the returned loss and the parameters, per step.
    """
    check = "check_train_step"
    name, sizes = require_learner(check, fn, "train_step", world_sizes)
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
    say_passed(check, sizes, T("step_passed", steps=STEP_STEPS, batch=STEP_BATCH))


def _compare_step(check: str, n: int, rank: int, step: int, loss: Any, params: dict, local_loss: float,
                  ref: Any, before: dict) -> None:
    where = f"world size {n}, rank {rank}, step {step}"
    for pname, expected in ref.params.items():
        got = params[pname]
        if close(got, expected):
            continue
        start = before[pname].detach()
        hint = factor_mistake(got - start, expected - start, [(n, lambda: T("grads_summed", n=n)),
                                                              (1 / n, lambda: T("averaged_twice", n=n)),
                                                              (2, lambda: T("stepped_twice"))])
        CheckFailure(check, where, T("param_differs", rank=rank, pname=pname), hint or T("average_then_step"),
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
