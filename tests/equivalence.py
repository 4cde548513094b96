"""The engines' tests' cases for the equivalence harness (a helper module, not a test file).

The harness itself (N ranks versus one process, step by step; the Trainee adapters, Case, Trace,
compare, check_equivalence) lives in the package, `fsdp_course.engines.equivalence`, because the
exercise checkers use it at run time. This module adds what only the tests share: the grid
of standard cases (an MLP and a small Transformer, each with SGD and AdamW) with its one-process
references, computed once per test session, and `differing_replicas`, a property the harness does
not check (it compares every rank with one process within a tolerance, not the ranks bitwise), and
`sliced_reference`, one process doing what N ranks do under a mixed-precision policy.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fsdp_course.engines.equivalence import (
    ADAMW,
    SGD,
    Case,
    MixedPrecisionReference,
    Trace,
    digits_batches,
    full_pieces,
    local_slice,
    run_reference,
)
from fsdp_course.models import MLP, TransformerClassifier, TransformerConfig


@functools.cache
def standard_cases(steps: int = 5) -> tuple[Case, ...]:
    """The standard grid: an MLP and a small Transformer, each with SGD (momentum) and AdamW.

    AdamW's lr is 1e-3: parameters that only get rounding noise as gradient (attention's key bias)
    move by about lr per step, and the global-norm check must stay far above that noise.
    Models are built once here, under a fixed seed, with the global RNG restored afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = MLP([64, 32, 10])
        transformer = TransformerClassifier(TransformerConfig.tiny())  # dropout 0: outputs compare
    return tuple(Case(f"{m}/{o}", model, opt, digits_batches(kind, steps), params)
                 for m, model, kind in (("mlp", mlp, "vectors"), ("transformer", transformer, "tokens"))
                 for o, opt, params in (("sgd", SGD, "elementwise"), ("adamw", ADAMW, "global_norm")))


@functools.cache
def standard_references(steps: int = 5) -> tuple[Trace, ...]:
    """One-process traces of `standard_cases()`, computed once per test session."""
    return tuple(run_reference(case) for case in standard_cases(steps))


def differing_replicas(traces: Sequence[Trace]) -> list[str]:
    """Where ranks that hold the same element of a parameter hold different bits after a step ([] if none).

    A replicated engine (DDP; ZeRO after its all-gather) must keep bitwise identical replicas: each
    rank within the harness's tolerance of one process can still drift apart, step after step.
    """
    out = []
    for step in range(len(traces[0].params)):
        for name, [(start, end, values)] in traces[0].params[step].items():
            for rank, trace in enumerate(traces[1:], 1):
                [(s, e, other)] = trace.params[step][name]
                if (s, e) != (start, end) or not torch.equal(other, values):
                    out.append(f"step {step + 1}, {name!r}: rank {rank} differs from rank 0")
    return out


def sliced_reference(case: Case, world_size: int, dtype: torch.dtype) -> Trace:
    """One process doing what N ranks under the policy do: each slice's gradient in `dtype` (cast to fp32), their
    mean in fp32, one optimizer step; the loss is the mean of the slices' losses."""
    model = MixedPrecisionReference(copy.deepcopy(case.model), dtype)
    params = list(model.named_parameters())
    optimizer = case.optimizer_factory([p for _, p in params])
    trace = Trace()
    for batch in case.batches:
        grads = [torch.zeros_like(p) for _, p in params]
        losses = []
        for rank in range(world_size):
            x, y = local_slice(batch, rank, world_size)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            for g, (_, p) in zip(grads, params, strict=True):
                g += p.grad
        for g, (_, p) in zip(grads, params, strict=True):
            p.grad = g / world_size
        optimizer.step()
        trace.losses.append(sum(losses) / world_size)
        trace.grads.append(full_pieces([(n, p.grad) for n, p in params]))
        trace.params.append(full_pieces(params))
    return trace
