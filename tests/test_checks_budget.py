"""The checkers of exercise 18 (memory-budget puzzles) pass the reference solution and fail planted mistakes with the
diagnosis that names them: each planted function is the reference with one thing wrong, as a learner would get it."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest
from reference_solutions import fails, load, passes

from fsdp_course.classroom.checks import (
    check_bytes_sent,
    check_comm_seconds,
    check_device_peak,
    check_smallest_world_size,
)
from fsdp_course.classroom.checks.budget import RUN_ACTIVATIONS, RUN_CAPACITY, run_with_budget

BUDGET = load("18_offload")
REF = BUDGET["device_peak"]


def no_optimizer(psi, n, stage, offload, unit):  # forgot Adam's 8 bytes per parameter
    params = 4 * psi / (n if stage >= 3 else 1)
    grads = 4 * psi / (n if stage >= 2 else 1)
    gathered = 8 * unit if stage == 3 else 0
    return gathered if offload else params + grads + gathered


def adam_four_bytes(psi, n, stage, offload, unit):  # one moment instead of two
    return REF(psi, n, stage, offload, unit) - (0 if offload else 4 * psi / (n if stage >= 1 else 1))


def offload_on_device(psi, n, stage, offload, unit):  # counted the offloaded state against the device
    return REF(psi, n, stage, False, unit)


def offload_keeps_shards(psi, n, stage, offload, unit):  # offload moved only Adam's state to the host
    return REF(psi, n, stage, False, unit) - (8 * psi / n if offload else 0)


def no_gathered_unit(psi, n, stage, offload, unit):
    return REF(psi, n, stage, offload, unit) - (8 * unit if stage == 3 else 0)


def elements(psi, n, stage, offload, unit):
    return REF(psi, n, stage, offload, unit) / 4


def never_shards(psi, n, stage, offload, unit):
    return REF(psi, 1, stage, offload, unit)


def floor_division(psi, n, stage, offload, unit):  # // where Psi / N is not whole
    shard = lambda k: 4 * psi // (n if stage >= k else 1)  # noqa: E731
    gathered = 8 * unit if stage == 3 else 0
    return gathered if offload else shard(3) + shard(2) + 2 * shard(1) + gathered


def stage_off_by_one(psi, n, stage, offload, unit):  # ZeRO-k computed as ZeRO-(k+1) (ZeRO-3 as ZeRO-2)
    return REF(psi, n, min(stage + 1, 3), offload, unit) if stage < 3 else REF(psi, n, 2, offload, unit)


def smallest_strictly_below(psi, unit, capacity, stage, offload):  # < where a peak equal to the capacity fits
    return next((n for n in range(1, 65) if REF(psi, n, stage, offload, unit) < capacity), None)


def stub(*args):
    raise NotImplementedError()


def smallest_with(device: Callable) -> Callable:
    def smallest(psi, unit, capacity, stage, offload):
        return next((n for n in range(1, 65) if device(psi, n, stage, offload, unit) <= capacity), None)
    return smallest


def smallest_calling(device_peak: Callable) -> Callable:
    """The reference smallest_world_size as the notebook defines it, its global `device_peak` the planted one."""
    ref = BUDGET["smallest_world_size"]
    return types.FunctionType(ref.__code__, {"device_peak": device_peak, "__builtins__": __builtins__}, ref.__name__)


def smallest_never_tries_64(psi, unit, capacity, stage, offload):
    return next((n for n in range(1, 64) if REF(psi, n, stage, offload, unit) <= capacity), None)


def smallest_past_64(psi, unit, capacity, stage, offload):
    return next((n for n in range(1, 129) if REF(psi, n, stage, offload, unit) <= capacity), None)


def smallest_counts_from_zero(psi, unit, capacity, stage, offload):  # range(64) starts at N = 0
    return 0


def smallest_none_for_the_run(psi, unit, capacity, stage, offload):  # a branch that returns nothing for the run's
    return None if capacity == RUN_CAPACITY - RUN_ACTIVATIONS else BUDGET["smallest_world_size"](psi, unit, capacity,
                                                                                                stage, offload)


def smallest_off_by_one(psi, unit, capacity, stage, offload):
    n = BUDGET["smallest_world_size"](psi, unit, capacity, stage, offload)
    return None if n is None else n + 1


def ring_n(psi, n, stage):  # N instead of N - 1
    return (3 if stage == 3 else 2) * 4 * psi


def ring_elements(psi, n, stage):
    return (3 if stage == 3 else 2) * psi * (n - 1) / n


def ring_two_passes(psi, n, stage):  # ZeRO-3 counted like DDP
    return 2 * 4 * psi * (n - 1) / n


def comm_n_steps(psi, n, units, alpha, beta):  # N latency steps and N/N of the bytes
    return units * 3 * (n * alpha + 4 * psi / units * beta) if n > 1 else 0.0


def comm_alpha_once(psi, n, units, alpha, beta):  # one alpha per collective, not N - 1
    return units * 3 * (alpha + (n - 1) / n * 4 * psi / units * beta) if n > 1 else 0.0


def comm_whole_payload(psi, n, units, alpha, beta):  # every collective moves the whole model
    return units * 3 * ((n - 1) * alpha + (n - 1) / n * 4 * psi * beta)


def comm_one_collective(psi, n, units, alpha, beta):  # the whole model as one collective per pass
    return 3 * ((n - 1) * alpha + (n - 1) / n * 4 * psi * beta)


def comm_two_collectives(psi, n, units, alpha, beta):  # forgot the backward all-gather
    return units * 2 * ((n - 1) * alpha + (n - 1) / n * 4 * psi / units * beta)


def test_references_pass(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_device_peak, REF, capsys=capsys)
    assert "predicted 33,280 B + activations" in out
    # the measured peak, term by term: below the bound without offload (one unit's sharded gradient is not made yet)
    assert ("ZeRO-3 on 2 ranks: predicted 166,400 B + activations, measured peak 159,152 B at 'post_backward: grads "
            "ready layers.0'\n    = 166,400 (the formula) - 8,320 (layers.0's own sharded gradient, 4 x 4,160 / 2: the "
            "formula counts it, but the reduce-scatter that makes it comes next) + 16 (Adam's step counts) + 1,056 "
            "(activations)\n") in out, out
    assert "measured peak 37,408 B at 'post_backward: grads ready layers.3'\n    = 33,280 (the formula) + 4,128 " \
           "(activations)\n" in out, out
    out = passes(check_smallest_world_size, BUDGET["smallest_world_size"], capsys=capsys)
    assert "ZeRO-3: N = 4 fits, N = 3 runs out (grads); ZeRO-3 + offload: N = 1 fits" in out
    passes(check_bytes_sent, BUDGET["bytes_sent"], capsys=capsys)
    out = passes(check_comm_seconds, BUDGET["comm_seconds"], capsys=capsys)
    assert "N = 3: 12 collectives, 24 ring steps" in out


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (no_optimizer, "budget.forgot_moments", {}),
    (adam_four_bytes, "budget.adam_two_tensors", {}),
    (offload_on_device, "budget.offload_counted", {}),
    (offload_keeps_shards, "budget.kept_on_device", {"what": "budget.kept_params_grads"}),
    (no_gathered_unit, "budget.gathers_one_unit", {}),
    (elements, "budget.elements", {}),
    (never_shards, "budget.divide_by_n", {}),
    (floor_division, "budget.rounded", {"direction": "budget.down"}),
    (stage_off_by_one, "budget.neighbour_peak", {"other": "ZeRO-3", "stage": "ZeRO-2"}),
])
def test_device_peak_mistakes_are_named(fn: Callable, says: str, fields: dict,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_device_peak, fn, says=says, fields=fields, capsys=capsys)


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (smallest_with(no_optimizer), "budget.forgot_optimizer", {}),
    (smallest_with(offload_on_device), "budget.offload_counted_search", {}),
    (smallest_with(no_gathered_unit), "budget.holds_gathered_unit", {}),
    (smallest_off_by_one, "budget.try_each", {}),
    (smallest_strictly_below, "budget.boundary", {"n": 4, "capacity": 2_631_680}),
    (smallest_never_tries_64, "budget.never_tried", {"top": 64, "last": 63}),
    (smallest_past_64, "budget.past_search", {"top": 64, "got": 65}),
    (smallest_counts_from_zero, "budget.at_least_one", {"got": 0}),
    (smallest_none_for_the_run, "budget.returned", {"kind": "NoneType", "value": None}),
    (smallest_calling(offload_keeps_shards), "budget.blame_device_peak", {"got": 4_737_024, "n": 1,
                                                                          "expected": 526_336}),
    (smallest_calling(no_optimizer), "budget.blame_device_peak", {"got": 4_737_024, "n": 1, "expected": 8_947_712}),
])
def test_smallest_world_size_mistakes_are_named(fn: Callable, says: str, fields: dict,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_smallest_world_size, fn, says=says, fields=fields, capsys=capsys)


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (ring_n, "budget.ring_n_minus_1", {}),
    (ring_elements, "budget.elements", {}),
    (ring_two_passes, "budget.two_or_three_passes", {}),
])
def test_bytes_sent_mistakes_are_named(fn: Callable, says: str, fields: dict,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_bytes_sent, fn, says=says, fields=fields, capsys=capsys)


@pytest.mark.parametrize(("fn", "says", "fields"), [
    (comm_n_steps, "budget.ring_steps", {}),
    (comm_alpha_once, "budget.latency", {"k": 3}),
    (comm_whole_payload, "budget.bandwidth", {"units": 8}),
    (comm_one_collective, "budget.own_collective", {}),
    (comm_two_collectives, "budget.three_collectives", {}),
])
def test_comm_seconds_mistakes_are_named(fn: Callable, says: str, fields: dict,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_comm_seconds, fn, says=says, fields=fields, capsys=capsys)


def test_the_loop_is_not_blamed_for_a_right_device_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """The reference loop over the reference device_peak passes; over a wrong one the hint names device_peak."""
    passes(check_smallest_world_size, smallest_calling(REF), capsys=capsys)


def test_the_run_catches_what_the_formula_cases_do_not(capsys: pytest.CaptureFixture[str]) -> None:
    """The real run is a second referee: a prediction right on every formula case but too low for the run's model
    (which no formula case uses) runs out of device memory with the budget on."""
    def low_for_small_models(psi, n, stage, offload, unit):
        return REF(psi, n, stage, offload, unit) / (2 if psi < 10_000 * 2 and psi != 10_000 else 1)

    out = fails(check_device_peak, low_for_small_models, says="budget.prediction_low", capsys=capsys)
    assert "the run ran out of device memory" in out and "Tried to allocate" in out
    assert not run_with_budget(3, False, RUN_CAPACITY)[0]["fits"] and run_with_budget(4, False, RUN_CAPACITY)[0]["fits"]


@pytest.mark.parametrize("check", [check_device_peak, check_smallest_world_size, check_bytes_sent,
                                   check_comm_seconds])
def test_the_stub_gives_one_short_not_implemented(check: Callable) -> None:
    with pytest.raises(NotImplementedError, match="stub is not implemented yet"):
        check(stub)


def test_a_string_instead_of_the_function_is_refused() -> None:
    with pytest.raises(TypeError, match=r"check_device_peak\(device_peak\)"):
        check_device_peak("device_peak")
