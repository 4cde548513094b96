"""DDP, ZeRO-1 and ZeRO-2 side by side, measured: the bookkeeping of lesson 04, as functions.

The lesson keeps what it teaches (the engines, the formulas, the claims); the loops, the recording and the tables
live here.

    reference, runs = train_engines(model, batches, adamw, world_sizes=(1, 2, 4, 8))
    runs[4, "ZeRO-2"].errors                 # largest relative differences from one process: loss, grad, param
    runs[4, "ZeRO-2"].traces[0].memory[-1]   # rank 0's bytes by category after the last step, before zero_grad
    runs[4, "ZeRO-2"].sent_per_step()        # rank 0's bytes sent in each step (the order's broadcast apart)
    print_memory_table(runs, psi)            # beside ZeRO's formulas
    print_traffic_table(runs)                # beside 2Ψ(N−1)/N

    recorded = run_ranks(lambda ctx: record_zero_steps(model, ctx, adamw, batches[:2]), 4)
    print_events(recorded[0])                # bytes held at each event of the last step

Every rank trains a deep copy of the model on its contiguous slice of each global batch (`local_slice`); one
process trains on the whole global batches (`one_process`), and `equivalence.compare` checks every step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_course.engines.ddp import DDP
from fsdp_course.engines.equivalence import (
    Batch,
    OptimizerFactory,
    Trace,
    Trainee,
    compare,
    local_slice,
    one_process,
)
from fsdp_course.engines.zero import ZeRO1, ZeRO2
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.memory import attach, measure, total_bytes, zero_formula
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Ledger, traffic_formula
from fsdp_course.runtime.simulate import run_ranks

__all__ = [
    "ENGINES", "EngineRun", "StepEvents", "TwoTensors", "bucket_listing", "is_view_of", "make_trainee",
    "peak_at_every_moment", "print_buckets", "print_chunks", "print_events", "print_memory_table",
    "print_traffic_table", "record_zero_steps", "replicas_identical", "train_engines",
]

ENGINES = ("DDP", "ZeRO-1", "ZeRO-2")
FORMULA_TEXT = {"DDP": "16Ψ", "ZeRO-1": "8Ψ + 8Ψ/N", "ZeRO-2": "4Ψ + 12Ψ/N"}


# -- the engines, as the equivalence harness drives them -------------------------------------------
def make_trainee(name: str, model: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory) -> Trainee:
    """"DDP", "ZeRO-1" or "ZeRO-2" around `model` on this rank, as a `Trainee` (forward, step, zero_grad, and the
    averaged gradient this rank holds: DDP all of it, ZeRO its chunk of every bucket)."""
    if name == "DDP":
        return Trainee(DDP(model, ctx), optimizer_factory)
    engines = {"ZeRO-1": ZeRO1, "ZeRO-2": ZeRO2}
    if name not in engines:
        raise ValueError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}")
    engine = engines[name](model, ctx, optimizer_factory)
    return Trainee(engine, module=engine.module,
                   grad_chunks=lambda: [(b.layout, ctx.rank, b.shard.grad) for b in engine.buckets])


@dataclass
class EngineRun:
    """One engine trained on N ranks: every rank's trace and ledger, and the largest differences from one process
    (relative: the loss, each averaged gradient tensor, the parameters by global norm; `equivalence.compare`)."""

    name: str
    world_size: int
    traces: list[Trace]
    ledgers: list[Ledger]  # phases "<engine> init", "<engine> step k" (all engines of the run share the ledger)
    errors: dict[str, float]
    steps: int = 0

    def records(self, step: int, rank: int = 0) -> list:
        """Rank `rank`'s collectives of step `step` (1-based)."""
        return self.ledgers[rank].select(label=f"{self.name} step {step}")

    def sent_per_step(self, rank: int = 0) -> list[float]:
        """Bytes sent in each step, for the gradients and the parameters (ZeRO-2's broadcast of its order apart)."""
        return [sum(r.sent_bytes for r in self.records(k, rank) if r.op != "broadcast")
                for k in range(1, self.steps + 1)]

    def broadcast_per_step(self, rank: int = 0) -> list[int]:
        """Bytes broadcast in each step (payload): ZeRO-2's first step takes rank 0's order of the gradients."""
        return [sum(r.payload_bytes for r in self.records(k, rank) if r.op == "broadcast")
                for k in range(1, self.steps + 1)]

    def calls(self, step: int = 1, rank: int = 0) -> dict[str, int]:
        """Number of calls per collective in one step, the broadcast of the order left out."""
        out: dict[str, int] = {}
        for r in self.records(step, rank):
            if r.op != "broadcast":
                out[r.op] = out.get(r.op, 0) + 1
        return out

    def reduced_numel(self, rank: int = 0) -> int:
        """Ψ as the gradients' collectives see it: the elements all-reduced (DDP) or reduce-scattered (ZeRO) in
        step 1, padding included."""
        return sum(r.payload_bytes // torch.empty(0, dtype=getattr(torch, r.dtype)).element_size()
                   for r in self.records(1, rank) if r.op in ("all_reduce", "reduce_scatter"))

    def memory(self, rank: int = 0) -> dict[str, int]:
        """Bytes by category after the last step, before `zero_grad()`."""
        return self.traces[rank].memory[-1]


