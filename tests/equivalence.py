"""Equivalence harness (a helper module, not a test file): N ranks versus one process, step by step.

The proof every engine owes (docs/ARCHITECTURE.md, "Equivalence under Adam"): train it on N simulated
ranks, each on its contiguous slice of the global batch, and train one plain process on the whole
global batch, then compare at every step:
  - the loss (mean of the ranks' losses; the slices are equal) and every averaged gradient, per
    tensor: relative norm of the difference <= tol;
  - the parameters after the step: elementwise relative to the tensor's largest value (SGD), or in
    global norm over all parameters (Adam/AdamW: Adam divides by the gradient's own scale, so a
    gradient that is mathematically zero, such as attention's key bias, turns rounding noise into
    updates that differ from run to run).
A failure names the step, the tensor, the rank and the difference (as in CS336's FSDP checks).

An engine plugs in through a small adapter, a `Trainee` (see `ModuleTrainee`, `ShardedTrainee`):
forward, step, zero_grad, and what it holds, as `Pieces`: name -> [(start, end, values)], ranges of
the flattened tensor, so sharded engines report only their chunks (`shard_pieces`) and replicated
ones the whole tensor (`full_pieces`). Every element of every tensor must be covered by some rank.

    case = Case("mlp/sgd", MLP([64, 32, 10]), lambda ps: torch.optim.SGD(ps, lr=0.1),
                digits_batches("vectors"), params="elementwise")
    make = lambda model, ctx, opt_factory: ModuleTrainee(DDP(model, ctx), opt_factory)
    result = check_equivalence([case], make, world_size=3)["mlp/sgd"]
    result.errors      # {"loss": ..., "grad": ..., "param": ...}, the largest relative errors seen
    result.traces[r]   # rank r's Trace: losses, grads, params, ledger bytes sent and memory per step

Cases run in one `run_ranks` per world size (starting the simulated world is the slow part).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_course.data import digits_tokens, digits_vectors
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.memory import measure
from fsdp_course.models import MLP, TransformerClassifier, TransformerConfig
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Ledger
from fsdp_course.runtime.simulate import run_ranks

Pieces = dict[str, list[tuple[int, int, Tensor]]]  # name -> [(start, end, values of flat[start:end])]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Batch = tuple[Tensor, Tensor]


class Trainee(Protocol):
    """What the harness needs from an engine on one rank."""

    def __call__(self, x: Tensor) -> Tensor: ...
    def step(self) -> None: ...
    def zero_grad(self) -> None: ...
    def grad_pieces(self) -> Pieces: ...  # the averaged gradient this rank holds
    def param_pieces(self) -> Pieces: ...  # the parameters this rank holds, after the step


MakeTrainee = Callable[[nn.Module, RankContext, OptimizerFactory], Trainee]


def full_pieces(named: Sequence[tuple[str, Tensor | None]]) -> Pieces:
    """Whole tensors (replicated engines): each one piece [0, numel). None entries are skipped."""
    return {n: [(0, t.numel(), t.detach().reshape(-1).clone())] for n, t in named if t is not None}


def shard_pieces(layout: FlatParamLayout, rank: int, shard: Tensor | None) -> Pieces:
    """The parts of each parameter inside `rank`'s chunk `shard` (padded_numel // N,) of a flat buffer."""
    if shard is None:
        return {}
    out: Pieces = {}
    for piece in layout.pieces(rank):
        n = piece.param_end - piece.param_start
        values = shard.detach()[piece.shard_offset:piece.shard_offset + n].clone()
        out.setdefault(piece.name, []).append((piece.param_start, piece.param_end, values))
    return out


class ModuleTrainee:
    """A module-like object with full parameters and gradients and an optimizer over `parameters()`
    (one process, or DDP)."""

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory) -> None:
        self.module = module
        self.optimizer = optimizer_factory(list(module.parameters()))

    def __call__(self, x: Tensor) -> Tensor:
        return self.module(x)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def grad_pieces(self) -> Pieces:
        return full_pieces([(n, p.grad) for n, p in self.module.named_parameters()])

    def param_pieces(self) -> Pieces:
        return full_pieces(list(self.module.named_parameters()))

    def memory(self) -> dict[str, int]:
        return measure(self.module, self.optimizer) if hasattr(self.module, "memory_tensors") else {}


class ShardedTrainee:
    """An engine that owns its optimizer (`step()`, `zero_grad()`), holds full parameters in
    `engine.module` and its averaged gradient as chunks: `chunks()` -> [(layout, rank, grad chunk)]."""

    def __init__(self, engine: nn.Module, chunks: Callable[[], list[tuple[FlatParamLayout, int, Tensor | None]]]):
        self.engine = engine
        self.chunks = chunks

    def __call__(self, x: Tensor) -> Tensor:
        return self.engine(x)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def grad_pieces(self) -> Pieces:
        out: Pieces = {}
        for layout, rank, chunk in self.chunks():
            for name, pieces in shard_pieces(layout, rank, chunk).items():
                out.setdefault(name, []).extend(pieces)
        return out

    def param_pieces(self) -> Pieces:
        return full_pieces(list(self.engine.module.named_parameters()))

    def memory(self) -> dict[str, int]:
        return measure(self.engine)  # the engine lists its own optimizer's state


