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

A device budget (`attach(engine, optimizer, capacity=64 * 2**20)`) turns the recorder into a small
accelerator: every recorded point (and the moment of attaching) adds up the bytes alive in the
"device" pool, and when they pass `capacity` it raises `DeviceOutOfMemory`, a `torch.OutOfMemoryError`
(what `torch.cuda` raises, `torch.cuda.OutOfMemoryError is torch.OutOfMemoryError`) whose message is
written the way the CUDA caching allocator writes its own ("Tried to allocate X MiB. ... has a total
capacity of Y MiB of which Z MiB is free"), and names the category that grew past the budget and what
would shrink it. An engine that keeps some categories in host memory (FSDP with
`offload_policy=OffloadPolicy()`, ZeRO-Offload's and torch's `CPUOffloadPolicy`'s placement) lists them in
`engine.memory_pools` ({category: "host"}); host bytes are counted apart and never against the budget.
The check runs at the recorded points only: between two of them a tensor may come and go unseen.
`recorder.track_activations()` (a `torch.autograd.graph.saved_tensors_hooks` context, per thread)
adds the tensors autograd saves for backward as the "activations" category (device).
Without a capacity and without tracked activations the recorder behaves exactly as before.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Mapping
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


def measure(engine: Any, optimizer: torch.optim.Optimizer | None = None,
            extra: Mapping[str, Iterable[torch.Tensor]] | None = None) -> dict[str, int]:
    """Bytes alive right now on this rank, by category (see the engine protocol in the module doc).

    `extra` adds categories after the engine's (a storage already counted there is not counted again)."""
    tensors = dict(engine.memory_tensors())
    tensors["optimizer"] = list(tensors.get("optimizer", [])) + optimizer_tensors(optimizer)
    for category, more in (extra or {}).items():
        tensors[category] = list(tensors.get(category, [])) + list(more)
    return measure_tensors(tensors)


def total_bytes(snapshot: Mapping[str, int], categories: Iterable[str] = PARAM_GRAD_OPTIMIZER) -> int:
    """Sum of the given categories of one snapshot (default: parameters + gradients + optimizer)."""
    return sum(snapshot.get(c, 0) for c in categories)


HOST, DEVICE = "host", "device"  # the two memory pools

CATEGORY_NAMES = {  # how an out-of-memory message names a category
    "params": "parameters", "sharded_params": "parameters (sharded)", "gathered_params": "gathered parameters",
    "grads": "gradients", "sharded_grads": "gradients (sharded)", "optimizer": "optimizer state",
    "buffers": "buffers", "activations": "activations",
}

REMEDIES = {  # what shrinks each category on the device
    "params": "shard the parameters (ZeRO-3 / FSDP) over more ranks, or offload them to the host "
              "(FSDP(..., offload_policy=OffloadPolicy()))",
    "sharded_params": "more ranks (each keeps 1/N), or offload the shards to the host "
                      "(FSDP(..., offload_policy=OffloadPolicy()))",
    "gathered_params": "smaller FSDP units (wrap finer: more ranks do not shrink a gathered unit), no prefetch, "
                       "or a narrower param_dtype (MixedPrecision)",
    "grads": "shard the gradients (ZeRO-2 or ZeRO-3) over more ranks; under FSDP these are a gathered unit's full "
             "gradient until its reduce-scatter: smaller units (wrap finer)",
    "sharded_grads": "more ranks (each keeps 1/N), or offload the sharded gradients to the host "
                     "(FSDP(..., offload_policy=OffloadPolicy()))",
    "optimizer": "shard the optimizer state (ZeRO-1 and up) over more ranks, offload it to the host "
                 "(FSDP(..., offload_policy=OffloadPolicy())), or an optimizer with less state (SGD)",
    "buffers": "fewer or smaller buffers: they are replicated on every rank",
    "activations": "a smaller batch per rank, or activation checkpointing (torch.utils.checkpoint)",
}

MiB = 2**20


def pool_of(engine: Any, category: str) -> str:
    """"host" or "device": where `engine` keeps `category` (`engine.memory_pools`, default: the device)."""
    return (getattr(engine, "memory_pools", None) or {}).get(category, DEVICE)


def pool_bytes(snapshot: Mapping[str, int], engine: Any, pool: str = DEVICE) -> int:
    """Bytes of `snapshot` in one pool ("device" or "host") of `engine`, all categories (buffers, activations...)."""
    return sum(b for c, b in snapshot.items() if pool_of(engine, c) == pool)


class DeviceOutOfMemory(torch.OutOfMemoryError):
    """The device budget was passed at a recorded point: what torch.cuda raises, as a subclass.

    Attributes: `rank`, `label` (the recorded point), `category` (the one that grew most), `requested`
    (bytes that appeared since the previous point), `capacity`, `free` (capacity minus what was in use
    before), `device` and `host` (bytes by category in each pool at this point)."""

    def __init__(self, message: str, *, rank: int, label: str, category: str, requested: int, capacity: int,
                 free: int, device: dict[str, int], host: dict[str, int]) -> None:
        super().__init__(message)
        self.rank, self.label, self.category = rank, label, category
        self.requested, self.capacity, self.free = requested, capacity, free
        self.device, self.host = device, host


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.2f} MiB"


class MemoryRecorder:
    """Snapshots at the engine's events: `events` (= engine.timeline), `peak` per category, `peak_total`.

    With a `capacity` (bytes per rank): `peak_device` / `peak_host` (bytes per pool, all categories) and the
    budget check, which raises `DeviceOutOfMemory` (see the module doc)."""

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer | None = None,
                 capacity: int | None = None) -> None:
        if not callable(getattr(engine, "memory_tensors", None)):
            raise TypeError(f"attach takes an engine (DDP, ZeRO1, ZeRO2, FSDP), got a {type(engine).__name__}, which "
                            "has no memory_tensors(): wrap the model first, e.g. attach(FSDP(model, ctx), optimizer)")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0):
            raise ValueError(f"capacity must be a number of bytes (an int >= 0, e.g. 64 * 2**20), got {capacity!r}")
        self.engine = engine
        self.optimizer = optimizer
        self.capacity = capacity
        if not isinstance(getattr(engine, "timeline", None), list):
            engine.timeline = []
        self.events: list[tuple[str, dict[str, int]]] = engine.timeline
        self.peak: dict[str, int] = {}
        self.peak_total = 0  # max over events of params + grads + optimizer
        self.peak_label = ""
        self.peak_device = 0  # max over events of everything in the device pool
        self.peak_device_label = ""
        self.peak_host = 0
        self._activations: list[weakref.ref] | None = None  # tensors saved for backward, once tracking began
        self._previous: dict[str, int] = {}  # the device pool at the last point that passed the check
        self.step_hook: Any = None  # with a budget: the optimizer's step post-hook that records "optimizer step"

    @property
    def rank(self) -> int:
        ctx = getattr(self.engine, "ctx", None)
        return int(getattr(ctx, "rank", 0))

    def snapshot(self) -> dict[str, int]:
        """Bytes by category now (with "activations" once `track_activations` has been used), recording nothing."""
        if self._activations is None:
            return measure(self.engine, self.optimizer)
        alive = [t for t in (ref() for ref in self._activations) if t is not None]
        self._activations[:] = [weakref.ref(t) for t in alive]
        return measure(self.engine, self.optimizer, extra={"activations": alive})

    def record(self, label: str) -> dict[str, int]:
        snap = self.snapshot()
        if self.events and self.events[-1] == (label, snap):
            return snap  # recorded already (the optimizer's step hook, then the same event by hand)
        self.events.append((label, snap))
        for c, b in snap.items():
            self.peak[c] = max(self.peak.get(c, 0), b)
        t = total_bytes(snap)
        if t > self.peak_total:
            self.peak_total, self.peak_label = t, label
        device = pool_bytes(snap, self.engine, DEVICE)
        if device > self.peak_device:
            self.peak_device, self.peak_device_label = device, label
        self.peak_host = max(self.peak_host, pool_bytes(snap, self.engine, HOST))
        self.check(label, snap)
        return snap

    def check(self, label: str, snap: Mapping[str, int]) -> None:
        """Raise `DeviceOutOfMemory` if the device pool of `snap` passes the capacity (no capacity: nothing)."""
        device = {c: b for c, b in snap.items() if pool_of(self.engine, c) == DEVICE}
        host = {c: b for c, b in snap.items() if pool_of(self.engine, c) == HOST}
        if self.capacity is None:
            return
        used = sum(device.values())
        if used <= self.capacity:
            self._previous = device
            return
        grew = {c: b - self._previous.get(c, 0) for c, b in device.items() if b > self._previous.get(c, 0)}
        if not grew:  # nothing grew (the capacity was lowered): blame the largest
            grew = {max(device, key=device.__getitem__): 0}
        category = max(grew, key=grew.__getitem__)
        requested = sum(grew.values())
        free = max(self.capacity - (used - requested), 0)
        name = CATEGORY_NAMES.get(category, category)
        largest = max(device, key=device.__getitem__)
        also = "" if largest == category else (
            f" The largest category on the device is {CATEGORY_NAMES.get(largest, largest)}, {_mib(device[largest])}; "
            f"what shrinks it: {REMEDIES.get(largest, 'fewer bytes in this category')}.")
        in_use = ", ".join(f"{CATEGORY_NAMES.get(c, c)} {_mib(b)}" for c, b in device.items() if b)
        held = ", ".join(f"{CATEGORY_NAMES.get(c, c)} {_mib(b)}" for c, b in host.items() if b) or "nothing"
        message = (
            f"Device out of memory (the course's budget). Tried to allocate {_mib(requested)} for {name} at "
            f"'{label}'. Rank {self.rank} has a total capacity of {_mib(self.capacity)} of which {_mib(free)} "
            f"is free. Including this allocation, {_mib(used)} would be in use: {in_use}. Host memory (not "
            f"counted against the budget): {held}. The {name} overflowed the device; what would help: "
            f"{REMEDIES.get(category, 'fewer bytes in this category')}.{also}")
        raise DeviceOutOfMemory(message, rank=self.rank, label=label, category=category, requested=requested,
                                capacity=self.capacity, free=free, device=device, host=host)

    @contextlib.contextmanager
    def track_activations(self) -> Iterator[None]:
        """Count what autograd saves for backward inside the block (run forward in it) as "activations".

        `torch.autograd.graph.saved_tensors_hooks` is per thread: enter it in the rank's own thread. The tensors
        are held weakly: they stop counting when the graph that saved them is freed (after backward)."""
        if self._activations is None:
            self._activations = []
        saved = self._activations

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def reset(self) -> None:
        """Forget the events and peaks (call at the start of the step you want to look at)."""
        self.events.clear()
        self.peak.clear()
        self.peak_total, self.peak_label = 0, ""
        self.peak_device, self.peak_device_label, self.peak_host = 0, "", 0


