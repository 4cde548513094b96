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
    scale_ratio,
)
from fsdp_course.engines.equivalence import close, max_rel_diff
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.monitor import CollectiveHang, CollectiveMismatch

__all__ = ["check_found_inf", "check_update_scale"]

NUMELS = (30, 17)  # two flat gradients; 17 needs padding for 2, 3 and 4 ranks
SCALE = 1024.0  # a power of two, as GradScaler's scales are: dividing by it is exact
# (name, what is planted): the order matters, each case's hint assumes the cases before it passed
CASES = (("no inf or NaN", None), ("an inf on every rank", "inf everywhere"),
         ("an inf on the last rank only", "inf"), ("a NaN on the last rank only", "nan"))


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
        shown = f"a tensor, {value!r}" if isinstance(value, torch.Tensor) else f"{value!r} ({type(value).__name__})"
        CheckFailure(check, where, f"rank {rank} returned {shown}, not a Python bool",
                     "return a Python bool, e.g. bool(flag.item())").fail()
    CheckFailure(check, where, f"rank {rank} returned {value!r} ({type(value).__name__}), not True or False",
                 "return True (some rank found an inf or NaN: skip the step) or False (every shard is finite)").fail()


def _hint_for(exc: BaseException) -> str:
    if isinstance(exc, (CollectiveMismatch, CollectiveHang)):
        return ("some ranks made a collective that others did not (an all-reduce under `if found:`?): every rank "
                "must call the all-reduce, with its flag 0 or 1, whether or not it found an inf")
    if "op must be one of" in str(exc):
        return ("a flag of 1.0 (found) or 0.0 (not) on each rank, all-reduced with op='max', is 1.0 on every rank "
                "exactly when some rank found an inf or NaN")
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
    print(f"All tests in {check} passed (world sizes {', '.join(map(str, sizes))})")
    print("  every rank unscales its shards as torch's kernel does on the full gradients, and every rank skips when "
          "any one rank holds an inf or a NaN")


def _judge_flags(check: str, where: str, n: int, plant: str | None, flags: list[bool], expected: bool) -> None:
    if len(set(flags)) > 1:
        stepped = [r for r, f in enumerate(flags) if not f]
        skipped = [r for r, f in enumerate(flags) if f]
        a, b = stepped[0], skipped[0]
        CheckFailure(check, where, f"the ranks disagree: {_who(stepped)} returned False, {_who(skipped)} True",
                     f"rank {a} would step while rank {b} skips: the decision was local. All-reduce the flag with "
                     "op='max' (every rank, found or not), so that every rank skips when any rank found an inf",
                     [f"returned, by rank: {flags}"]).fail()
    got = flags[0]
    if got == expected:
        return
    if not expected:
        hint = ("with every shard finite, return False: True only when some shard holds an inf or NaN "
                "(torch.isfinite(g).all() is True for a clean shard)")
    elif plant == "inf everywhere":
        hint = ("no rank found the inf in its own shards: after dividing, test each shard with torch.isfinite "
                "(or look for inf/NaN in it) and turn that into a flag")
    elif plant == "nan":
        hint = ("an inf is found, a NaN is not: torch.isinf misses NaN. Use ~torch.isfinite(g), which is True for "
                "inf, -inf and NaN")
    elif n > 1:
        hint = ("every rank agreed, but an inf on one rank did not make them skip, while an inf on every rank did: "
                "that is op='min' (or a product): skip if ANY rank found one, op='max' (or 'sum', then > 0)")
    else:
        hint = "test every shard, not only the first: any shard with an inf or NaN means skip"
    CheckFailure(check, where, f"every rank returned {got}, one process finds "
                 f"{'an inf or NaN' if expected else 'nothing'} ({expected})", hint).fail()


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


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
            hint = ("the shards were left scaled because an inf was found: the contract is to divide every shard in "
                    "place first, whatever the flag, as torch's kernel does (GradScaler unscales, then checks)")
        elif untouched:
            hint = ("the shards were not unscaled: divide each one in place (g.div_(scale) or g.mul_(1 / scale)); "
                    "a new tensor (g = g / scale) leaves the optimizer's .grad as it was")
        elif ratio is not None and math.isclose(ratio, 1 / SCALE, rel_tol=1e-6):
            hint = "divided by the scale twice: once is enough"
        elif ratio is not None and math.isclose(ratio, SCALE * SCALE, rel_tol=1e-6):
            hint = "multiplied by the scale: unscaling divides by it (the loss was multiplied before backward)"
        else:
            hint = "divide every shard of this rank by `scale`, in place, and nothing else"
        details = [f"expected {format_tensor(expected, 8)}", f"got      {format_tensor(g, 8)}"]
        if same_shape:
            details.append(f"max difference {max_rel_diff(g[finite], expected[finite]):.3g} relative (finite values)")
        CheckFailure(check, where, f"shard {i} after unscaling differs from one process's", hint, details).fail()


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
            CheckFailure(check, where, f"returned {got!r}, not a pair", "return (new_scale, new_clean_steps)").fail()
        new_scale, new_clean = float(got[0]), got[1]
        if (new_scale, int(new_clean)) != expected or new_clean != int(new_clean):
            CheckFailure(check, where, f"returned (scale {new_scale:g}, clean_steps {new_clean}), torch's "
                         f"GradScaler gives (scale {expected[0]:g}, clean_steps {expected[1]})",
                         _update_hint(scale, found, clean, (new_scale, new_clean), expected),
                         [f"the steps so far (found_inf, scale after): {history}"] if history else []).fail()
        scale, clean = expected
        history.append((found, scale))
    print(f"All tests in {check} passed ({len(SEQUENCE)} steps against torch._amp_update_scale_)")
    print(f"  the scale halves after every skipped step and doubles after {GROWTH_INTERVAL} clean steps in a row, the "
          "count of clean steps restarting after each change; every rank runs this rule on the same decision")


def _update_hint(scale: float, found: bool, clean: int, got: tuple[float, Any], expected: tuple[float, int]) -> str:
    new_scale, new_clean = got
    if found and new_scale != scale * 0.5:
        return "after a skipped step (found_inf True) the scale is multiplied by backoff_factor = 0.5"
    if found:
        return "after a skipped step the count of clean steps starts again from 0"
    if expected[0] == scale * 2 and new_scale == scale:
        return (f"this clean step is the {clean + 1}th in a row, which reaches growth_interval: the scale doubles now. "
                "Count this step first, then compare the count with >= (or ==) growth_interval: comparing the old "
                "count, or with >, doubles one step late")
    if expected[0] == scale and new_scale == scale * 2:
        return (f"only {clean + 1} clean steps in a row: the scale doubles when the count reaches growth_interval, "
                "not before")
    if expected[0] == scale * 2 and new_clean != 0:
        return "when the scale grows, the count of clean steps starts again from 0"
    if new_clean != clean + 1:
        return "after a clean step (found_inf False) the count of clean steps goes up by one"
    return "halve the scale and reset the count on found_inf; else count the step and double at growth_interval"
