"""Checker of exercise 07: a wrap policy, the units it makes, and the peak memory it predicts.

Cites ZeRO (arXiv:1910.02054); PyTorch FSDP (arXiv:2304.11277).
Design notes: docs/CLASSROOM.md, "Checkers", `wrapping.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    hints,
    require_callable,
    require_learner,
    require_world_sizes,
    run_checked,
    say_passed,
)
from fsdp_course.fsdp import FSDP
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.memory import attach, zero_formula
from fsdp_course.models import TransformerClassifier, TransformerConfig, count_parameters
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.simulate import run_ranks

__all__ = ["PEAK_BOUND", "POLICIES", "check_predicted_peak", "check_unit_numels", "exercise_model",
           "fsdp_unit_numels", "measure_peak"]

VOCAB, SEQ, BATCH, SEED = 384, 16, 4, 7
PEAK_BOUND = 0.9  # the measured peak is at most the prediction and at least this fraction of it
POLICIES: dict[str, set[type[nn.Module]] | None] = {
    "wrap=None": None,
    "wrap={nn.TransformerEncoderLayer}": {nn.TransformerEncoderLayer},
    "wrap={nn.TransformerEncoderLayer, nn.Embedding}": {nn.TransformerEncoderLayer, nn.Embedding},
    "wrap={nn.Embedding}": {nn.Embedding},
    "wrap={nn.TransformerEncoderLayer, nn.LayerNorm}": {nn.TransformerEncoderLayer, nn.LayerNorm},  # units in units
}
# unit sizes the prediction is checked on (padded numels, as FSDP reports them): the root the largest, and not
PEAK_CASES: tuple[tuple[dict[str, int], int], ...] = (
    ({"root": 13194, "encoder.layers.0": 12704, "encoder.layers.1": 12704}, 2),
    ({"root": 396, "embedding": 12288, "pos_embedding": 513, "encoder.layers.0": 12705, "encoder.layers.1": 12705}, 3),
    ({"root": 38602}, 2),
)

T = catalogue("wrapping")  # fsdp_course/i18n/catalogues/wrapping.yml


def exercise_model() -> TransformerClassifier:
    """The checker's model: lesson 07's small Transformer, 2 layers, a vocabulary of 384 tokens (seeded)."""
    torch.manual_seed(SEED)
    return TransformerClassifier(TransformerConfig.small(vocab_size=VOCAB, num_layers=2, max_len=SEQ))


def fsdp_unit_numels(model: nn.Module, wrap: set[type[nn.Module]] | None, world_size: int) -> dict[str, int]:
    """What `FSDP(model, ctx, wrap=wrap).unit_numels()` reports on `world_size` simulated ranks (rank 0's)."""
    return run_ranks(lambda ctx: FSDP(copy.deepcopy(model), ctx, wrap=wrap).unit_numels(), world_size)[0]


def check_unit_numels(fn: Callable[[nn.Module, Any, int], dict[str, int]],
                      world_sizes: Sequence[int] = (1, 2, 3)) -> None:
    """Check `fn(model, wrap, world_size) -> {unit name: padded numel}` against the course's FSDP."""
    check = "check_unit_numels"
    name, sizes = require_learner(check, fn, "unit_numels", world_sizes)
    model = exercise_model()
    for n in sizes:
        for label, wrap in POLICIES.items():
            where = f"world size {n}, {label}"
            expected = fsdp_unit_numels(model, wrap, n)
            got = call_learner(check, name, fn, copy.deepcopy(model), copy.copy(wrap), n, where=where)
            _judge_units(check, where, model, n, expected, got)
    say_passed(check, sizes, T("numels_passed", policies=len(POLICIES)))


def _judge_units(check: str, where: str, model: nn.Module, n: int, expected: dict[str, int], got: Any) -> None:
    def fail(problem: Message, hint: Message) -> None:
        CheckFailure(check, where, problem, hint, [f"expected {expected}", f"got      {got!r}"]).fail()

    if not isinstance(got, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                            for k, v in got.items()):
        fail(T("not_dict", kind=type(got).__name__), T("return_dict"))
    if got == expected:
        return
    if "root" not in got:
        fail(T("no_root"), T("root_unit"))
    if set(got) != set(expected):
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        fail(T("units_differ", missing=missing, extra=extra), T("unit_named"))
    for k in expected:
        if got[k] == expected[k]:
            continue
        if n > 1 and got[k] < expected[k] and padded_numel(got[k], n) == expected[k]:
            fail(T("no_padding", unit=k, got=got[k], expected=expected[k]),
                 T("pad_every", got=got[k], expected=expected[k]))
        if k == "root" and got[k] > expected[k]:
            fail(T("root_counts", got=got[k], expected=expected[k]), T("nearest"))
        fail(T("unit_numel", unit=k, got=got[k], expected=expected[k]), T("count_unit"))


def measure_peak(wrap: set[type[nn.Module]] | None, world_size: int) -> list[dict[str, Any]]:
    """Train `FSDP(exercise_model(), ctx, wrap=wrap)` with AdamW for 2 steps on `world_size` simulated ranks; per rank,
    the last step's peak (bytes, from live storages), where it happened, and the units' padded sizes."""
    base = exercise_model()
    return run_ranks(lambda ctx: _train(base, ctx, wrap), world_size)


def _train(base: nn.Module, ctx: RankContext, wrap: Any, steps: int = 2) -> dict[str, Any]:
    fsdp = FSDP(copy.deepcopy(base), ctx, wrap=wrap)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    recorder = attach(fsdp, opt)
    g = torch.Generator().manual_seed(SEED + ctx.rank)
    for _ in range(steps):  # the first step creates Adam's state; the last one is measured
        recorder.reset()
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        recorder.record("step starts")
        F.cross_entropy(fsdp(x), y).backward()
        opt.step()
        recorder.record("optimizer step")
        opt.zero_grad()
    return {"peak": recorder.peak_total, "peak_label": recorder.peak_label, "numels": fsdp.unit_numels()}


def check_predicted_peak(fn: Callable[[dict[str, int], int], float], wrap_policy: Callable[[], Any],
                         world_sizes: Sequence[int] = (2, 3)) -> None:
    """Check `fn(numels, world_size) -> bytes` against 16Ψ/N + 8 · largest, then the classes `wrap_policy()` returns
    on the exercise's model: no unit larger than a layer, and the peak measured on simulated ranks within the
    prediction."""
    check = "check_predicted_peak"
    name = require_callable(check, fn, "predicted_peak")
    policy_name = require_callable(check, wrap_policy, "wrap_policy")
    sizes = require_world_sizes(world_sizes)
    for numels, n in PEAK_CASES:
        _judge_prediction(check, name, fn, numels, n, f"world size {n}, units {numels}")
    wrap = call_learner(check, policy_name, wrap_policy, where="calling wrap_policy()")
    model = exercise_model()
    layer = count_parameters(model.encoder.layers[0])
    lines: list[Message] = []
    for n in sizes:
        where = f"world size {n}, wrap_policy() = {_policy_text(wrap)}"
        runs = run_checked(check, "FSDP(model, ctx, wrap=wrap_policy())", lambda ctx: _train(model, ctx, wrap), n,
                           lambda r, w=where: f"{w}, rank {r}", _wrap_hint)
        numels = runs[0]["numels"]
        largest_name = max(numels, key=numels.get)
        if numels[largest_name] > padded_numel(layer, n):
            root_note = T("root_note") if largest_name == "root" else ""
            CheckFailure(check, where, T("largest_unit", unit=largest_name, numel=numels[largest_name],
                                         root_note=root_note, layer=padded_numel(layer, n)),
                         T("wrap_classes"), [f"units {numels}"]).fail()
        predicted = call_learner(check, name, fn, dict(numels), n, where=where)
        peak = runs[0]["peak"]
        if not all(r["peak"] == peak for r in runs):
            raise AssertionError("equal shards: every rank holds the same bytes")  # the course's invariant
        ratio = peak / float(predicted)
        if not PEAK_BOUND * predicted <= peak <= predicted:
            CheckFailure(check, where, T("peak_outside", peak=peak, predicted=float(predicted), ratio=ratio,
                                         bound=PEAK_BOUND), T("formula_units")).fail()
        lines.append(T("peak_measured", n=n, units=len(numels), largest=largest_name, numel=numels[largest_name],
                       peak=peak, label=runs[0]["peak_label"], ratio=ratio, predicted=float(predicted)))
    say_passed(check, sizes, *lines, T("peak_passed", cases=len(PEAK_CASES), bound=PEAK_BOUND))


def _policy_text(wrap: Any) -> str:
    if isinstance(wrap, set | frozenset | list | tuple):
        return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in wrap)) + "}"
    return repr(wrap)