def attach(engine: Any, optimizer: torch.optim.Optimizer | None = None,
           capacity: int | None = None) -> MemoryRecorder:
    """Start recording `engine`'s events; returns the recorder (also at `engine.memory_recorder`).

    `capacity` (bytes per rank, e.g. 64 * 2**20): the device budget. What the engine holds already is
    checked at once (it may raise `DeviceOutOfMemory` here, as moving a model to a full GPU does), then
    every recorded point; past that first check, a budget needs the `optimizer` whose state it counts, and each of
    its `step()` is a recorded point too ("optimizer step": where its state appears)."""
    recorder = MemoryRecorder(engine, optimizer, capacity)  # checks `capacity`
    previous = getattr(engine, "memory_recorder", None)
    engine.memory_recorder = recorder
    try:
        if capacity is not None:
            recorder.check("attach", recorder.snapshot())
            if optimizer is None and "optimizer" not in engine.memory_tensors():
                raise ValueError(
                    "a device budget needs the optimizer: attach(engine, optimizer, capacity=...). What the engine "
                    "holds fits; without the optimizer its state (AdamW: two tensors the size of the parameters) "
                    "would be left out of every later check (ZeRO1 and ZeRO2 own theirs: they count it themselves)")
    except BaseException:
        engine.memory_recorder = previous  # a budget that failed at once records nothing afterwards
        raise
    if getattr(previous, "step_hook", None) is not None:  # attached again: the old recorder's hook goes
        previous.step_hook.remove()
    if capacity is not None and optimizer is not None:  # the state appears in step(): checked there, not at the
        recorder.step_hook = optimizer.register_step_post_hook(  # engine's next event (a step late)
            lambda *_: recorder.record("optimizer step") if engine.memory_recorder is recorder else None)
    return recorder


