"""Checker of exercise 17: a LoRA layer (Hu et al., arXiv:2106.09685), alone and fine-tuned under the course's FSDP.

The learner writes `LoRALinear(base, rank, alpha)`: keep the pretrained `nn.Linear` as `self.base`, frozen; two
trainable parameters `lora_A` (rank, in_features), drawn at random, and `lora_B` (out_features, rank), zeros; and
`forward(x) = base(x) + (alpha / rank) * x Aᵀ Bᵀ`. `check_lora_linear(LoRALinear)` checks, in order, and names the
first thing wrong with a hint:

  1. the structure: `base` kept (the same module, its values untouched) and frozen, `lora_A` and `lora_B` trainable
     `nn.Parameter`s of the right shapes, and nothing else trainable;
  2. step 0: the output equals `base(x)` bit for bit (B = 0), and A is not zero (else B's gradient is zero too and
     nothing ever trains); with the base's weight and bias swapped for other values (as FSDP swaps them for views of
     its flat parameter) the output follows them: the forward goes through `self.base`, not a weight kept aside;
  3. the forward with given A and B against `fsdp_course.lora.LoRALinear`'s formula (the scaling alpha / rank);
  4. the gradients of one backward: none for the base, A's and B's as the formula's;
  5. fine-tuning under FSDP (wrap={nn.TransformerEncoderLayer}) of a tiny Transformer whose feed-forward Linear layers
     are the learner's, head trainable, on each world size: every step's loss and gradients, and the parameters,
     against one process within 1e-5 (the equivalence harness), and the frozen base bit-identical on every rank.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    format_tensor,
    known_mistake,
    require_callable,
    require_world_sizes,
    say,
)
from fsdp_course.classroom.checks._common import T as COMMON
from fsdp_course.engines.equivalence import ADAMW, Case, Trainee, check_equivalence, digits_batches
from fsdp_course.fsdp.api import FSDP
from fsdp_course.i18n.messages import Message, catalogue
from fsdp_course.lora import add_lora
from fsdp_course.memory import measure
from fsdp_course.models import TransformerClassifier, TransformerConfig
from fsdp_course.runtime.simulate import RankError, run_ranks

__all__ = ["check_kept_bytes", "check_lora_linear"]

IN, OUT, RANK, ALPHA = 6, 5, 2, 4.0  # scaling alpha / rank = 2.0
TOL = 1e-5

T = catalogue("lora", {
    "not_module": ("got a {kind}, not an nn.Module", "得到了一个 {kind}，不是 nn.Module"),
    "subclass": ("LoRALinear subclasses nn.Module and calls super().__init__() first",
                 "LoRALinear 继承 nn.Module，并首先调用 super().__init__()"),
    "base_not_kept": ("self.base is not the nn.Linear that was passed in", "self.base 不是传进来的那个 nn.Linear"),
    "keep_base": ("keep the Linear you were given as self.base (not a copy, not a new Linear): it holds the pretrained "
                  "weights",
                  "把传入的 Linear 保存为 self.base（不是副本，也不是新的 Linear）：它持有预训练权重"),
    "base_changed": ("the base Linear's weight or bias changed", "基座 Linear 的 weight 或 bias 被改变了"),
    "leave_weights": ("leave the pretrained weights as they are: only freeze them (self.base.requires_grad_(False)); "
                      "never re-initialize them",
                      "保持预训练权重不变：只冻结它们（self.base.requires_grad_(False)）；永远不要重新初始化它们"),
    "param_missing": ("self.{name} is missing, not an nn.Parameter", "self.{name} 不存在，它应是一个 nn.Parameter"),
    "param_type": ("self.{name} is a {kind}, not an nn.Parameter", "self.{name} 是 {kind}，不是 nn.Parameter"),
    "make_param": ("make self.{name} = nn.Parameter(...): only parameters are seen by .parameters(), the optimizer "
                   "and FSDP",
                   "让 self.{name} = nn.Parameter(...)：只有参数才会被 .parameters()、优化器和 FSDP 看到"),
    "shape": ("self.{name} has shape {got}, expected {expected}", "self.{name} 的形状是 {got}，应为 {expected}"),
    "shapes": ("A maps the input down to `rank` values: (rank, in_features); B maps them back up: "
               "(out_features, rank)",
               "A 把输入降到 `rank` 个值：(rank, in_features)；B 再把它们映射回去：(out_features, rank)"),
    "base_trainable_one": ("the base's {name} still requires grad", "基座的 {name} 仍然需要梯度（requires grad）"),
    "base_trainable_two": ("the base's {first} and {last} still require grad",
                           "基座的 {first} 和 {last} 仍然需要梯度（requires grad）"),
    "freeze": ("freeze the pretrained Linear: self.base.requires_grad_(False)",
               "冻结预训练的 Linear：self.base.requires_grad_(False)"),
    "trainable": ("the trainable parameters are {trainable}, expected ['lora_A', 'lora_B']",
                  "可训练的参数是 {trainable}，应为 ['lora_A', 'lora_B']"),
    "only_adapters": ("only the two adapter matrices train: both nn.Parameter with requires_grad=True (the default)",
                      "只训练两个适配器矩阵：两者都是 requires_grad=True（默认值）的 nn.Parameter"),
    "forward_returned": ("forward returned {shown}, expected a tensor of shape {shape}",
                         "forward 返回了 {shown}，应为形状为 {shape} 的张量"),
    "return_shape": ("return base(x) plus the update, the shape of base(x)",
                     "返回 base(x) 加上更新量，形状与 base(x) 相同"),
    "b_zero": ("B must start at zero (torch.zeros or nn.init.zeros_), so that the update B A x is exactly zero and the "
               "adapted model starts as the pretrained one",
               "B 必须从零开始（torch.zeros 或 nn.init.zeros_），这样更新量 B A x 恰好为零，适配后的模型起点就是"
               "预训练模型"),
    "only_base": ("with B zero the update is zero: forward must return base(x) + (alpha / rank) * B(A x) and nothing "
                  "else (the base called once, with its bias)",
                  "B 为零时更新量为零：forward 必须返回 base(x) + (alpha / rank) * B(A x)，此外什么都不加"
                  "（base 只调用一次，带上它的 bias）"),
    "differs_at_init": ("the output differs from the base Linear's at step 0", "第 0 步时，输出与基座 Linear 的不同"),
    "a_zero_b_not": ("lora_A is all zeros and lora_B is not", "lora_A 全为零，而 lora_B 不是"),
    "swapped": ("A and B are swapped: B starts at zero (so the adapted model starts as the pretrained one) and A at "
                "random (so that B's gradient, (dL/dy) (A x)ᵀ, is not zero from the first step)",
                "A 和 B 弄反了：B 应从零开始（这样适配后的模型一开始就是预训练模型），A 应随机初始化"
                "（这样 B 的梯度 (dL/dy) (A x)ᵀ 从第一步起就不为零）"),
    "a_zero": ("lora_A is all zeros", "lora_A 全为零"),
    "both_zero": ("with A and B both zero, B's gradient (which is (dL/dy) (A x)ᵀ) is zero too, and A's is (B ...) "
                  "zero: nothing ever trains. Draw A at random, e.g. nn.init.kaiming_uniform_(A, a=math.sqrt(5)) or "
                  "a normal",
                  "A 和 B 都为零时，B 的梯度（即 (dL/dy) (A x)ᵀ）也为零，A 的梯度（B ...）同样为零：什么都训练不了。"
                  "A 要随机初始化，例如 nn.init.kaiming_uniform_(A, a=math.sqrt(5)) 或正态分布"),
    "kept_one": ("your forward does not go through self.base: it uses a {name} kept aside, which FSDP would empty "
                 "(sharded away)",
                 "你的 forward 没有经过 self.base：它使用了另外保存的 {name}，而 FSDP 会把它清空（分片出去）"),
    "kept_both": ("your forward does not go through self.base: it uses a weight and bias kept aside, which FSDP would "
                  "empty (sharded away)",
                  "你的 forward 没有经过 self.base：它使用了另外保存的 weight 和 bias，而 FSDP 会把它们清空"
                  "（分片出去）"),
    "call_base": ("call self.base(x) in forward: FSDP replaces the base's parameters by views of its gathered flat "
                  "parameter and empties the originals, so a tensor kept in __init__ (self.w = base.weight, or a "
                  "detached copy) is either emptied or a private unsharded copy on every rank that a loaded checkpoint "
                  "never reaches",
                  "在 forward 里调用 self.base(x)：FSDP 会把 base 的参数换成全聚合后展平参数的视图并清空原参数，"
                  "所以在 __init__ 里留下的张量（self.w = base.weight，或一个 detach 的副本）要么被清空，"
                  "要么是每个 rank 上一份未分片的私有副本，加载检查点时也不会更新到它"),
    "not_scaled": ("the update is not scaled: multiply B(A x) by alpha / rank (here {alpha:g} / {rank} = {scaling:g})",
                   "更新量没有缩放：把 B(A x) 乘以 alpha / rank（这里是 {alpha:g} / {rank} = {scaling:g}）"),
    "scaled_by_alpha": ("the update is scaled by alpha: the scaling is alpha / rank (here {scaling:g}, not {alpha:g})",
                        "更新量按 alpha 缩放了：缩放系数应为 alpha / rank（这里是 {scaling:g}，而不是 {alpha:g}）"),
    "inverted": ("the scaling is inverted: the update is multiplied by {inverse:g} = rank / alpha{or_rank}; it is "
                 "alpha / rank = {scaling:g}: a larger alpha makes the adapters' update larger",
                 "缩放反了：更新量被乘以 {inverse:g} = rank / alpha{or_rank}；应为 alpha / rank = {scaling:g}："
                 "alpha 越大，适配器的更新量越大"),
    "or_one_over_rank": (" (or 1 / rank, alpha left out)", "（或 1 / rank，即漏掉了 alpha）"),
    "formula": ("y = base(x) + (alpha / rank) * x Aᵀ Bᵀ, e.g. self.base(x) + F.linear(F.linear(x, self.lora_A), "
                "self.lora_B) * self.scaling",
                "y = base(x) + (alpha / rank) * x Aᵀ Bᵀ，例如 self.base(x) + F.linear(F.linear(x, self.lora_A), "
                "self.lora_B) * self.scaling"),
    "differs_formula": ("the output differs from base(x) + (alpha / rank) B A x",
                        "输出与 base(x) + (alpha / rank) B A x 不同"),
    "base_grad": ("the base Linear got a gradient", "基座 Linear 得到了梯度"),
    "no_grad": ("{label} got no gradient", "{label} 没有得到梯度"),
    "use_in_forward": ("use self.{label} in forward, on the path to the output",
                       "在 forward 里使用 self.{label}，让它在通往输出的路径上"),
    "grad_differs": ("{label}'s gradient differs from the formula's", "{label} 的梯度与公式给出的不同"),
    "from_params": ("compute the update from self.lora_A and self.lora_B themselves (not .data or a detached copy), "
                    "scaled by alpha / rank",
                    "用 self.lora_A 和 self.lora_B 本身（而不是 .data 或 detach 的副本）计算更新量，再按 alpha / rank "
                    "缩放"),
    "fsdp_views": ("FSDP replaces every module's parameters by views of its gathered flat parameter: use self.base(x), "
                   "self.lora_A and self.lora_B in forward, never tensors kept aside in __init__",
                   "FSDP 会把每个模块的参数换成它全聚合后展平参数的视图：在 forward 里使用 self.base(x)、self.lora_A "
                   "和 self.lora_B，决不要用在 __init__ 里另外保存的张量"),
    "not_one_process": ("not what one process computes: {error}", "与单进程的计算结果不同：{error}"),
    "same_forward": ("the same forward on every rank: no randomness in forward, no state kept between calls",
                     "每个 rank 上的 forward 必须完全相同：forward 中不要有随机性，也不要在两次调用之间保存状态"),
    "frozen_changed": ("rank {rank}: the frozen {name} changed during training",
                       "rank {rank}：冻结的 {name} 在训练中改变了"),
    "stay_frozen": ("the base must stay frozen: requires_grad False, so it gets no gradient and no step",
                    "基座必须保持冻结：requires_grad 为 False，这样它既得不到梯度，也不会被更新"),
    # check_kept_bytes: what one rank keeps after an AdamW step
    "kept_not_dict": ("returned {shown}, not a dict of the three categories", "返回了 {shown}，而不是三个类别的字典"),
    "kept_keys": ("the keys are {got}, expected {expected}", "键是 {got}，应为 {expected}"),
    "kept_return": ("return {{\"sharded_params\": ..., \"sharded_grads\": ..., \"optimizer\": ...}}: bytes, as ints",
                    "返回 {{\"sharded_params\": ..., \"sharded_grads\": ..., \"optimizer\": ...}}：字节数，"
                    "整数"),
    "kept_not_number": ("{category} is {shown}, not a number of bytes", "{category} 是 {shown}，不是字节数"),
    "kept_round": ("a rank holds whole elements: round each flat parameter's piece up (ceil(n / N)), then multiply "
                   "by the bytes per element",
                   "每个 rank 持有的是整数个元素：把每个展平参数的那一份向上取整（ceil(n / N)），再乘以每个元素的"
                   "字节数"),
    "kept_differs": ("{category}: expected {expected:,} bytes per rank, got {got:,}",
                     "{category}：每个 rank 应为 {expected:,} 字节，得到 {got:,}"),
    "kept_frozen_left_out": ("the frozen flat parameters are left out of the parameters: they are sharded too, every "
                             "rank keeps 1/N of each (frozen means never updated, not never stored)",
                             "参数里漏掉了冻结的展平参数：它们同样被分片，每个 rank 保存每个的 1/N"
                             "（冻结的意思是从不更新，而不是从不存储）"),
    "kept_whole": ("that is the whole of it on every rank: FSDP keeps 1/N of each flat parameter per rank, and its "
                   "reduce-scatter leaves 1/N of each gradient; AdamW's state follows the shards it updates",
                   "这是每个 rank 都保存了一整份：FSDP 让每个 rank 只保存每个展平参数的 1/N，reduce-scatter 也只给它"
                   "留下每个梯度的 1/N；AdamW 的状态跟随它更新的那些分片"),
    "kept_unpadded": ("{category} is {short:,} bytes short, the padding: at N = {n}, FSDP pads each flat parameter "
                      "to a multiple of N on its own, so a rank's piece of n elements is ceil(n / N) elements, not "
                      "n / N (and not the padded total of all of them)",
                      "{category} 少了 {short:,} 字节，正是填充：N = {n} 时，FSDP 把每个展平参数各自填充到 N 的"
                      "整数倍，所以 n 个元素中一个 rank 的那份是 ceil(n / N) 个元素，而不是 n / N"
                      "（也不是把全部加起来再填充）"),
    "kept_frozen_grad": ("a frozen flat parameter gets no gradient: only the trainable ones are reduce-scattered into "
                         "a sharded gradient",
                         "冻结的展平参数没有梯度：只有可训练的展平参数会经 reduce-scatter 得到分片梯度"),
    "kept_frozen_state": ("AdamW keeps state only for the parameters it updates: the trainable shards, not the frozen "
                          "ones",
                          "AdamW 只为它更新的参数保存状态：可训练的分片，而不是冻结的分片"),
    "kept_one_moment": ("AdamW keeps two moments per trainable element (exp_avg and exp_avg_sq): 8 bytes in fp32, "
                        "not 4",
                        "AdamW 为每个可训练元素保存两个矩（exp_avg 和 exp_avg_sq）：fp32 下是 8 字节，而不是 4"),
    "kept_no_step": ("the optimizer is {short:,} bytes short: AdamW also keeps a step count, one 4-byte tensor per "
                     "parameter it updates (here, one per trainable flat parameter)",
                     "optimizer 少了 {short:,} 字节：AdamW 还保存一个步数计数，每个被它更新的参数一个 4 字节张量"
                     "（这里是每个可训练展平参数一个）"),
    "kept_recount": ("recount: which flat parameters does this category hold on a rank, and how many elements of each?",
                     "重新数一数：这个类别在一个 rank 上包含哪些展平参数，每个有多少个元素？"),
    "kept_measured": ("rank {rank}: you predicted {got:,} bytes of {category}, the run measured {measured:,}",
                      "rank {rank}：你预测 {category} 为 {got:,} 字节，实际测得 {measured:,}"),
    "kept_environment": ("your prediction follows the formula, but this run measured otherwise: something in this "
                         "kernel changed what a rank holds (the default dtype, the optimizer's settings); restart the "
                         "kernel and run the notebook again",
                         "你的预测符合公式，但这次运行测得的不同：这个内核里有东西改变了一个 rank 持有的内容"
                         "（默认 dtype、优化器的设置）；重启内核，再把笔记本运行一遍"),
    "kept_passed": ("  {cases} made-up layouts at 1 to 3 ranks, then a LoRA fine-tuning step under FSDP: your "
                    "prediction is the bytes measured on every rank at world sizes {sizes} (e.g. {lora:,} bytes kept "
                    "per rank of {n}, where full fine-tuning would keep {full:,})",
                    "  1 到 3 个 rank 上的 {cases} 个构造布局，然后是 FSDP 下的一步 LoRA 微调：你的预测就是每个 rank "
                    "上测得的字节数，world size 为 {sizes}（例如 {n} 个 rank 时每个 rank 保存 {lora:,} 字节，"
                    "而全量微调要保存 {full:,}）"),
    # what passed
    "passed": ("  the base frozen, B zero at step 0 (the output is the base's, bit for bit, and follows the base's "
               "weights when they are swapped), the scaled update and its gradients as the formula's; under FSDP the "
               "fine-tuning equals one process's and the base stays bit-identical on every rank",
               "  基座被冻结，第 0 步时 B 为零（输出与基座的输出逐位相同，换掉基座的权重后输出也随之改变），"
               "缩放后的更新及其梯度都与公式一致；在 FSDP 下，微调结果与单进程相同，且基座在每个 rank 上都逐位不变"),
})


def _linear(seed: int = 0) -> nn.Linear:
    """A Linear(IN, OUT) with weights from a private generator (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(IN, OUT)


def _fail(where: str, problem: Message, hint: Message, details: list[str] | None = None,
          check: str = "check_lora_linear") -> None:
    CheckFailure(check, where, problem, hint, details or []).fail()


def _structure(module: Any, base: nn.Linear, values: dict[str, torch.Tensor], where: str) -> None:
    if not isinstance(module, nn.Module):
        _fail(where, T("not_module", kind=type(module).__name__), T("subclass"))
    if getattr(module, "base", None) is not base:
        _fail(where, T("base_not_kept"), T("keep_base"))
    if any(not torch.equal(p, values[n]) for n, p in base.named_parameters()):
        _fail(where, T("base_changed"), T("leave_weights"))
    for name in ("lora_A", "lora_B"):
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter):
            problem = T("param_missing", name=name) if p is None else T("param_type", name=name,
                                                                         kind=type(p).__name__)
            _fail(where, problem, T("make_param", name=name))
    shapes = {"lora_A": (RANK, IN), "lora_B": (OUT, RANK)}
    for name, shape in shapes.items():
        got = tuple(getattr(module, name).shape)
        if got != shape:
            _fail(where, T("shape", name=name, got=got, expected=shape), T("shapes"),
                  [f"base: nn.Linear(in_features={IN}, out_features={OUT}), rank={RANK}"])
    trainable_base = [n for n, p in base.named_parameters() if p.requires_grad]
    if trainable_base:
        problem = (T("base_trainable_one", name=trainable_base[0]) if len(trainable_base) == 1 else
                   T("base_trainable_two", first=" and ".join(trainable_base[:-1]), last=trainable_base[-1]))
        _fail(where, problem, T("freeze"))
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    if trainable != ["lora_A", "lora_B"]:
        _fail(where, T("trainable", trainable=trainable), T("only_adapters"))


