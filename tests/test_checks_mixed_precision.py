"""The checkers of exercise 13 (fp16 loss scaling over shards) pass the reference solutions and fail planted mistakes
with the right hint; the reference found-inf check keeps the ranks together in a real fp16 FSDP step.

Each planted mistake is the reference with one thing wrong, the way a learner would get it wrong: a decision each
rank takes alone (the sharding trap), `torch.isinf` that misses NaN, a collective made only by the ranks that found
an inf, a tensor or a count returned instead of a bool, shards not unscaled in place; for the scale's update, an
off-by-one growth and a count that is not reset.
"""

from __future__ import annotations

from collections.abc import Callable

import nbformat
import pytest
import torch
from reference_solutions import ROOT, fails, load

from fsdp_course import RankContext
from fsdp_course.classroom.checks import check_found_inf, check_update_scale

MP = load("13_loss_scaling")


def demonstration() -> dict:
    """The namespace of the notebook's first demonstration cell (fp16_step, decide_alone), run after the reference."""
    nb = nbformat.read(ROOT / "solutions" / "13_loss_scaling.ipynb", as_version=4)
    namespace = dict(MP)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def fp16_step(" in c.source)
    exec(compile(cell.source, "<solution 13_loss_scaling demonstration>", "exec"), namespace)  # noqa: S102
    return namespace


# -- part 1: the found-inf check ----------------------------------------------------------------------------
def decides_alone(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    for g in shards:
        g.div_(scale)
    return any(not torch.isfinite(g).all() for g in shards)


def misses_nan(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    found = torch.zeros(1)
    for g in shards:
        g.div_(scale)
        found = torch.maximum(found, torch.isinf(g).any().float().reshape(1))
    return bool(ctx.all_reduce(found, op="max").item())


def reduces_only_when_found(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    for g in shards:
        g.div_(scale)
    if any(not torch.isfinite(g).all() for g in shards):
        ctx.all_reduce(torch.ones(1), op="max")
        return True
    return False


def divides_only_when_clean(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    found = torch.zeros(1)
    for g in shards:
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
    found = ctx.all_reduce(found, op="max")
    if not found.item():  # the step is skipped anyway, but the contract is broken
        for g in shards:
            g.div_(scale)
    return bool(found.item())


def returns_the_flag_tensor(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> torch.Tensor:
    found = torch.zeros(1)
    for g in shards:
        g.div_(scale)
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
    return ctx.all_reduce(found, op="max")  # the right answer, as a tensor holding 0.0 or 1.0


def returns_the_count(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> float:
    found = torch.zeros(1)
    for g in shards:
        g.div_(scale)
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
    return ctx.all_reduce(found, op="sum").item()


def not_in_place(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    found = torch.zeros(1)
    for g in shards:
        g = g / scale
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
    return bool(ctx.all_reduce(found, op="max").item())


def multiplies(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    found = torch.zeros(1)
    for g in shards:
        g.mul_(scale)
        found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
    return bool(ctx.all_reduce(found, op="max").item())


def checks_last_shard_only(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    for g in shards:
        g.div_(scale)
    found = (~torch.isfinite(shards[-1])).any().float().reshape(1)  # the checker plants its values in shard 0
    return bool(ctx.all_reduce(found, op="max").item())


def always_skips(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    for g in shards:
        g.div_(scale)
    return True


def stub(ctx: RankContext, shards: list[torch.Tensor], scale: float) -> bool:
    # YOUR CODE HERE
    raise NotImplementedError()


def test_found_inf_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    check_found_inf(MP["unscale_and_check"])
    out = capsys.readouterr().out
    assert out.startswith("All tests in check_found_inf passed (world sizes 1, 2, 3, 4)")


@pytest.mark.parametrize(("fn", "world_sizes", "where", "says", "fields"), [
    (decides_alone, (1, 2), "world size 2, an inf on the last rank only", "mixed_precision.decision_local",
     {"a": 0, "b": 1}),
    (misses_nan, (2,), "world size 2, a NaN on the last rank only", "mixed_precision.nan_missed", {}),
    (reduces_only_when_found, (2,), "world size 2, an inf on the last rank only, rank 1",
     "mixed_precision.all_reduce_under_if", {}),
    (returns_the_flag_tensor, (1, 2), "world size 1, no inf or NaN, rank 0", "mixed_precision.return_bool", {}),
    (returns_the_count, (2,), "world size 2, no inf or NaN, rank 0", "mixed_precision.return_bool", {}),
    (not_in_place, (2,), "world size 2, no inf or NaN, rank 0", "mixed_precision.not_unscaled", {}),
    (multiplies, (1,), "world size 1, no inf or NaN, rank 0", "mixed_precision.multiplied", {}),
    (checks_last_shard_only, (2,), "world size 2, an inf on every rank", "mixed_precision.no_rank_found", {}),
    (always_skips, (2,), "world size 2, no inf or NaN", "mixed_precision.finite_false", {}),
    (divides_only_when_clean, (2,), "world size 2, an inf on every rank, rank 0", "mixed_precision.left_scaled", {}),
])
def test_found_inf_planted(fn: Callable, world_sizes: tuple[int, ...], where: str, says: str, fields: dict,
                           capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_found_inf, fn, world_sizes=world_sizes, says=says, fields=fields, capsys=capsys)
    assert f"check_found_inf FAILED at {where}\n" in out, out


def test_found_inf_stub_says_not_implemented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check_found_inf(stub)
    assert "FAILED" not in capsys.readouterr().out


def test_the_reference_keeps_a_real_fp16_fsdp_step_together(capsys: pytest.CaptureFixture[str]) -> None:
    """The notebook's own demonstration: deciding alone splits the ranks, the reference does not (one process
    skips and changes nothing; two ranks with the reference do the same)."""
    demo = demonstration()
    assert "2 ranks: stepped [True, False]" in capsys.readouterr().out
    alone = demo["fp16_step"](demo["decide_alone"], world_size=2)
    assert [r["stepped"] for r in alone] == [True, False] and alone[0]["changed"] > 0.2
    for n in (1, 2):
        ours = demo["fp16_step"](MP["unscale_and_check"], world_size=n)
        assert [r["stepped"] for r in ours] == [False] * n and all(r["changed"] == 0 for r in ours)


# -- part 2: the scale's update ----------------------------------------------------------------------------
def grows_one_step_late(scale: float, found_inf: bool, clean_steps: int, growth_interval: int) -> tuple[float, int]:
    if found_inf:
        return scale * 0.5, 0
    if clean_steps == growth_interval:
        return scale * 2.0, 0
    return scale, clean_steps + 1


def keeps_count_on_skip(scale: float, found_inf: bool, clean_steps: int, growth_interval: int) -> tuple[float, int]:
    if found_inf:
        return scale * 0.5, clean_steps
    return MP["update_scale"](scale, found_inf, clean_steps, growth_interval)


def keeps_count_on_growth(scale: float, found_inf: bool, clean_steps: int, growth_interval: int) -> tuple[float, int]:
    new_scale, new_clean = MP["update_scale"](scale, found_inf, clean_steps, growth_interval)
    return new_scale, (clean_steps + 1 if new_scale > scale else new_clean)


def never_backs_off(scale: float, found_inf: bool, clean_steps: int, growth_interval: int) -> tuple[float, int]:
    return MP["update_scale"](scale, False, clean_steps, growth_interval) if not found_inf else (scale, 0)


def returns_scale_only(scale: float, found_inf: bool, clean_steps: int, growth_interval: int) -> float:
    return MP["update_scale"](scale, found_inf, clean_steps, growth_interval)[0]


def test_update_scale_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    check_update_scale(MP["update_scale"])
    assert capsys.readouterr().out.startswith("All tests in check_update_scale passed (15 steps against torch.")


@pytest.mark.parametrize(("fn", "where", "says", "fields"), [
    (grows_one_step_late, "step 3 ", "mixed_precision.double_now", {"n": 3}),
    (keeps_count_on_skip, "step 5 ", "mixed_precision.reset_after_skip", {}),
    (keeps_count_on_growth, "step 3 ", "mixed_precision.reset_after_growth", {}),
    (never_backs_off, "step 5 ", "mixed_precision.backoff", {}),
    (returns_scale_only, "step 1 ", "mixed_precision.return_pair", {}),
])
def test_update_scale_planted(fn: Callable, where: str, says: str, fields: dict,
                              capsys: pytest.CaptureFixture[str]) -> None:
    out = fails(check_update_scale, fn, says=says, fields=fields, capsys=capsys)
    assert f"check_update_scale FAILED at {where}" in out, out
