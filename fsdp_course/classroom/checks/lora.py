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
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.classroom.checks._common import (
    CheckFailure,
    call_learner,
    format_tensor,
    require_callable,
    require_world_sizes,
)
from fsdp_course.engines.equivalence import ADAMW, Case, FSDPTrainee, check_equivalence, digits_batches
from fsdp_course.fsdp.api import FSDP
from fsdp_course.models import TransformerClassifier, TransformerConfig
from fsdp_course.runtime.simulate import RankError

__all__ = ["check_lora_linear"]

IN, OUT, RANK, ALPHA = 6, 5, 2, 4.0  # scaling alpha / rank = 2.0
TOL = 1e-5


def _linear(seed: int = 0) -> nn.Linear:
    """A Linear(IN, OUT) with weights from a private generator (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(IN, OUT)


def _fail(where: str, problem: str, hint: str, details: list[str] | None = None) -> None:
    CheckFailure("check_lora_linear", where, problem, hint, details or []).fail()


def _structure(module: Any, base: nn.Linear, values: dict[str, torch.Tensor], where: str) -> None:
    if not isinstance(module, nn.Module):
        _fail(where, f"got a {type(module).__name__}, not an nn.Module",
              "LoRALinear subclasses nn.Module and calls super().__init__() first")
    if getattr(module, "base", None) is not base:
        _fail(where, "self.base is not the nn.Linear that was passed in",
              "keep the Linear you were given as self.base (not a copy, not a new Linear): it holds the pretrained "
              "weights")
    if any(not torch.equal(p, values[n]) for n, p in base.named_parameters()):
        _fail(where, "the base Linear's weight or bias changed", "leave the pretrained weights as they are: only "
              "freeze them (self.base.requires_grad_(False)); never re-initialize them")
    for name in ("lora_A", "lora_B"):
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter):
            shown = "missing" if p is None else f"a {type(p).__name__}"
            _fail(where, f"self.{name} is {shown}, not an nn.Parameter",
                  f"make self.{name} = nn.Parameter(...): only parameters are seen by .parameters(), the optimizer "
                  "and FSDP")
    shapes = {"lora_A": (RANK, IN), "lora_B": (OUT, RANK)}
    for name, shape in shapes.items():
        got = tuple(getattr(module, name).shape)
        if got != shape:
            _fail(where, f"self.{name} has shape {got}, expected {shape}",
                  "A maps the input down to `rank` values: (rank, in_features); B maps them back up: "
                  "(out_features, rank)", [f"base: nn.Linear(in_features={IN}, out_features={OUT}), rank={RANK}"])
    trainable_base = [n for n, p in base.named_parameters() if p.requires_grad]
    if trainable_base:
        verb = "requires" if len(trainable_base) == 1 else "require"
        _fail(where, f"the base's {' and '.join(trainable_base)} still {verb} grad",
              "freeze the pretrained Linear: self.base.requires_grad_(False)")
    trainable = sorted(n for n, p in module.named_parameters() if p.requires_grad)
    if trainable != ["lora_A", "lora_B"]:
        _fail(where, f"the trainable parameters are {trainable}, expected ['lora_A', 'lora_B']",
              "only the two adapter matrices train: both nn.Parameter with requires_grad=True (the default)")


def _at_init(module: nn.Module, base: nn.Linear, name: str) -> None:
    where = "step 0 (the adapters as your __init__ made them)"
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = call_learner("check_lora_linear", name, module, x, where=where)
        expected = base(x)
    a, b = module.lora_A.detach(), module.lora_B.detach()
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        _fail(where, f"forward returned {shown}, expected a tensor of shape {tuple(expected.shape)}",
              "return base(x) plus the update, the shape of base(x)")
    if not torch.equal(got, expected):
        hint = ("B must start at zero (torch.zeros or nn.init.zeros_), so that the update B A x is exactly zero and "
                "the adapted model starts as the pretrained one" if b.any() else
                "with B zero the update is zero: forward must return base(x) + (alpha / rank) * B(A x) and nothing "
                "else (the base called once, with its bias)")
        _fail(where, "the output differs from the base Linear's at step 0", hint,
              [f"expected {format_tensor(expected)}", f"got      {format_tensor(got)}"])
    if not a.any() and b.any():
        _fail(where, "lora_A is all zeros and lora_B is not",
              "A and B are swapped: B starts at zero (so the adapted model starts as the pretrained one) and A at "
              "random (so that B's gradient, (dL/dy) (A x)ᵀ, is not zero from the first step)")
    if not a.any():
        _fail(where, "lora_A is all zeros",
              "with A and B both zero, B's gradient (which is (dL/dy) (A x)ᵀ) is zero too, and A's is (B ...) zero: "
              "nothing ever trains. Draw A at random, e.g. nn.init.kaiming_uniform_(A, a=math.sqrt(5)) or a normal")


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
    what = f"a {kept[0]}" if kept else "a weight and bias"
    _fail(where, f"your forward does not go through self.base: it uses {what} kept aside, which FSDP would empty "
          "(sharded away)",
          "call self.base(x) in forward: FSDP replaces the base's parameters by views of its gathered flat parameter "
          "and empties the originals, so a tensor kept in __init__ (self.w = base.weight, or a detached copy) is "
          "either emptied or a private unsharded copy on every rank that a loaded checkpoint never reaches",
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
        hint = f"the update is not scaled: multiply B(A x) by alpha / rank (here {ALPHA:g} / {RANK} = {ALPHA / RANK:g})"
    elif abs(ratio - ALPHA) < 1e-4:
        hint = f"the update is scaled by alpha: the scaling is alpha / rank (here {ALPHA / RANK:g}, not {ALPHA:g})"
    elif abs(ratio - RANK / ALPHA) < 1e-4:
        hint = (f"the scaling is inverted: the update is multiplied by {RANK / ALPHA:g} = rank / alpha"
                + (" (or 1 / rank, alpha left out)" if abs(1 / RANK - RANK / ALPHA) < 1e-9 else "")
                + f"; it is alpha / rank = {ALPHA / RANK:g}: a larger alpha makes the adapters' update larger")
    else:
        hint = ("y = base(x) + (alpha / rank) * x Aᵀ Bᵀ, e.g. self.base(x) + F.linear(F.linear(x, self.lora_A), "
                "self.lora_B) * self.scaling")
    _fail(where, "the output differs from base(x) + (alpha / rank) B A x", hint,
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
        _fail(where, "the base Linear got a gradient", "freeze the pretrained Linear: self.base.requires_grad_(False)")
    for label, p, ref in (("lora_A", module.lora_A, a.grad), ("lora_B", module.lora_B, b.grad)):
        if p.grad is None:
            _fail(where, f"{label} got no gradient", f"use self.{label} in forward, on the path to the output")
        if not torch.allclose(p.grad, ref, rtol=TOL, atol=1e-6):
            _fail(where, f"{label}'s gradient differs from the formula's", "compute the update from self.lora_A and "
                  "self.lora_B themselves (not .data or a detached copy), scaled by alpha / rank",
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

    def make(m: nn.Module, ctx: Any, factory: Any) -> FSDPTrainee:
        return FSDPTrainee(FSDP(m, ctx, wrap={nn.TransformerEncoderLayer}), factory)

    for n in sizes:
        where = f"fine-tuning under FSDP, world size {n}"
        try:
            result = check_equivalence([case], make, n, tol=TOL, timeout=60)["lora"]
        except RankError as err:
            rank = min(err.failures)
            _fail(where, f"rank {rank} raised {type(err.failures[rank]).__name__}: {err.failures[rank]}",
                  "FSDP replaces every module's parameters by views of its gathered flat parameter: use "
                  "self.base(x), self.lora_A and self.lora_B in forward, never tensors kept aside in __init__")
        except AssertionError as err:
            _fail(where, f"not what one process computes: {err}",
                  "the same forward on every rank: no randomness in forward, no state kept between calls")
        for rank, trace in enumerate(result.traces):
            for name in frozen:
                for start, end, values in trace.params[-1].get(name, []):
                    if not torch.equal(values, initial[name][start:end]):
                        _fail(where, f"rank {rank}: the frozen {name} changed during training",
                              "the base must stay frozen: requires_grad False, so it gets no gradient and no step")


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
    print(f"All tests in {check} passed (world sizes {', '.join(map(str, sizes))})")
    print("  the base frozen, B zero at step 0 (the output is the base's, bit for bit, and follows the base's weights "
          "when they are swapped), the scaled update and its gradients as the formula's; under FSDP the fine-tuning "
          "equals one process's and the base stays bit-identical on every rank")
