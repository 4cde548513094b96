"""Training-equivalence helpers for the checkers: small seeded models, global batches, one reference process.

The proof a data-parallel exercise owes (as in CS336's FSDP checks and the engines' tests): N ranks,
each on its contiguous slice of every global batch, must produce the loss, the averaged gradients
and the parameters that one process produces on the whole batch, step by step, under SGD
(elementwise; under Adam a mathematically zero gradient turns rounding noise into full steps, see
docs/ARCHITECTURE.md). Models are built once in the calling thread, without touching the global RNG
(threads share it), and every rank trains a deep copy.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_course.sampler import rank_slice

__all__ = ["Batch", "StepRecord", "global_batches", "local_slice", "max_rel_diff", "reference_run", "seeded_mlp"]

Batch = tuple[Tensor, Tensor]


def seeded_mlp(sizes: Sequence[int], seed: int) -> nn.Sequential:
    """Linear/Tanh layers with weights drawn from a private generator (the global RNG is left untouched)."""
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global RNG
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.Tanh())
    model = nn.Sequential(*layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def global_batches(steps: int, batch: int, in_dim: int, classes: int, seed: int) -> list[Batch]:
    """`steps` global batches of (batch, in_dim) inputs and class labels."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, in_dim, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def local_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous, equal slice of a global batch (inputs and labels: sampler.rank_slice)."""
    x, y = batch
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)


@dataclass
class StepRecord:
    """What one process saw in one step: the loss, the gradients (before the step), the parameters after it."""

    loss: float
    grads: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)


def reference_run(model: nn.Module, batches: Sequence[Batch], lr: float) -> list[StepRecord]:
    """One process, plain SGD on the whole global batches (a deep copy of `model` is trained)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out.append(StepRecord(loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def local_grads(model: nn.Module, batch: Batch) -> dict[str, Tensor]:
    """The gradients of one rank's slice alone (what a rank holds before any averaging)."""
    model = copy.deepcopy(model)
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def max_rel_diff(got: Tensor, expected: Tensor) -> float:
    """Largest elementwise difference, relative to the largest magnitude of `expected` (0 if both are 0)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    diff = float((got.detach().double() - expected.detach().double()).abs().max()) if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def close(got: Tensor, expected: Tensor, tol: float = 1e-5) -> bool:
    return tuple(got.shape) == tuple(expected.shape) and max_rel_diff(got, expected) <= tol
