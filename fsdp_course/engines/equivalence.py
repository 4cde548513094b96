"""The equivalence harness: an engine on N simulated ranks against one process, step by step.

Every rank trains on its contiguous slice of each global batch (`local_slice`), one process on the whole batches
(`one_process`), and `compare` checks every step: the loss, each averaged gradient (relative norm per tensor) and
the parameters after the step (elementwise under SGD; under Adam in global norm, and elementwise only where the
gradient is more than rounding noise: docs/ARCHITECTURE.md, "Equivalence under Adam"). It is the proof CS336's
FSDP assignment asks of an engine. An engine plugs in as a `Trainee`; checkers, tests and lessons share the
seeded models and batches and the relative differences (`norm_rel_diff`, `max_rel_diff`, `close`).

    case = Case("mlp/sgd", MLP([64, 32, 10]), SGD, digits_batches("vectors"), params="elementwise")
    results = check_equivalence([case], lambda model, ctx, opt: Trainee(DDP(model, ctx), opt), world_size=3)
    results["mlp/sgd"].errors      # {"loss": ..., "grad": ..., "param": ...}, the largest relative errors seen
    results["mlp/sgd"].traces[r]   # rank r's Trace: losses, grads, params, collectives and memory per step
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
    "ADAMW", "SGD", "Batch", "Case", "MakeTrainee", "MixedPrecisionReference", "OptimizerFactory", "Result",
    "StepRecord", "Trace", "Trainee", "check_equivalence", "close", "compare", "digits_batches", "full_tensor",
    "global_batches", "local_slice", "max_rel_diff", "norm_rel_diff", "one_process", "seeded_mlp", "train",
]

Pieces = dict[str, list[tuple[int, int, Tensor]]]  # name -> [(start, end, values of flat[start:end])]
Chunks = Callable[[], list[tuple[FlatParamLayout, int, Tensor | None]]]  # -> [(layout, rank, this rank's chunk)]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
ParamCheck = Literal["elementwise", "global_norm"]
Compared = float | Tensor | Mapping[str, Tensor] | Sequence[Tensor]

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


# -- an engine on one rank -------------------------------------------------------------------------
def _whole_pieces(named: Iterable[tuple[str, Tensor | None]]) -> Pieces:
    """Whole tensors, each one piece [0, numel); None entries are skipped."""
    return {n: [(0, t.numel(), t.detach().reshape(-1).clone())] for n, t in named if t is not None}


def _chunk_pieces(chunks: Iterable[tuple[FlatParamLayout, int, Tensor | None]]) -> Pieces:
    """The parts of each parameter inside each rank's chunk (padded_numel // N,) of a flat buffer."""
    out: Pieces = {}
    for layout, rank, chunk in chunks:
        if chunk is None:
            continue
        for piece in layout.pieces(rank):
            n = piece.param_end - piece.param_start
            values = chunk.detach()[piece.shard_offset:piece.shard_offset + n].clone()
            out.setdefault(piece.name, []).append((piece.param_start, piece.param_end, values))
    return out


class Trainee:
    """An engine on one rank as the harness trains it: forward, step, zero_grad, and what the rank holds.

    The optimizer is `optimizer_factory(list(engine.parameters()))`, or, with None, the engine's own `step()` and
    `zero_grad()` (ZeRO-1/2). The rank holds whole tensors, the named parameters of `module` (default: the engine)
    and their gradients, unless `grad_chunks` / `param_chunks` return its chunks of flat buffers instead (ZeRO: the
    gradient; FSDP: both, see `Trainee.fsdp`). Every element of every tensor must be held by some rank.
    """

    def __init__(self, engine: nn.Module, optimizer_factory: OptimizerFactory | None = None, *,
                 module: nn.Module | None = None, grad_chunks: Chunks | None = None,
                 param_chunks: Chunks | None = None) -> None:
        self.engine = engine
        self.optimizer = None if optimizer_factory is None else optimizer_factory(list(engine.parameters()))
        self.module = engine if module is None else module
        self.grad_chunks, self.param_chunks = grad_chunks, param_chunks

    @classmethod
    def fsdp(cls, fsdp: Any, optimizer_factory: OptimizerFactory) -> Trainee:
        """The course's FSDP (or anything with `ctx` and `handles` of (layout, shard)): the optimizer steps the
        shards, and the rank holds its chunks of the parameters and of the averaged gradients only."""
        return cls(fsdp, optimizer_factory,
                   grad_chunks=lambda: [(h.layout, fsdp.ctx.rank, h.shard.grad) for h in fsdp.handles],
                   param_chunks=lambda: [(h.layout, fsdp.ctx.rank, h.shard) for h in fsdp.handles])

    def __call__(self, x: Tensor) -> Tensor:
        return self.engine(x)

    def step(self) -> None:
        (self.engine if self.optimizer is None else self.optimizer).step()

    def zero_grad(self) -> None:
        (self.engine if self.optimizer is None else self.optimizer).zero_grad()

    def grad_pieces(self) -> Pieces:
        """The averaged gradient this rank holds."""
        if self.grad_chunks is not None:
            return _chunk_pieces(self.grad_chunks())
        return _whole_pieces((n, p.grad) for n, p in self.module.named_parameters())

    def param_pieces(self) -> Pieces:
        """The parameters this rank holds (after the step)."""
        if self.param_chunks is not None:
            return _chunk_pieces(self.param_chunks())
        return _whole_pieces(self.module.named_parameters())

    def memory(self) -> dict[str, int]:
        """Bytes alive by category (`fsdp_course.memory.measure`) for an engine that lists its tensors, else {}."""
        return measure(self.engine, self.optimizer) if hasattr(self.engine, "memory_tensors") else {}


