"""The loops and tables lessons 02, 03 and 06 call in one line (fsdp_course/engines/steps.py, memory.saved_by_shape,
viz.timeline.timeline_table, viz.zero_bars.zero_table): the paths the lessons themselves do not take."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from fsdp_course import run_ranks
from fsdp_course.engines import DDP, ZeRO1
from fsdp_course.engines.steps import measured_step, record_steps, train_steps
from fsdp_course.fsdp import FSDP
from fsdp_course.memory import saved_by_shape, zero_formula
from fsdp_course.viz.timeline import timeline_table
from fsdp_course.viz.zero_bars import zero_table

SGD = functools.partial(torch.optim.SGD, lr=0.1)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batches(steps: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(steps)]


def test_train_steps_records_every_step_and_calls_after_backward_before_the_step() -> None:
    model, calls = _model(), []
    start = [p.detach().clone() for p in model.parameters()]

    def after_backward() -> None:  # sees the gradients of this step and the parameters before its update
        calls.append(all(p.grad is not None for p in model.parameters())
                     and all(torch.equal(p, q) for p, q in zip(model.parameters(), start, strict=True)))
        for p in model.parameters():
            p.grad.zero_()  # so the step does nothing

    run = train_steps(model, SGD, _batches(2)[:1], after_backward=after_backward)
    assert calls == [True] and len(run.losses) == len(run.grads) == len(run.params) == 1
    assert all(torch.equal(p, q) for p, q in zip(run.params[0], start, strict=True))
    assert run.memory == {} and run.ledger is None  # a plain module lists no tensors


def test_record_steps_without_a_ledger_keeps_the_last_steps_events() -> None:
    def fn(ctx):
        return record_steps(lambda: FSDP(_model(), ctx), ADAMW, _batches(2))

    (run,) = run_ranks(fn, 1)
    labels = [label for label, _ in run.timeline]
    assert labels[0] == "step starts" and labels[-1] == "optimizer step" and "forward done" in labels
    assert run.ledger is None and run.peak == max(sum(v for k, v in snap.items() if k != "buffers")
                                                  for _, snap in run.timeline)


def test_measured_step_for_an_engine_that_owns_its_optimizer_and_for_one_that_does_not() -> None:
    x, y = _batches(1)[0]

    def fn(ctx):
        return (measured_step(ZeRO1(_model(), ctx, ADAMW), None, x, y),
                measured_step(DDP(_model(), ctx), ADAMW, x, y))

    zero1, ddp = run_ranks(fn, 2)[0]
    psi = sum(p.numel() for p in _model().parameters())
    assert ddp["optimizer"] == 8 * psi + 4 * 4  # 4 parameter tensors, a step counter each
    assert zero1["optimizer"] < ddp["optimizer"] and zero1["grads"] >= ddp["grads"]  # its state sharded; padded
    plain = measured_step(copy.deepcopy(_model()), SGD, x, y)
    assert plain == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 0}


def test_timeline_table_shows_the_columns_asked_for_in_kib() -> None:
    timeline = [("a", {"params": 2048, "grads": 0, "optimizer": 1024}), ("b", {"params": 2048, "grads": 512})]
    table = timeline_table(timeline, "event", columns={"grads": "g"})
    assert table.splitlines() == ["event  total      g", "a        3.0    0.0", "b        2.5    0.5"]


def test_saved_by_shape_counts_each_storage_and_sorts_by_bytes() -> None:
    text = saved_by_shape({1: (64, (4, 4), "float32"), 2: (64, (4, 4), "float32"), 3: (256, (8, 8), "float32")})
    assert text.splitlines()[0] == "3 saved tensors, 384 bytes; by shape:"
    assert "(8, 8)" in text.splitlines()[1] and text.splitlines()[2].strip().startswith("2 x (4, 4)")


def test_zero_table_has_a_row_per_stage_and_follows_the_optimizer() -> None:
    rows = zero_table({"N = 2": (1000, 2)}, optimizer="sgd").splitlines()
    assert [r.split()[0] for r in rows[1:]] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    assert zero_formula(1000, 2, 0, optimizer="sgd")["total"] == 8000 and rows[1].endswith("7.81 KiB")