def detach(engine: Any) -> None:
    recorder = getattr(engine, "memory_recorder", None)
    if getattr(recorder, "step_hook", None) is not None:
        recorder.step_hook.remove()
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


OFFLOADED = ("params", "grads", "optimizer")  # what CPU offload keeps on the host: the shards and their state


def budget_formula(
    numel: int,
    world_size: int,
    stage: int | str,
    *,
    offload: bool = False,
    bytes_per_param: int = 4,
    optimizer: str = "adam",
    gathered_numel: int = 0,
    activation_bytes: float = 0,
) -> dict[str, float]:
    """Peak bytes per rank by pool: ZeRO's formula (`zero_formula`) split between "device" and "host".

    offload (stage 3 only, FSDP's `OffloadPolicy`): the sharded parameters, gradients and optimizer state
    (16 Psi / N with fp32 Adam) are host memory; the device keeps the gathered unit and the activations.
    Returns {"device", "host"} plus `zero_formula`'s entries and "activations"."""
    out = zero_formula(numel, world_size, stage, bytes_per_param, optimizer, gathered_numel)
    if offload and stage_index(stage) != 3:
        raise ValueError("offload here is FSDP's (ZeRO-3): the replicated states of stages 0-2 stay on the device")
    host = sum(out[s] for s in OFFLOADED) if offload else 0.0
    out["activations"] = activation_bytes
    out["host"] = host
    out["device"] = out["total"] - host + activation_bytes
    return out


