"""Checker of exercise 03: a ZeRO memory calculator, against the formulas and against measured bytes.

ZeRO (arXiv:1910.02054, section 5.1, figure 1) counts the model states of mixed-precision Adam; the
course trains in fp32, so per parameter: 4 bytes of parameter, 4 of gradient and K = 8 of Adam
state (momentum and variance). Stage 0 (DDP) replicates all three, stage 1 shards the optimizer
state over the N ranks, stage 2 also the gradients, stage 3 (FSDP) also the parameters:
16 Psi, 8 Psi + 8 Psi/N, 4 Psi + 12 Psi/N, 16 Psi/N bytes per rank.

The learner's numbers are compared with `fsdp_course.memory.zero_formula`, then with what the
course's engines (DDP, ZeRO-1, ZeRO-2, FSDP) really hold after one AdamW step, measured from the
live tensor storages (`fsdp_course.memory.measure`) on simulated ranks.
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
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
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

T = catalogue("memory", {
    "parameters": ("parameters", "参数"),
    "gradients": ("gradients", "梯度"),
    "adam_state": ("Adam state", "Adam 状态"),
    "total": ("total is params + grads + optimizer", "total 是 params + grads + optimizer 之和"),
    "shards": ("{stage_name} shards the {what}: each rank keeps 1/N of them; divide by the world size (stage {first} "
               "and above)",
               "{what}在 {stage_name} 中是分片的：每个 rank 只保留其中的 1/N；要除以 world size"
               "（stage {first} 及以上）"),
    "not_yet": ("{stage_name} does not shard the {what} yet: stage 1 shards the optimizer state, stage 2 also the "
                "gradients, stage 3 also the parameters",
                "{what}在 {stage_name} 中还没有分片：stage 1 对优化器状态分片，stage 2 再加上梯度，stage 3 再加上参数"),
    "adam_two": ("Adam keeps two fp32 tensors per parameter (momentum and variance): 8 bytes per parameter, not 4",
                 "Adam 为每个参数保存两个 fp32 张量（动量和方差）：每个参数 8 字节，不是 4"),
    "elements": ("those are elements, not bytes: one fp32 value is 4 bytes",
                 "这些是元素个数，不是字节数：一个 fp32 值占 4 字节"),
    "per_parameter": ("per parameter: 4 bytes of parameter (fp32), 4 of gradient, 8 of Adam state; divide what the "
                      "stage shards by the world size",
                      "每个参数：参数 4 字节（fp32），梯度 4 字节，Adam 状态 8 字节；"
                      "该阶段分片的部分要除以 world size"),
    "measured": ("{category}: your formula says {got:,.0f} B, rank 0 holds {held:,} B",
                 "{category}：你的公式给出 {got:,.0f} B，而 rank 0 实际持有 {held:,} B"),
    "returned": ("returned {kind} {value!r:.120}", "返回了 {kind} {value!r:.120}"),
    "return_dict": ("return a dict with the keys {keys} (bytes per rank)",
                    "返回一个 dict，键为 {keys}（每个 rank 的字节数）"),
    "not_number": ("{category} is {kind}, not a number", "{category} 是 {kind}，不是数字"),
    "plain_numbers": ("return plain numbers of bytes (int or float)", "返回表示字节数的普通数字（int 或 float）"),
    "got_expected": ("{category}: got {got:,.0f} B, expected {expected:,.0f} B",
                     "{category}：得到 {got:,.0f} B，应为 {expected:,.0f} B"),
    # what passed
    "against": ("world sizes {formula} against zero_formula; {measured} against measured bytes",
                "world size 为 {formula} 时与 zero_formula 对照；为 {measured} 时与实测字节数对照"),
    "measured_after": ("  measured after one AdamW step, {numel} parameters, rank 0 (params + grads + Adam state):",
                       "  一步 AdamW 之后的实测值，{numel} 个参数，rank 0（参数 + 梯度 + Adam 状态）："),
    # the rows are data: the stage's name, N and two numbers of bytes, aligned under the columns' names
    "table": ("    stage         N  your formula B  measured B\n{rows}",
              "    阶段          N      你的公式 B      实测 B\n{rows}"),
    "step_counters": ("  (measured includes Adam's step counters, 4 B per parameter tensor)",
                      "  （实测值包含 Adam 的 step 计数器，每个参数张量 4 B）"),
})


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
            if stage == 0:
                engine: Any = DDP(m, ctx)
                opt: Any = adam(list(engine.parameters()))
            elif stage in (1, 2):
                engine = (ZeRO1 if stage == 1 else ZeRO2)(m, ctx, adam)
                opt = None  # the engine lists its own optimizer's state
            else:
                engine = FSDP(m, ctx)
                opt = adam(list(engine.parameters()))
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
    ], lambda a, b: abs(a - b) < 1e-6 * abs(b), first=True) or T("per_parameter")


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
    say(COMMON("passed", check=check, what=against), T("measured_after", numel=numel), T("table", rows=table),
        T("step_counters"))


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