def _at_init(module: nn.Module, base: nn.Linear, name: str) -> None:
    where = "step 0 (the adapters as your __init__ made them)"
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = call_learner("check_lora_linear", name, module, x, where=where)
        expected = base(x)
    a, b = module.lora_A.detach(), module.lora_B.detach()
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        _fail(where, T("forward_returned", shown=shown, shape=tuple(expected.shape)), T("return_shape"))
    if not torch.equal(got, expected):
        hint = T("b_zero") if b.any() else T("only_base")
        _fail(where, T("differs_at_init"), hint,
              [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"])
    if not a.any() and b.any():
        _fail(where, T("a_zero_b_not"), T("swapped"))
    if not a.any():
        _fail(where, T("a_zero"), T("both_zero"))


def _through_base(module: nn.Module, base: nn.Linear, name: str) -> None:
    """Swap the base's weight and bias for other values, as FSDP swaps them for views of its flat parameter: the output
    must follow (B is zero here, so it is base(x) with the new values). A forward that uses a tensor kept aside in
    __init__ (self.w = base.weight, or a detached copy) keeps the old values. The originals are put back after."""
    where = "forward after the base's weight and bias were swapped for other values (as FSDP swaps them)"
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(2))
    old = {"weight": base.weight, "bias": base.bias}
    other = _linear(seed=5)
    new = {k: nn.Parameter(other.get_parameter(k).detach(), requires_grad=False) for k in old}
    try:
        for k, p in new.items():
            setattr(base, k, p)
        with torch.no_grad():
            got = call_learner("check_lora_linear", name, module, x, where=where)
            expected = F.linear(x, new["weight"], new["bias"])
            stale = {k: F.linear(x, **{**new, k: old[k]}) for k in old}  # k kept aside, the other one followed
    finally:
        for k, p in old.items():
            setattr(base, k, p)
    if torch.allclose(got, expected, rtol=TOL, atol=1e-6):
        return
    kept = [k for k in ("weight", "bias") if torch.allclose(got, stale[k], rtol=TOL, atol=1e-6)]
    _fail(where, T("kept_one", name=kept[0]) if kept else T("kept_both"), T("call_base"),
          [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"])


def _reference(x: torch.Tensor, base: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return base(x) + F.linear(F.linear(x, a), b) * (ALPHA / RANK)


def _with_values(module: nn.Module, base: nn.Linear, name: str) -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(RANK, IN, generator=g), torch.randn(OUT, RANK, generator=g)
    with torch.no_grad():
        module.lora_A.copy_(a)
        module.lora_B.copy_(b)
    x = torch.randn(4, IN, generator=g)
    where = "forward with given A and B"
    got = call_learner("check_lora_linear", name, module, x, where=where)
    expected = _reference(x, base, a, b)
    if torch.allclose(got.detach(), expected.detach(), rtol=TOL, atol=1e-6):
        return
    update, unscaled = (got - base(x)).detach(), F.linear(F.linear(x, a), b).detach()
    ratio = (update.norm() / unscaled.norm()).item() if unscaled.norm() > 0 else float("nan")
    if abs(ratio - 1) < 1e-4:
        hint = T("not_scaled", alpha=ALPHA, rank=RANK, scaling=ALPHA / RANK)
    elif abs(ratio - ALPHA) < 1e-4:
        hint = T("scaled_by_alpha", scaling=ALPHA / RANK, alpha=ALPHA)
    elif abs(ratio - RANK / ALPHA) < 1e-4:
        or_rank = T("or_one_over_rank") if abs(1 / RANK - RANK / ALPHA) < 1e-9 else ""
        hint = T("inverted", inverse=RANK / ALPHA, or_rank=or_rank, scaling=ALPHA / RANK)
    else:
        hint = T("formula")
    _fail(where, T("differs_formula"), hint,
          [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"])


def _gradients(module: nn.Module, base: nn.Linear, name: str) -> None:
    where = "one backward with given A and B"
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(4))
    module.zero_grad(set_to_none=True)
    call_learner("check_lora_linear", name, lambda: module(x).square().sum().backward(), where=where)
    a = module.lora_A.detach().clone().requires_grad_(True)
    b = module.lora_B.detach().clone().requires_grad_(True)
    frozen = copy.deepcopy(base)
    _reference(x, frozen, a, b).square().sum().backward()
    if any(p.grad is not None for p in base.parameters()):
        _fail(where, T("base_grad"), T("freeze"))
    for label, p, ref in (("lora_A", module.lora_A, a.grad), ("lora_B", module.lora_B, b.grad)):
        if p.grad is None:
            _fail(where, T("no_grad", label=label), T("use_in_forward", label=label))
        if not torch.allclose(p.grad, ref, rtol=TOL, atol=1e-6):
            _fail(where, T("grad_differs", label=label), T("from_params"),
                  [f"expected {format_tensor(ref)}", f"got      {format_tensor(p.grad)}"])
    module.zero_grad(set_to_none=True)


def _adapted_transformer(cls: Callable[..., nn.Module]) -> tuple[nn.Module, list[str]]:
    """The tiny Transformer (seed 0), each feed-forward Linear replaced by the learner's LoRALinear (adapters drawn
    under seed 1), every parameter frozen but the adapters and the head."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TransformerClassifier(TransformerConfig.tiny())
        torch.manual_seed(1)
        for layer in model.encoder.layers:
            layer.linear1 = cls(layer.linear1, RANK, ALPHA)
            layer.linear2 = cls(layer.linear2, RANK, ALPHA)
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, cls):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)
    model.fc.requires_grad_(True)
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return model, frozen


def _under_fsdp(cls: Callable[..., nn.Module], sizes: list[int]) -> None:
    model, frozen = _adapted_transformer(cls)
    initial = {n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}
    case = Case("lora", model, ADAMW, digits_batches("tokens", 3, 12, token_stride=4), "global_norm")

    def make(m: nn.Module, ctx: Any, factory: Any) -> Trainee:
        return Trainee.fsdp(FSDP(m, ctx, wrap={nn.TransformerEncoderLayer}), factory)

    for n in sizes:
        where = f"fine-tuning under FSDP, world size {n}"
        try:
            result = check_equivalence([case], make, n, tol=TOL, timeout=60)["lora"]
        except RankError as err:
            rank = min(err.failures)
            _fail(where, COMMON("raised", rank=rank, kind=type(err.failures[rank]).__name__,
                                text=err.failures[rank]), T("fsdp_views"))
        except AssertionError as err:
            _fail(where, T("not_one_process", error=err), T("same_forward"))
        for rank, trace in enumerate(result.traces):
            for name in frozen:
                for start, end, values in trace.params[-1].get(name, []):
                    if not torch.equal(values, initial[name][start:end]):
                        _fail(where, T("frozen_changed", rank=rank, name=name), T("stay_frozen"))


def check_lora_linear(cls: Callable[..., nn.Module], world_sizes: Sequence[int] = (2, 3)) -> None:
    """Check the learner's `LoRALinear(base, rank, alpha)` (see the module docstring), then fine-tune a tiny
    Transformer adapted with it under FSDP on each of `world_sizes` ranks against one process."""
    check = "check_lora_linear"
    name = require_callable(check, cls, "LoRALinear")
    sizes = require_world_sizes(world_sizes)
    base = _linear()
    values = {n: p.detach().clone() for n, p in base.named_parameters()}
    module = call_learner(check, name, cls, base, RANK, ALPHA,
                          where=f"LoRALinear(nn.Linear({IN}, {OUT}), rank={RANK}, alpha={ALPHA:g})")
    _structure(module, base, values, f"LoRALinear(nn.Linear({IN}, {OUT}), rank={RANK}, alpha={ALPHA:g})")
    _at_init(module, base, name)
    _through_base(module, base, name)
    _with_values(module, base, name)
    _gradients(module, base, name)
    _under_fsdp(cls, sizes)
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("passed"))


KEPT = ("sharded_params", "sharded_grads", "optimizer")
KEPT_CHECK = "check_kept_bytes"
Units = dict[str, list[tuple[int, bool]]]  # unit label -> its flat parameters, (numel before padding, trainable)
KEPT_CASES: list[tuple[Units, int]] = [(units, n) for n in (1, 2, 3) for units in (
    {"root": [(166, True), (2_657, False)], "layers.0": [(1_281, True), (12_703, False)]},
    {"root": [(10, True)], "layers.0": [(7, False)], "layers.1": [(5, True), (4, False)]},
)]


def _kept_bytes(units: Units, world_size: int, *, grads_of_frozen: bool = False, state_of_frozen: bool = False,
                frozen_params: bool = True, pieces: str = "ceil", sharded: bool = True, moments: int = 2,
                step: bool = True, step_of_frozen: bool = False) -> dict[str, float]:
    """The bytes one rank keeps after an AdamW step in fp32 (the defaults), or a known mistake (a keyword changed)."""
    n = world_size if sharded else 1
    flats = [(numel, trainable) for handles in units.values() for numel, trainable in handles]

    def piece(numels: list[int]) -> float:  # elements of one rank's pieces: each rounded up (right), or not
        return {"ceil": lambda: sum(-(-k // n) for k in numels), "floor": lambda: sum(k // n for k in numels),
                "exact": lambda: sum(numels) / n, "total": lambda: -(-sum(numels) // n)}[pieces]()

    trainable = [k for k, t in flats if t]
    frozen = [k for k, t in flats if not t]
    return {"sharded_params": 4 * piece(trainable + (frozen if frozen_params else [])),
            "sharded_grads": 4 * piece(trainable + (frozen if grads_of_frozen else [])),
            "optimizer": 4 * moments * piece(trainable + (frozen if state_of_frozen else []))
            + 4 * step * (len(trainable) + (len(frozen) if step_of_frozen else 0))}


def _unpadded(category: str, short: float, n: int) -> Message:
    return T("kept_unpadded", category=category, short=short, n=n)


KEPT_MISTAKES: list[tuple[dict[str, Any], Callable[[str, float, int], Message]]] = [  # the mistake as _kept_bytes'
    ({"frozen_params": False}, lambda category, short, n: T("kept_frozen_left_out")),  # keywords, and its hint
    ({"sharded": False}, lambda category, short, n: T("kept_whole")),
    *[({"pieces": pieces}, _unpadded) for pieces in ("exact", "floor", "total")],
    ({"grads_of_frozen": True}, lambda category, short, n: T("kept_frozen_grad")),
    ({"state_of_frozen": True}, lambda category, short, n: T("kept_frozen_state")),
    ({"state_of_frozen": True, "step_of_frozen": True}, lambda category, short, n: T("kept_frozen_state")),
    ({"moments": 1}, lambda category, short, n: T("kept_one_moment")),
    ({"step": False}, lambda category, short, n: T("kept_no_step", short=short)),
]


def _judge_kept(where: str, got: Any, units: Units, n: int) -> None:
    if not isinstance(got, dict):
        _fail(where, T("kept_not_dict", shown=type(got).__name__), T("kept_return"), check=KEPT_CHECK)
    if sorted(map(str, got)) != sorted(KEPT):
        _fail(where, T("kept_keys", got=sorted(map(str, got)), expected=sorted(KEPT)), T("kept_return"),
              check=KEPT_CHECK)
    for category in KEPT:
        if isinstance(got[category], bool) or not isinstance(got[category], int | float) \
                or not math.isfinite(got[category]):
            _fail(where, T("kept_not_number", category=category, shown=repr(got[category])), T("kept_return"),
                  check=KEPT_CHECK)
    expected = _kept_bytes(units, n)
    for category in KEPT:
        value = got[category]
        if value == expected[category]:
            continue
        problem = T("kept_differs", category=category, expected=int(expected[category]), got=value)
        gap = expected[category] - value
        short = int(gap) if gap == int(gap) else round(gap, 1)
        named = known_mistake(value, [(_kept_bytes(units, n, **keywords)[category],
                                       lambda hint=hint, c=category, s=short: hint(c, s, n))
                                      for keywords, hint in KEPT_MISTAKES], first=True)
        fallback = T("kept_round") if value != int(value) else T("kept_recount")
        _fail(where, problem, named or fallback, check=KEPT_CHECK)


def _measured_kept(n: int) -> list[tuple[Units, dict[str, int]]]:
    """Per rank: the units of a tiny Transformer with LoRA adapters under FSDP, and the bytes measured after one
    AdamW step (before zero_grad)."""
    def body(ctx: Any) -> tuple[Units, dict[str, int]]:
        torch.manual_seed(0)
        model = TransformerClassifier(TransformerConfig.tiny())
        add_lora(model, rank=RANK, alpha=ALPHA, trainable="fc", generator=torch.Generator().manual_seed(1))
        fsdp = FSDP(model, ctx, wrap={nn.TransformerEncoderLayer})
        optimizer = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad], lr=1e-2)
        F.cross_entropy(fsdp(torch.zeros(2, 64, dtype=torch.long)), torch.tensor([3, 7])).backward()
        optimizer.step()
        units = {u.label: [(h.layout.numel, h.requires_grad) for h in u.handles] for u in fsdp.units}
        snapshot = measure(fsdp, optimizer)
        return units, {k: snapshot.get(k, 0) for k in KEPT}

    return run_ranks(body, n, timeout=60)


def check_kept_bytes(fn: Callable[..., Any], world_sizes: Sequence[int] = (2, 3)) -> None:
    """Check `fn(units, world_size) -> {"sharded_params", "sharded_grads", "optimizer": bytes}`: what one rank keeps
    after an AdamW step in fp32 under FSDP, each unit's flat parameters given as (numel, trainable). Made-up layouts at
    1 to 3 ranks first (each known mistake named), then the bytes measured on every rank of a LoRA fine-tuning step."""
    check = KEPT_CHECK
    name = require_callable(check, fn, "kept_bytes")
    sizes = require_world_sizes(world_sizes)
    for units, n in KEPT_CASES:
        where = f"{name}({units}, {n})"
        _judge_kept(where, call_learner(check, name, fn, copy.deepcopy(units), n, where=where), units, n)
    lora = full = 0
    for n in sizes:
        for rank, (units, measured) in enumerate(_measured_kept(n)):
            where = f"a LoRA fine-tuning step under FSDP, world size {n}, rank {rank}"
            got = call_learner(check, name, fn, copy.deepcopy(units), n, where=where)
            wrong = [c for c in KEPT if not isinstance(got, dict) or got.get(c) != measured[c]]
            if wrong:
                _judge_kept(where, got, units, n)  # names the learner's mistake, if the formula says it is one
                _fail(where, T("kept_measured", rank=rank, got=got[wrong[0]], category=wrong[0],
                               measured=measured[wrong[0]]), T("kept_environment"), [f"units: {units}"], KEPT_CHECK)
            if n == sizes[0] and rank == 0:  # full fine-tuning: one trainable flat parameter per unit
                lora = sum(measured.values())
                full = int(sum(_kept_bytes({u: [(sum(k for k, _ in h), True)] for u, h in units.items()}, n).values()))
    say(COMMON("passed", check=check, what=COMMON("world_sizes", sizes=", ".join(map(str, sizes)))),
        T("kept_passed", cases=len(KEPT_CASES), sizes=", ".join(map(str, sizes)), n=sizes[0], lora=lora, full=full))
