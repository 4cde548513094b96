"""Benchmark (a script, not a test): DDP, ZeRO-1, ZeRO-2 and FSDP against one process, N = 1, 2, 4.

For each engine and world size it trains the small Transformer classifier on digits (the same
global batch split over the ranks, AdamW) and prints, as ratios to one plain process:
  - step time: the slowest rank's mean seconds per step after a warm-up step;
  - peak memory per rank: the largest parameters + gradients + optimizer state alive at any
    event of a step, measured from the tensor storages (fsdp_course.memory), beside ZeRO's formula
    (arXiv:1910.02054: DDP 16Ψ, ZeRO-1 8Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, ZeRO-3/FSDP 16Ψ/N + a unit).

Ranks are threads in one process sharing the machine's cores (one intra-op thread each), so step
times measure the simulation: more ranks do the same total work plus collectives over loopback.
Memory ratios are what carries over to real machines. Run: python benchmarks/engines.py [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_course.data import digits_tokens
from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.zero import ZeRO1, ZeRO2
from fsdp_course.memory import attach, measure_tensors, optimizer_tensors, record_event, total_bytes, zero_formula
from fsdp_course.models import TransformerClassifier, TransformerConfig
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.simulate import run_ranks

try:
    from fsdp_course.fsdp.api import FSDP
except ImportError:  # FSDP not there yet: benchmark the others
    FSDP = None

Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class Engine:
    """One rank's engine behind one interface: forward, step (+ zero_grad), and what to measure."""

    def __init__(self, name: str, model: nn.Module, ctx: RankContext) -> None:
        if name == "DDP":
            self.engine: Any = DDP(model, ctx)
            self.optimizer = adamw(list(self.engine.parameters()))
        elif name == "FSDP":
            self.engine = FSDP(model, ctx, wrap={nn.TransformerEncoderLayer})
            self.optimizer = adamw(list(self.engine.parameters()))
        else:
            self.engine = (ZeRO1 if name == "ZeRO-1" else ZeRO2)(model, ctx, adamw)
            self.optimizer = None  # the engine owns it

    def step(self) -> None:
        if self.optimizer is None:
            self.engine.step()
            self.engine.zero_grad()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad()


def run_engine(name: str, base: nn.Module, x: torch.Tensor, y: torch.Tensor, world_size: int,
               steps: int) -> tuple[float, int]:
    """(seconds per step of the slowest rank, peak parameter+gradient+optimizer bytes of any rank)."""
    copies = [copy.deepcopy(base) for _ in range(world_size)]

    def fn(ctx: RankContext) -> tuple[float, int]:
        torch.set_num_threads(1)
        e = Engine(name, copies[ctx.rank], ctx)
        b = x.shape[0] // ctx.world_size
        xs, ys = x[ctx.rank * b:(ctx.rank + 1) * b], y[ctx.rank * b:(ctx.rank + 1) * b]
        F.cross_entropy(e.engine(xs), ys).backward()  # warm-up: Adam's state comes to life here
        e.step()
        recorder = attach(e.engine, e.optimizer)
        ctx.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            F.cross_entropy(e.engine(xs), ys).backward()
            record_event(e.engine, "after backward")
            e.step()
            record_event(e.engine, "after step")
        return (time.perf_counter() - start) / steps, recorder.peak_total

    results = run_ranks(fn, world_size, timeout=120)
    return max(t for t, _ in results), max(m for _, m in results)


def one_process(base: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[float, int]:
    """The baseline: plain training on the whole global batch; memory after backward and after step."""
    model = copy.deepcopy(base)
    opt = adamw(list(model.parameters()))
    peak = 0

    def snapshot() -> int:
        params = list(model.parameters())
        return total_bytes(measure_tensors({"params": params, "grads": [p.grad for p in params],
                                            "optimizer": optimizer_tensors(opt)}))

    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    start = time.perf_counter()
    for _ in range(steps):
        F.cross_entropy(model(x), y).backward()
        peak = max(peak, snapshot())
        opt.step()
        peak = max(peak, snapshot())
        opt.zero_grad()
    return (time.perf_counter() - start) / steps, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--batch", type=int, default=32, help="global batch (divisible by 4)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = TransformerClassifier(TransformerConfig.small())
    psi = sum(p.numel() for p in base.parameters())
    tokens, labels = digits_tokens()
    x, y = tokens[:args.batch], labels[:args.batch]
    base_time, base_mem = one_process(base, x, y, args.steps)
    print(f"small Transformer: {psi:,} parameters (Ψ); AdamW fp32; global batch {args.batch}")
    print(f"one process: {base_time * 1e3:.1f} ms/step, peak {base_mem:,} B = {base_mem / psi:.1f} Ψ bytes")
    engines = ["DDP", "ZeRO-1", "ZeRO-2"] + (["FSDP"] if FSDP is not None else [])
    stages = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "FSDP": 3}
    print(f"{'engine':<8} {'N':>2} {'ms/step':>9} {'time ×':>7} {'peak B/rank':>12} {'mem ×':>6} "
          f"{'formula ×':>9}")
    for n in (1, 2, 4):
        for name in engines:
            seconds, peak = run_engine(name, base, x, y, n, args.steps)
            formula = zero_formula(psi, n, stages[name])["total"]
            print(f"{name:<8} {n:>2} {seconds * 1e3:>9.1f} {seconds / base_time:>7.2f} {peak:>12,} "
                  f"{peak / base_mem:>6.2f} {formula / base_mem:>9.2f}", flush=True)
    if FSDP is None:
        print("FSDP: fsdp_course.fsdp.api is not available yet; rerun when it is.")


if __name__ == "__main__":
    main()
