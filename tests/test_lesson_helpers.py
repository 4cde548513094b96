"""The bookkeeping lessons 05, 08 and 09 call in one line (fsdp_course.demos.digit_training and .reproduce,
fsdp_course.fsdp.layout_tables, fsdp_course.viz.training): the paths the lessons' own runs do not take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.demos.digit_training import (
    EpochLog,
    batches,
    format_log,
    steps_per_epoch,
    train_in_threads,
    train_steps,
)
from fsdp_course.demos.reproduce import error_message, one_step, rank_failures
from fsdp_course.fsdp.layout_tables import layouts_table, per_param_table
from fsdp_course.fsdp.per_param import PerParamLayout
from fsdp_course.runtime.simulate import run_ranks
from fsdp_course.viz.training import plot_positions_prenorm


def test_error_message_names_the_exception_and_insists_on_one() -> None:
    assert error_message(int, "x").startswith("ValueError: invalid literal")
    with pytest.raises(AssertionError, match="raised nothing"):
        error_message(int, "3")


def test_rank_failures_maps_each_failed_rank_to_its_exception() -> None:
    assert rank_failures(lambda ctx: ctx.rank, 2) == {}

    def second_fails(ctx):  # type: ignore[no-untyped-def]
        if ctx.rank == 1:
            raise RuntimeError("rank 1 gives up")

    failures = rank_failures(second_fails, 2, timeout=5)
    assert list(failures) == [1] and "rank 1 gives up" in str(failures[1])


def test_one_step_returns_the_step_and_the_optimizer() -> None:
    def sgd_step(opt: torch.optim.Optimizer, p: torch.Tensor) -> None:
        p.grad = torch.ones_like(p)
        opt.step()

    step, opt = one_step(lambda p: torch.optim.SGD([p], lr=0.5), sgd_step, numel=3)
    assert torch.equal(step, torch.full((3,), -0.5)) and isinstance(opt, torch.optim.SGD)


def test_batches_and_steps_per_epoch_drop_the_short_tail() -> None:
    assert [b.tolist() for b in batches(range(7), 3)] == [[0, 1, 2], [3, 4, 5]]
    assert steps_per_epoch(1438, 4, 16) == 22 and steps_per_epoch(1438, 1, 64) == 22


def test_epoch_log_agrees_on_every_rank_and_stops_at_max_steps() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(40, 5), torch.arange(40) % 3
    base = nn.Linear(5, 3)

    def rank_fn(ctx):  # type: ignore[no-untyped-def]
        model = nn.Linear(5, 3)
        model.load_state_dict(base.state_dict())
        log = EpochLog(ctx, x, y, 3)
        for idx in batches(range(ctx.rank, 40, ctx.world_size), 4):
            logits = model(x[idx])
            if log.step(F.cross_entropy(logits, y[idx]), logits, y[idx]) == 3:  # max_steps = 3
                break
        log.epoch(model)
        return log.summary()

    logs = run_ranks(rank_fn, 2)
    assert logs[0] == logs[1], "losses and scores are all-reduced"
    assert len(logs[0]["step_loss"]) == 3 and len(logs[0]["test_acc"]) == len(logs[0]["train_acc"]) == 1
    assert sum(logs[0]["predicted"].values()) == 40 and 0 <= logs[0]["test_acc"][0] <= 1
    assert format_log("run", logs[0]).splitlines()[0] == "run: 3 steps, 3 per epoch"


def test_train_steps_draws_with_a_generator_or_takes_global_batches() -> None:
    x, y = torch.randn(20, 4), torch.arange(20) % 2
    runs = {seed: (lambda s=seed: train_steps(nn.Linear(4, 2), x, y, 3, batch=4, generator=torch.Generator()
                                              .manual_seed(s))) for seed in (0, 1)}
    losses = train_in_threads(runs)
    assert list(losses) == [0, 1] and all(len(v) == 3 for v in losses.values())
    assert len(train_steps(nn.Linear(4, 2), x, y, 2, batch=4)) == 2


def test_layout_tables_have_a_line_per_parameter_and_per_layout() -> None:
    params = [("w", torch.zeros(3, 4)), ("b", torch.zeros(3))]
    assert len(per_param_table(PerParamLayout.build(params, 2)).splitlines()) == 1 + 2
    assert len(layouts_table(params, (2, 3)).splitlines()) == 1 + 2 * 2


def test_the_four_runs_figure_draws_every_run() -> None:
    logs = {(p, n): {"step_loss": [2.3, 2.0, 1.5, 1.2], "test_acc": [0.2, 0.4]} for p in (False, True)
            for n in (False, True)}
    fig = plot_positions_prenorm(logs, 0.22)
    assert len(fig.axes) == 2 and len(fig.axes[1].get_lines()) == 4 + 1  # four runs and the bag's line
