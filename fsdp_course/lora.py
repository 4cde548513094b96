"""Low-rank adapters (LoRA, Hu et al., arXiv:2106.09685): fine-tune a frozen model through small trainable matrices.

LoRA keeps a pretrained weight W (out x in) frozen and learns a low-rank update beside it:

    y = x W^T + b + (alpha / r) * x A^T B^T,      A: (r, in), B: (out, r), r << min(in, out)

A is drawn at random (Kaiming-uniform, as the paper's reference code `loralib` does) and B starts at zero, so at
step 0 the adapted model computes exactly what the base model computes (B x = 0, and adding an exact zero changes
no bit). Only A and B (plus whatever the new task needs, such as a fresh classifier head) train: the gradients and
the optimizer state shrink to the adapters' size, while the frozen weights still have to be held (and, under FSDP,
gathered) for every forward and backward. After training, `merge_lora` folds B A into W (one Linear again, no extra
cost at inference); `remove_lora` drops the adapters and gives back the base model, bit for bit.

    add_lora(model, rank=4, alpha=8, targets=("linear1", "linear2"), trainable=("fc",))

replaces every `nn.Linear` whose qualified name is a target or ends with "." + target by a `LoRALinear`, freezes
every parameter, then unfreezes the adapters and the modules named in `trainable`.

Attention. `nn.MultiheadAttention` (inside `nn.TransformerEncoderLayer`) never calls a Linear: its forward passes
`in_proj_weight` (a bare parameter, the query, key and value projections stacked) and `out_proj.weight` /
`out_proj.bias` straight to `F.multi_head_attention_forward`. `out_proj` *is* an `nn.Linear`, but a `LoRALinear` put
in its place would never run: the adapter would get no gradient and change nothing. So `add_lora` refuses any target
inside an `nn.MultiheadAttention`, and the course adapts the feed-forward layers (`linear1`, `linear2`) and,
if asked, the head. (The paper adapts the attention's query and value projections; doing that to PyTorch's attention
takes a parametrization of `in_proj_weight`, `torch.nn.utils.parametrize`, which is not done here.) For the same
reason PyTorch's inference fast path of `nn.TransformerEncoderLayer` (eval mode, `batch_first=True`, no hooks) reads
`linear1.weight` directly: a `LoRALinear` has no `.weight`, so that path fails loudly instead of silently skipping the
adapter; the course's models run with `batch_first=False`, which never takes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_course.holders import holder

__all__ = ["DEFAULT_TARGETS", "LoRALinear", "add_lora", "lora_modules", "merge_lora", "remove_lora"]

DEFAULT_TARGETS = ("linear1", "linear2")  # nn.TransformerEncoderLayer's feed-forward


class LoRALinear(nn.Module):
    """`base(x) + (alpha / rank) * B(A(x))` with `base` frozen; `lora_A` (rank, in), `lora_B` (out, rank).

    `lora_B` starts at zero, so the module computes exactly `base(x)` until B is trained. `generator` draws `lora_A`
    (default: the global RNG, as nn.Linear's own init).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        _check(base, rank, alpha)
        self.base = base
        base.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, float(alpha), float(alpha) / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device))
        with torch.no_grad():  # loralib's init of A (that of nn.Linear's weight); B = 0
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> Tensor:
        """The update the adapters add to the base weight: (alpha / rank) * B A, shaped (out, in)."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha:g}"


def _check_rank_alpha(rank: int, alpha: float) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)):
        raise ValueError(f"alpha must be a finite number, got {alpha!r}")
    if alpha == 0:
        raise ValueError("alpha=0 scales the adapters' output by alpha / rank = 0: they would change nothing and get "
                         "zero gradients, so nothing would train. Use alpha = rank (scale 1) or 2 * rank")


def _check(base: nn.Module, rank: int, alpha: float) -> None:
    if not isinstance(base, nn.Linear):
        raise TypeError(f"LoRALinear adapts an nn.Linear, got {type(base).__name__}")
    _check_rank_alpha(rank, alpha)
    if rank > min(base.in_features, base.out_features):
        raise ValueError(f"rank {rank} exceeds min(in_features, out_features) = "
                         f"{min(base.in_features, base.out_features)}: that is no low-rank update")


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def _names(what: str, value: str | Iterable[str]) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{what} must be module names (strings), got {value!r}")
    return names


def add_lora(model: nn.Module, *, rank: int, alpha: float, targets: str | Iterable[str] = DEFAULT_TARGETS,
             trainable: str | Iterable[str] = (), generator: torch.Generator | None = None) -> list[str]:
    """Put a `LoRALinear` in place of every target `nn.Linear`, freeze the rest; returns the adapted modules' names.

    A module matches a target when its qualified name is the target or ends with "." + target ("linear1" matches
    "encoder.layers.0.linear1"). Every target must match at least one module, each an `nn.Linear` outside any
    `nn.MultiheadAttention`. Afterwards only the adapters and the parameters of the modules named in `trainable`
    (matched the same way, e.g. the new task's head "fc") require grad; a second call adds to the first (whose adapters
    and trainable modules stay trainable). Must come before any wrapping (FSDP, DDP, fully_shard): raises then, as for
    any bad input, before changing anything.
    """
    _check_rank_alpha(rank, alpha)
    held = holder(model)
    if held is not None:
        raise ValueError(f"add_lora after wrapping: {held}. Adapters added now would be plain parameters outside "
                         "its shards: drawn differently on every rank, their gradients never averaged, and left out "
                         "of its state dict. Add them first, then wrap: add_lora(model, ...); fsdp = FSDP(model, "
                         "ctx, ...); then build the optimizer on fsdp.parameters()")
    targets, trainable = _names("targets", targets), _names("trainable", trainable)
    if not targets:
        raise ValueError("targets is empty: name the nn.Linear modules to adapt, e.g. ('linear1', 'linear2')")
    modules = dict(model.named_modules())
    chosen: list[str] = []
    for target in targets:
        found = [n for n in modules if n and _matches(n, target)]
        if not found:
            linears = sorted({n.rpartition(".")[2] for n, m in modules.items() if isinstance(m, nn.Linear)})
            raise ValueError(f"target {target!r} matches no module of this {type(model).__name__}; "
                             f"its nn.Linear modules are named {linears}")
        for name in found:
            module = modules[name]
            if isinstance(module, LoRALinear):
                raise ValueError(f"{name!r} already has LoRA adapters")
            if not isinstance(module, nn.Linear):
                raise TypeError(f"target {target!r} matches {name!r}, a {type(module).__name__}: LoRA adapts "
                                "nn.Linear modules")
            owner = modules[name.rpartition(".")[0]]
            if isinstance(owner, nn.MultiheadAttention):
                raise ValueError(f"{name!r} is inside an nn.MultiheadAttention, which never calls it: it passes "
                                 f"{name.rpartition('.')[2]}.weight straight to F.multi_head_attention_forward, so "
                                 "an adapter there would be skipped (no gradient, no effect). Adapt the "
                                 "feed-forward layers instead, e.g. targets=('linear1', 'linear2')")
            _check(module, rank, alpha)
            if name not in chosen:
                chosen.append(name)
    chosen = [n for n in modules if n in chosen]  # in the model's order
    unfrozen: list[nn.Module] = []  # the modules `trainable` names, found before any replacement
    for name in trainable:
        matched = [m for n, m in modules.items() if n and _matches(n, name)]
        if not matched:
            raise ValueError(f"trainable {name!r} matches no module of this {type(model).__name__}")
        unfrozen += matched
    if not lora_modules(model):  # a second call keeps what the first one left trainable (its adapters, its heads)
        model.requires_grad_(False)
    for name in chosen:
        _set_submodule(model, name, LoRALinear(modules[name], rank, alpha, generator=generator))
    for module in unfrozen:
        module.requires_grad_(True)
    return chosen


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every `LoRALinear` of `model`, by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Replace every `LoRALinear` by one `nn.Linear` of weight W + (alpha / rank) B A (and the base's bias, its
    requires_grad unchanged: frozen); returns the merged modules' names. The merged model computes the adapted one up
    to rounding (one matrix product instead of two paths)."""
    found = lora_modules(model)
    for name, lora in found.items():
        base = lora.base
        merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None,
                           device=base.weight.device, dtype=base.weight.dtype)
        merged.weight.copy_(base.weight + lora.delta_weight())
        if base.bias is not None:
            merged.bias.copy_(base.bias)
        merged.requires_grad_(base.weight.requires_grad)
        _set_submodule(model, name, merged)
    return list(found)


def remove_lora(model: nn.Module) -> list[str]:
    """Put every `LoRALinear`'s base `nn.Linear` back (the adapters are dropped): the base model, bit for bit.
    Returns the names of the modules restored. Parameters keep their requires_grad (the bases stay frozen)."""
    found = lora_modules(model)
    for name, lora in found.items():
        _set_submodule(model, name, lora.base)
    return list(found)
