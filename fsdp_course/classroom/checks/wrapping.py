"""Checker of exercise 07: a wrap policy, the units it makes, and the peak memory it predicts.

The learner writes three functions:

- `unit_numels(model, wrap, world_size)`: the padded number of elements of every FSDP unit that
  `FSDP(model, ctx, wrap=wrap)` makes, by unit name (the module path of each wrapped module, "root" for the rest),
  as `FSDP.unit_numels()` reports them: a parameter belongs to its nearest wrapped ancestor, else to the root, and
  every unit's flat parameter is padded to a multiple of the world size (lesson 05);
- `predicted_peak(numels, world_size)`: lesson 07's prediction for fp32 AdamW, 16Ψ/N + 8 · largest unit, with Ψ the
  sum of the padded units (`memory.zero_formula(Ψ, N, "fsdp", gathered_numel=largest)`: ZeRO-3's accounting,
  arXiv:1910.02054, plus the gathered unit of the FSDP paper, arXiv:2304.11277);
- `wrap_policy()`: returns a set of module classes (FSDP's `wrap`) for the checker's model (`exercise_model()`, a
  small Transformer whose embedding, with the head, outweighs a layer), such that no unit is larger than one
  encoder layer.

`check_unit_numels` compares the learner's units with the course's FSDP built on simulated ranks, for five policies
(one with wrapped modules inside wrapped modules) at world sizes 1 to 3. `check_predicted_peak` compares the
prediction with the formula on unit sizes where the root is, and is not, the largest unit; then it trains
`FSDP(model, ctx, wrap=wrap_policy())` for two AdamW steps on 2 and 3 simulated ranks, measures the peak per rank
with `fsdp_course.memory.attach`, and asks that the measured peak be at most the prediction and at least `PEAK_BOUND`
of it. With the embeddings wrapped a layer is the largest unit, and the peak measures 0.93 to 0.94 of the prediction;
with every layer wrapped but not the embeddings, the root is the largest unit and stays gathered beside each layer,
and at N = 3 the peak passes the prediction (tests/test_checks_wrapping.py measures both).
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
    exception_hint,
    require_callable,
    require_world_sizes,
    run_checked,
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.fsdp import FSDP
from fsdp_course.fsdp.flat_param import padded_numel
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.memory import attach, zero_formula
from fsdp_course.models import TransformerClassifier, TransformerConfig, count_parameters
from fsdp_course.runtime.context import RankContext

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

T = catalogue("wrapping", {
    "not_dict": ("returned {kind}, not a dict of unit name -> int", "返回了 {kind}，不是“单元名 -> int”的 dict"),
    "return_dict": ("return a dict such as {{'root': 13130, 'encoder.layers.0': 12704, ...}}: unit name to padded "
                    "numel", "返回一个 dict，例如 {{'root': 13130, 'encoder.layers.0': 12704, ...}}：单元名映射到"
                    "填充后的 numel"),
    "no_root": ("there is no 'root' unit", "没有 'root' 单元"),
    "root_unit": ("the parameters that no wrapped module owns (here at least the head, fc) form the root unit, named "
                  "'root': FSDP always wraps the model itself last",
                  "不属于任何被包装模块的参数（这里至少有分类头 fc）组成根单元，名为 'root'："
                  "FSDP 总是最后包装模型本身"),
    "units_differ": ("the units differ: missing {missing}, unexpected {extra}",
                     "单元不一致：缺少 {missing}，多出 {extra}"),
    "unit_named": ("a unit is named by its module's path in model.named_modules() (e.g. 'encoder.layers.0'); a wrapped "
                   "module inside another wrapped module is a unit of its own, and the model itself is 'root'",
                   "单元以其模块在 model.named_modules() 中的路径命名（例如 'encoder.layers.0'）；被包装模块里面的"
                   "被包装模块是一个独立的单元，模型本身是 'root'"),
    "no_padding": ("unit {unit!r} has {got} elements, FSDP's flat parameter has {expected}: no padding",
                   "单元 {unit!r} 有 {got} 个元素，而 FSDP 的展平参数有 {expected} 个：没有填充"),
    "pad_every": ("pad every unit to a multiple of the world size: {got} -> {expected} (lesson 05)",
                  "把每个单元填充到 world size 的整数倍：{got} -> {expected}（第 05 课）"),
    "root_counts": ("the root unit has {got} elements, expected {expected}: it counts parameters that belong to "
                    "wrapped units",
                    "根单元有 {got} 个元素，应为 {expected}：它把属于被包装单元的参数也算进去了"),
    "nearest": ("a parameter belongs to its nearest wrapped ancestor only: the root gets what no wrapped module owns",
                "参数只属于离它最近的被包装祖先：根单元只拿到不属于任何被包装模块的参数"),
    "unit_numel": ("unit {unit!r} has {got} elements, expected {expected}",
                   "单元 {unit!r} 有 {got} 个元素，应为 {expected}"),
    "count_unit": ("count a unit's parameters that no wrapped module inside it owns, then pad to a multiple of the "
                   "world size", "统计一个单元中不属于它内部任何被包装模块的参数，再填充到 world size 的整数倍"),
    "root_note": (", all that no wrapped module owns,", "（即不属于任何被包装模块的全部参数）"),
    "largest_unit": ("the largest unit is {unit!r} with {numel} elements{root_note} larger than one encoder layer "
                     "({layer})", "最大的单元是 {unit!r}{root_note}，有 {numel} 个元素，比一个编码器层（{layer}）还大"),
    "wrap_classes": ("wrap the module classes whose parameters would otherwise stay together: every encoder layer, "
                     "and the embeddings (nn.Embedding), so that the root keeps only the final norm and the head",
                     "包装那些若不单独包装、参数就会全部留在同一个单元里的模块类：每个编码器层，"
                     "以及嵌入层（nn.Embedding），这样根单元只保留最后的 norm 和分类头"),
    "peak_outside": ("measured peak {peak} bytes, predicted {predicted:.0f}: ratio {ratio:.3f}, outside [{bound}, 1]",
                     "实测峰值 {peak} 字节，预测为 {predicted:.0f}：比值 {ratio:.3f}，不在 [{bound}, 1] 之内"),
    "formula_units": ("predicted_peak must be 16Ψ/N + 8 · largest for these units",
                      "对这些单元，predicted_peak 必须是 16Ψ/N + 8 · largest"),
    "wrap_set": ("wrap_policy() returns a set of module classes, e.g. {{nn.TransformerEncoderLayer}}: the classes, not "
                 "instances or names",
                 "wrap_policy() 返回一个模块类的集合，例如 {{nn.TransformerEncoderLayer}}：是类，不是实例或名字"),
    "functional": ("a class used through functional code inside another module (nn.Linear inside attention) cannot be "
                   "a unit: wrap whole blocks (nn.TransformerEncoderLayer) and nn.Embedding",
                   "在另一个模块内部通过函数式代码使用的类（例如注意力里的 nn.Linear）不能成为单元：包装整个块"
                   "（nn.TransformerEncoderLayer）和 nn.Embedding"),
    "not_number": ("returned {kind}, not a number of bytes", "返回了 {kind}，不是字节数"),
    "return_float": ("return 16 * psi / world_size + 8 * largest, a float",
                     "返回 16 * psi / world_size + 8 * largest，一个 float"),
    # the mistakes a prediction is recognised by (why), and their hints
    "why_root_not_largest": ("the largest unit ignores the root", "取最大单元时没有考虑根单元"),
    "why_psi_no_root": ("Ψ leaves out the root", "Ψ 漏掉了根单元"),
    "why_both_no_root": ("Ψ and the largest unit both leave out the root", "Ψ 和最大单元都漏掉了根单元"),
    "why_not_divided": ("16Ψ is not divided by N", "16Ψ 没有除以 N"),
    "why_four": ("4 · largest: the gathered parameters without their gradient", "4 · largest：只算了全聚合的参数，"
                 "没有算它们的梯度"),
    "why_no_largest": ("the largest unit's term is missing: 16Ψ/N alone", "漏掉了最大单元那一项：只有 16Ψ/N"),
    "why_first": ("the first unit is not the largest", "第一个单元并不是最大的单元"),
    "why_elements": ("the units are in elements, not bytes", "单位是元素个数，不是字节数"),
    "root_too": ("the root is a unit too ({root} elements here), gathered beside every other unit: take the largest "
                 "over all units, root included",
                 "根单元也是一个单元（这里有 {root} 个元素），在其他每个单元全聚合时它也处于全聚合状态：在所有单元中取"
                 "最大，包括根单元"),
    "psi_sum": ("Ψ is the sum of every unit's padded size, the root's included",
                "Ψ 是每个单元填充后大小之和，包括根单元"),
    "root_in_both": ("the root is a unit too: count it in Ψ and in the largest",
                     "根单元也是一个单元：把它计入 Ψ，也在取最大单元时考虑它"),
    "keep_1n": ("each rank keeps 1/N of the parameters, gradients and Adam's state: 16Ψ/N",
                "每个 rank 保留 1/N 的参数、梯度和 Adam 状态：16Ψ/N"),
    "holds_both": ("while the largest unit computes its gradient it holds its gathered parameters and its full "
                   "gradient: 8 bytes per element",
                   "最大单元计算梯度时，同时持有全聚合的参数和完整梯度：每个元素 8 字节"),
    "add_largest": ("add 8 · largest: the unit gathered while it computes",
                    "加上 8 · largest：计算时被全聚合的那个单元"),
    "take_max": ("take max(numels.values()), not the first unit", "取 max(numels.values())，而不是第一个单元"),
    "fp32": ("fp32: 4 bytes per element, so 16 bytes per element of Ψ/N", "fp32：每个元素 4 字节，所以 Ψ/N 的每个元素"
             "占 16 字节"),
    "predicted_why": ("predicted {got:.0f} bytes, expected {expected:.0f}: {why}",
                      "预测为 {got:.0f} 字节，应为 {expected:.0f}：{why}"),
    "predicted_off": ("predicted {got:.0f} bytes, expected {expected:.0f} (16Ψ/N + 8 · largest)",
                      "预测为 {got:.0f} 字节，应为 {expected:.0f}（16Ψ/N + 8 · largest）"),
    "formula": ("Ψ = the sum of the padded unit sizes; largest = the largest unit, root included; fp32 AdamW: 16 "
                "bytes per element of Ψ/N, 8 per element of the largest unit",
                "Ψ = 各单元填充后大小之和；largest = 最大的单元，包括根单元；fp32 AdamW：Ψ/N 的每个元素 16 字节，"
                "最大单元的每个元素 8 字节"),
    # what passed
    "numels_passed": ("  {policies} policies: every unit's padded size equals what the course's FSDP builds",
                      "  {policies} 种包装策略：每个单元填充后的大小都与课程的 FSDP 构建出的一致"),
    "peak_measured": ("  world size {n}: {units} units, largest {largest!r} ({numel}); measured peak {peak} bytes at "
                      "'{label}' = {ratio:.3f} x predicted {predicted:.0f}",
                      "  world size {n}：{units} 个单元，最大的是 {largest!r}（{numel}）；实测峰值 {peak} 字节"
                      "（出现在 '{label}'）= {ratio:.3f} x 预测值 {predicted:.0f}"),
    "peak_passed": ("  the prediction is 16Ψ/N + 8 · largest on {cases} sets of units; with wrap_policy() no unit is "
                    "larger than a layer and the measured peak lies within [{bound}, 1] of the prediction",
                    "  在 {cases} 组单元上，预测值都等于 16Ψ/N + 8 · largest；使用 wrap_policy() 时，"
                    "没有哪个单元比一层大，实测峰值在预测值的 [{bound}, 1] 倍之间"),
})


def exercise_model() -> TransformerClassifier:
    """The checker's model: lesson 07's small Transformer, 2 layers, a vocabulary of 384 tokens (seeded)."""
    torch.manual_seed(SEED)
    return TransformerClassifier(TransformerConfig.small(vocab_size=VOCAB, num_layers=2, max_len=SEQ))


def fsdp_unit_numels(model: nn.Module, wrap: set[type[nn.Module]] | None, world_size: int) -> dict[str, int]:
    """What `FSDP(model, ctx, wrap=wrap).unit_numels()` reports on `world_size` simulated ranks (rank 0's)."""
    from fsdp_course.runtime.simulate import run_ranks

    return run_ranks(lambda ctx: FSDP(copy.deepcopy(model), ctx, wrap=wrap).unit_numels(), world_size)[0]


def _describe(numels: dict[str, int]) -> str:
    return "{" + ", ".join(f"{k!r}: {v}" for k, v in numels.items()) + "}"


def check_unit_numels(fn: Callable[[nn.Module, Any, int], dict[str, int]],
                      world_sizes: Sequence[int] = (1, 2, 3)) -> None:
    """Check `fn(model, wrap, world_size) -> {unit name: padded numel}` against the course's FSDP."""
    check = "check_unit_numels"
    name = require_callable(check, fn, "unit_numels")
    sizes = require_world_sizes(world_sizes)
    model = exercise_model()
    for n in sizes:
        for label, wrap in POLICIES.items():
            where = f"world size {n}, {label}"
            expected = fsdp_unit_numels(model, wrap, n)
            got = call_learner(check, name, fn, copy.deepcopy(model), copy.copy(wrap), n, where=where)
            _judge_units(check, where, model, n, expected, got)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("numels_passed", policies=len(POLICIES)))


