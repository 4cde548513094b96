"""Per-rank memory, measured from the tensor storages that are alive, beside the ZeRO formulas.

Measured, not computed: every engine (DDP, ZeRO-1/2, FSDP) lists the tensors it holds, by category,
in `engine.memory_tensors()`; `measure` adds up the bytes of their *storages*, each storage once
(two views of one flat buffer cost the buffer once; a gathered buffer that FSDP freed with
`untyped_storage().resize_(0)` costs 0).  Optimizer state is read from `optimizer.state`.

A `MemoryRecorder` attached to an engine takes such a snapshot whenever the engine reports an event
(`record_event(engine, "unshard layers.0")`), appends `(label, bytes_by_category)` to
`engine.timeline` (what the visualizer draws) and keeps the peak.  Snapshots are taken only at those
events, so the peak is the peak over the events; the engines report after every allocation that
matters (unshard, gradients ready, reduce-scatter, reshard, all-reduce, step).

`zero_formula` is ZeRO's accounting (arXiv:1910.02054, section 5.1 and figure 1) for fp32 training
with Adam (K = 8 bytes of state per parameter: momentum and variance), Psi = number of parameters:
  DDP 16 Psi,  ZeRO-1 (P_os) 8 Psi + 8 Psi/N,  ZeRO-2 (P_os+g) 4 Psi + 12 Psi/N,  ZeRO-3 (P_os+g+p) 16 Psi/N,
plus, for ZeRO-3 / FSDP (arXiv:2304.11277), the unit that is gathered at the moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

PARAM_GRAD_OPTIMIZER = ("params", "sharded_params", "gathered_params", "grads", "sharded_grads",
                        "optimizer")  # what the ZeRO formulas count (not buffers, not activations)


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (Adam: exp_avg, exp_avg_sq, step)."""
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def measure_tensors(
    tensors_by_category: Mapping[str, Iterable[torch.Tensor | None]],
) -> dict[str, int]:
    """Bytes per category, each storage counted once (in the first category that holds it)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for category, tensors in tensors_by_category.items():
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0:  # freed (resize_(0)) or empty: nothing held
                continue
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += nbytes
        out[category] = out.get(category, 0) + total
    return out


def measure(engine: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes alive right now on this rank, by category (see the engine protocol in the module doc)."""
    tensors = dict(engine.memory_tensors())
    tensors["optimizer"] = list(tensors.get("optimizer", [])) + optimizer_tensors(optimizer)
    return measure_tensors(tensors)


def total_bytes(snapshot: Mapping[str, int], categories: Iterable[str] = PARAM_GRAD_OPTIMIZER) -> int:
    """Sum of the given categories of one snapshot (default: parameters + gradients + optimizer)."""
    return sum(snapshot.get(c, 0) for c in categories)


class MemoryRecorder:
    """Snapshots at the engine's events: `events` (= engine.timeline), `peak` per category, `peak_total`."""

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.engine = engine
        self.optimizer = optimizer
        if not isinstance(getattr(engine, "timeline", None), list):
            engine.timeline = []
        self.events: list[tuple[str, dict[str, int]]] = engine.timeline
        self.peak: dict[str, int] = {}
        self.peak_total = 0  # max over events of params + grads + optimizer
        self.peak_label = ""

    def record(self, label: str) -> dict[str, int]:
        snap = measure(self.engine, self.optimizer)
        self.events.append((label, snap))
        for c, b in snap.items():
            self.peak[c] = max(self.peak.get(c, 0), b)
        t = total_bytes(snap)
        if t > self.peak_total:
            self.peak_total, self.peak_label = t, label
        return snap

    def reset(self) -> None:
        """Forget the events and peaks (call at the start of the step you want to look at)."""
        self.events.clear()
        self.peak.clear()
        self.peak_total, self.peak_label = 0, ""


def attach(engine: Any, optimizer: torch.optim.Optimizer | None = None) -> MemoryRecorder:
    """Start recording `engine`'s events; returns the recorder (also at `engine.memory_recorder`)."""
    recorder = MemoryRecorder(engine, optimizer)
    engine.memory_recorder = recorder
    return recorder


def detach(engine: Any) -> None:
    engine.memory_recorder = None


def record_event(engine: Any, label: str) -> None:
    """Engines call this at each event; it costs nothing when no recorder is attached."""
    recorder = getattr(engine, "memory_recorder", None)
    if recorder is not None:
        recorder.record(label)


_STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}
# which stage shards what (ZeRO's P_os, P_os+g, P_os+g+p): each model state is sharded from this stage on
SHARDED_FROM_STAGE = {"optimizer": 1, "grads": 2, "params": 3}
_OPTIMIZER_STATE = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 1}  # state tensors per param


def stage_index(stage: int | str) -> int:
    """0..3 from 0..3, "DDP", "ZeRO-1", "zero_2", "ZeRO-3" or "FSDP" (case, "-" and "_" ignored)."""
    s = _STAGES.get(stage.lower().replace("-", "").replace("_", ""), -1) if isinstance(stage, str) else stage
    if isinstance(s, bool) or s not in (0, 1, 2, 3):
        raise ValueError(f"unknown ZeRO stage {stage!r}: use 0-3 or one of DDP, ZeRO-1, ZeRO-2, ZeRO-3, FSDP")
    return int(s)


def zero_formula(
    numel: int,
    world_size: int,
    stage: int | str,
    bytes_per_param: int = 4,
    optimizer: str = "adam",
    gathered_numel: int = 0,
) -> dict[str, float]:
    """ZeRO's model-state bytes per rank (arXiv:1910.02054 section 5.1), fp32 by default.

    stage: 0 = DDP, 1 = optimizer state sharded, 2 = + gradients, 3 = + parameters (FSDP).
    gathered_numel: for stage 3, the parameters of the largest unit, held gathered together with
    their gradient while that unit runs (the FSDP paper's extra; 0 leaves it out).
    Returns bytes for "params", "grads", "optimizer", "gathered" and their "total".
    """
    s = stage_index(stage)
    if numel < 0 or world_size < 1:
        raise ValueError(f"need numel >= 0 and world_size >= 1, got {numel}, {world_size}")
    if optimizer.lower() not in _OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(_OPTIMIZER_STATE)}, got {optimizer!r}")
    n, psi, b = world_size, numel, bytes_per_param
    k = _OPTIMIZER_STATE[optimizer.lower()] * b  # K bytes of optimizer state per parameter
    per_rank = {"params": psi * b, "grads": psi * b, "optimizer": psi * k}  # replicated (DDP)
    out = {state: v / n if s >= SHARDED_FROM_STAGE[state] else v for state, v in per_rank.items()}
    out["gathered"] = 2 * gathered_numel * b if s >= SHARDED_FROM_STAGE["params"] else 0
    out["total"] = sum(out.values())
    return out