@dataclass
class Trace:
    """What one rank (or the one process) saw, per step."""

    losses: list[float] = field(default_factory=list)
    grads: list[Pieces] = field(default_factory=list)
    params: list[Pieces] = field(default_factory=list)
    sent: list[dict[str, float]] = field(default_factory=list)  # bytes sent per collective op (ledger)
    memory: list[dict[str, int]] = field(default_factory=list)  # measured after the step, if offered


def train(trainee: Trainee, batches: Sequence[Batch], ledger: Ledger | None = None,
          loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> Trace:
    """The training loop every rank runs: forward, backward, step, record, zero_grad."""
    trace = Trace()
    for x, y in batches:
        first = len(ledger.records) if ledger is not None else 0
        loss = loss_fn(trainee(x), y)
        loss.backward()
        trainee.step()
        trace.losses.append(loss.item())
        trace.grads.append(trainee.grad_pieces())
        trace.params.append(trainee.param_pieces())
        if ledger is not None:
            sent: dict[str, float] = {}
            for record in ledger.records[first:]:
                sent[record.op] = sent.get(record.op, 0.0) + record.sent_bytes
            trace.sent.append(sent)
        if hasattr(trainee, "memory"):
            trace.memory.append(trainee.memory())
        trainee.zero_grad()
    return trace


@dataclass(frozen=True)
class Case:
    """One model trained with one optimizer on some global batches, and how to compare its parameters."""

    name: str  # e.g. "mlp/sgd", used in failure messages
    model: nn.Module  # built once, outside the ranks; never changed (every run trains a deep copy)
    optimizer_factory: OptimizerFactory
    batches: Sequence[Batch]
    params: Literal["elementwise", "global_norm"]  # SGD: elementwise; Adam/AdamW: global_norm


def run_reference(case: Case) -> Trace:
    """One process on the global batches."""
    return train(ModuleTrainee(copy.deepcopy(case.model), case.optimizer_factory), case.batches)


def local_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous slice of the global batch (its size must divide by the world size)."""
    x, y = batch
    if x.shape[0] % world_size:
        raise ValueError(f"global batch of {x.shape[0]} does not split into {world_size} equal slices")
    b = x.shape[0] // world_size
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def run_engine(cases: Sequence[Case], make_trainee: MakeTrainee, world_size: int, *,
               timeout: float = 30.0) -> list[list[Trace]]:
    """Train every case on `world_size` ranks (one `run_ranks`); traces[case][rank].

    Every rank trains its own deep copy of each model, copied here before the threads start.
    """
    copies = [[copy.deepcopy(case.model) for _ in range(world_size)] for case in cases]

    def fn(ctx: RankContext) -> list[Trace]:
        return [train(make_trainee(models[ctx.rank], ctx, case.optimizer_factory),
                      [local_slice(b, ctx.rank, ctx.world_size) for b in case.batches], ctx.ledger)
                for case, models in zip(cases, copies, strict=True)]

    per_rank = run_ranks(fn, world_size, timeout=timeout)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


def _worst_difference(name: str, step: int, what: str, ref: Tensor,
                      traces: Sequence[Trace]) -> tuple[Tensor, list[float]]:
    """Per element, the largest |difference| over the ranks that hold it; and each rank's diff norm."""
    ref = ref.reshape(-1)
    worst = torch.zeros_like(ref)
    covered = torch.zeros(ref.numel(), dtype=torch.bool)
    per_rank = [0.0] * len(traces)
    for rank, trace in enumerate(traces):
        for start, end, values in getattr(trace, what)[step].get(name, []):
            diff = (values.to(ref.dtype) - ref[start:end]).abs()
            worst[start:end] = torch.maximum(worst[start:end], diff)
            covered[start:end] = True
            per_rank[rank] = max(per_rank[rank], diff.norm().item())
    if not covered.all():
        missing = (~covered).nonzero().flatten()
        raise AssertionError(f"step {step + 1}, {what[:-1]} of {name!r}: no rank holds elements "
                             f"{missing[:5].tolist()}{' ...' if len(missing) > 5 else ''} of {ref.numel()}")
    return worst, per_rank


def compare(reference: Trace, traces: Sequence[Trace], *,
            params: Literal["elementwise", "global_norm"], tol: float = 1e-5) -> dict[str, float]:
    """Assert the N-rank traces match the reference at every step; return the largest errors seen."""
    tiny = torch.finfo(torch.float32).tiny
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    n = len(traces)
    for step, ref_loss in enumerate(reference.losses):
        loss = sum(t.losses[step] for t in traces) / n
        err = abs(loss - ref_loss) / max(abs(ref_loss), tiny)
        errors["loss"] = max(errors["loss"], err)
        if err > tol:
            raise AssertionError(f"step {step + 1}: loss {loss:.8g} (mean over {n} ranks, each "
                                 f"{[t.losses[step] for t in traces]}) != {ref_loss:.8g}: relative {err:.2e} > {tol:g}")
        for name, [(_, _, ref)] in reference.grads[step].items():
            worst, per_rank = _worst_difference(name, step, "grads", ref, traces)
            err = worst.norm().item() / max(ref.norm().item(), tiny)
            errors["grad"] = max(errors["grad"], err)
            if err > tol:
                rank = max(range(n), key=per_rank.__getitem__)
                raise AssertionError(f"step {step + 1}, averaged gradient of {name!r}, rank {rank}: relative norm "
                                     f"of the difference {err:.2e} > {tol:g} (max abs {worst.max().item():.2e}, "
                                     f"reference norm {ref.norm().item():.2e})")
        sq_diff, sq_ref, blame = 0.0, 0.0, ("", 0, 0.0)
        for name, [(_, _, ref)] in reference.params[step].items():
            worst, per_rank = _worst_difference(name, step, "params", ref, traces)
            rank = max(range(n), key=per_rank.__getitem__)
            if params == "elementwise":
                err = worst.max().item() / max(ref.abs().max().item(), tiny)
                errors["param"] = max(errors["param"], err)
                if err > tol:
                    raise AssertionError(f"step {step + 1}, parameter {name!r}, rank {rank}: max difference "
                                         f"{worst.max().item():.2e} is {err:.2e} of the tensor's largest value "
                                         f"(> {tol:g})")
            else:
                sq_diff += worst.norm().item() ** 2
                sq_ref += ref.norm().item() ** 2
                if worst.norm().item() > blame[2]:
                    blame = (name, rank, worst.norm().item())
        if params == "global_norm":
            err = sq_diff ** 0.5 / max(sq_ref ** 0.5, tiny)
            errors["param"] = max(errors["param"], err)
            if err > tol:
                raise AssertionError(f"step {step + 1}, parameters: global relative norm of the difference "
                                     f"{err:.2e} > {tol:g}; largest on {blame[0]!r} (rank {blame[1]}, norm "
                                     f"{blame[2]:.2e})")
    return errors


@dataclass
class Result:
    """The largest errors seen ({"loss", "grad", "param"}) and every rank's trace (for traffic, memory)."""

    errors: dict[str, float]
    traces: list[Trace]


def check_equivalence(cases: Sequence[Case], make_trainee: MakeTrainee, world_size: int, *,
                      references: Sequence[Trace] | None = None, tol: float = 1e-5) -> dict[str, Result]:
    """Run the engine on `world_size` ranks and compare each case with one process (or `references`).

    Raises AssertionError naming case, world size, step, tensor, rank and difference at the first
    mismatch; otherwise returns, per case name, the largest errors and the ranks' traces.
    """
    if references is None:
        references = [run_reference(case) for case in cases]
    out = {}
    for case, reference, traces in zip(cases, references, run_engine(cases, make_trainee, world_size), strict=True):
        try:
            out[case.name] = Result(compare(reference, traces, params=case.params, tol=tol), traces)
        except AssertionError as exc:
            raise AssertionError(f"{case.name}, world size {world_size}: {exc}") from None
    return out


def digits_batches(kind: Literal["tokens", "vectors"], steps: int = 5, batch_size: int = 12) -> list[Batch]:
    """`steps` global batches of the digits data, in order (12 divides by 1, 2, 3 and 4)."""
    x, y = digits_tokens() if kind == "tokens" else digits_vectors()
    return [(x[i * batch_size:(i + 1) * batch_size], y[i * batch_size:(i + 1) * batch_size])
            for i in range(steps)]


@functools.cache
def standard_cases(steps: int = 5) -> tuple[Case, ...]:
    """The issue's grid: an MLP and a small Transformer, each with SGD (momentum) and AdamW.

    AdamW's lr is 1e-3: parameters that only get rounding noise as gradient (attention's key bias)
    move by about lr per step, and the global-norm check must stay far above that noise.
    Models are built once here, under a fixed seed, with the global RNG restored afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = MLP([64, 32, 10])
        transformer = TransformerClassifier(TransformerConfig.tiny())  # dropout 0: outputs compare
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    return tuple(Case(f"{m}/{o}", model, opt, digits_batches(kind, steps), params)
                 for m, model, kind in (("mlp", mlp, "vectors"), ("transformer", transformer, "tokens"))
                 for o, opt, params in (("sgd", sgd, "elementwise"), ("adamw", adamw, "global_norm")))


@functools.cache
def standard_references(steps: int = 5) -> tuple[Trace, ...]:
    """One-process traces of `standard_cases()`, computed once per test session."""
    return tuple(run_reference(case) for case in standard_cases(steps))
