"""The equivalence harness: an engine on N simulated ranks against one process, step by step.

The proof every data-parallel engine and exercise owes (as in CS336's FSDP checks; docs/ARCHITECTURE.md,
"Equivalence under Adam"): train it on N ranks, each on its contiguous slice of every global batch
(`local_slice`), train one plain process on the whole global batches (`reference_run`), and compare
at every step:
  - the loss (mean of the ranks' losses; the slices are equal) and every averaged gradient, per
    tensor: relative norm of the difference <= tol;
  - the parameters after the step: elementwise relative to the tensor's largest value (SGD); under
    Adam/AdamW in global norm over all parameters, and elementwise only where the gradient is
    more than rounding noise (Adam divides by the gradient's own scale, so a gradient that is
    mathematically zero, such as attention's key bias, turns rounding noise into steps that differ
    from run to run, up to lr in size).
A failure names the case, world size, step, tensor, rank and difference.

An engine plugs in through a small adapter, a `Trainee` (`ModuleTrainee` for one process or DDP,
`ShardedTrainee` for ZeRO-1/2, `FSDPTrainee`): forward, step, zero_grad, and what it holds, as
`Pieces`: name -> [(start, end, values)], ranges of the flattened tensor, so sharded engines report
only their chunks (`shard_pieces`) and replicated ones the whole tensor (`full_pieces`). Every
element of every tensor must be covered by some rank.

    case = Case("mlp/sgd", MLP([64, 32, 10]), SGD, digits_batches("vectors"), params="elementwise")
    make = lambda model, ctx, opt_factory: ModuleTrainee(DDP(model, ctx), opt_factory)
    result = check_equivalence([case], make, world_size=3)["mlp/sgd"]
    result.errors      # {"loss": ..., "grad": ..., "param": ...}, the largest relative errors seen
    result.traces[r]   # rank r's Trace: losses, grads, params, collectives and memory per step

Cases run in one `run_ranks` per world size (starting the simulated world is the slow part).
The exercise checkers (`fsdp_course.classroom.checks`) run the learner's code themselves and use
the pieces below it: `seeded_mlp` and `global_batches` (built without touching the global RNG,
which the rank threads share), `local_slice`, one process's `StepRecord`s (`reference_steps`),
`local_grads`, `max_rel_diff` and `close`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fsdp_course.data import digits_tokens, digits_vectors
from fsdp_course.fsdp.flat_param import FlatParamLayout
from fsdp_course.memory import measure
from fsdp_course.runtime.context import RankContext
from fsdp_course.runtime.ledger import Ledger
from fsdp_course.runtime.simulate import run_ranks
from fsdp_course.sampler import rank_slice

__all__ = [
    "ADAMW", "SGD", "Batch", "Case", "FSDPTrainee", "MakeTrainee", "MixedPrecisionReference",
    "ModuleTrainee", "OptimizerFactory", "Pieces",
    "Result", "ShardedTrainee", "StepRecord", "Trace", "Trainee", "check_equivalence", "close", "compare",
    "digits_batches", "full_pieces", "full_tensor", "global_batches", "local_grads", "local_slice", "max_rel_diff",
    "norm_rel_diff", "reference_run", "reference_steps", "run_engine", "run_reference", "seeded_mlp", "shard_pieces",
    "train",
]

Pieces = dict[str, list[tuple[int, int, Tensor]]]  # name -> [(start, end, values of flat[start:end])]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
ParamCheck = Literal["elementwise", "global_norm"]

SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)  # the optimizers of the engines' tests
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
SIGNAL = 1e-3  # under Adam, elements whose gradient stays >= SIGNAL x its tensor's largest are compared one by one


# -- models and data -------------------------------------------------------------------------------
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
    """`steps` global batches of (batch, in_dim) random inputs and class labels."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, in_dim, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(steps)]


def digits_batches(kind: Literal["tokens", "vectors"], steps: int = 5, batch_size: int = 12, *,
                   token_stride: int = 1) -> list[Batch]:
    """`steps` global batches of the digits data, in order (12 divides by 1, 2, 3 and 4).

    `token_stride` keeps every k-th token of each image (a shorter sequence: the same test, faster).
    """
    x, y = digits_tokens() if kind == "tokens" else digits_vectors()
    if kind == "tokens":
        x = x[:, ::token_stride]
    return [(x[i * batch_size:(i + 1) * batch_size], y[i * batch_size:(i + 1) * batch_size])
            for i in range(steps)]


