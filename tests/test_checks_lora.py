"""The checker of exercise 17 (a LoRA layer) passes the reference solution and fails planted mistakes with the
diagnosis that names them: each planted class is the reference with one thing wrong, as a learner would get it."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from reference_solutions import fails, load, passes
from torch import nn

from fsdp_course.classroom.checks import check_kept_bytes, check_lora_linear
from fsdp_course.classroom.checks.lora import KEPT_CASES, _under_fsdp
from fsdp_course.lora import LoRALinear as LibraryLoRALinear

FINETUNE = load("17_finetune")


class Reference(nn.Module):
    """What the solution notebook writes, spelled out here so that each mistake below changes one line of it."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class RandomB(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank))


class BothZero(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features))


class SwappedInit(Reference):  # A zero, B random: the adapted model still starts as the pretrained one
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.lora_A = nn.Parameter(torch.zeros(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank))


class InvertedScaling(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.scaling = rank / alpha


class Unscaled(Reference):
    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B)


class ScaledByAlpha(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.scaling = alpha


class BaseNotFrozen(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        base.requires_grad_(True)


class BiasNotFrozen(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        base.bias.requires_grad_(True)


class WeightKeptAside(Reference):
    """Right at every step alone and under the course's FSDP (which swaps the base's parameters for views): a forward
    that never reads self.base."""

    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.w = base.weight  # the same Parameter, registered a second time

    def forward(self, x):
        return F.linear(x, self.w, self.base.bias) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class CopyKeptAside(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.w, self.b = base.weight.detach().clone(), base.bias.detach().clone()

    def forward(self, x):
        return F.linear(x, self.w, self.b) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class BiasKeptAside(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.b = base.bias.detach()

    def forward(self, x):
        return F.linear(x, self.base.weight, self.b) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class TransposedA(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        self.lora_A = nn.Parameter(torch.randn(base.in_features, rank))

    def forward(self, x):
        return self.base(x) + x @ self.lora_A @ self.lora_B.t() * self.scaling


class PlainTensors(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(base, rank, alpha)
        del self.lora_A, self.lora_B
        self.lora_A = torch.randn(rank, base.in_features)
        self.lora_B = torch.zeros(base.out_features, rank)


class CopiedBase(Reference):
    def __init__(self, base, rank, alpha):
        super().__init__(copy.deepcopy(base), rank, alpha)


class DetachedUpdate(Reference):
    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.lora_A.data), self.lora_B) * self.scaling


class ReinitializedBase(Reference):
    def __init__(self, base, rank, alpha):
        base.reset_parameters()
        super().__init__(base, rank, alpha)


class NoisyUpdate(Reference):
    """Passes the checks of the layer alone only if they are skipped: a random term in the forward."""

    def forward(self, x):
        return super().forward(x) + 1e-3 * torch.randn_like(self.base(x))


class Stub(nn.Module):
    def __init__(self, base, rank, alpha):
        super().__init__()
        raise NotImplementedError()


def test_the_reference_solutions_pass(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_lora_linear, FINETUNE["LoRALinear"], capsys=capsys)
    assert "(world sizes 2, 3)" in out
    passes(check_lora_linear, Reference, capsys=capsys, world_sizes=(2,))
    passes(check_lora_linear, LibraryLoRALinear, capsys=capsys, world_sizes=(2,))


@pytest.mark.parametrize("planted, says, fields", [
    (RandomB, "lora.b_zero", {}),
    (BothZero, "lora.both_zero", {}),
    (SwappedInit, "lora.swapped", {}),
    (InvertedScaling, "lora.inverted", {"inverse": 0.5}),
    (Unscaled, "lora.not_scaled", {"alpha": 4, "rank": 2, "scaling": 2}),
    (ScaledByAlpha, "lora.scaled_by_alpha", {"scaling": 2, "alpha": 4}),
    (BaseNotFrozen, "lora.base_trainable_two", {"first": "weight", "last": "bias"}),
    (BiasNotFrozen, "lora.base_trainable_one", {"name": "bias"}),
    (WeightKeptAside, "lora.kept_one", {"name": "weight"}),
    (CopyKeptAside, "lora.kept_both", {}),
    (BiasKeptAside, "lora.kept_one", {"name": "bias"}),
    (TransposedA, "lora.shapes", {}),
    (PlainTensors, "lora.make_param", {"name": "lora_A"}),
    (CopiedBase, "lora.keep_base", {}),
    (DetachedUpdate, "lora.use_in_forward", {"label": "lora_A"}),
    (ReinitializedBase, "lora.leave_weights", {}),
])
def test_planted_mistakes_fail_with_their_hint(planted: type, says: str, fields: dict,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_lora_linear, planted, says=says, fields=fields, capsys=capsys, world_sizes=(2,))


def test_a_weight_kept_aside_passes_every_other_stage() -> None:
    """Why the swap is checked: the layer alone and the fine-tuning under FSDP do not see a weight kept aside."""
    for planted in (WeightKeptAside, CopyKeptAside):
        _under_fsdp(planted, [2])


def test_the_fsdp_stage_fails_what_one_process_would_not_compute() -> None:
    with pytest.raises(AssertionError, match="not what one process computes"):
        _under_fsdp(NoisyUpdate, [2])
    _under_fsdp(Reference, [2])  # and passes the reference


def test_a_stub_says_it_is_not_implemented() -> None:
    with pytest.raises(NotImplementedError, match="is not implemented yet"):
        check_lora_linear(Stub)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="check_lora_linear takes your function itself"):
        check_lora_linear("LoRALinear")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_sizes must be positive ints"):
        check_lora_linear(Reference, world_sizes=(0,))


def kept(units, n, *, pieces=lambda k, n: math.ceil(k / n), frozen_params=True, frozen_grads=False,
         frozen_state=False, moments=2, step=4):
    """The solution's kept_bytes, one thing changeable at a time, as a learner would get it wrong."""
    flats = [flat for handles in units.values() for flat in handles]
    t = sum(pieces(k, n) for k, trainable in flats if trainable)
    f = sum(pieces(k, n) for k, trainable in flats if not trainable)
    flats_t = sum(trainable for _, trainable in flats)
    return {"sharded_params": 4 * (t + (f if frozen_params else 0)),
            "sharded_grads": 4 * (t + (f if frozen_grads else 0)),
            "optimizer": 4 * moments * (t + (f if frozen_state else 0)) + step * flats_t}


def test_kept_bytes_reference_passes(capsys: pytest.CaptureFixture[str]) -> None:
    out = passes(check_kept_bytes, FINETUNE["kept_bytes"], capsys=capsys)
    assert "made-up layouts" in out
    # the planted answers below are `kept` with one thing wrong: unchanged, it is the reference on every case
    assert all(kept(units, n) == FINETUNE["kept_bytes"](units, n) for units, n in KEPT_CASES)


@pytest.mark.parametrize("planted, says, fields", [
    (lambda u, n: kept(u, n, frozen_params=False), "lora.kept_frozen_left_out", {}),
    (lambda u, n: kept(u, n, pieces=lambda k, n: k), "lora.kept_whole", {}),
    (lambda u, n: kept(u, n, pieces=lambda k, n: k / n), "lora.kept_unpadded",
     {"category": "sharded_params", "short": 6, "n": 2}),
    (lambda u, n: kept(u, n, pieces=lambda k, n: k // n), "lora.kept_unpadded", {"category": "sharded_params", "n": 2}),
    (lambda u, n: kept(u, n, frozen_grads=True), "lora.kept_frozen_grad", {}),
    (lambda u, n: kept(u, n, frozen_state=True), "lora.kept_frozen_state", {}),
    (lambda u, n: kept(u, n, moments=1), "lora.kept_one_moment", {}),
    (lambda u, n: kept(u, n, step=0), "lora.kept_no_step", {"short": 8}),
    (lambda u, n: {"params": 0}, "lora.kept_keys", {}),
    (lambda u, n: 0, "lora.kept_not_dict", {"shown": "int"}),
    (lambda u, n: {**kept(u, n), "optimizer": None}, "lora.kept_not_number", {"category": "optimizer"}),
    (lambda u, n: {**kept(u, n), "optimizer": math.nan}, "lora.kept_not_number", {"category": "optimizer"}),
])
def test_kept_bytes_planted_mistakes_name_the_mistake(planted, says: str, fields: dict,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    fails(check_kept_bytes, planted, says=says, fields=fields, capsys=capsys, world_sizes=(2,))
