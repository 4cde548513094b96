"""Training loops the lessons run to measure an engine, not to teach it: the loop is the one of lesson 02, the
measurement is what the lesson reads.

    run = record_steps(lambda: FSDP(model, ctx, wrap=WRAP), ADAMW, my_batches, ctx.ledger)
    run.timeline      # the last step's memory events: [(label, {category: bytes})], what the figures draw
    run.peak          # parameters + gradients + optimizer state, the most over those events (bytes)
    run.ledger        # the collectives, in the phases "init", "step 0", "step 1", ...

    steps = gathered_steps(FSDP(model, ctx, wrap=WRAP), ADAMW, my_batches)   # a collective: every rank calls it
    steps[k].loss, steps[k].grads, steps[k].params   # what one process holds after step k, to compare with
                                                     # equivalence.one_process(...).steps(model)

    run = train_steps(model_or_engine, make_optimizer, batches, ledger, after_backward=average_gradients)
    run.losses[k], run.grads[k], run.params[k]       # step k: the loss, every gradient, every parameter after it
    run.memory                                       # bytes by category after the last step, gradients still held
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fsdp_course.engines.equivalence import StepRecord
from fsdp_course.memory import attach, measure, measure_tensors, optimizer_tensors
from fsdp_course.runtime.ledger import Ledger

__all__ = ["MeasuredSteps", "TrainedSteps", "gathered_steps", "measured_step", "record_steps", "train_steps"]

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass
class MeasuredSteps:
    """What `record_steps` measured on one rank."""

    engine: Any  # the engine it trained (e.g. for `fsdp.unit_numels()`)
    timeline: list[tuple[str, dict[str, int]]]  # the last step's events: (label, bytes by category)
    peak: int  # parameters + gradients + optimizer state, the most over the last step's events
    peak_label: str  # the event where that peak came
    ledger: Ledger | None  # the rank's collectives, labelled "init", "step 0", "step 1", ...


def record_steps(make_engine: Callable[[], Any], optimizer_factory: OptimizerFactory, batches: Sequence[Batch],
                 ledger: Ledger | None = None, loss_fn: LossFn = F.cross_entropy) -> MeasuredSteps:
    """Build the engine (ledger phase "init"), then train one step per batch with a memory recorder attached
    (`memory.attach`; ledger phases "step 0", "step 1", ...), and keep the last step's events: "step starts", the
    engine's own (unshard, reshard, all_reduce ...), "forward done", "optimizer step". The first step creates
    Adam's state: give two batches to measure a step that holds it."""
    mark = ledger.mark if ledger is not None else (lambda label: None)
    mark("init")
    engine = make_engine()
    optimizer = optimizer_factory(list(engine.parameters()))
    recorder = attach(engine, optimizer)
    for step, (x, y) in enumerate(batches):
        recorder.reset()
        mark(f"step {step}")
        recorder.record("step starts")
        loss = loss_fn(engine(x), y)
        recorder.record("forward done")
        loss.backward()
        optimizer.step()
        recorder.record("optimizer step")
        optimizer.zero_grad()
    return MeasuredSteps(engine, list(recorder.events), recorder.peak_total, recorder.peak_label, ledger)


def gathered_steps(fsdp: Any, optimizer_factory: OptimizerFactory, batches: Sequence[Batch],
                   loss_fn: LossFn = F.cross_entropy) -> list[StepRecord]:
    """Train `fsdp` (the course's FSDP) one step per batch of this rank, and after each step gather what one
    process on the global batch would hold: the loss averaged over the ranks (their slices are equal), the averaged
    gradients (`fsdp.full_grads()`, before the step) and the parameters after it (`fsdp.full_state_dict()`).
    Collectives: every rank calls it, and every rank gets the same records."""
    optimizer = optimizer_factory(list(fsdp.parameters()))
    out = []
    for x, y in batches:
        loss = loss_fn(fsdp(x), y)
        loss.backward()
        mean = fsdp.ctx.all_reduce(loss.detach().reshape(1), op="mean").item()
        grads = fsdp.full_grads()
        optimizer.step()
        optimizer.zero_grad()
        out.append(StepRecord(mean, grads, fsdp.full_state_dict()))
    return out


@dataclass
class TrainedSteps:
    """What `train_steps` saw, per step, on one rank (or in one process)."""

    losses: list[float] = field(default_factory=list)  # this rank's loss (of its own batch)
    grads: list[list[Tensor]] = field(default_factory=list)  # every parameter's gradient, before the step
    params: list[list[Tensor]] = field(default_factory=list)  # every parameter, after the step
    memory: dict[str, int] = field(default_factory=dict)  # bytes by category after the last step, before zero_grad
    ledger: Ledger | None = None  # the collectives, in the phases "step 1", "step 2", ... (and what came before)


def train_steps(model: torch.nn.Module, optimizer_factory: OptimizerFactory, batches: Sequence[Batch],
                ledger: Ledger | None = None, *, after_backward: Callable[[], None] | None = None,
                loss_fn: LossFn = F.cross_entropy) -> TrainedSteps:
    """The one-process loop of lesson 02, on a module or an engine (DDP averages the gradients inside `backward()`):
    per batch, forward, backward, `after_backward()` (e.g. all-reduce the gradients by hand), record the loss and
    every gradient, step, record every parameter, zero_grad. With a ledger, step k's collectives carry the phase
    "step k" (from 1). `memory` is `memory.measure(model, optimizer)` after the last step, while the gradients are
    still held, for an engine that lists its tensors (`memory_tensors()`); {} for a plain module."""
    optimizer = optimizer_factory(list(model.parameters()))
    run = TrainedSteps(ledger=ledger)
    for step, (x, y) in enumerate(batches, start=1):
        if ledger is not None:
            ledger.mark(f"step {step}")
        loss = loss_fn(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        run.losses.append(loss.item())
        run.grads.append([p.grad.detach().clone() for p in model.parameters()])
        optimizer.step()
        run.params.append([p.detach().clone() for p in model.parameters()])
        if step == len(batches) and callable(getattr(model, "memory_tensors", None)):
            run.memory = measure(model, optimizer)
        optimizer.zero_grad()
    return run


def measured_step(engine: Any, optimizer_factory: OptimizerFactory | None, x: Tensor, y: Tensor,
                  loss_fn: LossFn = F.cross_entropy) -> dict[str, int]:
    """One training step on (x, y), then the bytes held by category, the gradients still there (no zero_grad).

    `optimizer_factory` builds the optimizer over `engine.parameters()`; None for an engine that owns its optimizer
    (ZeRO-1/2: `engine.step()`). An engine is measured with `memory.measure`; a plain module by its "params", "grads"
    and "optimizer" (its optimizer's state)."""
    optimizer = None if optimizer_factory is None else optimizer_factory(list(engine.parameters()))
    loss_fn(engine(x), y).backward()
    (engine if optimizer is None else optimizer).step()
    if callable(getattr(engine, "memory_tensors", None)):
        return measure(engine, optimizer)
    return measure_tensors({"params": list(engine.parameters()), "grads": [p.grad for p in engine.parameters()],
                            "optimizer": optimizer_tensors(optimizer)})