def local_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s contiguous, equal slice of a global batch (inputs and labels: sampler.rank_slice)."""
    x, y = batch
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)


# -- what an engine holds --------------------------------------------------------------------------
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


def _chunk_pieces(chunks: Sequence[tuple[FlatParamLayout, int, Tensor | None]]) -> Pieces:
    out: Pieces = {}
    for layout, rank, chunk in chunks:
        for name, pieces in shard_pieces(layout, rank, chunk).items():
            out.setdefault(name, []).extend(pieces)
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
    `engine.module` and its averaged gradient as chunks: `chunks()` -> [(layout, rank, grad chunk)]
    (ZeRO-1 and ZeRO-2)."""

    def __init__(self, engine: nn.Module,
                 chunks: Callable[[], list[tuple[FlatParamLayout, int, Tensor | None]]]) -> None:
        self.engine = engine
        self.chunks = chunks

    def __call__(self, x: Tensor) -> Tensor:
        return self.engine(x)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def grad_pieces(self) -> Pieces:
        return _chunk_pieces(self.chunks())

    def param_pieces(self) -> Pieces:
        return full_pieces(list(self.engine.module.named_parameters()))

    def memory(self) -> dict[str, int]:
        return measure(self.engine)  # the engine lists its own optimizer's state


class FSDPTrainee:
    """FSDP (`fsdp_course.fsdp.api.FSDP`, or anything with `handles` of (layout, shard) and `ctx`): the
    optimizer steps the shards; parameters and averaged gradients are held as this rank's chunks only."""

    def __init__(self, fsdp: Any, optimizer_factory: OptimizerFactory) -> None:
        self.fsdp = fsdp
        self.optimizer = optimizer_factory(list(fsdp.parameters()))

    def __call__(self, x: Tensor) -> Tensor:
        return self.fsdp(x)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def grad_pieces(self) -> Pieces:
        return _chunk_pieces([(h.layout, self.fsdp.ctx.rank, h.shard.grad) for h in self.fsdp.handles])

    def param_pieces(self) -> Pieces:
        return _chunk_pieces([(h.layout, self.fsdp.ctx.rank, h.shard) for h in self.fsdp.handles])

    def memory(self) -> dict[str, int]:
        return measure(self.fsdp, self.optimizer)


# -- the training loop -----------------------------------------------------------------------------
@dataclass
class Trace:
    """What one rank (or the one process) saw, per step."""

    losses: list[float] = field(default_factory=list)
    grads: list[Pieces] = field(default_factory=list)
    params: list[Pieces] = field(default_factory=list)
    sent: list[dict[str, float]] = field(default_factory=list)  # bytes sent per collective op (ledger)
    calls: list[list[tuple[str, str]]] = field(default_factory=list)  # (phase, op) of each collective, in order
    memory: list[dict[str, int]] = field(default_factory=list)  # measured after the step, if offered


def train(trainee: Trainee, batches: Sequence[Batch], ledger: Ledger | None = None,
          loss_fn: LossFn = F.cross_entropy) -> Trace:
    """The training loop every rank runs: forward, backward, step, record, zero_grad.

    With a ledger, the collectives of each step are recorded with the phase that issued them
    ("forward", "backward" or "step"; the ledger's label is restored afterwards).
    """
    trace = Trace()
    label = ledger.label if ledger is not None else ""

    def phase(name: str) -> None:
        if ledger is not None:
            ledger.mark(name)

    for x, y in batches:
        first = len(ledger.records) if ledger is not None else 0
        phase("forward")
        loss = loss_fn(trainee(x), y)
        phase("backward")
        loss.backward()
        phase("step")
        trainee.step()
        phase(label)
        trace.losses.append(loss.item())
        trace.grads.append(trainee.grad_pieces())
        trace.params.append(trainee.param_pieces())
        if ledger is not None:
            sent: dict[str, float] = {}
            for record in ledger.records[first:]:
                sent[record.op] = sent.get(record.op, 0.0) + record.sent_bytes
            trace.sent.append(sent)
            trace.calls.append([(record.label, record.op) for record in ledger.records[first:]])
        if hasattr(trainee, "memory"):
            trace.memory.append(trainee.memory())
        trainee.zero_grad()
    return trace


