"""fsdp_course.claims: one line per claim, the same text for values that differ only in their rounding noise, and
every false claim named at the end of the block."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from fsdp_course.claims import Claims, ClaimsFailed, claims


def test_true_claims_print_aligned_lines_that_do_not_depend_on_rounding_noise(capsys: pytest.CaptureFixture[str]
                                                                               ) -> None:
    printed = []
    for noise in (3.1e-7, 8.9e-8):  # two CPUs' rounding of the same sum
        with claims() as c:
            assert c.below(noise, 1e-5, "loss, FSDP vs one process, every step")
            c.equal(12_288, 3 * 4096, "bytes sent per rank and step")
            c.equal(torch.tensor([2, 3]), torch.tensor([2, 3]), "shape")
            c.above(9.2e-3, 1e-4, "the step moved the parameters")
            c.between(0.5, 0.0, 1.0, "accuracy")
            c.true(True, "every rank holds the same shard")
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1]
    assert printed[0].splitlines() == [
        "loss, FSDP vs one process, every step    < 1e-05  ✓",
        "bytes sent per rank and step              12,288  ✓",
        "shape                                     [2, 3]  ✓",
        "the step moved the parameters            > 1e-04  ✓",
        "accuracy                               in [0, 1]  ✓",
        "every rank holds the same shard                   ✓",
    ], printed[0]


def test_exact_fractions_are_numbers_too() -> None:
    c = Claims()
    assert c.between(Fraction(21, 8), 1, Fraction(21, 8), "an exact ratio")
    assert c.equal(Fraction(3, 2) * 8, 12, "1.5 R")
    assert c.lines() == ["an exact ratio  in [1, 2.625]  ✓", "1.5 R                      12  ✓"]


def test_every_false_claim_is_named_with_what_was_measured(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ClaimsFailed) as raised:
        with claims() as c:
            c.below(3.2e-4, 1e-5, "loss, FSDP vs one process")
            c.equal(100, 100, "a true one")
            c.equal(4095, 4096, "bytes sent")
            c.below(math.nan, 1e-5, "a NaN is no small difference")
    said = str(raised.value)
    assert said.startswith("3 of 4 claims are false: ")
    assert "'loss, FSDP vs one process' (measured 3.20e-04)" in said
    assert "'bytes sent' (measured 4,095 instead of 4,096)" in said and "'a NaN is no small difference'" in said
    out = capsys.readouterr().out.splitlines()
    assert [line[-1] for line in out] == ["✗", "✓", "✗", "✗"]  # printed before the error: the reader sees which


def test_an_error_in_the_block_goes_on_after_the_claims_so_far(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ZeroDivisionError):
        with claims() as c:
            c.equal(1, 1, "first")
            1 / 0  # noqa: B018
    assert capsys.readouterr().out.strip().endswith("first  1  ✓")


def test_bad_claims_say_what_is_wrong() -> None:
    with claims() as c:
        with pytest.raises(ValueError, match="a bound must be a finite number"):
            c.below(1.0, math.inf, "x")
        with pytest.raises(ValueError, match="a claim needs its sentence"):
            c.equal(1, 1, " ")
        with pytest.raises(TypeError, match="a claim compares numbers, got str"):
            c.below("0.1", 1e-5, "x")
        with pytest.raises(ValueError, match="between: low 2 is above high 1"):
            c.between(1.5, 2, 1, "x")


def test_the_differences_lessons_claim_about() -> None:
    from fsdp_course.engines.equivalence import max_rel_diff, norm_rel_diff

    ref = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # global norm 5
    got = {"a": torch.tensor([3.0, 0.3]), "b": torch.tensor([4.4])}  # difference (0, 0.3, 0.4): norm 0.5
    assert abs(norm_rel_diff(got, ref) - 0.1) < 1e-6  # the state dict as one vector (float32 inputs)
    assert abs(norm_rel_diff(got["b"], ref["b"]) - 0.1) < 1e-6  # one tensor
    assert abs(norm_rel_diff(list(got.values()), list(ref.values())) - 0.1) < 1e-6  # a list, in order
    with pytest.raises(ValueError, match=r"1 tensor\(s\) against 2: compare lists of the same tensors"):
        norm_rel_diff([got["a"]], list(ref.values()))
    assert abs(max_rel_diff(got["a"], ref["a"]) - 0.1) < 1e-6  # elementwise, over the largest magnitude