def _judge_units(check: str, where: str, model: nn.Module, n: int, expected: dict[str, int], got: Any) -> None:
    def fail(problem: Message, hint: Message) -> None:
        shown = _describe(got) if isinstance(got, dict) else repr(got)
        CheckFailure(check, where, problem, hint, [f"expected {_describe(expected)}", f"got      {shown}"]).fail()

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


def measure_peak(wrap: set[type[nn.Module]] | None, world_size: int, model: nn.Module | None = None,
                 steps: int = 2) -> list[dict[str, Any]]:
    """Train `FSDP(model, ctx, wrap=wrap)` with AdamW for `steps` steps on `world_size` simulated ranks; per rank, the
    last step's peak (bytes, from live storages), where it happened, and the units' padded sizes."""
    from fsdp_course.runtime.simulate import run_ranks

    base = exercise_model() if model is None else model
    return run_ranks(lambda ctx: _train(base, ctx, wrap, steps), world_size)


def _train(base: nn.Module, ctx: RankContext, wrap: Any, steps: int) -> dict[str, Any]:
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
        _judge_prediction(check, name, fn, numels, n, f"world size {n}, units {_describe(numels)}")
    wrap = call_learner(check, policy_name, wrap_policy, where="calling wrap_policy()")
    model = exercise_model()
    layer = count_parameters(model.encoder.layers[0])
    lines: list[Message] = []
    for n in sizes:
        where = f"world size {n}, wrap_policy() = {_policy_text(wrap)}"
        runs = run_checked(check, "FSDP(model, ctx, wrap=wrap_policy())", lambda ctx: _train(model, ctx, wrap, 2), n,
                           lambda r, w=where: f"{w}, rank {r}", _wrap_hint)
        numels = runs[0]["numels"]
        largest_name = max(numels, key=numels.get)
        if numels[largest_name] > padded_numel(layer, n):
            root_note = T("root_note") if largest_name == "root" else ""
            CheckFailure(check, where, T("largest_unit", unit=largest_name, numel=numels[largest_name],
                                         root_note=root_note, layer=padded_numel(layer, n)),
                         T("wrap_classes"), [f"units {_describe(numels)}"]).fail()
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
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))), *lines,
        T("peak_passed", cases=len(PEAK_CASES), bound=PEAK_BOUND))


