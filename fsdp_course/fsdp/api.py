"""FSDP from scratch: ZeRO-3 (arXiv:1910.02054) the way PyTorch FSDP (arXiv:2304.11277) builds it.

`FSDP(module, ctx, wrap={nn.TransformerEncoderLayer})` turns every instance of a `wrap` class into
its own unit and everything else into the root unit (`wrap=None`: the whole model is one unit, the
article's pitfall 5.3 "nothing is really sharded": the whole model is gathered at once; a `wrap` class
that makes no unit, such as the model's own class or one it does not contain, warns).  Per unit
one flat parameter, padded to a multiple of the world size, of which each rank keeps one shard
(flat_param.py); the unit's life cycle is in param_group.py, the checkpoints in state_dict.py.

What the article's Java trainer does, and what changes here:
  - it broadcasts rank 0's parameters, then slices the flat buffer without padding: kept (the
    broadcast), fixed (the padding);
  - it gathers the whole model once before forward and keeps it: here each unit is gathered just
    before it runs and freed right after, in forward and again in backward;
  - it clips each shard by its own norm (`shardedGrad.norm()`): wrong, the norm must be global;
    `clip_grad_norm_` all-reduces the squared norms first, as torch.nn.utils.clip_grad_norm_ would
    on one process;
  - pitfall 5.4 (optimizer built before wrapping): here such an optimizer fails loudly at step().

Rules it needs: the same control flow on every rank (same units used in the same order), and
`loss.backward()` (not torch.autograd.grad), since gradients are collected from `.grad`.
A parameter unused in a step inside a unit that was used gets a zero gradient, not None (its
slice of the flat gradient is zero, as in PyTorch FSDP's flat parameters), so weight decay still
moves it; a whole unit unused on every rank keeps `.grad` None, as on one process.

Meta-device init (deferred initialization, arXiv:2304.11277 section 3.1): a module built on the
`meta` device has shapes but no values, so no rank ever holds the whole model.  FSDP then builds
each layout from the shapes alone, allocates only the local shard, skips the broadcast, and fills
the shard from `init`, which yields the full tensors of one piece at a time (meta_init.materialize):

  FSDP(meta_model, ctx, wrap=..., init=lambda m: materialize(m, seed))
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_course.fsdp import state_dict as fsdp_state_dict
from fsdp_course.fsdp.common import ShardedState, TrainingState, sharded_away
from fsdp_course.fsdp.flat_param import CopyCounter, FlatParamHandle, FlatParamLayout, check_same_dtype
from fsdp_course.fsdp.param_group import CommContext, FSDPUnit, Observer, Span
from fsdp_course.fsdp.policy import MixedPrecision, OffloadPolicy, cast_floating
from fsdp_course.holders import holds
from fsdp_course.hooks import queue_after_backward, register_grad_hooks
from fsdp_course.memory import HOST, record_event

__all__ = ["FSDP", "MixedPrecision", "OffloadPolicy", "ShardedState", "TrainingState"]

STALE_OPTIMIZER = (
    "this optimizer was built before FSDP wrapped the model: its parameters are the original "
    "tensors, now emptied (their values moved into FSDP's flat shards), so step() would train "
    "nothing. Build the optimizer after wrapping: torch.optim.AdamW(fsdp.parameters(), ...) "
    "(the article's pitfall 5.4)."
)


class FSDP(nn.Module):
    """Fully sharded data parallel over the rank context `ctx`; `parameters()` are the local shards.

    A real `module`: rank 0's values are broadcast.  A `module` on the meta device needs `init`: a
    callable that, given a meta copy of the module, yields (piece name, {state_dict name: full tensor})
    one piece at a time, e.g. `lambda m: meta_init.materialize(m, seed)`; every rank keeps its slice of
    each piece and drops the rest, so the extra memory is one piece, never the whole model.

    `reshard_after_forward=True` (FSDP2's default) frees every wrapped unit after its forward and gathers it
    again in backward; False keeps them gathered from forward to backward (ZeRO-2's memory, one all-gather
    fewer per unit and step).  `reshard_root_after_forward=True` (the course's default) treats the root unit
    the same way: 3 Psi (N-1)/N bytes per rank and step.  False does what `fully_shard` does with its root:
    the root finishes forward last and starts backward first, so it stays gathered in between, which saves
    one all-gather of the root per step (train.py uses this).

    `mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`: fp32 shards (the master
    copy the optimizer steps), all-gather and compute in bf16, gradients reduce-scattered in fp32 (policy.py).

    `prefetch=k` (default 0): each unit's hook issues the all-gathers of the next k units without waiting for them
    (async), so they run while this unit computes: in forward in the order the previous forward used the units
    (the first forward has none to follow), in backward in the reverse of the order this step's forwards ended
    (FSDP2's post_forward_order); and each
    reduce-scatter runs on while autograd computes the next unit's gradients, waited for when the next one is issued
    and at the end of backward. The price: k more units gathered (FSDP2's `set_modules_to_forward_prefetch` /
    `set_modules_to_backward_prefetch`, and its implicit backward prefetch of one unit). It assumes every step uses
    the units in the same order. `fsdp.trace` holds the last step's compute spans (`Span`); with the ledger's times
    of every collective they draw the overlap (the root unit has none: its passes enclose every other unit's).

    `mesh=ctx.mesh(replicate=R, shard=S)` (runtime/mesh.py): HSDP, FSDP2's `fully_shard(model, mesh=2-D mesh)`.
    The flat parameters are padded to a multiple of S and sharded over the shard group (`self.ctx` is then
    `mesh.shard`; `self.world_ctx` the whole world, which broadcasts the initial values): all-gathers and
    reduce-scatters (mean) run inside the shard group, then the reduced shard is all-reduced (mean) across the
    replicate group; the clipping norm is summed over the shard group only (replicas hold equal shards). Each of
    the N ranks still trains on its own slice of the global batch.

    `offload_policy=OffloadPolicy()` (policy.py, torch's `CPUOffloadPolicy`): the shards, their gradients and
    the optimizer state (built on `parameters()`) live on the host; each all-gather's input is the shard copied to
    the device, each reduce-scattered gradient chunk is copied back; `fsdp.copies` counts them (a `CopyCounter`) and
    `fsdp.memory_pools` tells the memory tracker which categories are host memory.

    Activation checkpointing (`torch.utils.checkpoint`, non-reentrant) works inside and around wrapped
    modules; frozen parameters (`requires_grad=False`) get their own flat parameter per unit, freed when the
    unit's backward is over; a backward that raised is forgotten at the next forward.
    """

    @holds(consumes=True)
    def __init__(self, module: nn.Module, ctx: Any, *, wrap: set[type[nn.Module]] | None = None,
                 init: Callable[[nn.Module], Iterable[tuple[str, dict[str, torch.Tensor]]]] | None = None,
                 reshard_after_forward: bool = True, reshard_root_after_forward: bool = True,
                 mp_policy: MixedPrecision | None = None, prefetch: int = 0, mesh: Any = None,
                 offload_policy: OffloadPolicy | None = None) -> None:
        super().__init__()
        if mp_policy is not None and not isinstance(mp_policy, MixedPrecision):
            raise TypeError(f"mp_policy must be a fsdp_course.MixedPrecision, e.g. MixedPrecision(param_dtype="
                            f"torch.bfloat16, reduce_dtype=torch.float32), got {type(mp_policy).__name__}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be the number of units to gather ahead (0, 1, 2 ...), got {prefetch!r}")
        on_meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
        if on_meta and init is None:
            raise ValueError("a module on the meta device has no values: pass init=, e.g. "
                             "init=lambda m: meta_init.materialize(m, seed)")
        template = copy.deepcopy(module) if on_meta else None  # shapes only: costs no storage
        self.mesh = _check_mesh(mesh, ctx)
        self.world_ctx = ctx  # the whole world: the initial broadcasts
        if mesh is not None:  # HSDP: shards, all-gathers, reduce-scatters and the clipping norm in the shard group
            ctx = mesh.shard
        self.module = module
        self.ctx = ctx
        self.timeline: list[tuple[str, dict[str, int]]] = []
        self.memory_recorder = None
        self.observer = Recorder(self)  # what the units report: memory points and compute spans (`trace`)
        self.mp_policy = mp_policy or MixedPrecision()
        self.prefetch = prefetch
        if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
            raise TypeError("offload_policy must be a fsdp_course OffloadPolicy() (fsdp/policy.py), got "
                            f"{type(offload_policy).__name__}")
        self.offload_policy = offload_policy
        self.copies = CopyCounter()  # host <-> device copies (offload only)
        self.memory_pools = dict.fromkeys(("sharded_params", "sharded_grads", "optimizer"), HOST) \
            if offload_policy is not None else {}
        self.comm = CommContext(reduce_in_flight=1 if prefetch else 0)
        self._forward_order: list[FSDPUnit] = []  # this step's units, in the order their forward began
        self._last_forward_order: list[FSDPUnit] = []
        self._post_forward_order: list[FSDPUnit] = []  # this step's units, in the order their forward ended
        self._callback_queued = False
        self.state_dict_keys = list(module.state_dict().keys())  # what full_state_dict() returns
        wrap_types = (wrap,) if isinstance(wrap, type) else tuple(wrap or ())
        if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in wrap_types):
            raise TypeError(f"wrap must be a set of nn.Module classes (e.g. {{nn.Linear}}), got {wrap!r}")
        self.units: list[FSDPUnit] = []
        self._originals: list[nn.Parameter] = []
        with torch.no_grad():
            for unit_module, unit_name, uses in _group_by_unit(_find_parameters(module, wrap_types), module):
                handles = self._build_handles(unit_name, uses)
                is_root = unit_module is module
                self.units.append(FSDPUnit(
                    unit_name, unit_module, handles, ctx, replicate=mesh.replicate if mesh is not None else None,
                    reshard_after_forward=reshard_root_after_forward if is_root else reshard_after_forward,
                    mp_policy=self.mp_policy, comm=self.comm, observer=self.observer,
                    records_spans=not is_root))  # the root's forward and backward enclose every other unit's
            _warn_unused_wrap(module, wrap_types, self.units)
            if template is not None:
                self._fill_from_pieces(init(template))  # type: ignore[misc]  (init checked above)
            else:
                for _, buf in module.named_buffers():  # buffers: replicated, rank 0's values
                    self.world_ctx.broadcast(buf.data)
        self.flat_params = nn.ParameterList([h.shard for h in self.handles])
        self.root_unit = next((u for u in self.units if u.module is module), None)
        self._trip_stale_optimizers()
        for unit in self.units:
            if unit is not self.root_unit:
                unit.module.register_forward_pre_hook(
                    lambda m, args, kwargs, u=unit: self._pre_forward(u, args, kwargs), with_kwargs=True)
                unit.module.register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))

    def _build_handles(self, unit_name: str, uses: list[ParamUse]) -> list[FlatParamHandle]:
        check_same_dtype([(u.name, u.param) for u in uses], f"FSDP unit '{unit_name or 'root'}'")
        handles = []
        for requires_grad in (True, False):  # frozen parameters get their own flat parameter
            group = [u for u in uses if u.param.requires_grad == requires_grad]
            if not group:
                continue
            layout = FlatParamLayout.build([(u.name, u.param) for u in group], self.ctx.world_size)
            unique = list({id(u.param): u.param for u in group}.values())
            if unique[0].is_meta:  # no values yet: _fill_from_pieces writes them into the shard
                local = torch.zeros(layout.shard_numel, dtype=layout.dtype, device=self.ctx.device)
            else:
                flat = layout.flatten(p.detach() for p in unique).to(unique[0].device)  # (padded_numel,)
                self.world_ctx.broadcast(flat, src=0)  # initial values come from rank 0, as in the article
                local = layout.shard(flat, self.ctx.rank).clone()
            shard = nn.Parameter(local, requires_grad=requires_grad)  # (padded_numel // N,)
            index = {id(p): i for i, p in enumerate(unique)}
            locations: list[list[tuple[nn.Module, str]]] = [[] for _ in unique]
            for u in group:
                locations[index[id(u.param)]].append((u.owner, u.attr))
                u.owner._parameters.pop(u.attr, None)  # the module no longer owns it
            for p in unique:  # free the originals; a stale optimizer trips over them
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                self._originals.append(p)
            handles.append(FlatParamHandle(layout, shard, locations,
                                           compute_dtype=self.mp_policy.gather_dtype(layout.dtype),
                                           offload=self.copies if self.offload_policy is not None else None))
        return handles

    def _fill_from_pieces(self, pieces: Iterable[tuple[str, dict[str, torch.Tensor]]]) -> None:
        """Copy this rank's slice of each full tensor into its shard; buffers are kept whole."""
        slices: dict[str, list[tuple[torch.Tensor, Any]]] = {}  # name -> [(shard, ShardPiece)]
        for unit in self.units:
            for h in unit.handles:
                aliases = {i.name: i.aliases for i in h.layout.infos}
                for piece in h.layout.pieces(self.ctx.rank):
                    for name in (piece.name, *aliases[piece.name]):
                        slices.setdefault(name, []).append((h.shard, piece))
        owners = {name: name.rpartition(".") for name, b in self.module.named_buffers() if b.is_meta}
        seen: set[str] = set()
        for _, full in pieces:  # one piece of the model at a time
            for name, value in full.items():
                seen.add(name)
                for shard, piece in slices.get(name, []):
                    n = piece.param_end - piece.param_start
                    shard.data[piece.shard_offset : piece.shard_offset + n].copy_(
                        value.reshape(-1)[piece.param_start : piece.param_end])
                if name in owners:  # a buffer: every rank keeps all of it
                    prefix, _, attr = owners[name]
                    self.module.get_submodule(prefix)._buffers[attr] = value.to(self.ctx.device).clone()
            del full
        names = [i.name for h in self.handles for i in h.layout.infos]
        missing = sorted(set(names + list(owners)) - seen)
        if missing:
            raise RuntimeError(f"init yielded no values for {missing}: they would stay zero")

    # -- forward / backward: the hooks (FSDP2's FSDPState, _fsdp_state.py) --------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._callback_queued or any(u.training_state is not TrainingState.IDLE for u in self.units):
            self._forget_failed_backward()
        if self._forward_order:  # a new step: the order the last one used the units guides forward prefetch
            self._last_forward_order, self._forward_order, self._post_forward_order = self._forward_order, [], []
            self.trace.clear()
        if self.root_unit is not None:
            args, kwargs = self._pre_forward(self.root_unit, args, kwargs)
        else:  # no root unit, no pre-forward: cast the inputs here, as it would
            args, kwargs = self._cast_inputs(args, kwargs)
        out = self.module(*args, **kwargs)
        if self.root_unit is not None:
            out = self._post_forward(self.root_unit, out)
        else:  # no root unit: the final callback is queued by the first gradient that arrives
            register_grad_hooks(out, self._root_pre_backward)
        return out

    def _pre_forward(self, unit: FSDPUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if unit.recomputing:  # activation checkpointing, inside the unit's backward (param_group.py): only gather
            unit.unshard()  # a no-op, unless a post_backward has already freed a flat parameter
            unit.use_unsharded_views()
            return self._cast_inputs(args, kwargs)
        unit.pre_forward()
        if unit not in self._forward_order:
            self._forward_order.append(unit)
        self._prefetch_after(unit, self._last_forward_order, "forward")
        args, kwargs = self._cast_inputs(args, kwargs)
        args, kwargs = unit.register_post_backward(args, kwargs)
        unit.compute_begins()
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not self.mp_policy.cast_forward_inputs:
            return args, kwargs
        return cast_floating(self.mp_policy.param_dtype, (args, kwargs))

    def _post_forward(self, unit: FSDPUnit, out: Any) -> Any:
        if unit.recomputing:  # the unit's post_backward reshards it, not this hook
            return out
        unit.post_forward()
        if unit not in self._post_forward_order:
            self._post_forward_order.append(unit)
        out = cast_floating(self.mp_policy.output_dtype, out)
        if torch.is_grad_enabled():
            register_grad_hooks(out, lambda: self._pre_backward(unit))
        return out

    def _pre_backward(self, unit: FSDPUnit) -> None:
        self._root_pre_backward()
        unit.pre_backward()
        self._prefetch_after(unit, self._post_forward_order[::-1], "backward")  # backward runs in reverse
        unit.compute_begins()

    def _prefetch_after(self, unit: FSDPUnit, order: list[FSDPUnit], phase: str) -> None:
        """Issue the all-gathers of the `self.prefetch` units that follow `unit` in `order` (async)."""
        if not self.prefetch or unit not in order:
            return
        i = order.index(unit)
        for following in order[i + 1 : i + 1 + self.prefetch]:
            following.prefetch(phase)

    def _root_pre_backward(self) -> None:
        if not self._callback_queued:  # runs once, after the whole backward pass
            self._callback_queued = True
            queue_after_backward(self.finalize_backward)

    def finalize_backward(self) -> None:
        """End of a backward (autograd's final callback): every unit reduces what is left and reshards."""
        for unit in self.units:
            unit.finalize_backward()
        self.comm.wait_reduces()
        self._callback_queued = False
        self._trip_stale_optimizers()  # again: the stale optimizer's zero_grad() may have cleared them
        self.observer.event("backward done")

    def _forget_failed_backward(self) -> None:
        """A backward raised before its final callback: free what it gathered, drop partial unsharded gradients
        (the sharded `.grad` keep what was reduced, as one process keeps the gradients computed before a raise)."""
        self.comm.wait_reduces()
        for unit in self.units:
            unit.reset()
        self._callback_queued = False
        self._trip_stale_optimizers()

    def _trip_stale_optimizers(self) -> None:
        """Give the emptied original parameters a gradient that raises STALE_OPTIMIZER when used."""
        with torch._C.DisableTorchFunctionSubclass():
            for p in self._originals:
                p.grad = sharded_away((0,), p.dtype, STALE_OPTIMIZER, device=p.device)

    @property
    def trace(self) -> list[Span]:
        """The last step's compute spans, per unit and pass (none for the root unit); the next step clears it."""
        return self.observer.trace

    @property
    def handles(self) -> list[FlatParamHandle]:
        """Every flat parameter of every unit, in unit order."""
        return [h for u in self.units for h in u.handles]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward keeps each unit's unsharded gradient and accumulates into it (no reduce-scatter);
        the first backward after setting True again reduces everything accumulated (FSDP2's method name)."""
        for unit in self.units:
            unit.reduce_grads = requires_gradient_sync

    @property
    def requires_gradient_sync(self) -> bool:
        return all(u.reduce_grads for u in self.units)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """`set_requires_gradient_sync(False)` inside the block (DDP's and FSDP1's name for it)."""
        previous = self.requires_gradient_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(previous)

    # -- gradients ---------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all shards of all ranks (what one process would compute)."""
        grads = [h.shard.grad for h in self.handles if h.shard.grad is not None]
        dtype = grads[0].dtype if grads else torch.float32
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros(())
            total = self.ctx.all_reduce(local.to(dtype).reshape(1), op="max")[0]
        else:
            local = sum((g.norm(norm_type) ** norm_type for g in grads), torch.zeros((), dtype=dtype))
            total = self.ctx.all_reduce(local.reshape(1), op="sum")[0] ** (1.0 / norm_type)
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(clip_coef)
        return total

    @torch.no_grad()
    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gather the averaged gradients, keyed as module.named_parameters() (a collective)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            for h in unit.handles:
                if not h.requires_grad:
                    continue
                g = h.shard.grad if h.shard.grad is not None else torch.zeros_like(h.shard)
                full = self.ctx.all_gather(g.contiguous())  # (padded_numel,)
                for info, view in zip(h.layout.infos, h.layout.unflatten(full), strict=True):
                    out[info.name] = view.clone()
        return out

    # -- memory (engine protocol of memory.py) -----------------------------------------------------
    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        handles = self.handles
        return {
            "sharded_params": [h.shard for h in handles],
            "gathered_params": [h.unsharded for h in handles],
            "grads": [*(h.unsharded.grad for h in handles if h.unsharded.grad is not None),
                      *(h.accumulated for h in handles if h.accumulated is not None), *self.comm.in_flight()],
            "sharded_grads": [h.shard.grad for h in handles if h.shard.grad is not None],
            "buffers": list(self.module.buffers()),
        }

    def unit_numels(self) -> dict[str, int]:
        """Padded numel of every unit's flat parameter(s), by unit name ("root" for the root)."""
        return {u.label: sum(h.layout.padded_numel for h in u.handles) for u in self.units}

    # -- checkpoints (fsdp_state_dict.py) ----------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return fsdp_state_dict.full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        fsdp_state_dict.load_full_state_dict(self, state_dict)

    def save_sharded(self, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        fsdp_state_dict.save_sharded(self, directory, optimizer)

    def load_sharded(self, directory: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        fsdp_state_dict.load_sharded(self, directory, optimizer)


class Recorder(Observer):
    """What FSDP records as its units run: each memory point through `memory.record_event(fsdp, label)` (kept in
    `fsdp.timeline` once `memory.attach(fsdp)` is called), each compute span in `trace`."""

    def __init__(self, fsdp: FSDP) -> None:
        self.fsdp = fsdp
        self.trace: list[Span] = []
        self._starts: dict[FSDPUnit, float] = {}  # time.perf_counter() when each unit's compute began

    def event(self, label: str) -> None:
        record_event(self.fsdp, label)

    def compute_begins(self, unit: FSDPUnit) -> None:
        self._starts[unit] = time.perf_counter()

    def compute_ends(self, unit: FSDPUnit, phase: str) -> None:
        start = self._starts.pop(unit, None)
        if start is not None:  # the first end after a beginning: a unit's backward ends at each flat parameter
            self.trace.append(Span(unit.label, phase, start, time.perf_counter()))


def _check_mesh(mesh: Any, ctx: Any) -> Any:
    """`mesh` must be this rank's `ctx.mesh(replicate=R, shard=S)` (runtime/mesh.py), or None."""
    if mesh is None:
        return None
    if not all(hasattr(mesh, a) for a in ("shard", "replicate", "world")):
        raise TypeError(f"mesh must come from ctx.mesh(replicate=R, shard=S), got {type(mesh).__name__}")
    if mesh.world is not ctx:
        raise ValueError("mesh was made from another rank context: pass mesh=ctx.mesh(replicate=R, shard=S) "
                         "of the ctx given to FSDP")
    return mesh


def _warn_unused_wrap(root: nn.Module, wrap: tuple[type, ...], units: list[FSDPUnit]) -> None:
    """Warn about a wrap class that made no unit: a typo or the root's own class would silently leave
    the whole model in the root unit (pitfall 5.3)."""
    for cls in wrap:
        if any(u.module is not root and isinstance(u.module, cls) for u in units):
            continue
        why = ("the model itself is one, and the model is always the root unit" if isinstance(root, cls)
               else f"no submodule with parameters is a {cls.__name__}")
        result = "the whole model is one unit, gathered at once (pitfall 5.3)" if len(units) == 1 else "it does nothing"
        warnings.warn(f"FSDP: wrap class {cls.__name__} makes no unit of this {type(root).__name__} ({why}), so "
                      f"{result}. Pass the classes of the blocks to shard one at a time, e.g. wrap={{nn.Linear}} "
                      "or wrap={nn.TransformerEncoderLayer} (or wrap=None for one unit on purpose).",
                      stacklevel=4)  # past this function, FSDP.__init__ and its @holds wrapper: the caller


@dataclass(frozen=True)
class ParamUse:
    """One place a parameter is used: `owner.attr` is `param`, named `name`, inside FSDP unit `unit`."""

    unit: nn.Module  # the nearest wrapped ancestor, else the root
    unit_name: str  # its module path, "" for the root
    name: str
    owner: nn.Module
    attr: str
    param: nn.Parameter


def _find_parameters(root: nn.Module, wrap: tuple[type, ...]) -> list[ParamUse]:
    """Every use of a parameter, in named_parameters() order but keeping repeats (tied weights)."""
    found: list[ParamUse] = []

    def walk(mod: nn.Module, prefix: str, unit: nn.Module, unit_name: str) -> None:
        if mod is not root and wrap and isinstance(mod, wrap):
            unit, unit_name = mod, prefix.rstrip(".")
        for attr, p in mod._parameters.items():
            if p is not None:
                found.append(ParamUse(unit, unit_name, prefix + attr, mod, attr, p))
        for child_name, child in mod._modules.items():
            if child is not None:
                walk(child, f"{prefix}{child_name}.", unit, unit_name)

    walk(root, "", root, "")
    return found


def _group_by_unit(found: list[ParamUse], root: nn.Module) -> list[tuple[nn.Module, str, list[ParamUse]]]:
    """Group the uses by unit; a parameter used by several units (tied across units) goes to the root unit,
    which stays gathered around all of them (FSDP's lowest common ancestor rule)."""
    units_of: dict[int, set[int]] = {}
    for use in found:
        units_of.setdefault(id(use.param), set()).add(id(use.unit))
    groups: dict[int, tuple[nn.Module, str, list[ParamUse]]] = {id(root): (root, "", [])}
    for use in found:
        unit, unit_name = (root, "") if len(units_of[id(use.param)]) > 1 else (use.unit, use.unit_name)
        groups.setdefault(id(unit), (unit, unit_name, []))[2].append(use)
    return [g for g in groups.values() if g[2]]
