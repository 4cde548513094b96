"""One FSDP unit: its flat parameter(s), and the life cycle unshard -> compute -> reshard.

PyTorch FSDP (arXiv:2304.11277, section 3) splits a model into units; each unit's parameters form one
flat parameter (flat_param.py) of which every rank keeps one shard. FSDP2 calls the unit an
`FSDPParamGroup` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py); this class plays its part,
and the method names are its names. The FSDP object (api.py, FSDP2's `FSDPState`) installs the hooks and
calls these methods:

  pre_forward        unshard(): all-gather the shards into the unsharded buffer; the module's
                     attributes become views of it                                    (forward)
  post_forward       reshard(): free the unsharded storage for real (untyped_storage().resize_(0));
                     reshard_after_forward=False keeps it gathered for backward (FSDP2's root)
  pre_backward       unshard() again (autograd's saved views see the refilled storage) and point the
                     attributes at views, so that a forward recomputed by activation checkpointing
                     finds the parameters                                              (backward)
  post_backward      per flat parameter, when its gradient is complete: reduce-scatter it (mean over
                     ranks) into the shard's .grad and free it; when the gradient of the unit's inputs
                     arrives (the unit's backward is over): free the frozen flat parameter as well
  finalize_backward  at the end of the whole backward: reduce what was not reduced (a unit unused on
                     this rank), reshard everything, back to IDLE

Activation checkpointing: a forward recomputed during backward runs pre_forward / post_forward while the
unit is in PRE_BACKWARD. pre_forward then only makes sure the unit is gathered, and post_forward returns at
once, as FSDP2's `FSDPState._pre_forward` / `_post_forward` do (_fsdp_state.py: "the pre-backward hook is
responsible for the unshard", "the post-backward hook is responsible for the reshard"): the recomputation uses
the gather pre_backward made, and nothing is resharded in the middle of the unit's backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_course.fsdp.common import RegisterPostBackward, ShardedState, TrainingState
from fsdp_course.fsdp.flat_param import FlatParamHandle

__all__ = ["FSDPUnit"]


class FSDPUnit:
    """One unit's state machine over its flat parameters (`handles`: the trainable one, then a frozen one).

    `ctx` issues the collectives; `on_event(label)` receives the points of the memory timeline.
    """

    def __init__(self, name: str, module: nn.Module, handles: list[FlatParamHandle], ctx: Any, *,
                 reshard_after_forward: bool = True, on_event: Callable[[str], None] | None = None) -> None:
        self.name = name  # module path, "" for the root
        self.label = name or "root"
        self.module = module
        self.handles = handles
        self.ctx = ctx
        self.reshard_after_forward = reshard_after_forward  # False: stay gathered from forward to backward
        self.reduce_grads = True  # False: keep unsharded gradients (set_requires_gradient_sync(False))
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self._on_event = on_event
        self._reduced: set[int] = set()  # indices of the handles reduced in this backward
        for i, h in enumerate(handles):
            h.set_attributes(h.placeholders)
            if h.requires_grad:  # fires once per backward, when all of the flat parameter's grads are summed
                h.unsharded.register_post_accumulate_grad_hook(lambda t, i=i: self.post_backward(i))

    # -- the two primitives ---------------------------------------------------------------------
    def unshard(self) -> None:
        """All-gather every flat parameter that is not gathered yet."""
        gathered = False
        for h in self.handles:
            if not h.is_unsharded:
                self.ctx.all_gather(h.shard.detach(), out=h.alloc())  # (padded_numel,)
                gathered = True
        self.sharded_state = ShardedState.UNSHARDED
        if gathered:
            self._event("unshard")

    def reshard(self, handles: list[FlatParamHandle] | None = None) -> None:
        """Free the given flat parameters (default: all); the module's attributes become placeholders."""
        for h in self.handles if handles is None else handles:
            h.free()
        if not any(h.is_unsharded for h in self.handles):
            self.sharded_state = ShardedState.SHARDED
        self._event("reshard")

    def _event(self, what: str) -> None:
        """A point on the memory timeline, e.g. "pre_backward: unshard layers.0"."""
        if self._on_event is not None:
            self._on_event(f"{self.training_state.name.lower()}: {what} {self.label}")

    # -- forward --------------------------------------------------------------------------------
    @property
    def recomputing(self) -> bool:
        """A forward now is a recomputation during this unit's backward (activation checkpointing)."""
        return self.training_state is TrainingState.PRE_BACKWARD

    def pre_forward(self) -> None:
        if not self.recomputing:
            self.training_state = TrainingState.FORWARD
        self.unshard()  # when recomputing: a no-op, unless a post_backward has already freed a flat parameter
        for h in self.handles:  # fresh views each forward: their grad_fn leads to h.unsharded's .grad
            h.use_unsharded_views()

    def post_forward(self) -> None:
        if self.recomputing:
            return
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        # else: stay gathered for backward, which needs the unit next (FSDP2 does so for its root unit:
        # the last to run forward is the first to run backward); saves one all-gather per step
        self.training_state = TrainingState.IDLE

    def register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the unit's inputs that require grad through `RegisterPostBackward` (FSDP2 does the same)."""
        if self.recomputing or not torch.is_grad_enabled():
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not where:  # e.g. token ids: the frozen flat parameter is freed by finalize_backward
            return args, kwargs
        routed = RegisterPostBackward.apply(self._inputs_grad_ready, *(leaves[i] for i in where))
        for i, t in zip(where, routed, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, spec)

    # -- backward -------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        """Runs when the gradient of one of the unit's outputs is ready, before the unit's backward."""
        self.training_state = TrainingState.PRE_BACKWARD
        self.unshard()
        for h in self.handles:
            if h.is_unsharded:
                h.use_unsharded_views()

    def post_backward(self, index: int) -> None:
        """Flat parameter `index` has its whole gradient in `.unsharded.grad`: reduce-scatter it, then free it."""
        h = self.handles[index]
        self.training_state = TrainingState.POST_BACKWARD
        self._event("grads ready")
        if self.reduce_grads:
            self.reduce_grad(index)
        self.reshard([h])

    def _inputs_grad_ready(self) -> None:
        """The unit's backward is over: the frozen flat parameter (no gradient hook of its own) is freed too."""
        frozen = [h for h in self.handles if not h.requires_grad and h.is_unsharded]
        if frozen:
            self.reshard(frozen)

    def reduce_grad(self, index: int) -> None:
        """Mean over ranks of the unsharded gradient, keeping this rank's chunk (accumulates)."""
        h = self.handles[index]
        grad = h.unsharded.grad
        unused_here = grad is None  # the unit took no part in this backward on this rank
        if unused_here:  # still take part in the collective (other ranks may have used it)
            grad = torch.zeros_like(h.unsharded, memory_format=torch.contiguous_format)
        local = self.ctx.reduce_scatter(grad, op="mean")  # (padded_numel // N,)
        h.unsharded.grad = None  # frees the unsharded gradient
        if unused_here and not local.any():
            pass  # unused here, and a zero chunk (unused everywhere): leave .grad None, as one process
        elif h.shard.grad is None:
            h.shard.grad = local
        else:
            h.shard.grad += local
        self._reduced.add(index)
        self._event("reduce_scatter")

    def finalize_backward(self) -> None:
        """End of backward: reduce what was not reduced (a unit unused on this rank), reshard everything."""
        if self.reduce_grads:
            for i, h in enumerate(self.handles):
                if h.requires_grad and i not in self._reduced:
                    self.reduce_grad(i)
        if self.sharded_state is ShardedState.UNSHARDED:
            self.reshard()
        self.training_state = TrainingState.IDLE
        self._reduced.clear()

    def reset(self) -> None:
        """Forget a backward that raised: free what it gathered and the partial unsharded gradients."""
        for h in self.handles:
            if h.requires_grad and self.reduce_grads:
                h.unsharded.grad = None
            h.free()
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self._reduced.clear()
