"""Checkers of exercise 13: fp16 loss scaling over sharded gradients (the found-inf check, then the scale's update).

Cites Micikevicius et al. (arXiv:1710.03740, section 3.2); torch's ShardedGradScaler.
Design notes: docs/CLASSROOM.md, "Checkers", `mixed_precision.py`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    format_tensor,
    hints,
    padded_flat_grads,
    require_callable,
    require_learner,
    run_checked,
    say_passed,
    scale_ratio,
)
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

T = catalogue("mixed_precision")  # fsdp_course/i18n/catalogues/mixed_precision.yml


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


_hint_for = hints((CollectiveMismatch, T("all_reduce_under_if")), (CollectiveHang, T("all_reduce_under_if")),
                  ("op must be one of", T("flag_max")))


def check_found_inf(fn: Callable[[RankContext, list[torch.Tensor], float], Any],
                    world_sizes: Sequence[int] = (1, 2, 3, 4)) -> None:
    """Check `fn(ctx, shards, scale) -> bool`: unscale this rank's gradient shards in place and say, the same on
    every rank, whether any rank's shards hold an inf or NaN.

    Compared with torch's one-process kernel on the full gradients: with nothing planted, every rank returns False
    and holds its chunk of the unscaled gradients; with an inf on every rank, an inf on the last rank only and a NaN
    on the last rank only, every rank returns True.
    """
    check = "check_found_inf"
    name, sizes = require_learner(check, fn, "unscale_and_check", world_sizes)
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
    say_passed(check, sizes, T("found_inf_passed"))


def _judge_flags(check: str, where: str, n: int, plant: str | None, flags: list[bool], expected: bool) -> None:
    if len(set(flags)) > 1:
        stepped = [r for r, f in enumerate(flags) if not f]
        skipped = [r for r, f in enumerate(flags) if f]
        who_stepped = T("stepped_many" if len(stepped) > 1 else "stepped_one", ranks=", ".join(map(str, stepped)))
        who_skipped = T("skipped_many" if len(skipped) > 1 else "skipped_one", ranks=", ".join(map(str, skipped)))
        CheckFailure(check, where, T("disagree", stepped=who_stepped, skipped=who_skipped),
                     T("decision_local", a=stepped[0], b=skipped[0]), [f"returned, by rank: {flags}"]).fail()
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
    say_passed(check, T("update_steps", steps=len(SEQUENCE)), T("update_passed", growth=GROWTH_INTERVAL))


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