def offload_copy_formula(numel: int, world_size: int, bytes_per_param: int = 4,
                         gathers_per_step: int = 2) -> dict[str, float]:
    """Bytes copied per rank and step under CPU offload: each all-gather reads the host shard (`gathers_per_step`
    times: forward and backward when units reshard after forward), each gradient chunk comes back once.
    `numel` is the padded total (every unit's flat parameter, a multiple of N)."""
    shard = numel * bytes_per_param / world_size
    return {"h2d": gathers_per_step * shard, "d2h": shard}


def saved_by_shape(saved: Mapping[int, tuple[int, tuple[int, ...], str]]) -> str:
    """What autograd saved for backward (`{storage: (bytes, shape, dtype)}`, each storage once) as text: the count
    and bytes in all, then one line per shape and dtype, the most bytes first."""
    kinds: dict[tuple[tuple[int, ...], str], list[int]] = {}
    for nbytes, shape, dtype in saved.values():
        kinds.setdefault((shape, dtype), []).append(nbytes)
    lines = [f"{len(saved)} saved tensors, {sum(v[0] for v in saved.values())} bytes; by shape:"]
    for (shape, dtype), sizes in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {len(sizes):>2} x {str(shape):<16} {dtype:<8} {sum(sizes):>8} bytes")
    return "\n".join(lines)