def _policy_text(wrap: Any) -> str:
    if isinstance(wrap, set | frozenset | list | tuple):
        return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in wrap)) + "}"
    return repr(wrap)


def _wrap_hint(exc: BaseException) -> Message:
    if "wrap must be a set of nn.Module classes" in str(exc):
        return T("wrap_set")
    if "is sharded by FSDP" in str(exc):
        return T("functional")
    return exception_hint(exc)


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
    first = next(iter(numels.values()))
    known = [  # what a mistake predicts, the mistake, its hint
        (16 * psi / n + 8 * largest_wrapped, T("why_root_not_largest"), T("root_too", root=numels.get("root"))),
        (16 * sum(without_root.values()) / n + 8 * largest, T("why_psi_no_root"), T("psi_sum")),
        (16 * sum(without_root.values()) / n + 8 * largest_wrapped, T("why_both_no_root"), T("root_in_both")),
        (16 * psi + 8 * largest, T("why_not_divided"), T("keep_1n")),
        (16 * psi / n + 4 * largest, T("why_four"), T("holds_both")),
        (16 * psi / n, T("why_no_largest"), T("add_largest")),
        (16 * psi / n + 8 * first, T("why_first"), T("take_max")),
        ((16 * psi / n + 8 * largest) / 4, T("why_elements"), T("fp32")),
    ]
    for value, why, hint in known:
        if value != expected and abs(got - value) <= 1e-6 * max(value, 1.0):
            CheckFailure(check, where, T("predicted_why", got=got, expected=expected, why=why), hint,
                         [f"Ψ = {psi}, largest unit {max(numels, key=numels.get)!r} = {largest}"]).fail()
    CheckFailure(check, where, T("predicted_off", got=got, expected=expected), T("formula"),
                 [f"Ψ = {psi}, largest unit {max(numels, key=numels.get)!r} = {largest}"]).fail()