MakeTrainee = Callable[[nn.Module, RankContext, OptimizerFactory], Trainee]


# -- training: N ranks, one process ---------------------------------------------------------------
@dataclass
class StepRecord:
    """What one process saw in one step: the loss, the gradients, the parameters after the step (shaped)."""

    loss: float
    grads: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Trace:
    """What one rank (or the one process) saw, per step."""

    losses: list[float] = field(default_factory=list)
    grads: list[Pieces] = field(default_factory=list)
    params: list[Pieces] = field(default_factory=list)
    sent: list[dict[str, float]] = field(default_factory=list)  # bytes sent per collective op (ledger)
    calls: list[list[tuple[str, str]]] = field(default_factory=list)  # (phase, op) of each collective, in order
    memory: list[dict[str, int]] = field(default_factory=list)  # measured after the step

    def steps(self, like: nn.Module) -> list[StepRecord]:
        """Step by step, with whole tensors shaped as `like`'s parameters (a trace that holds whole tensors, such
        as one process's: what the checkers compare with)."""
        shapes = {n: p.shape for n, p in like.named_parameters()}

        def shaped(pieces: Pieces) -> dict[str, Tensor]:
            return {n: values.view(shapes[n]) for n, [(_, _, values)] in pieces.items()}

        return [StepRecord(loss, shaped(grads), shaped(params))
                for loss, grads, params in zip(self.losses, self.grads, self.params, strict=True)]

    def record(self, trainee: Trainee, loss: Tensor, records: Sequence[Any] | None = None) -> None:
        """One step after `trainee.step()`: its loss, gradient and parameter pieces, its memory, and, given the
        ledger records the step made, the bytes each op sent and the (phase, op) of each collective."""
        self.losses.append(loss.item())
        self.grads.append(trainee.grad_pieces())
        self.params.append(trainee.param_pieces())
        if records is not None:
            sent: dict[str, float] = {}
            for record in records:
                sent[record.op] = sent.get(record.op, 0.0) + record.sent_bytes
            self.sent.append(sent)
            self.calls.append([(record.label, record.op) for record in records])
        self.memory.append(trainee.memory())


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
        trace.record(trainee, loss, ledger.records[first:] if ledger is not None else None)
        trainee.zero_grad()
    return trace


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


def one_process(model: nn.Module, batches: Sequence[Batch], optimizer_factory: OptimizerFactory, *,
                slices: int = 1, param_dtype: torch.dtype | None = None,
                loss_fn: LossFn = F.cross_entropy) -> Trace:
    """One process trained on the whole global batches: the reference (a deep copy of `model` is trained).

    `param_dtype`: each forward computes in it (`MixedPrecisionReference`). `slices` > 1: what N = `slices` ranks
    compute, in one process: each rank's slice forward and backward apart, the gradients averaged in fp32, the loss
    the mean of the slices' losses, then one step (under a mixed-precision policy this rounds as the ranks do).
    """
    model = copy.deepcopy(model)
    forward = model if param_dtype is None else MixedPrecisionReference(model, param_dtype)
    params = list(model.named_parameters())
    optimizer = optimizer_factory([p for _, p in params])
    trace = Trace()
    for batch in batches:
        losses: list[float] = []
        sums: list[Tensor | None] = [None] * len(params)  # None: no slice gave this parameter a gradient
        for rank in range(slices):
            x, y = local_slice(batch, rank, slices)
            optimizer.zero_grad()
            loss = loss_fn(forward(x), y)
            loss.backward()
            losses.append(loss.item())
            for i, (_, p) in enumerate(params):
                if p.grad is not None:
                    sums[i] = p.grad.clone() if sums[i] is None else sums[i] + p.grad
        for (_, p), total in zip(params, sums, strict=True):
            p.grad = None if total is None else total / slices
        optimizer.step()
        trace.losses.append(sum(losses) / slices)
        trace.grads.append(_whole_pieces((n, p.grad) for n, p in params))
        trace.params.append(_whole_pieces(params))
    return trace


