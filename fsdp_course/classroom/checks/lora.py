"""Checker of exercise 17: a LoRA layer (Hu et al., arXiv:2106.09685), alone and fine-tuned under the course's FSDP.

Cites LoRA (Hu et al., arXiv:2106.09685).
Design notes: docs/CLASSROOM.md, "Checkers", `lora.py`.
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
    require_learner,
    say_passed,
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

T = catalogue("lora")  # fsdp_course/i18n/catalogues/lora.yml


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
    or_rank = T("or_one_over_rank") if abs(1 / RANK - RANK / ALPHA) < 1e-9 else ""
    hint = known_mistake(ratio, [  # the update's scale: none, alpha, rank / alpha
        (1.0, lambda: T("not_scaled", alpha=ALPHA, rank=RANK, scaling=ALPHA / RANK)),
        (ALPHA, lambda: T("scaled_by_alpha", scaling=ALPHA / RANK, alpha=ALPHA)),
        (RANK / ALPHA, lambda: T("inverted", inverse=RANK / ALPHA, or_rank=or_rank, scaling=ALPHA / RANK)),
    ], lambda a, b: abs(a - b) < 1e-4) or T("formula")
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
    name, sizes = require_learner(check, cls, "LoRALinear", world_sizes)
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
    say_passed(check, sizes, T("passed"))


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
    category = next((c for c in KEPT if got[c] != expected[c]), None)
    if category is None:
        return
    value, gap = got[category], expected[category] - got[category]
    short = int(gap) if gap == int(gap) else round(gap, 1)
    named = known_mistake(value, [(_kept_bytes(units, n, **keywords)[category], hint) for keywords, hint in (
        ({"frozen_params": False}, lambda: T("kept_frozen_left_out")),  # the mistake as _kept_bytes' keywords
        ({"sharded": False}, lambda: T("kept_whole")),
        *[({"pieces": pieces}, lambda: T("kept_unpadded", category=category, short=short, n=n))
          for pieces in ("exact", "floor", "total")],
        ({"grads_of_frozen": True}, lambda: T("kept_frozen_grad")),
        ({"state_of_frozen": True}, lambda: T("kept_frozen_state")),
        ({"state_of_frozen": True, "step_of_frozen": True}, lambda: T("kept_frozen_state")),
        ({"moments": 1}, lambda: T("kept_one_moment")),
        ({"step": False}, lambda: T("kept_no_step", short=short)))])
    _fail(where, T("kept_differs", category=category, expected=int(expected[category]), got=value),
          named or (T("kept_round") if value != int(value) else T("kept_recount")), check=KEPT_CHECK)


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
    name, sizes = require_learner(check, fn, "kept_bytes", world_sizes)
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
    say_passed(check, sizes, T("kept_passed", cases=len(KEPT_CASES), sizes=", ".join(map(str, sizes)), n=sizes[0],
                               lora=lora, full=full))