def reference_run(model: nn.Module, batches: Sequence[Batch], optimizer_factory: OptimizerFactory,
                  loss_fn: LossFn = F.cross_entropy) -> Trace:
    """One process on the whole global batches (a deep copy of `model` is trained)."""
    return train(ModuleTrainee(copy.deepcopy(model), optimizer_factory), batches, loss_fn=loss_fn)


@dataclass
class StepRecord:
    """What one process saw in one step: the loss, the gradients, the parameters after the step (shaped)."""

    loss: float
    grads: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)


def reference_steps(model: nn.Module, batches: Sequence[Batch], optimizer_factory: OptimizerFactory,
                    loss_fn: LossFn = F.cross_entropy) -> list[StepRecord]:
    """`reference_run`, step by step, with `model`'s parameter shapes (what the checkers compare with)."""
    trace = reference_run(model, batches, optimizer_factory, loss_fn)
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def shaped(pieces: Pieces) -> dict[str, Tensor]:
        return {n: values.view(shapes[n]) for n, [(_, _, values)] in pieces.items()}

    return [StepRecord(loss, shaped(grads), shaped(params))
            for loss, grads, params in zip(trace.losses, trace.grads, trace.params, strict=True)]


def local_grads(model: nn.Module, batch: Batch, loss_fn: LossFn = F.cross_entropy) -> dict[str, Tensor]:
    """The gradients of one rank's slice alone (what a rank holds before any averaging)."""
    model = copy.deepcopy(model)
    loss_fn(model(batch[0]), batch[1]).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def full_tensor(traces: Sequence[Trace], step: int, name: str, like: Tensor,
                what: Literal["grads", "params"] = "params") -> Tensor:
    """Tensor `name` at `step` (0-based) put together from the ranks' pieces, shaped like `like`."""
    out = torch.full((like.numel(),), float("nan"), dtype=like.dtype)
    for trace in traces:
        for start, end, values in getattr(trace, what)[step].get(name, []):
            out[start:end] = values
    return out.view(like.shape)


# -- the comparison --------------------------------------------------------------------------------
def max_rel_diff(got: Tensor, expected: Tensor) -> float:
    """Largest elementwise difference, relative to the largest magnitude of `expected` (0 if both are 0)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    diff = float((got.detach().double() - expected.detach().double()).abs().max()) if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def norm_rel_diff(got: Tensor | Mapping[str, Tensor] | Sequence[Tensor],
                  expected: Tensor | Mapping[str, Tensor] | Sequence[Tensor]) -> float:
    """The norm of the difference over the norm of `expected`: of one tensor, or of several as a whole, a state dict
    (by key) or a list (in order): every tensor flattened into one vector, the global norm, the measure under Adam
    (docs/ARCHITECTURE.md)."""
    if isinstance(expected, Mapping):
        got = torch.cat([got[k].detach().reshape(-1).double() for k in expected])  # type: ignore[index]
        expected = torch.cat([v.detach().reshape(-1).double() for v in expected.values()])
    elif not isinstance(expected, Tensor):
        if len(got) != len(expected):  # type: ignore[arg-type]
            raise ValueError(f"{len(got)} tensor(s) against {len(expected)}: compare lists of the same tensors")  # type: ignore
        got = torch.cat([t.detach().reshape(-1).double() for t in got])  # type: ignore[union-attr]
        expected = torch.cat([t.detach().reshape(-1).double() for t in expected])
    diff = float((got.detach().double() - expected.detach().double()).norm())  # type: ignore[union-attr]
    scale = float(expected.detach().double().norm())
    return diff / scale if scale > 0 else diff


def close(got: Tensor, expected: Tensor, tol: float = 1e-5) -> bool:
    """Same shape, and `max_rel_diff(got, expected) <= tol`."""
    return tuple(got.shape) == tuple(expected.shape) and max_rel_diff(got, expected) <= tol


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


def _signal(reference: Trace) -> dict[str, Tensor]:
    """Per tensor, the elements whose gradient is at least SIGNAL x the tensor's largest at every step."""
    out: dict[str, Tensor] = {}
    names = set.intersection(*(set(step) for step in reference.grads)) if reference.grads else set()
    for name in names:
        g = torch.stack([step[name][0][2].abs() for step in reference.grads])  # (steps, numel)
        out[name] = (g >= SIGNAL * g.amax(1, keepdim=True)).all(0)
    return out