def _train_one(name: str, model: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory,
               batches: Sequence[Batch]) -> Trace:
    """One engine on this rank: the loop of `equivalence.train`, with the ledger marked per engine and step."""
    ledger = ctx.ledger
    ledger.mark(f"{name} init")
    trainee = make_trainee(name, model, ctx, optimizer_factory)
    trace = Trace()
    for step, batch in enumerate(batches, start=1):
        ledger.mark(f"{name} step {step}")
        first = len(ledger.records)
        x, y = local_slice(batch, ctx.rank, ctx.world_size)
        loss = F.cross_entropy(trainee(x), y)
        loss.backward()
        trainee.step()
        trace.record(trainee, loss, ledger.records[first:])
        trainee.zero_grad()
    return trace


def train_engines(model: nn.Module, batches: Sequence[Batch], optimizer_factory: OptimizerFactory,
                  world_sizes: Iterable[int], engines: Sequence[str] = ENGINES, *, tol: float = 1e-5,
                  ) -> tuple[Trace, dict[tuple[int, str], EngineRun]]:
    """Train each engine on each world size (one `run_ranks` per world size, the engines one after the other on
    every rank), and one process on the whole global batches. Returns the one process's trace and, per
    (world size, engine), an `EngineRun`. Raises AssertionError, naming the step, tensor and rank, where an engine
    differs from one process by more than `tol`."""
    reference = one_process(model, batches, optimizer_factory)
    runs: dict[tuple[int, str], EngineRun] = {}
    for n in world_sizes:
        copies = [{name: copy.deepcopy(model) for name in engines} for _ in range(n)]  # built before the threads

        def fn(ctx: RankContext, copies: list[dict[str, nn.Module]] = copies) -> tuple[list[Trace], Ledger]:
            traces = [_train_one(name, copies[ctx.rank][name], ctx, optimizer_factory, batches) for name in engines]
            return traces, ctx.ledger

        per_rank = run_ranks(fn, n)
        for i, name in enumerate(engines):
            traces = [traces[i] for traces, _ in per_rank]
            try:
                errors = compare(reference, traces, params="global_norm", tol=tol)
            except AssertionError as exc:
                raise AssertionError(f"{name} on {n} ranks: {exc}") from None
            runs[n, name] = EngineRun(name, n, traces, [ledger for _, ledger in per_rank], errors, len(batches))
    return reference, runs


def replicas_identical(traces: Sequence[Trace]) -> bool:
    """Whether every rank holds bit for bit rank 0's parameters after the last step (engines that hold whole
    parameters: DDP, ZeRO-1, ZeRO-2)."""
    first = traces[0].params[-1]
    return all(torch.equal(values, theirs[2]) for t in traces[1:] for name, pieces in t.params[-1].items()
               for (_, _, values), theirs in zip(pieces, first[name], strict=True))


