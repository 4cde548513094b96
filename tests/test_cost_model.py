"""The α–β cost model (fsdp_course.runtime.cost_model): the fit recovers known α and β, `predict` is the formula
steps α + bytes β with the ring's steps and the ledger's bytes, bad input says what is wrong, and a real timing run on
two simulated ranks gives a latency and a bandwidth that are both positive."""

from __future__ import annotations

import math

import pytest

from fsdp_course.runtime.cost_model import OPS, CostFit, Sample, fit, ring_steps, time_collectives
from fsdp_course.runtime.ledger import ring_bytes

ALPHA, BETA = 3.7e-4, 2.9e-9  # seconds per step, seconds per byte


def synthetic(alpha: float = ALPHA, beta: float = BETA) -> list[Sample]:
    """Exact times from the model for every op, three world sizes and three payloads."""
    samples = []
    for n in (2, 3, 5):
        for op in OPS:
            for payload in (960, 61_440, 7_864_320):
                steps = 2 * (n - 1) if op == "all_reduce" else n - 1
                sent = (2 if op == "all_reduce" else 1) * (n - 1) / n * payload
                samples.append(Sample(op, n, payload, steps * alpha + sent * beta))
    return samples


def test_ring_steps_count_the_ring() -> None:
    assert [ring_steps("all_reduce", n) for n in (2, 3, 8)] == [2, 4, 14]
    assert [ring_steps(op, n) for op in ("all_gather", "reduce_scatter") for n in (2, 8)] == [1, 7, 1, 7]


def test_a_sample_counts_steps_and_the_ledgers_bytes() -> None:
    s = Sample("all_reduce", 4, 4096, 1e-3)
    assert s.steps == 6 and s.bytes == ring_bytes("all_reduce", 4096, 4)[0] == 6144


def test_the_fit_recovers_alpha_and_beta_exactly() -> None:
    model = fit(synthetic())
    assert model.alpha == pytest.approx(ALPHA, rel=1e-9) and model.beta == pytest.approx(BETA, rel=1e-9)
    assert model.r2 == pytest.approx(1.0, abs=1e-12) and model.rms < 1e-15
    assert model.median_ratio == pytest.approx(1.0) and model.worst_ratio == pytest.approx(1.0)
    assert model.samples == 27


def test_the_fit_reports_how_far_the_samples_lie_from_its_line() -> None:
    samples = synthetic()
    off = [Sample(s.op, s.world_size, s.payload_bytes, s.seconds * (1.5 if i % 2 else 1 / 1.5))
           for i, s in enumerate(samples)]
    model = fit(off)
    factors = [max(r, 1 / r) for r in (s.seconds / model.predict(s.op, s.payload_bytes, s.world_size) for s in off)]
    assert model.worst_ratio == pytest.approx(max(factors)) and model.worst_ratio > 1.2
    assert model.median_ratio == pytest.approx(sorted(factors)[len(factors) // 2])
    assert 0 < model.r2 < 1
    residual = [s.seconds - model.predict(s.op, s.payload_bytes, s.world_size) for s in off]
    assert model.rms == pytest.approx(math.sqrt(sum(r * r for r in residual) / len(residual)))


def test_predict_is_steps_alpha_plus_bytes_beta() -> None:
    model = CostFit(alpha=1e-3, beta=1e-9, r2=1.0, rms=0.0, median_ratio=1.0, worst_ratio=1.0, samples=0)
    n, payload = 4, 1_000_000
    expected = 2 * (n - 1) * 1e-3 + 2 * (n - 1) / n * payload * 1e-9
    assert model.predict("all_reduce", payload, n) == pytest.approx(expected)
    for op in ("all_gather", "reduce_scatter"):
        assert model.predict(op, payload, n) == pytest.approx((n - 1) * 1e-3 + (n - 1) / n * payload * 1e-9)
    assert model.predict("all_gather", 0, 8) == pytest.approx(7e-3), "an empty message still pays its steps"


def test_bad_input_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="got none"):
        fit([])
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        Sample("broadcast", 2, 10, 1e-3)
    with pytest.raises(ValueError, match="at least 2"):
        Sample("all_reduce", 1, 10, 1e-3)
    model = fit(synthetic())
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        model.predict("allreduce", 10, 2)
    with pytest.raises(ValueError, match="at least 2"):
        model.predict("all_gather", 10, 1)
    with pytest.raises(ValueError, match=">= 0"):
        Sample("all_gather", 2, 10, -1.0)
    one_size = [Sample("all_gather", 2, 4096, 1e-3), Sample("all_gather", 2, 4096, 2e-3)]
    with pytest.raises(ValueError, match="separate latency from bandwidth"):
        fit(one_size)
    with pytest.raises(ValueError, match="at least 2"):
        time_collectives([1], [4096])
    with pytest.raises(ValueError, match="unknown collective"):
        time_collectives([2], [4096], ops=("broadcast",))


def test_a_payload_rounds_up_to_whole_elements_that_divide_by_the_world_size() -> None:
    (sample,) = time_collectives([3], [10], ops=("all_gather",), repeats=1)
    assert (sample.op, sample.world_size, sample.payload_bytes) == ("all_gather", 3, 12)  # 3 float32 elements
    assert sample.seconds > 0


def test_a_real_timing_on_two_ranks_gives_positive_latency_and_bandwidth() -> None:
    big = 16 * 1024 * 1024  # milliseconds of bytes even on a fast machine: a loaded one cannot hide them in noise
    samples = time_collectives([2], [4096, big], repeats=3)
    assert [(s.op, s.payload_bytes) for s in samples] == [(op, p) for op in OPS for p in (4096, big)]
    model = fit(samples)
    assert model.alpha > 0 and model.beta > 0, model
