"""The engines' tests' standard cases (a helper module, not a test file; the harness is
`fsdp_course.engines.equivalence`).

The grid of an MLP and a small Transformer, each with SGD and AdamW, and its one-process references, built once
per test session; and `differing_replicas`, a property the harness does not check (it compares every rank with one
process within a tolerance, not the ranks with each other bit for bit).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from fsdp_course.engines.equivalence import ADAMW, SGD, Case, Trace, digits_batches, one_process
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
    return tuple(one_process(case.model, case.batches, case.optimizer_factory) for case in standard_cases(steps))


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
