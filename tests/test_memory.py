"""Tests for fsdp_course.memory: storage-based measurement, recorder, ZeRO formulas."""

import pytest
import torch

from fsdp_course.memory import (
    attach,
    measure,
    measure_tensors,
    record_event,
    total_bytes,
    zero_formula,
)


class ToyEngine:
    """Holds a flat buffer and views of it, the way the engines do."""

    def __init__(self) -> None:
        self.flat = torch.zeros(100)  # 400 bytes
        self.views = [self.flat[:50], self.flat[50:]]
        self.gathered = torch.zeros(200)  # 800 bytes
        self.timeline = []

    def memory_tensors(self):
        return {"sharded_params": self.views + [self.flat], "gathered_params": [self.gathered],
                "grads": [self.flat[:10]]}


def test_views_of_one_storage_count_once():
    e = ToyEngine()
    snap = measure(e)
    assert snap["sharded_params"] == 400
    assert snap["gathered_params"] == 800
    assert snap["grads"] == 0  # same storage, already counted under sharded_params
    assert snap["optimizer"] == 0


def test_freed_storage_counts_zero():
    e = ToyEngine()
    e.gathered.untyped_storage().resize_(0)
    assert measure(e)["gathered_params"] == 0


def test_optimizer_state_is_measured():
    p = torch.nn.Parameter(torch.zeros(25))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones(25)
    opt.step()

    class E:
        def memory_tensors(self):
            return {"params": [p], "grads": [p.grad]}

    snap = measure(E(), opt)
    # exp_avg + exp_avg_sq (100 bytes each) + the step counter (a scalar tensor)
    assert 200 <= snap["optimizer"] <= 216
    assert total_bytes(snap) == 100 + 100 + snap["optimizer"]


def test_recorder_timeline_and_peak():
    e = ToyEngine()
    record_event(e, "nothing attached")  # no recorder: a no-op
    assert e.timeline == []
    rec = attach(e)
    record_event(e, "gathered")
    e.gathered.untyped_storage().resize_(0)
    record_event(e, "freed")
    assert [label for label, _ in e.timeline] == ["gathered", "freed"]
    assert rec.peak_total == 1200 and rec.peak_label == "gathered"
    assert e.timeline[1][1]["gathered_params"] == 0
    rec.reset()
    assert e.timeline == [] and rec.peak_total == 0


def test_measure_tensors_skips_none():
    assert measure_tensors({"grads": [None, torch.zeros(3)]}) == {"grads": 12}


@pytest.mark.parametrize("stage,expected", [(0, 16 * 1000), (1, 8 * 1000 + 8 * 1000 / 4),
                                            (2, 4 * 1000 + 12 * 1000 / 4), (3, 16 * 1000 / 4)])
def test_zero_formulas_match_the_paper(stage, expected):
    assert zero_formula(1000, 4, stage)["total"] == pytest.approx(expected)


def test_zero_formula_options():
    assert zero_formula(1000, 4, "fsdp", gathered_numel=100)["gathered"] == 800
    assert zero_formula(1000, 4, "ddp", optimizer="sgd")["total"] == 8000
    with pytest.raises(ValueError, match="stage"):
        zero_formula(10, 2, 4)
    with pytest.raises(ValueError, match="optimizer"):
        zero_formula(10, 2, 0, optimizer="lion")


def test_a_budget_without_the_optimizer_is_refused_and_a_failed_attach_detaches():
    with pytest.raises(TypeError, match=r"attach takes an engine .* got a Linear, which has no memory_tensors"):
        attach(torch.nn.Linear(2, 2))
    e = ToyEngine()
    with pytest.raises(ValueError, match=r"a device budget needs the optimizer: attach\(engine, optimizer, capacity"):
        attach(e, None, capacity=10_000)
    assert getattr(e, "memory_recorder", None) is None
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(10))])
    with pytest.raises(torch.OutOfMemoryError):
        attach(e, opt, capacity=100)  # the engine already holds 1200 bytes
    assert e.memory_recorder is None  # nothing is recorded, nor checked, afterwards
    record_event(e, "step")
    assert e.timeline == []


def test_a_budget_catches_the_optimizer_state_at_the_step_that_makes_it():
    # DDP and FSDP do not own their optimizer: its state appears in opt.step(), which the recorder hooks
    import copy

    from fsdp_course import run_ranks
    from fsdp_course.engines.ddp import DDP
    from fsdp_course.memory import DeviceOutOfMemory

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))

    def fn(ctx):
        ddp = DDP(copy.deepcopy(base), ctx)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        psi = sum(p.numel() for p in ddp.parameters())
        attach(ddp, opt, capacity=int(psi * 4 * 2.5))  # parameters and gradients fit, Adam's 8 bytes do not
        for step in range(2):
            try:
                loss = torch.nn.functional.cross_entropy(ddp(torch.randn(4, 64)), torch.zeros(4, dtype=torch.long))
                loss.backward()
                opt.step()
                record_event(ddp, "optimizer step")  # by hand too, as the lessons do: recorded once
            except DeviceOutOfMemory as e:
                return step, e.label, e.category
        return None

    assert run_ranks(fn, 1) == [(0, "optimizer step", "optimizer")]  # was step 1's 'all_reduce gradients'