def compare(reference: Trace, traces: Sequence[Trace], *, params: ParamCheck, tol: float = 1e-5) -> dict[str, float]:
    """Assert the N-rank traces match the reference at every step; return the largest errors seen."""
    tiny = torch.finfo(torch.float32).tiny
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    n = len(traces)
    signal = _signal(reference) if params == "global_norm" else {}
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
            if params == "elementwise" or name in signal:
                where = "" if params == "elementwise" else " where the gradient is more than rounding noise"
                diff = worst if params == "elementwise" else worst * signal[name]
                err = diff.max().item() / max(ref.abs().max().item(), tiny)
                errors["param"] = max(errors["param"], err)
                if err > tol:
                    raise AssertionError(f"step {step + 1}, parameter {name!r}, rank {rank}: max difference{where} "
                                         f"{diff.max().item():.2e} is {err:.2e} of the tensor's largest value "
                                         f"(> {tol:g})")
            if params == "global_norm":
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


class MixedPrecisionReference(nn.Module):
    """One process under a mixed-precision policy, the reference for FSDP's `mp_policy`: the parameters stay in
    their dtype (fp32, the master copy the optimizer steps), each forward computes with copies cast to
    `param_dtype` and with floating inputs cast too. Autograd casts the gradient back through the copy, so `.grad`
    holds the `param_dtype` gradient in fp32, as FSDP's shard does (whatever its reduce dtype: one process reduces
    nothing). `state_dict()` and `named_parameters()` are the wrapped module's."""

    def __init__(self, module: nn.Module, param_dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.param_dtype = param_dtype

    def forward(self, *args: Any) -> Tensor:
        cast = {n: p.to(self.param_dtype) for n, p in self.module.named_parameters()}
        args = tuple(a.to(self.param_dtype) if a.is_floating_point() else a for a in args)
        return torch.func.functional_call(self.module, cast, args, tie_weights=True)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # the wrapped module's names, no "module."
        return self.module.named_parameters(*args, **kwargs)


# -- cases -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One model trained with one optimizer on some global batches, and how to compare its parameters."""

    name: str  # e.g. "mlp/sgd", used in failure messages
    model: nn.Module  # built once, outside the ranks; never changed (every run trains a deep copy)
    optimizer_factory: OptimizerFactory
    batches: Sequence[Batch]
    params: ParamCheck  # SGD: elementwise; Adam/AdamW: global_norm


def run_reference(case: Case) -> Trace:
    """One process on the case's global batches."""
    return reference_run(case.model, case.batches, case.optimizer_factory)


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


@dataclass
class Result:
    """The largest errors seen ({"loss", "grad", "param"}) and every rank's trace (for traffic, memory)."""

    errors: dict[str, float]
    traces: list[Trace]


def check_equivalence(cases: Sequence[Case], make_trainee: MakeTrainee, world_size: int, *,
                      references: Sequence[Trace] | None = None, tol: float = 1e-5,
                      timeout: float = 30.0) -> dict[str, Result]:
    """Run the engine on `world_size` ranks and compare each case with one process (or `references`).

    Raises AssertionError naming case, world size, step, tensor, rank and difference at the first
    mismatch; otherwise returns, per case name, the largest errors and the ranks' traces.
    """
    if references is None:
        references = [run_reference(case) for case in cases]
    out = {}
    engine_traces = run_engine(cases, make_trainee, world_size, timeout=timeout)
    for case, reference, traces in zip(cases, references, engine_traces, strict=True):
        try:
            out[case.name] = Result(compare(reference, traces, params=case.params, tol=tol), traces)
        except AssertionError as exc:
            raise AssertionError(f"{case.name}, world size {world_size}: {exc}") from None
    return out
