"""What a wrap policy does to a training step, measured: lesson 07's bookkeeping, out of the lesson's way.

    profile = profile_step(base, {nn.TransformerEncoderLayer}, 4, x, y, batch=32)   # peak memory, units
    traffic = step_traffic(DDP, base, 4, x, y, batch=32)                            # one step's collectives
    latency, data = price(traffic.records, cost_fit, 4)                             # its seconds, α-β model

Each runs simulated ranks (`run_ranks`), every rank on a deep copy of `base` and on its slice of the same global
batch (`sampler.global_batch`, then `sampler.rank_slice`, lesson 02). The lesson keeps what it compares: the
formula `memory.zero_formula`, the ledger's bytes against 3Ψ(N−1)/N, the units a policy makes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.cost_model import CostFit, ring_steps
from fsdp_course.runtime.simulate import run_ranks
from fsdp_course.sampler import global_batch, rank_slice

__all__ = ["StepProfile", "StepTraffic", "price", "profile_step", "step_traffic"]


@dataclass(frozen=True)
class StepProfile:
    """Rank 0's measurements of one FSDP training step (the second: the first creates Adam's state)."""

    peak: int  # bytes of parameters, gradients and optimizer state at the step's peak
    peak_label: str  # the event at which it came, e.g. "post_backward: grads ready root"
    timeline: list[tuple[str, dict[str, int]]]  # (event, bytes by category) over the step
    numels: dict[str, int]  # padded flat-parameter size of every unit, root first
    layouts: list[Any]  # each unit's FlatParamLayout, root first (for viz.plot_sharding)
    peaks: list[int]  # every rank's peak, in rank order


def _my_batch(x: torch.Tensor, y: torch.Tensor, batch: int, step: int,
              ctx: RankContext) -> tuple[torch.Tensor, torch.Tensor]:
    mine = rank_slice(global_batch(len(x), batch, step), ctx.rank, ctx.world_size)
    return x[mine], y[mine]


def profile_step(base: nn.Module, wrap: set[type[nn.Module]] | None, world_size: int, x: torch.Tensor,
                 y: torch.Tensor, batch: int) -> StepProfile:
    """Wrap a copy of `base` with `FSDP(..., wrap=wrap)` on `world_size` ranks, train two AdamW steps on global
    batches of `batch` samples, and return the second step's memory timeline and peak (measured from the live
    storages at every event the engine reports, `memory.attach`) with the units' sizes."""
    from fsdp_course.fsdp import FSDP  # the engine imports this package's siblings: load it on use
    from fsdp_course.memory import attach

    def rank_fn(ctx: RankContext) -> StepProfile:
        fsdp = FSDP(copy.deepcopy(base), ctx, wrap=wrap)
        opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
        recorder = attach(fsdp, opt)
        for step in range(2):  # step 0 creates Adam's state; measure step 1
            recorder.reset()
            xs, ys = _my_batch(x, y, batch, step, ctx)
            recorder.record("step starts")
            F.cross_entropy(fsdp(xs), ys).backward()
            opt.step()
            recorder.record("optimizer step")
            opt.zero_grad()
        return StepProfile(recorder.peak_total, recorder.peak_label, list(fsdp.timeline), fsdp.unit_numels(),
                           [u.handles[0].layout for u in fsdp.units], [])

    ranks = run_ranks(rank_fn, world_size)
    return StepProfile(**{**ranks[0].__dict__, "peaks": [r.peak for r in ranks]})


@dataclass(frozen=True)
class StepTraffic:
    """Rank 0's collectives over one training step, from its ledger."""

    records: list[tuple[str, int]]  # (op, payload bytes) of every collective, in order
    sent: float  # bytes this rank sent, ring model
    numels: dict[str, int]  # the units' padded sizes (FSDP), {} for an engine without units

    @property
    def calls(self) -> int:
        """How many collectives the step ran."""
        return len(self.records)


def step_traffic(make: Callable[[nn.Module, RankContext], nn.Module], base: nn.Module, world_size: int,
                 x: torch.Tensor, y: torch.Tensor, batch: int) -> StepTraffic:
    """One forward and backward of the engine `make(copy of base, ctx)` on `world_size` ranks, on the first global
    batch of `batch` samples: rank 0's collectives (the initial broadcast of rank 0's values left out)."""

    def rank_fn(ctx: RankContext) -> StepTraffic:
        engine = make(copy.deepcopy(base), ctx)
        ctx.ledger.clear()  # the step only, not the broadcast of rank 0's initial values
        xs, ys = _my_batch(x, y, batch, 0, ctx)
        F.cross_entropy(engine(xs), ys).backward()
        numels = engine.unit_numels() if hasattr(engine, "unit_numels") else {}
        return StepTraffic([(r.op, r.payload_bytes) for r in ctx.ledger], ctx.ledger.total()[0], numels)

    return run_ranks(rank_fn, world_size)[0]


def price(records: Sequence[tuple[str, int]], cost: CostFit, world_size: int) -> tuple[float, float]:
    """(latency, bytes) seconds of a step's collectives under the α-β fit `cost`: steps · α, and the rest."""
    latency = sum(ring_steps(op, world_size) * cost.alpha for op, _ in records)
    return latency, sum(cost.predict(op, payload, world_size) for op, payload in records) - latency