# -- tables ----------------------------------------------------------------------------------------
def print_memory_table(runs: Mapping[tuple[int, str], EngineRun], psi: int) -> None:
    """Rank 0's model state after the last step, by category, beside ZeRO's formula (lesson 03), every run."""
    print(" N  engine      params    grads  optimizer     total   formula           difference   same on all ranks")
    for (n, name), run in runs.items():
        m = run.memory()
        grads = m["grads"] + m.get("sharded_grads", 0)
        total = total_bytes(m)
        formula = zero_formula(psi, n, name)["total"]
        same = all(run.memory(r) == m for r in range(n))
        print(f"{n:>2}  {name:<8} {m['params']:>9} {grads:>8} {m['optimizer']:>10} {total:>9} {formula:>9.0f}"
              f"  {FORMULA_TEXT[name]:<11} {total - formula:>+6.0f}   {same}")


def print_traffic_table(runs: Mapping[tuple[int, str], EngineRun]) -> None:
    """Rank 0's collectives of step 1 and bytes sent per step, beside 2Ψ(N−1)/N × 4 B with Ψ padded, every run."""
    print(" N  engine    collectives in step 1                          sent per step   2Ψ(N-1)/N x 4 B (padded Ψ)")
    for (n, name), run in runs.items():
        text = ", ".join(f"{count} {op}" for op, count in run.calls().items())
        padded = run.reduced_numel()
        print(f"{n:>2}  {name:<8}  {text:<45} {run.sent_per_step()[0]:>10.0f} B   "
              f"{traffic_formula(4 * padded, n)['ddp']:>10.0f} B  (Ψ = {padded})")


# -- inside the engines ----------------------------------------------------------------------------
def is_view_of(tensor: Tensor, flat: Tensor) -> bool:
    """Whether `tensor`'s elements lie inside `flat`'s storage: a view of the flat buffer, no copy."""
    start = flat.data_ptr()
    return start <= tensor.data_ptr() < start + flat.numel() * flat.element_size()


def print_chunks(layout: FlatParamLayout) -> None:
    """Each rank's chunk of a flat buffer: its range, and the parameter pieces that fall in it."""
    print(f"flat buffer: Ψ = {layout.numel} elements, padded to {layout.padded_numel} "
          f"({layout.padded_numel - layout.numel} zeros), {layout.shard_numel} per rank")
    for rank in range(layout.world_size):
        start, end = layout.shard_range(rank)
        pieces = layout.pieces(rank)
        print(f"rank {rank}: chunk [{start:>5}, {end:>5}): {len(pieces):>2} parameter pieces, from {pieces[0].name}"
              f"[{pieces[0].param_start}:] to {pieces[-1].name}[:{pieces[-1].param_end}]")


def bucket_listing(engine: ZeRO1 | ZeRO2) -> list[tuple[int, list[str]]]:
    """(padded numel, parameter names) of each of the engine's flat buffers, in the order they are reduced."""
    return [(b.layout.padded_numel, list(b.names)) for b in engine.buckets]


def print_buckets(listing: Sequence[tuple[int, list[str]]], title: str, psi: int) -> None:
    """A `bucket_listing`, one line per bucket ("encoder." left out of the names)."""
    print(f"{title}: {len(listing)} buckets, {sum(p for p, _ in listing)} elements after padding (Ψ = {psi})")
    for i, (padded, names) in enumerate(listing):
        print(f"  bucket {i:>2}: {padded:>5} elements: {', '.join(n.removeprefix('encoder.') for n in names)}")