_wrap_hint = hints(("wrap must be a set of nn.Module classes", T("wrap_set")), ("is sharded by FSDP", T("functional")))


def _judge_prediction(check: str, name: str, fn: Callable[..., Any], numels: dict[str, int], n: int,
                      where: str) -> None:
    got = call_learner(check, name, fn, dict(numels), n, where=where)
    if isinstance(got, bool) or not isinstance(got, int | float | torch.Tensor):
        CheckFailure(check, where, T("not_number", kind=type(got).__name__), T("return_float")).fail()
    got = float(got)
    psi, largest = sum(numels.values()), max(numels.values())
    expected = zero_formula(psi, n, "fsdp", gathered_numel=largest)["total"]
    if abs(got - expected) <= 1e-6 * expected:
        return
    without_root = {k: v for k, v in numels.items() if k != "root"}
    largest_wrapped = max(without_root.values()) if without_root else 0
    known = [  # what a mistake predicts, the mistake, its hint
        (16 * psi / n + 8 * largest_wrapped, T("why_root_not_largest"), T("root_too", root=numels.get("root"))),
        (16 * sum(without_root.values()) / n + 8 * largest, T("why_psi_no_root"), T("psi_sum")),
        (16 * sum(without_root.values()) / n + 8 * largest_wrapped, T("why_both_no_root"), T("root_in_both")),
        (16 * psi + 8 * largest, T("why_not_divided"), T("keep_1n")),
        (16 * psi / n + 4 * largest, T("why_four"), T("holds_both")),
        (16 * psi / n, T("why_no_largest"), T("add_largest")),
        (16 * psi / n + 8 * next(iter(numels.values())), T("why_first"), T("take_max")),
        ((16 * psi / n + 8 * largest) / 4, T("why_elements"), T("fp32")),
    ]
    details = [f"Ψ = {psi}, largest unit {max(numels, key=numels.get)!r} = {largest}"]
    for value, why, hint in known:
        if value != expected and abs(got - value) <= 1e-6 * max(value, 1.0):
            CheckFailure(check, where, T("predicted_why", got=got, expected=expected, why=why), hint, details).fail()
    CheckFailure(check, where, T("predicted_off", got=got, expected=expected), T("formula"), details).fail()
