"""The α–β cost model of a collective, fitted to collectives timed on this machine.

A message costs a fixed latency α plus β per byte (Hockney's model). A ring collective over N ranks
runs in steps: at each step every rank sends one chunk to its neighbour and receives one. So, per rank,

    all_gather, reduce_scatter:  time = (N - 1) α  +  (N - 1)/N · payload · β
    all_reduce:                  time = 2(N - 1) α + 2(N - 1)/N · payload · β

Thakur, Rabenseifner and Gropp price MPI's collectives with this model ("Optimization of Collective Communication
Operations in MPICH", Int. J. High Performance Computing Applications 19(1), 2005): their ring all-gather costs
(p - 1) α + (p - 1)/p · n β. A reduce-scatter moves the same, an all-reduce is one of each. The bytes term is the
ledger's ring model (`ledger.ring_bytes`); this module adds the steps, each of which pays α.

`time_collectives` times the course's collectives (`ctx.all_reduce`, ...) on simulated ranks: every rank
passes a barrier before each timed call; a call's time is the shortest any rank measured (the rank that left
the barrier last started its clock last, so its time holds no wait for the others), and a sample is the median
of its repeats. `fit` finds α (seconds per step) and β (seconds per byte) by least squares, with no intercept,
and says how well the line explains the samples (R², and the worst ratio of measured to predicted time).
`CostFit.predict(op, payload_bytes, world_size)` then prices any collective.

The fitted numbers describe this machine and its load: threads talking to each other over loopback, not a
network. Gloo's own algorithms also differ from the ring (its reduce-scatter is built from all-reduces,
`collectives.py` measures it), so the model is a summary, not a law.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import ring_bytes
from fsdp_course.runtime.simulate import run_ranks

__all__ = ["OPS", "CostFit", "Sample", "fit", "ring_steps", "time_collectives"]

OPS = ("all_reduce", "all_gather", "reduce_scatter")  # the ring collectives this model prices


def ring_steps(op: str, world_size: int) -> int:
    """Steps of the ring algorithm, each paying one latency α: 2(N-1) for all_reduce, N-1 for the others."""
    _check(op, world_size)
    return 2 * (world_size - 1) if op == "all_reduce" else world_size - 1


def _check(op: str, world_size: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: the cost model prices {', '.join(OPS)}")
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an integer of at least 2 (one rank sends nothing), got {world_size!r}")


@dataclass(frozen=True)
class Sample:
    """One collective timed: `seconds` for `op` on a full tensor of `payload_bytes` over `world_size` ranks."""

    op: str
    world_size: int
    payload_bytes: int
    seconds: float

    def __post_init__(self) -> None:
        _check(self.op, self.world_size)
        if self.payload_bytes < 0 or not self.seconds >= 0:
            raise ValueError(f"payload_bytes and seconds must be >= 0, got {self.payload_bytes}, {self.seconds}")

    @property
    def steps(self) -> int:
        """Ring steps, each paying α."""
        return ring_steps(self.op, self.world_size)

    @property
    def bytes(self) -> float:
        """Bytes each rank sends under the ring model (the ledger's count)."""
        return ring_bytes(self.op, self.payload_bytes, self.world_size)[0]


@dataclass(frozen=True)
class CostFit:
    """α (seconds per ring step) and β (seconds per byte sent per rank), fitted to `samples` measurements.

    `r2` is the share of the samples' variance the line explains (1 is a perfect fit); `rms` the root mean
    square of the residuals in seconds; `median_ratio` and `worst_ratio` the median and the largest factor between
    a measured and a predicted time (either way round, so always >= 1).
    """

    alpha: float
    beta: float
    r2: float
    rms: float
    median_ratio: float
    worst_ratio: float
    samples: int

    def predict(self, op: str, payload_bytes: float, world_size: int) -> float:
        """Seconds for one `op` on a full tensor of `payload_bytes` over `world_size` ranks: steps α + bytes β."""
        steps = ring_steps(op, world_size)  # checks op and world size
        return steps * self.alpha + ring_bytes(op, payload_bytes, world_size)[0] * self.beta  # type: ignore[arg-type]


def fit(samples: Iterable[Sample]) -> CostFit:
    """Least squares of seconds = steps α + bytes β over the samples, with α, β ≥ 0 (no intercept: a call of no
    steps is free)."""
    samples = list(samples)
    if not samples:
        raise ValueError("fit needs timed samples: got none (time some with time_collectives)")
    x = np.array([[s.steps, s.bytes] for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    scale = np.abs(x).max(axis=0)  # steps are a few, bytes millions: solve on columns of equal size
    if np.linalg.matrix_rank(x / np.where(scale > 0, scale, 1.0)) < 2:
        raise ValueError("fit needs samples that separate latency from bandwidth: time at least two payload "
                         "sizes (or two world sizes) with bytes > 0")
    from scipy.optimize import nnls  # scikit-learn's dependency: neither cost can be negative, even on a busy machine

    solution, _ = nnls(x / scale, y)
    alpha, beta = (float(v) for v in solution / scale)
    predicted = x @ np.array([alpha, beta])
    residual = y - predicted
    spread, missed = float(((y - y.mean()) ** 2).sum()), float((residual ** 2).sum())
    r2 = 1.0 - missed / spread if spread > 0 else float(missed == 0)
    if np.all(predicted > 0) and np.all(y > 0):
        factors = np.maximum(y / predicted, predicted / y)
    else:  # a prediction at or below zero is no factor away from anything
        factors = np.full(len(samples), np.inf)
    return CostFit(alpha, beta, r2, float(np.sqrt((residual ** 2).mean())), float(np.median(factors)),
                   float(factors.max()), len(samples))


def _call(ctx: RankContext, op: str, full: torch.Tensor, shard: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        ctx.all_reduce(full)
    elif op == "all_gather":
        ctx.all_gather(shard, out=full)
    else:
        ctx.reduce_scatter(full, out=out)


def time_collectives(world_sizes: Sequence[int], payloads: Sequence[int], ops: Sequence[str] = OPS, *,
                     repeats: int = 7, dtype: torch.dtype = torch.float32) -> list[Sample]:
    """Time each op on each payload (bytes of the full tensor) over each world size, on simulated ranks.

    A payload is rounded up to whole elements that divide by the world size (all_gather and reduce_scatter need
    equal chunks); the sample records the bytes actually moved. Before each call every rank waits at a barrier,
    one untimed call warms the connection up, a call's time is the shortest any rank measured (the last rank out
    of the barrier waits for no one), a sample the median of `repeats` calls.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if not payloads or not world_sizes or not ops:
        raise ValueError("time_collectives needs at least one world size, one payload and one op")
    for n in world_sizes:
        for op in ops:
            _check(op, n)
    size = torch.empty((), dtype=dtype).element_size()

    def rank_fn(ctx: RankContext) -> list[tuple[str, int, list[float]]]:
        n, rows = ctx.world_size, []
        for op in ops:
            for payload in payloads:
                numel = -(-max(int(payload), 1) // (size * n)) * n  # whole elements, a multiple of N
                full = torch.zeros(numel, dtype=dtype)
                shard, out = torch.zeros(numel // n, dtype=dtype), torch.zeros(numel // n, dtype=dtype)
                times = []
                for attempt in range(repeats + 1):
                    ctx.barrier()
                    start = time.perf_counter()
                    _call(ctx, op, full, shard, out)
                    if attempt:  # the first call warms up
                        times.append(time.perf_counter() - start)
                rows.append((op, numel * size, times))
        ctx.ledger.clear()
        return rows

    samples = []
    for n in world_sizes:
        per_rank = run_ranks(rank_fn, n)
        for i, (op, payload, _) in enumerate(per_rank[0]):
            # the rank that left the barrier last started its clock last: its time is the collective's own
            own = [min(rows[i][2][k] for rows in per_rank) for k in range(repeats)]
            samples.append(Sample(op, n, payload, statistics.median(own)))
    return samples
