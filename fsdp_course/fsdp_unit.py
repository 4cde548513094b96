"""One FSDP unit: its flat parameter(s), and the life cycle unshard -> compute -> reshard.

PyTorch FSDP (arXiv:2304.11277, section 3) splits a model into units; each unit's parameters form
one FlatParameter (see flat_param.py) of which every rank keeps one shard.  Around the unit's
computation:

  pre_forward   -> unshard():  all-gather the shards into the full flat buffer, point the module's
                               attributes at views of it                        (forward)
  post_forward  -> reshard():  free the gathered storage for real (untyped_storage().resize_(0));
                               hook the outputs so that backward reaches pre_backward
                               (reshard_after_forward=False: stay gathered, skip the next gather)
  pre_backward  -> unshard():  gather again: autograd's saved views see the refilled storage
  post_backward -> reduce-scatter the unit's gradient (mean over ranks) into the local shard's
                               .grad, then reshard()                            (backward)

The names and the two state enums follow FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_common.py
and _fsdp_param_group.py), so the last lesson can map this class onto `fully_shard` line by line.

Glossary: *shard* = this rank's `(padded_numel // N,)` chunk, an `nn.Parameter` the optimizer steps;
*full* = the gathered `(padded_numel,)` buffer whose storage exists only while the unit is unsharded;
*views* = the original parameter shapes cut out of `full`.  Between uses the module's attributes
hold `ShardedAway` placeholders that explain themselves instead of reading freed memory.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.overrides import resolve_name

from fsdp_course.flat_param import FlatParamLayout
from fsdp_course.memory import record_event


class ShardedState(Enum):
    SHARDED = auto()  # only the local shard exists
    UNSHARDED = auto()  # the full flat parameter is gathered


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedAway(torch.Tensor):
    """A placeholder tensor: metadata (shape, dtype, device) works, any computation raises `note`."""

    _METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "ndim", "dim", "size",
                           "numel", "is_floating_point"})
    note: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        parts = (resolve_name(func) or "").split(".")
        if len(parts) >= 3 and parts[:2] == ["torch", "Tensor"] and parts[2] in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        note = next((a.note for a in args if isinstance(a, ShardedAway)), "sharded by FSDP")
        raise RuntimeError(note)

    def __repr__(self) -> str:  # printing must not raise
        return f"ShardedAway({self.note})"


def sharded_away(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, note: str,
                 device: torch.device | str = "cpu") -> ShardedAway:
    base = torch.zeros((), dtype=dtype, device=device).expand(shape)  # 1 element of storage, any shape
    t = torch.Tensor._make_subclass(ShardedAway, base)
    t.note = note
    return t


class FlatParamHandle:
    """One flat parameter of a unit: the layout, the local shard and the gathered buffer."""

    def __init__(self, layout: FlatParamLayout, shard: nn.Parameter,
                 locations: list[list[tuple[nn.Module, str]]]) -> None:
        self.layout = layout
        self.shard = shard  # (padded_numel // world_size,) local shard, an nn.Parameter
        self.requires_grad = shard.requires_grad
        self.full = torch.empty(layout.padded_numel, dtype=layout.dtype, device=shard.device)
        self.full.untyped_storage().resize_(0)  # (padded_numel,) gathered; no storage while sharded
        self.full.requires_grad_(self.requires_grad)  # a leaf: the views' gradients add up in .grad
        self.locations = locations  # per parameter: every (module, attribute) that names it
        self.placeholders = [
            sharded_away(info.shape, layout.dtype,
                         f"'{info.name}' is sharded by FSDP: outside its unit's forward/backward only "
                         "the local shard exists. Read full values with fsdp.full_state_dict() "
                         "(on every rank) or inside forward.")
            for info in layout.infos
        ]

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def alloc_and_gather(self, ctx: Any) -> None:
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        # .data: write without bumping the version counter autograd checks on saved views
        ctx.all_gather(self.shard.detach(), out=self.full.data)  # (padded_numel,)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)  # the memory is returned now, not at garbage collection

    def set_attributes(self, tensors: list[torch.Tensor]) -> None:
        for places, t in zip(self.locations, tensors, strict=True):
            for module, attr in places:
                setattr(module, attr, t)


class FSDPUnit:
    """The unit's state machine. `engine` is the FSDP object (context, no_sync flag, events)."""

    def __init__(self, name: str, module: nn.Module, handles: list[FlatParamHandle], engine: Any) -> None:
        self.name = name  # module path, "" for the root
        self.label = name or "root"
        self.module = module
        self.handles = handles
        self.engine = engine
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.grads_reduced = False  # this backward
        self.reshard_after_forward = True  # False: keep the gathered parameters from forward to backward
        for h in handles:
            h.set_attributes(h.placeholders)
            if h.requires_grad:  # fires once per backward, when all of the unit's grads are summed
                h.full.register_post_accumulate_grad_hook(self._make_post_backward(h))

    # -- the two primitives ---------------------------------------------------------------------
    def unshard(self) -> None:
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        for h in self.handles:
            h.alloc_and_gather(self.engine.ctx)
        self.sharded_state = ShardedState.UNSHARDED
        self._event("unshard")

    def reshard(self, handles: list[FlatParamHandle] | None = None) -> None:
        for h in self.handles if handles is None else handles:
            h.free()
            h.set_attributes(h.placeholders)
        if not any(h.gathered for h in self.handles):
            self.sharded_state = ShardedState.SHARDED
        self._event("reshard")

    def _event(self, what: str) -> None:
        """A point on the memory timeline, e.g. "pre_backward: unshard layers.0"."""
        record_event(self.engine, f"{self.training_state.name.lower()}: {what} {self.label}")

    # -- forward --------------------------------------------------------------------------------
    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.unshard()
        for h in self.handles:  # fresh views each forward: their grad_fn leads to h.full's .grad
            h.set_attributes(h.layout.unflatten(h.full))

    def post_forward(self, outputs: Any) -> None:
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        # else: stay gathered for backward, which needs the unit next (FSDP2 does so for its root unit:
        # the last to run forward is the first to run backward); saves one all-gather per step
        self.training_state = TrainingState.IDLE
        register_grad_hooks(outputs, lambda: self.pre_backward())

    # -- backward -------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        """Runs when the gradient of one of the unit's outputs is ready, before the unit's backward."""
        self.engine._on_backward_start()
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self.training_state = TrainingState.PRE_BACKWARD
            self.unshard()

    def _make_post_backward(self, handle: FlatParamHandle) -> Callable[[torch.Tensor], None]:
        return lambda full: self.post_backward(handle)

    def post_backward(self, handle: FlatParamHandle) -> None:
        """The unit's gradient is complete in handle.full.grad: reduce-scatter it, then reshard."""
        self.training_state = TrainingState.POST_BACKWARD
        self._event("grads ready")
        if self.engine.sync_grads:
            self.reduce_grad(handle)
        frozen_still_needed = [h for h in self.handles if h is not handle]
        self.reshard([handle] if frozen_still_needed else None)  # frozen: freed at the end

    def reduce_grad(self, handle: FlatParamHandle) -> None:
        """Mean over ranks of the unsharded gradient, keeping this rank's chunk (accumulates)."""
        grad = handle.full.grad
        unused_here = grad is None  # the unit took no part in this backward on this rank
        if unused_here:  # still take part in the collective (other ranks may have used it)
            grad = torch.zeros_like(handle.full, memory_format=torch.contiguous_format)
        local = self.engine.ctx.reduce_scatter(grad, op="mean")  # (padded_numel // N,)
        handle.full.grad = None  # frees the unsharded gradient
        if unused_here and not local.any():
            pass  # unused here, and a zero chunk (unused everywhere): leave .grad None, as one process
        elif handle.shard.grad is None:
            handle.shard.grad = local
        else:
            handle.shard.grad += local
        self.grads_reduced = True
        self._event("reduce_scatter")

    def finish_backward(self) -> None:
        """End of backward: reduce what was not reduced (unused units), reshard everything."""
        if self.engine.sync_grads and not self.grads_reduced:
            for h in self.handles:
                if h.requires_grad:
                    self.reduce_grad(h)
        if self.sharded_state is ShardedState.UNSHARDED:
            self.reshard()
        self.training_state = TrainingState.IDLE
        self.grads_reduced = False


def register_grad_hooks(outputs: Any, fn: Callable[[], None]) -> None:
    """Call fn() when the gradient of any tensor in `outputs` (nested tuples/lists/dicts) arrives."""
    if isinstance(outputs, torch.Tensor):
        if outputs.requires_grad:
            outputs.register_hook(lambda grad: fn())
    elif isinstance(outputs, (tuple, list)):
        for o in outputs:
            register_grad_hooks(o, fn)
    elif isinstance(outputs, dict):
        for o in outputs.values():
            register_grad_hooks(o, fn)
