"""Checkers of exercise 18 (the memory-budget puzzles): a device budget, ZeRO's stages, CPU offload, ring traffic.

The learner writes four small calculators; each is compared with the course's formulas on a set of puzzles, and its
answer is then confirmed by running the configuration for real on simulated ranks with the device budget on
(`memory.attach(..., capacity=...)`, which raises `DeviceOutOfMemory` where a GPU would run out):

    device_peak(psi, world_size, stage, offload, unit_numel)    bytes on the device at the peak of a step (fp32 Adam,
                                                                 activations left out): `memory.budget_formula`
    smallest_world_size(psi, unit_numel, capacity, stage, offload)
                                                                 the smallest N in 1..64 that fits, or None
    bytes_sent(psi, world_size, stage)                           ring bytes sent per rank and step (fp32):
                                                                 `ledger.traffic_formula` (ZeRO's section 7)
    comm_seconds(psi, world_size, units, alpha, beta)            ZeRO-3's communication time per step under the α-β
                                                                 model (`cost_model.CostFit.predict`): per unit two
                                                                 all-gathers and one reduce-scatter

Formulas: ZeRO (arXiv:1910.02054, sections 5.1 and 7); FSDP (arXiv:2304.11277) adds the gathered unit and its
gradient (8 bytes per parameter of the largest unit); CPU offload (torch's `CPUOffloadPolicy`, the course's
`OffloadPolicy`) moves the sharded 16 Psi / N to the host. The diagnoses name the usual mistakes: Adam's 8 bytes per
parameter forgotten, N instead of N - 1 in the ring, offloaded state counted against the device (or only part of it
moved), a search that stops before N = 64 or goes past it, alpha paid once per collective instead of N - 1 times, the
whole model's bytes as one unit's payload; a `smallest_world_size` built on a wrong `device_peak` is sent back to
`device_peak`. The measured peak of the run is printed term by term against the formula (a bound: at the moment of the
peak one unit's sharded gradient is not made yet).
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
    call_learner,
    known_mistake,
    require_callable,
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.memory import (
    DEVICE,
    DeviceOutOfMemory,
    attach,
    budget_formula,
    pool_bytes,
    pool_of,
    record_event,
    zero_formula,
)
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.cost_model import CostFit, ring_steps
from fsdp_course.runtime.ledger import traffic_formula
from fsdp_course.runtime.simulate import run_ranks

__all__ = ["RUN_CAPACITY", "RUN_SIZES", "check_bytes_sent", "check_comm_seconds", "check_device_peak",
           "check_smallest_world_size", "expected_comm_seconds", "expected_smallest_world_size", "run_with_budget"]

STAGES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
MAX_WORLD_SIZE = 64
# (psi, unit_numel): lesson 18's MLP (8 layers of 65,792), a 1.3B model in 24 units, a small one in uneven units
MODELS = ((526_336, 65_792), (1_300_000_000, 52_000_000), (10_000, 4_000))
WORLD_SIZES = (1, 2, 3, 4, 8)
MiB = 2**20
# the model the checkers run for real: MLP([64] * 5), four units of 4,160 parameters, 4 samples per rank
RUN_SIZES = (64, 64, 64, 64, 64)
RUN_BATCH = 4
RUN_ACTIVATIONS = 2 * (len(RUN_SIZES) - 1) * RUN_BATCH * 64 * 4  # each layer's input and ReLU output, fp32
RUN_CAPACITY = 112 * 1024  # bytes per rank: ZeRO-3 fits from 4 ranks on, with offload from 1

T = catalogue("budget", {
    # -- any calculator --
    "returned": ("returned {kind} {value!r:.80}", "返回了 {kind} {value!r:.80}"),
    "plain_number": ("return a plain number (int or float)", "返回一个普通数字（int 或 float）"),
    "plain_number_or_none": ("return a plain number (int or float), or None when nothing fits",
                             "返回一个普通数字（int 或 float），什么都放不下时返回 None"),
    "got_bytes": ("got {got:,.0f} B, expected {expected:,.0f} B", "得到 {got:,.0f} B，应为 {expected:,.0f} B"),
    "elements": ("those are elements, not bytes: one fp32 value is 4 bytes",
                 "这些是元素个数，不是字节数：一个 fp32 值占 4 字节"),
    "see_formula": ("see the formula above", "见上面的公式"),
    # -- device_peak --
    "offload_counted": ("you counted the offloaded state against the device: with offload the sharded parameters, "
                        "their gradients and Adam's state (16 Psi / N bytes) live on the host, and only the gathered "
                        "unit with its gradient (8 bytes per parameter of the unit) is on the device",
                        "你把卸载出去的状态算进了设备内存：卸载时，分片后的参数、它们的梯度和 Adam 状态"
                        "（16 Psi / N 字节）都在主机上，设备上只有全聚合的单元及其梯度（按该单元每个参数 8 字节计）"),
    "kept_params_grads": ("the sharded parameters and gradients (8Ψ/N)", "分片后的参数和梯度（8Ψ/N）"),
    "kept_params": ("the sharded parameters or their gradients (4Ψ/N)", "分片后的参数或它们的梯度（4Ψ/N）"),
    "kept_params_adam": ("the sharded parameters or gradients and Adam's state (12Ψ/N)",
                         "分片后的参数或梯度，以及 Adam 状态（12Ψ/N）"),
    "kept_on_device": ("you kept {what} on the device: offload moves them to the host too, with Adam's state (all of "
                       "16Ψ/N); the device holds only the gathered unit and its gradient, 8 bytes per parameter of "
                       "the unit",
                       "你把{what}留在了设备上：卸载会把它们连同 Adam 状态一起移到主机上（共 16Ψ/N）；"
                       "设备上只有全聚合的单元及其梯度，按该单元每个参数 8 字节计"),
    "forgot_moments": ("you forgot the optimizer's state: Adam keeps two fp32 moments, 8 bytes per parameter (sharded "
                       "over N from ZeRO-1 on)",
                       "你漏掉了优化器状态：Adam 保存两个 fp32 矩估计，每个参数 8 字节（从 ZeRO-1 起在 N 个 rank 上"
                       "分片）"),
    "adam_two_tensors": ("Adam keeps two fp32 tensors per parameter (momentum and variance): 8 bytes per parameter, "
                         "not 4", "Adam 为每个参数保存两个 fp32 张量（动量和方差）：每个参数 8 字节，不是 4"),
    "gathers_one_unit": ("ZeRO-3 gathers one unit at a time: at the peak the largest unit's full parameters and its "
                         "full gradient are on the device too, 8 bytes per parameter of the unit",
                         "ZeRO-3 一次全聚合一个单元：峰值时，最大单元的完整参数和完整梯度也在设备上，"
                         "按该单元每个参数 8 字节计"),
    "gathered_grad_full": ("the gathered unit's gradient is full too while it waits for its reduce-scatter: 8 bytes, "
                           "not 4", "全聚合单元的梯度在等待归约分散时也是完整的：8 字节，不是 4"),
    "down": ("down", "向下"),
    "up": ("up", "向上"),
    "rounded": ("your {got:,.0f} B is the formula's {expected:,.2f} B rounded {direction}: Psi / N need not be whole, "
                "so divide with /, not // or round(); the checker compares bytes to a millionth, not to the byte",
                "你的 {got:,.0f} B 是公式的 {expected:,.2f} B {direction}取整的结果：Psi / N 不一定是整数，"
                "所以用 / 来除，不要用 // 或 round()；检查器按百万分之一的精度比较字节数，而不是精确到字节"),
    "divide_by_n": ("{stage} shards some states over the N ranks: divide what it shards by N",
                    "{stage} 把部分状态分片到 N 个 rank 上：被它分片的部分要除以 N"),
    "neighbour_peak": ("that is {other}'s peak, not {stage}'s: ZeRO-1 shards the optimizer state, ZeRO-2 the "
                       "gradients as well, ZeRO-3 the parameters too (and gathers one unit at a time); check which "
                       "states your stage number shards",
                       "这是 {other} 的峰值，不是 {stage} 的：ZeRO-1 对优化器状态分片，ZeRO-2 还对梯度分片，"
                       "ZeRO-3 连参数也分片（并且一次全聚合一个单元）；检查你的阶段编号对哪些状态分片"),
    "shards_nothing": ("nothing", "不对任何状态分片"),
    "shards_optimizer": ("the optimizer state", "对优化器状态分片"),
    "shards_grads": ("the optimizer state and the gradients", "对优化器状态和梯度分片"),
    "shards_all": ("all three", "对这三者都分片"),
    "offload_moves": ("; offload moves the sharded states to the host", "；卸载会把分片后的状态移到主机上"),
    "per_parameter": ("per parameter 4 bytes of parameter, 4 of gradient, 8 of Adam state; {stage} shards "
                      "{what}{offload}",
                      "每个参数有 4 字节参数、4 字节梯度、8 字节 Adam 状态；{stage} {what}{offload}"),
    "ran_out_budget": ("with a budget of your prediction + {activations:,} B for activations, the run ran out of "
                       "device memory",
                       "预算设为你的预测值加上留给激活值的 {activations:,} B 时，运行耗尽了设备内存"),
    "prediction_low": ("your prediction is too low", "你的预测太低了"),
    # -- smallest_world_size --
    "blame_device_peak": ("your device_peak gives {got:,.0f} B at N = {n}, the formula {expected:,.0f} B: fix "
                          "device_peak first (check_device_peak names the mistake): your loop only follows it",
                          "你的 device_peak 在 N = {n} 时给出 {got:,.0f} B，公式给出 {expected:,.0f} B：先修好 "
                          "device_peak（check_device_peak 会指出错在哪里）；你的循环只是照着它的结果走"),
    "offload_counted_search": ("you counted the offloaded state against the device: with offload only the gathered "
                               "unit and its gradient are on the device, the sharded 16 Psi / N is host memory",
                               "你把卸载出去的状态算进了设备内存：卸载时设备上只有全聚合的单元及其梯度，"
                               "分片后的 16 Psi / N 在主机内存里"),
    "forgot_optimizer": ("you forgot the optimizer's state: Adam keeps 8 bytes per parameter (sharded from ZeRO-1 "
                         "on)", "你漏掉了优化器状态：Adam 每个参数占 8 字节（从 ZeRO-1 起分片）"),
    "holds_gathered_unit": ("ZeRO-3 also holds the largest unit gathered with its gradient: 8 bytes per parameter of "
                            "the unit", "ZeRO-3 还要放下全聚合后的最大单元及其梯度：按该单元每个参数 8 字节计"),
    "never_tried": ("N = {top} fits, and your search never tried it: range(1, {top}) stops at {last}; try every N "
                    "from 1 to {top} (range(1, {stop}))",
                    "N = {top} 放得下，但你的搜索从没试过它：range(1, {top}) 止于 {last}；要试遍从 1 到 {top} "
                    "的每个 N（range(1, {stop})）"),
    "boundary": ("a boundary case: at N = {n} the device needs exactly {capacity:,.0f} B, the whole capacity, and a "
                 "peak equal to the capacity fits: compare with <=, not <",
                 "边界情况：N = {n} 时设备恰好需要 {capacity:,.0f} B，正好是全部容量，而峰值等于容量时是放得下的："
                 "比较时用 <=，不要用 <"),
    "past_search": ("the search is N = 1 to {top}: when none of them fits, return None (you went on to N = {got:.0f})",
                    "搜索范围是 N = 1 到 {top}：都放不下时返回 None（你继续试到了 N = {got:.0f}）"),
    "needs_more": ("at N = {n:.0f} the device needs {need:,.0f} B, more than the capacity",
                   "N = {n:.0f} 时设备需要 {need:,.0f} B，超过了容量"),
    "at_least_one": ("a world size counts ranks, so the smallest is 1 (got {got:g}): search N = 1, 2, ... and "
                     "return the first whose device peak fits",
                     "world size 是 rank 的个数，最小是 1（得到的是 {got:g}）：依次试 N = 1, 2, ...，"
                     "返回第一个设备峰值放得下的 N"),
    "try_each": ("try N = 1, 2, 3 ... and return the first N whose device peak fits; None when no N up to {top} fits",
                 "依次尝试 N = 1, 2, 3 ...，返回第一个设备峰值放得下的 N；所有不超过 {top} 的 N 都放不下时返回 None"),
    "got_expected": ("got {got!r}, expected {expected!r}", "得到 {got!r}，应为 {expected!r}"),
    "n_ran_out": ("your N = {n} ran out of device memory", "你的 N = {n} 耗尽了设备内存"),
    "n_too_small": ("your N is too small", "你的 N 太小了"),
    "fits_too": ("N = {n} fits too", "N = {n} 也放得下"),
    "not_smallest": ("your N is not the smallest", "你的 N 不是最小的"),
    # -- bytes_sent --
    "ledger_bytes": ("your answer {got:,.0f} B, the ledger counted {sent:,.0f} B",
                     "你的答案是 {got:,.0f} B，通信账本记录的是 {sent:,.0f} B"),
    "ring_n_minus_1": ("a ring sends (N - 1)/N of the payload per rank, not all of it: each rank already holds its own "
                       "chunk, so use N - 1 where you used N",
                       "环形算法中每个 rank 发送有效载荷的 (N - 1)/N，而不是全部：每个 rank 已经持有自己的分块，"
                       "所以把用 N 的地方换成 N - 1"),
    "two_or_three_passes": ("DDP, ZeRO-1 and ZeRO-2 move 2 Psi (N-1)/N (a reduce-scatter and an all-gather: one "
                            "all-reduce); ZeRO-3 moves 3 Psi (N-1)/N (all-gather in forward, again in backward, "
                            "reduce-scatter)",
                            "DDP、ZeRO-1 和 ZeRO-2 传输 2 Psi (N-1)/N（一次归约分散加一次全聚合，即一次全归约）；"
                            "ZeRO-3 传输 3 Psi (N-1)/N（前向全聚合、反向再全聚合一次、归约分散）"),
    "traffic": ("{stage}: {passes} Psi (N-1)/N elements of 4 bytes per rank and step",
                "{stage}：每个 rank 每步传输 {passes} Psi (N-1)/N 个元素，每个元素 4 字节"),
    # -- comm_seconds --
    "got_seconds": ("got {got:.6g} s, expected {expected:.6g} s", "得到 {got:.6g} 秒，应为 {expected:.6g} 秒"),
    "ledger_steps": ("your ring steps {steps:g} and bytes {sent:,.0f}; the ledger's {ledger_steps} and "
                     "{ledger_sent:,.0f}",
                     "你的环形步数 {steps:g}、字节数 {sent:,.0f}；通信账本记录的是 {ledger_steps} 步和 "
                     "{ledger_sent:,.0f} 字节"),
    "ring_steps": ("a ring all-gather or reduce-scatter over N ranks takes N - 1 steps, each paying alpha, and each "
                   "rank sends (N - 1)/N of the payload: use N - 1 where you used N",
                   "N 个 rank 上的环形全聚合或归约分散要走 N - 1 步，每步付出一次 alpha，而且每个 rank 发送有效载荷的 "
                   "(N - 1)/N：把用 N 的地方换成 N - 1"),
    "latency": ("the latency term is (N-1)x too small ({k}x here): a ring all-gather or reduce-scatter over N ranks "
                "takes N - 1 steps and each step pays alpha, so each collective costs (N - 1) alpha, not alpha",
                "延迟项只有应得值的 1/(N-1)（这里是 1/{k}）：N 个 rank 上的环形全聚合或归约分散要走 N - 1 步，"
                "每步付出一次 alpha，所以每次集合通信的代价是 (N - 1) alpha，而不是 alpha"),
    "bandwidth": ("the bandwidth term is units x too large ({units}x here): one unit's payload is 4Ψ/units bytes "
                  "(4 x {psi:,} / {units}), not the whole model's 4Ψ; each of the units x 3 collectives moves one unit",
                  "带宽项是应得值的 units 倍（这里是 {units} 倍）：一个单元的有效载荷是 4Ψ/units 字节"
                  "（4 x {psi:,} / {units}），不是整个模型的 4Ψ；units x 3 次集合通信每次只传一个单元"),
    "own_collective": ("each unit is its own collective: units x 3 collectives, each paying (N - 1) alpha",
                       "每个单元各自做集合通信：共 units x 3 次集合通信，每次付出 (N - 1) alpha"),
    "three_collectives": ("ZeRO-3 runs three collectives per unit and step: an all-gather in forward, another in "
                          "backward (the unit was freed after forward), and a reduce-scatter of its gradient",
                          "ZeRO-3 每个单元每步做三次集合通信：前向一次全聚合，反向再一次（前向之后单元已被释放），"
                          "以及对其梯度的一次归约分散"),
    "one_rank": ("one rank talks to nobody: no collective, 0 seconds",
                 "只有一个 rank 时不与任何人通信：没有集合通信，0 秒"),
    "per_unit": ("per unit: 2 all-gathers + 1 reduce-scatter, each (N - 1) alpha + (N - 1)/N x (4 psi / units) x beta",
                 "每个单元：2 次全聚合 + 1 次归约分散，每次 (N - 1) alpha + (N - 1)/N x (4 psi / units) x beta"),
    # -- what passed --
    "against_run": ("world sizes {sizes} against {formula}; {real} for real with the budget on",
                    "world size 为 {sizes} 时与 {formula} 对照；为 {real} 时开启预算实际运行"),
    "against_ledger": ("world sizes {sizes} against {formula}; {real} against the ledger of a real step",
                       "world size 为 {sizes} 时与 {formula} 对照；为 {real} 时与一次真实步骤的通信账本对照"),
    "the_run": ("the run: {model} ({psi:,} parameters), ZeRO-3 on 2 ranks{offload}",
                "实际运行：{model}（{psi:,} 个参数），2 个 rank 上的 ZeRO-3{offload}"),
    "with_offload": (" with offload", "，开启卸载"),
    "peak": ("  {run}: predicted {predicted:,.0f} B + activations, measured peak {peak:,} B at '{label}'",
             "  {run}：预测 {predicted:,.0f} B + 激活值，实测峰值 {peak:,} B，出现在 '{label}'"),
    # the measured peak term by term, each term after the ones `before` it
    "term_formula": ("    = {device:,.0f} (the formula)", "    = {device:,.0f}（公式）"),
    "term_own_grad": ("{before} - {grads:,.0f} ({name}'s own sharded gradient, 4 x {unit:,} / {n}: the formula counts "
                      "it, but the reduce-scatter that makes it comes next)",
                      "{before} - {grads:,.0f}（{name} 自己的分片梯度，4 x {unit:,} / {n}：公式把它算在内，"
                      "但产生它的归约分散紧随其后）"),
    "term_not_made": ("{before} - {grads:,.0f} (sharded gradients not made yet)",
                      "{before} - {grads:,.0f}（尚未产生的分片梯度）"),
    "term_steps": ("{before} + {steps:,.0f} (Adam's step counts)", "{before} + {steps:,.0f}（Adam 的 step 计数）"),
    "term_activations": ("{before} + {activations:,} (activations)", "{before} + {activations:,}（激活值）"),
    "term_other": ("{before} {sign} {other:,.0f} (other)", "{before} {sign} {other:,.0f}（其他）"),
    "run_budget": ("  the run, budget {capacity:,} B per rank: ZeRO-3: {plain}; ZeRO-3 + offload: {offloaded}",
                   "  实际运行，每个 rank 的预算为 {capacity:,} B：ZeRO-3：{plain}；ZeRO-3 + 卸载：{offloaded}"),
    "fits": ("N = {n} fits{below}", "N = {n} 时放得下{below}"),
    "runs_out": (", N = {n} runs out ({category})", "，N = {n} 时内存不足（{category}）"),
    "bytes_rows": ("  ZeRO-3 of the run model, bytes sent per rank and step: {rows}",
                   "  实际运行的模型上的 ZeRO-3，每个 rank 每步发送的字节数：{rows}"),
    "comm_rows": ("  ZeRO-3 of the run model, one step per rank: {rows}",
                  "  实际运行的模型上的 ZeRO-3，每个 rank 一步之内：{rows}"),
    "comm_row": ("N = {n}: {collectives} collectives, {ring_steps} ring steps, {sent:,.0f} B",
                 "N = {n}：{collectives} 次集合通信，共 {ring_steps} 步环形通信，{sent:,.0f} B"),
    "comm_row_after": ("{before}; N = {n}: {collectives} collectives, {ring_steps} ring steps, {sent:,.0f} B",
                       "{before}；N = {n}：{collectives} 次集合通信，共 {ring_steps} 步环形通信，{sent:,.0f} B"),
})


def _run_psi() -> tuple[int, int]:
    units = [a * b + b for a, b in zip(RUN_SIZES[:-1], RUN_SIZES[1:], strict=True)]
    return sum(units), max(units)


def _close(got: float, expected: float) -> bool:
    return abs(got - expected) <= 1e-6 * max(abs(expected), 1.0)


def _number(check: str, where: str, got: Any, allow_none: bool = False) -> float | None:
    if got is None and allow_none:
        return None
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        CheckFailure(check, where, T("returned", kind=type(got).__name__, value=got),
                     T("plain_number_or_none" if allow_none else "plain_number")).fail()
    return float(got)


# -- device_peak -----------------------------------------------------------------------------------------------------
def _device_hint(got: float, psi: int, n: int, stage: int, offload: bool, unit: int) -> Message:
    expected = budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)
    states = zero_formula(psi, n, stage, gathered_numel=unit)
    device, adam, gathered = expected["device"], states["optimizer"], states["gathered"]
    kept = ((T("kept_params_grads"), states["params"] + states["grads"]),
            (T("kept_params"), states["params"]),
            (T("kept_params_adam"), states["params"] + states["optimizer"]))
    unsharded = sum(states[k] * (n if stage >= s else 1) for k, s in (("params", 3), ("grads", 2), ("optimizer", 1)))
    named = known_mistake(got, [  # what each known mistake gives (None where it cannot be made), and its hint
        (device + expected["host"] if offload else None, lambda: T("offload_counted")),
        *[(device + nbytes if offload else None, lambda what=what: T("kept_on_device", what=what))
          for what, nbytes in kept],
        (device - adam if adam else None, lambda: T("forgot_moments")),
        (device - adam / 2 if adam else None, lambda: T("adam_two_tensors")),
        (device - gathered if stage == 3 else None, lambda: T("gathers_one_unit")),
        (device - gathered / 2 if stage == 3 else None, lambda: T("gathered_grad_full")),
        (device / 4, lambda: T("elements")),
        (unsharded + gathered if n > 1 else None, lambda: T("divide_by_n", stage=STAGES[stage])),
        *[(budget_formula(psi, n, other, gathered_numel=unit)["device"] if 0 <= other <= 3 and not offload else None,
           lambda other=other: T("neighbour_peak", other=STAGES[other], stage=STAGES[stage]))
          for other in (stage - 1, stage + 1)],
    ], _close, first=True)  # in the order of the old hints: the likelier mistake first
    if named is not None:
        return named
    if 0 < abs(got - device) < 8 and got == int(got):
        return T("rounded", got=got, expected=device, direction=T("down" if got < device else "up"))
    what = T(("shards_nothing", "shards_optimizer", "shards_grads", "shards_all")[stage])
    return T("per_parameter", stage=STAGES[stage], what=what, offload=T("offload_moves") if offload else "")


def run_with_budget(world_size: int, offload: bool, capacity: int, steps: int = 2) -> list[dict[str, Any]]:
    """Train the run model (ZeRO-3, the course's FSDP, one unit per Linear, Adam) on `world_size` ranks with the
    device budget on; per rank {"fits", "peak_device", "peak_label", "peak_snapshot", "sent", "collectives",
    "ring_steps", "error"}: the peak's snapshot is the bytes by category on the device at the recorded point where
    the device held the most."""
    from fsdp_course.fsdp.api import FSDP
    from fsdp_course.fsdp.policy import OffloadPolicy
    from fsdp_course.models import MLP

    torch.manual_seed(0)
    base = MLP(list(RUN_SIZES))

    def body(ctx: RankContext) -> dict[str, Any]:
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap={nn.Linear}, offload_policy=OffloadPolicy() if offload else None)
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(ctx.rank)
        try:
            recorder = attach(fsdp, opt, capacity=capacity)
            for _ in range(steps):
                ctx.ledger.clear()
                x, y = torch.randn(RUN_BATCH, RUN_SIZES[0], generator=g), torch.randint(0, RUN_SIZES[-1], (RUN_BATCH,),
                                                                                        generator=g)
                with recorder.track_activations():
                    loss = F.cross_entropy(fsdp(x), y)
                loss.backward()
                opt.step()
                record_event(fsdp, "optimizer step")
                opt.zero_grad()
        except DeviceOutOfMemory as e:
            return {"fits": False, "error": str(e), "category": e.category}
        records = list(ctx.ledger)
        at_peak = next(snap for _, snap in recorder.events if pool_bytes(snap, fsdp, DEVICE) == recorder.peak_device)
        return {"fits": True, "peak_device": recorder.peak_device, "peak_label": recorder.peak_device_label,
                "peak_snapshot": {c: b for c, b in at_peak.items() if b and pool_of(fsdp, c) == DEVICE},
                "sent": ctx.ledger.total()[0],
                "collectives": len(records),
                "ring_steps": sum(ring_steps(r.op, ctx.world_size) for r in records) if ctx.world_size > 1 else 0}

    return run_ranks(body, world_size, timeout=CHECK_TIMEOUT)


def check_device_peak(fn: Callable[[int, int, int, bool, int], float]) -> None:
    """Check `fn(psi, world_size, stage, offload, unit_numel)`: bytes on the device at the peak, fp32 Adam.

    Against `memory.budget_formula(...)["device"]` (activations left out) for stages 0-3 and ZeRO-3 with offload,
    then for real: ZeRO-3 on 2 ranks, with and without offload, with a budget of your prediction plus room for the
    activations, must run without running out of device memory."""
    check = "check_device_peak"
    name = require_callable(check, fn, "device_peak")
    for psi, unit in MODELS:
        for n in WORLD_SIZES:
            for stage, offload in ((0, False), (1, False), (2, False), (3, False), (3, True)):
                where = (f"psi {psi:,}, unit_numel {unit:,}, world size {n}, {STAGES[stage]}"
                         + (" with offload" if offload else ""))
                got = _number(check, where, call_learner(check, name, fn, psi, n, stage, offload, unit, where=where))
                expected = budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)["device"]
                if not _close(got, expected):
                    CheckFailure(check, where, T("got_bytes", got=got, expected=expected),
                                 _device_hint(got, psi, n, stage, offload, unit)).fail()
    psi, unit = _run_psi()
    rows = []
    for offload in (False, True):
        where = f"{name}({psi}, 2, 3, {offload}, {unit})"
        predicted = _number(check, where, call_learner(check, name, fn, psi, 2, 3, offload, unit, where=where))
        capacity = int(predicted) + RUN_ACTIVATIONS
        ran = run_with_budget(2, offload, capacity)
        the_run = T("the_run", model=f"MLP{list(RUN_SIZES)}", psi=psi, offload=T("with_offload") if offload else "")
        if not ran[0]["fits"]:
            CheckFailure(check, str(the_run), T("ran_out_budget", activations=RUN_ACTIVATIONS), T("prediction_low"),
                         [ran[0]["error"]]).fail()
        rows.append((the_run, offload, predicted, ran[0]))
    say(COMMON("passed", check=check, what=T("against_run", sizes=", ".join(map(str, WORLD_SIZES)),
                                              formula="budget_formula", real=2)))
    for the_run, offload, predicted, ran0 in rows:
        say(T("peak", run=the_run, predicted=predicted, peak=ran0["peak_device"], label=ran0["peak_label"]),
            _peak_terms(psi, unit, 2, offload, ran0))


def _peak_terms(psi: int, unit: int, n: int, offload: bool, ran: dict[str, Any]) -> Message:
    """The measured peak as the formula's device bytes plus or minus what differs at that moment, each term read off
    the snapshot at the peak: the activations, Adam's step counts (a scalar tensor per flat parameter, which the
    formula's 8 bytes per parameter leave out), and the sharded gradient of the unit whose full gradient just became
    ready (the formula counts every unit's sharded gradient at once; that unit's is made only by the reduce-scatter
    that follows)."""
    formula = budget_formula(psi, n, 3, offload=offload, gathered_numel=unit)
    snap = ran["peak_snapshot"]
    activations = snap.get("activations", 0)
    steps = snap.get("optimizer", 0) - (0 if offload else formula["optimizer"])
    grads = snap.get("sharded_grads", 0) - (0 if offload else formula["grads"])
    other = ran["peak_device"] - formula["device"] - activations - steps - grads
    terms = T("term_formula", device=formula["device"])
    if grads < 0:
        name = ran["peak_label"].split()[-1]
        terms = (T("term_own_grad", before=terms, grads=-grads, name=name, unit=unit, n=n)
                 if _close(-grads, 4 * unit / n) else T("term_not_made", before=terms, grads=-grads))
    if steps:
        terms = T("term_steps", before=terms, steps=steps)
    terms = T("term_activations", before=terms, activations=activations)
    if other:
        terms = T("term_other", before=terms, sign="+" if other > 0 else "-", other=abs(other))
    return terms


# -- smallest_world_size ---------------------------------------------------------------------------------------------
def expected_smallest_world_size(psi: int, unit: int, capacity: float, stage: int, offload: bool) -> int | None:
    for n in range(1, MAX_WORLD_SIZE + 1):
        if budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)["device"] <= capacity:
            return n
    return None


# a capacity that fits the 1.3B model's ZeRO-3 at N = MAX_WORLD_SIZE exactly, not at MAX_WORLD_SIZE - 1
EDGE_CAPACITY = budget_formula(1_300_000_000, MAX_WORLD_SIZE, 3, gathered_numel=52_000_000)["device"]
SMALLEST_CASES = (  # (psi, unit_numel, capacity in bytes, stage, offload)
    (526_336, 65_792, 3 * MiB, 3, False), (526_336, 65_792, 3 * MiB, 3, True), (526_336, 65_792, 3 * MiB, 2, False),
    (526_336, 65_792, 5 * MiB, 1, False), (526_336, 65_792, 3 * MiB, 0, False), (526_336, 65_792, 0.4 * MiB, 3, True),
    (1_300_000_000, 52_000_000, 80 * 2**30, 2, False), (1_300_000_000, 52_000_000, 2 * 2**30, 3, False),
    (1_300_000_000, 52_000_000, 1 * 2**30, 3, True), (10_000, 4_000, 80_000, 3, False),
    # a peak equal to the capacity fits: 16 Psi / 4 + 8 x 65,792 = 2,631,680 B at N = 4, to the byte
    (526_336, 65_792, 2_631_680, 3, False),
    # the edge of the search: the answer is the last N tried, then (one byte less) no N fits: None
    (1_300_000_000, 52_000_000, EDGE_CAPACITY, 3, False), (1_300_000_000, 52_000_000, EDGE_CAPACITY - 1, 3, False),
)


def _device_peak_blame(fn: Callable[..., Any], psi: int, unit: int, stage: int, offload: bool) -> Message | None:
    """If `fn` calls the learner's `device_peak` (a global of their notebook) and that gives another number than the
    formula at some N of the search, a hint that says so (the loop is not what is wrong), else None."""
    device_peak = getattr(fn, "__globals__", {}).get("device_peak")
    if not callable(device_peak) or "device_peak" not in getattr(getattr(fn, "__code__", None), "co_names", ()):
        return None
    for n in range(1, MAX_WORLD_SIZE + 1):
        expected = budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)["device"]
        try:
            got = float(device_peak(psi, n, stage, offload, unit))
        except Exception:  # noqa: BLE001  (the loop's own failure is reported instead)
            return None
        if not _close(got, expected):
            return T("blame_device_peak", got=got, n=n, expected=expected)
    return None


def _smallest_hint(got: float | None, psi: int, unit: int, capacity: float, stage: int, offload: bool) -> Message:
    def smallest(device: Callable[[int], float]) -> int | None:
        return next((n for n in range(1, MAX_WORLD_SIZE + 1) if device(n) <= capacity), None)

    def formula(n: int) -> dict[str, float]:
        return budget_formula(psi, n, stage, offload=offload, gathered_numel=unit)

    if offload and got == smallest(lambda n: formula(n)["device"] + formula(n)["host"]):
        return T("offload_counted_search")
    if got == smallest(lambda n: formula(n)["device"] - zero_formula(psi, n, stage)["optimizer"]):
        return T("forgot_optimizer")
    if stage == 3 and got == smallest(lambda n: formula(n)["device"] - zero_formula(psi, n, stage,
                                                                                     gathered_numel=unit)["gathered"]):
        return T("holds_gathered_unit")
    if got is not None and got < 1:  # no world has fewer than one rank (and the formula refuses it)
        return T("at_least_one", got=got)
    expected = smallest(lambda n: formula(n)["device"])
    if got is None and expected == MAX_WORLD_SIZE:
        return T("never_tried", top=MAX_WORLD_SIZE, last=MAX_WORLD_SIZE - 1, stop=MAX_WORLD_SIZE + 1)
    strict = next((n for n in range(1, MAX_WORLD_SIZE + 1) if formula(n)["device"] < capacity), None)
    if got == strict and expected is not None and formula(expected)["device"] == capacity:
        return T("boundary", n=expected, capacity=capacity)
    if expected is None and got is not None and got > MAX_WORLD_SIZE:
        return T("past_search", top=MAX_WORLD_SIZE, got=got)
    if got is not None and got <= MAX_WORLD_SIZE and formula(int(got))["device"] > capacity:
        return T("needs_more", n=got, need=formula(int(got))["device"])
    return T("try_each", top=MAX_WORLD_SIZE)


def check_smallest_world_size(fn: Callable[[int, int, float, int, bool], int | None]) -> None:
    """Check `fn(psi, unit_numel, capacity, stage, offload)`: the smallest N in 1..64 whose device peak fits.

    Against the formula on SMALLEST_CASES, then for real: the run model with ZeRO-3 and a budget of RUN_CAPACITY
    (activations allowed for) must fit at your N and run out of memory at N - 1, with and without offload."""
    check = "check_smallest_world_size"
    name = require_callable(check, fn, "smallest_world_size")
    for psi, unit, capacity, stage, offload in SMALLEST_CASES:
        where = (f"psi {psi:,}, unit_numel {unit:,}, capacity {capacity:,.0f} B, {STAGES[stage]}"
                 + (" with offload" if offload else ""))
        raw = call_learner(check, name, fn, psi, unit, capacity, stage, offload, where=where)
        got = _number(check, where, raw, allow_none=True)
        expected = expected_smallest_world_size(psi, unit, capacity, stage, offload)
        if got != expected:
            CheckFailure(check, where, T("got_expected", got=raw, expected=expected),
                         _device_peak_blame(fn, psi, unit, stage, offload)
                         or _smallest_hint(got, psi, unit, capacity, stage, offload)).fail()
    psi, unit = _run_psi()
    confirmed: dict[bool, Message] = {}
    sizes: set[int] = set()
    for offload in (False, True):
        asked = f"{name}({psi}, {unit}, {RUN_CAPACITY - RUN_ACTIVATIONS}, 3, {offload})"
        n = call_learner(check, name, fn, psi, unit, RUN_CAPACITY - RUN_ACTIVATIONS, 3, offload, where=asked)
        where = f"the run: MLP{list(RUN_SIZES)}, ZeRO-3{' with offload' if offload else ''}, {RUN_CAPACITY:,} B"
        ran = run_with_budget(int(n), offload, RUN_CAPACITY)
        if not ran[0]["fits"]:
            CheckFailure(check, where, T("n_ran_out", n=n), T("n_too_small"), [ran[0]["error"]]).fail()
        below = run_with_budget(int(n) - 1, offload, RUN_CAPACITY) if n > 1 else None
        if below is not None and below[0]["fits"]:
            CheckFailure(check, where, T("fits_too", n=n - 1), T("not_smallest")).fail()
        sizes |= {int(n), int(n) - 1} - {0}
        confirmed[offload] = T("fits", n=n, below=T("runs_out", n=n - 1, category=below[0]["category"])
                               if below is not None else "")
    say(COMMON("passed", check=check, what=T("against_run", sizes=f"1-{MAX_WORLD_SIZE}", formula="budget_formula",
                                              real=", ".join(map(str, sorted(sizes))))),
        T("run_budget", capacity=RUN_CAPACITY, plain=confirmed[False], offloaded=confirmed[True]))


# -- bytes_sent ------------------------------------------------------------------------------------------------------
def check_bytes_sent(fn: Callable[[int, int, int], float]) -> None:
    """Check `fn(psi, world_size, stage)`: fp32 bytes each rank sends per step under the ring model.

    Against `ledger.traffic_formula(4 * psi, N)` (stages 0-2: 2 Psi (N-1)/N elements, stage 3: 3 Psi (N-1)/N), then
    for real: the ledger of ZeRO-3 on 2 and 3 ranks (padded flat parameters) over one step."""
    check = "check_bytes_sent"
    name = require_callable(check, fn, "bytes_sent")
    for psi, _ in MODELS:
        for n in WORLD_SIZES:
            for stage in range(4):
                where = f"psi {psi:,}, world size {n}, {STAGES[stage]}"
                got = _number(check, where, call_learner(check, name, fn, psi, n, stage, where=where))
                formula = traffic_formula(4 * psi, n)
                expected = formula["fsdp" if stage == 3 else "ddp"]
                if not _close(got, expected):
                    CheckFailure(check, where, T("got_bytes", got=got, expected=expected),
                                 _traffic_hint(got, psi, n, stage)).fail()
    psi_units = [a * b + b for a, b in zip(RUN_SIZES[:-1], RUN_SIZES[1:], strict=True)]
    rows = []
    for n in (2, 3):
        padded = sum(-(-u // n) * n for u in psi_units)
        sent = run_with_budget(n, False, 2**40, steps=1)[0]["sent"]
        asked = f"{name}({padded}, {n}, 3)"
        got = _number(check, asked, call_learner(check, name, fn, padded, n, 3, where=asked))
        if not _close(got, sent):
            CheckFailure(check, f"the run: ZeRO-3 on {n} ranks, {padded:,} padded parameters",
                         T("ledger_bytes", got=got, sent=sent), T("see_formula")).fail()
        rows.append(f"N = {n}: {sent:,.0f} B")  # data: the Chinese shows it as it is
    say(COMMON("passed", check=check, what=T("against_ledger", sizes=", ".join(map(str, WORLD_SIZES)),
                                              formula="traffic_formula", real="2, 3")),
        T("bytes_rows", rows="; ".join(rows)))


def _traffic_hint(got: float, psi: int, n: int, stage: int) -> Message:
    passes = 3 if stage == 3 else 2
    ring = (n - 1) / n
    return known_mistake(got, [(passes * 4 * psi, lambda: T("ring_n_minus_1")),  # the whole payload, not (N-1)/N
                               (passes * psi * ring, lambda: T("elements")),  # elements, not bytes
                               ((5 - passes) * 4 * psi * ring, lambda: T("two_or_three_passes"))],
                         _close, first=True) or T("traffic", stage=STAGES[stage], passes=passes)


# -- comm_seconds ----------------------------------------------------------------------------------------------------
def expected_comm_seconds(psi: int, n: int, units: int, alpha: float, beta: float) -> float:
    """ZeRO-3, `units` equal units: two all-gathers and a reduce-scatter of each unit's 4 psi / units bytes."""
    if n == 1:
        return 0.0
    fit = CostFit(alpha, beta, 1.0, 0.0, 1.0, 1.0, 0)
    per_unit = 4 * psi / units
    return units * (2 * fit.predict("all_gather", per_unit, n) + fit.predict("reduce_scatter", per_unit, n))


COMM_CASES = (  # (psi, world size, units, alpha s, beta s/B)
    (526_336, 4, 8, 20e-6, 1e-9), (526_336, 2, 8, 20e-6, 1e-9), (526_336, 1, 8, 20e-6, 1e-9),
    (1_300_000_000, 8, 24, 10e-6, 1 / 25e9), (1_300_000_000, 64, 24, 10e-6, 1 / 25e9), (10_000, 3, 5, 1e-3, 0.0),
)


def _comm_hint(got: float, psi: int, n: int, units: int, alpha: float, beta: float) -> Message:
    b = 4 * psi / units
    ring = (n - 1) / n * b * beta

    def total(steps: float, per_byte: float, collectives: int = 3, count: int = units) -> float:
        return count * collectives * (steps * alpha + per_byte)

    several = n > 1
    named = known_mistake(got, [  # what each known mistake gives (None where it cannot be made), and its hint
        *[(wrong if several else None, lambda: T("ring_steps"))  # N where the ring takes N - 1
          for wrong in (total(n, ring), total(n, b * beta), total(n - 1, b * beta))],
        (total(1, ring) if n > 2 else None, lambda: T("latency", k=n - 1)),
        (total(n - 1, ring * units) if several and units > 1 else None, lambda: T("bandwidth", units=units, psi=psi)),
        (total(n - 1, ring * units, count=1) if several else None, lambda: T("own_collective")),
        (total(n - 1, ring, collectives=2) if several else None, lambda: T("three_collectives")),
    ], _close, first=True)
    if named is not None:
        return named
    return T("one_rank") if n == 1 and got != 0 else T("per_unit")


def check_comm_seconds(fn: Callable[[int, int, int, float, float], float]) -> None:
    """Check `fn(psi, world_size, units, alpha, beta)`: ZeRO-3's communication seconds per step, α-β ring model.

    Against `CostFit.predict` on COMM_CASES, then against a real step's ledger on 2 and 3 ranks: with alpha = 1,
    beta = 0 your function must count the ring steps the ledger's collectives took; with alpha = 0, beta = 1 the bytes
    they sent."""
    check = "check_comm_seconds"
    name = require_callable(check, fn, "comm_seconds")
    for psi, n, units, alpha, beta in COMM_CASES:
        where = f"psi {psi:,}, world size {n}, {units} units, alpha {alpha:g} s, beta {beta:g} s/B"
        got = _number(check, where, call_learner(check, name, fn, psi, n, units, alpha, beta, where=where))
        expected = expected_comm_seconds(psi, n, units, alpha, beta)
        if not _close(got, expected):
            CheckFailure(check, where, T("got_seconds", got=got, expected=expected),
                         _comm_hint(got, psi, n, units, alpha, beta)).fail()
    unit_numel = RUN_SIZES[0] * RUN_SIZES[1] + RUN_SIZES[1]
    units = len(RUN_SIZES) - 1
    rows: Message | None = None
    for n in (2, 3):
        padded = units * (-(-unit_numel // n) * n)
        ran = run_with_budget(n, False, 2**40, steps=1)[0]
        steps, sent = (_number(check, f"{name}({padded}, {n}, {units}, {a}, {b})",
                               call_learner(check, name, fn, padded, n, units, a, b,
                                            where=f"{name}({padded}, {n}, {units}, {a}, {b})"))
                       for a, b in ((1.0, 0.0), (0.0, 1.0)))
        if not (_close(steps, ran["ring_steps"]) and _close(sent, ran["sent"])):
            CheckFailure(check, f"the run: ZeRO-3 on {n} ranks, {units} units",
                         T("ledger_steps", steps=steps, sent=sent, ledger_steps=ran["ring_steps"],
                           ledger_sent=ran["sent"]), T("see_formula")).fail()
        rows = (T("comm_row", n=n, collectives=ran["collectives"], ring_steps=ran["ring_steps"], sent=ran["sent"])
                if rows is None else T("comm_row_after", before=rows, n=n, collectives=ran["collectives"],
                                       ring_steps=ran["ring_steps"], sent=ran["sent"]))
    say(COMMON("passed", check=check, what=T("against_ledger",
                                              sizes=", ".join(sorted({str(c[1]) for c in COMM_CASES}, key=int)),
                                              formula="CostFit.predict", real="2, 3")),
        T("comm_rows", rows=rows))