# -- one step, event by event ----------------------------------------------------------------------
@dataclass
class StepEvents:
    """What a `MemoryRecorder` saw over the last step of `record_zero_steps`, on one rank."""

    events: list[tuple[str, dict[str, int]]]  # (label, bytes by category); buckets named "reduce_scatter bucket i"
    peak: int  # parameters + gradients + optimizer state, the largest over the last step's events
    peak_label: str
    peaks: list[int] = field(default_factory=list)  # each step's peak (the first: before ZeRO-2 rebuilt its buckets)
    sizes: list[int] = field(default_factory=list)  # padded numel of each flat buffer (ZeRO-2: each bucket)

    @property
    def peak_bucket(self) -> int | None:
        """The bucket whose reduce-scatter is the peak, if it is one."""
        prefix = "reduce_scatter bucket "
        return int(self.peak_label[len(prefix):]) if self.peak_label.startswith(prefix) else None


def record_zero_steps(model: nn.Module, ctx: RankContext, optimizer_factory: OptimizerFactory,
                 batches: Sequence[Batch], engines: Sequence[str] = ("ZeRO-1", "ZeRO-2")) -> dict[str, StepEvents]:
    """Train each engine (a deep copy of `model`) one step per global batch, with a `MemoryRecorder` attached;
    keep the events of the last step. ZeRO-2's events name each bucket's first parameter; here they are numbered
    as the engine's buckets are at the end (after the first backward rebuilt them)."""
    out = {}
    for name in engines:
        engine = {"ZeRO-1": ZeRO1, "ZeRO-2": ZeRO2}[name](copy.deepcopy(model), ctx, optimizer_factory)
        recorder = attach(engine)
        peaks = []
        for batch in batches:
            recorder.reset()  # keep one step's events
            x, y = local_slice(batch, ctx.rank, ctx.world_size)
            F.cross_entropy(engine(x), y).backward()
            engine.step()
            engine.zero_grad()
            peaks.append(recorder.peak_total)
        number = {f"reduce_scatter {b.names[0]}": f"reduce_scatter bucket {i}" for i, b in enumerate(engine.buckets)}
        events = [(number.get(label, label), snap) for label, snap in recorder.events]
        out[name] = StepEvents(events, recorder.peak_total, number.get(recorder.peak_label, recorder.peak_label),
                               peaks, [b.layout.padded_numel for b in engine.buckets])
    return out


def print_events(recorded: Mapping[str, StepEvents]) -> None:
    """Bytes held at each event of the recorded step, by category, and the peak; one table per engine."""
    for name, steps in recorded.items():
        print(f"{name}, bytes held at each event of the last step:")
        for label, snap in steps.events:
            grads = snap["grads"] + snap["sharded_grads"]
            print(f"  {label:<26} params {snap['params']:>6}  grads {grads:>6}  optimizer {snap['optimizer']:>6}  "
                  f"total {snap['params'] + grads + snap['optimizer']:>6}")
        print(f"  peak {steps.peak} bytes at '{steps.peak_label}'")


# -- a parameter larger than a bucket --------------------------------------------------------------
class TwoTensors(nn.Module):
    """Two parameters, `small` and `large` elements; the output is the loss: `(large * x).sum() + small.sum()`."""

    def __init__(self, small: int = 10, large: int = 10**6, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # the global RNG, which rank threads share, is left alone
        self.small = nn.Parameter(torch.randn(small, generator=g))
        self.large = nn.Parameter(torch.randn(large, generator=g))

    def forward(self, x: Tensor) -> Tensor:
        return (self.large * x).sum() + self.small.sum()


def peak_at_every_moment(engine: ZeRO1 | ZeRO2, x: Tensor, steps: int = 2) -> tuple[int, int]:
    """Train `steps` steps on `engine(x)` as the loss; over the last one, return the peak at the engine's events and
    the largest total at the moments autograd hands over a gradient (what the rank holds plus that fresh gradient,
    measured by a tensor hook, which runs just before the gradient is accumulated)."""
    recorder = attach(engine)
    moments: list[int] = []
    for p in engine.module.parameters():
        p.register_hook(lambda g: moments.append(total_bytes(measure(engine)) + g.numel() * g.element_size()))
    for _ in range(steps):
        recorder.reset()
        moments.clear()
        engine(x).backward()
        engine.step()
        engine.zero_grad()
    return recorder.peak_total, max(moments)