# -- the comparison --------------------------------------------------------------------------------
def max_rel_diff(got: Tensor, expected: Tensor) -> float:
    """Largest elementwise difference, relative to the largest magnitude of `expected` (0 if both are 0)."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    diff = float((got.detach().double() - expected.detach().double()).abs().max()) if expected.numel() else 0.0
    return diff / scale if scale > 0 else diff


def norm_rel_diff(got: Compared, expected: Compared) -> float:
    """The norm of the difference over the norm of `expected` (the difference itself if that norm is 0): of two
    numbers (|got - expected| / |expected|), of one tensor, or of several as a whole, a state dict (by key) or a
    list (in order): every tensor flattened into one float64 vector, the global norm, the measure under Adam
    (docs/ARCHITECTURE.md)."""
    if isinstance(expected, int | float):
        diff, scale = abs(got - expected), abs(expected)  # type: ignore[operator]
        return diff / scale if scale > 0 else diff
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


def full_tensor(traces: Sequence[Trace], step: int, name: str, like: Tensor,
                what: Literal["grads", "params"] = "params") -> Tensor:
    """Tensor `name` at `step` (0-based) put together from the ranks' pieces, shaped like `like`."""
    out = torch.full((like.numel(),), float("nan"), dtype=like.dtype)
    for trace in traces:
        for start, end, values in getattr(trace, what)[step].get(name, []):
            out[start:end] = values
    return out.view(like.shape)


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
    """Assert the N-rank traces match the reference at every step; return the largest errors seen.

    A failure names the step, the tensor, the rank and the difference.
    """
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


# -- cases -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One model trained with one optimizer on some global batches, and how to compare its parameters."""

    name: str  # e.g. "mlp/sgd", used in failure messages
    model: nn.Module  # built once, outside the ranks; never changed (every run trains a deep copy)
    optimizer_factory: OptimizerFactory
    batches: Sequence[Batch]
    params: ParamCheck  # SGD: elementwise; Adam/AdamW: global_norm


@dataclass
class Result:
    """The largest errors seen ({"loss", "grad", "param"}) and every rank's trace (for traffic, memory)."""

    errors: dict[str, float]
    traces: list[Trace]


def check_equivalence(cases: Sequence[Case], make_trainee: MakeTrainee, world_size: int, *,
                      references: Sequence[Trace] | None = None, tol: float = 1e-5,
                      timeout: float = 30.0) -> dict[str, Result]:
    """Train every case on `world_size` ranks and compare it with one process (or with `references`).

    All cases run in one `run_ranks` (starting the simulated world is the slow part); every rank trains its own
    deep copy of each model, copied before the threads start. Raises AssertionError naming case, world size, step,
    tensor, rank and difference at the first mismatch; otherwise returns, per case name, the largest errors and
    the ranks' traces.
    """
    if references is None:
        references = [one_process(case.model, case.batches, case.optimizer_factory) for case in cases]
    copies = [[copy.deepcopy(case.model) for _ in range(world_size)] for case in cases]

    def fn(ctx: RankContext) -> list[Trace]:
        return [train(make_trainee(models[ctx.rank], ctx, case.optimizer_factory),
                      [local_slice(b, ctx.rank, ctx.world_size) for b in case.batches], ctx.ledger)
                for case, models in zip(cases, copies, strict=True)]

    per_rank = run_ranks(fn, world_size, timeout=timeout)
    out = {}
    for i, (case, reference) in enumerate(zip(cases, references, strict=True)):
        traces = [per_rank[r][i] for r in range(world_size)]
        try:
            out[case.name] = Result(compare(reference, traces, params=case.params, tol=tol), traces)
        except AssertionError as exc:
            raise AssertionError(f"{case.name}, world size {world_size}: {exc}") from None
    return out

