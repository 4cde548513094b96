"""Checker of exercise 03: a ZeRO memory calculator, against the formulas and against measured bytes.

Cites ZeRO (arXiv:1910.02054, section 5.1, figure 1).
Design notes: docs/CLASSROOM.md, "Checkers", `memory.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CHECK_TIMEOUT,
    CheckFailure,
    Message,
    call_learner,
    known_mistake,
    require_callable,
    say_passed,
)
from fsdp_course.engines.equivalence import global_batches, local_slice, seeded_mlp
from fsdp_course.i18n.messages import catalogue
from fsdp_course.memory import SHARDED_FROM_STAGE, measure, zero_formula
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.simulate import run_ranks

__all__ = ["check_zero_memory", "measure_stages"]

KEYS = ("params", "grads", "optimizer", "total")
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3/FSDP"}
FORMULA_CASES = ((1_000, 1), (1_000, 4), (12_344, 2), (29_164_304, 8))  # (numel, world size)
MEASURED_SIZES = (16, 16, 16, 8)  # 680 parameters: every layer's numel divides by 8, so no padding
MEASURE_WORLD_SIZES = (2, 4)
MEASURE_SLACK = 64  # bytes: Adam's `step` counters (one 4-byte scalar per parameter tensor)

T = catalogue("memory")  # fsdp_course/i18n/catalogues/memory.yml


def measure_stages(world_size: int) -> dict[int, dict[str, int]]:
    """Bytes per category on rank 0 after one AdamW step, per stage, measured on `world_size` simulated ranks."""
    from fsdp_course.engines.ddp import DDP
    from fsdp_course.engines.zero import ZeRO1, ZeRO2
    from fsdp_course.fsdp.api import FSDP

    model = seeded_mlp(MEASURED_SIZES, seed=3)
    batch = global_batches(1, 4 * world_size, MEASURED_SIZES[0], MEASURED_SIZES[-1], seed=5)[0]

    def adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-3)

    def body(ctx: RankContext) -> dict[int, dict[str, int]]:
        x, y = local_slice(batch, ctx.rank, ctx.world_size)
        out = {}
        for stage in range(4):
            m = copy.deepcopy(model)
            engine: Any = ((ZeRO1 if stage == 1 else ZeRO2)(m, ctx, adam) if stage in (1, 2) else
                           (DDP if stage == 0 else FSDP)(m, ctx))
            opt = None if stage in (1, 2) else adam(list(engine.parameters()))  # ZeRO-1/2: their own
            F.cross_entropy(engine(x), y).backward()
            (opt or engine).step()
            snap = measure(engine, opt)
            out[stage] = {
                "params": sum(snap.get(k, 0) for k in ("params", "sharded_params", "gathered_params")),
                "grads": snap.get("grads", 0) + snap.get("sharded_grads", 0),
                "optimizer": snap.get("optimizer", 0),
            }
            out[stage]["total"] = sum(out[stage].values())
        return out

    return run_ranks(body, world_size, timeout=CHECK_TIMEOUT)[0]


def _hint(key: str, stage: int, n: int, got: float, expected: float) -> Message:
    if key == "total":
        return T("total")
    shared = stage >= SHARDED_FROM_STAGE[key]
    what = T({"params": "parameters", "grads": "gradients", "optimizer": "adam_state"}[key])
    return known_mistake(got, [  # what each known mistake gives (None where it cannot be made), and its hint
        (expected * n if n > 1 and shared else None,  # not divided by N where the stage shards
         lambda: T("shards", stage_name=STAGE_NAMES[stage], what=what, first=SHARDED_FROM_STAGE[key])),
        (expected / n if n > 1 and not shared else None,  # divided by N where the stage does not shard yet
         lambda: T("not_yet", stage_name=STAGE_NAMES[stage], what=what)),
        (expected / 2 if key == "optimizer" else None, lambda: T("adam_two")),
        (expected / 4 if expected else None, lambda: T("elements")),
    ], lambda a, b: abs(a - b) < 1e-6 * abs(b)) or T("per_parameter")


def check_zero_memory(fn: Callable[[int, int, int], dict[str, float]]) -> None:
    """Check `fn(numel, world_size, stage) -> {"params", "grads", "optimizer", "total"}` in bytes per rank.

    fp32 training with Adam; stage 0 = DDP, 1, 2, 3 = ZeRO stages (3 is FSDP). Compared first with
    `zero_formula` on the cases in FORMULA_CASES, then with the bytes measured on simulated ranks
    (world sizes 2 and 4) after one AdamW step of DDP, ZeRO-1, ZeRO-2 and FSDP.
    """
    check = "check_zero_memory"
    name = require_callable(check, fn, "zero_memory")
    for numel, n in FORMULA_CASES:
        for stage in range(4):
            where = f"numel {numel:,}, world size {n}, stage {stage} ({STAGE_NAMES[stage]})"
            got = call_learner(check, name, fn, numel, n, stage, where=where)
            expected = zero_formula(numel, n, stage)
            _compare(check, where, got, expected, stage, n)
    rows = []
    for n in MEASURE_WORLD_SIZES:
        measured = measure_stages(n)
        numel = sum(a * b + b for a, b in zip(MEASURED_SIZES[:-1], MEASURED_SIZES[1:], strict=True))
        for stage in range(4):
            where = f"measured: {STAGE_NAMES[stage]}, {numel} parameters, world size {n}, rank 0"
            got = call_learner(check, name, fn, numel, n, stage, where=where)
            for key in ("params", "grads", "optimizer"):
                if abs(float(got[key]) - measured[stage][key]) > MEASURE_SLACK:
                    CheckFailure(check, where,
                                 T("measured", category=key, got=float(got[key]), held=measured[stage][key]),
                                 _hint(key, stage, n, float(got[key]), measured[stage][key])).fail()
            rows.append((STAGE_NAMES[stage], n, float(got["total"]), measured[stage]["total"]))
    against = T("against", formula=", ".join(str(n) for n in sorted({n for _, n in FORMULA_CASES})),
                measured=", ".join(map(str, MEASURE_WORLD_SIZES)))
    table = "\n".join(f"    {stage_name:<12} {n:>2} {formula:>15,.0f} {measured_total:>11,}"
                      for stage_name, n, formula, measured_total in rows)
    say_passed(check, against, T("measured_after", numel=numel), T("table", rows=table), T("step_counters"))


def _compare(check: str, where: str, got: Any, expected: dict[str, float], stage: int, n: int) -> None:
    if not isinstance(got, dict) or any(k not in got for k in KEYS):
        CheckFailure(check, where, T("returned", kind=type(got).__name__, value=got),
                     T("return_dict", keys=", ".join(map(repr, KEYS)))).fail()
    for key in KEYS:
        value = got[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            CheckFailure(check, where, T("not_number", category=key, kind=type(value).__name__),
                         T("plain_numbers")).fail()
        if abs(float(value) - expected[key]) > 1e-6 * max(expected[key], 1.0):
            CheckFailure(check, where, T("got_expected", category=key, got=float(value), expected=expected[key]),
                         _hint(key, stage, n, float(value), expected[key]),
                         [f"expected {', '.join(f'{k} {expected[k]:,.0f}' for k in KEYS)}"]).fail()
