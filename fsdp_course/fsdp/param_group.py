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
                     ranks; HSDP: then all-reduce the chunk, mean over the replicate group) into the
                     shard's .grad and free it; when the gradient of the unit's inputs
                     arrives (the unit's backward is over): free the frozen flat parameter as well
  finalize_backward  at the end of the whole backward: reduce what was not reduced (a unit unused on
                     this rank), reshard everything, back to IDLE

Activation checkpointing: a forward recomputed during backward runs FSDP's forward hooks while the unit is in
PRE_BACKWARD (`recomputing`). The hooks (api.py) decide it, as FSDP2's `FSDPState._pre_forward` / `_post_forward`
do (_fsdp_state.py: "the pre-backward hook is responsible for the unshard", "the post-backward hook is responsible
for the reshard"): instead of pre_forward they only make sure the unit is gathered, and they skip post_forward; the
recomputation uses the gather pre_backward made, and nothing is resharded in the middle of the unit's backward. A
checkpoint that spans several units recomputes the earlier ones before their own backward: they are gathered again
then, and stay gathered until their backward (FSDP2's `post_forward` does not reshard during backward): memory, not
another all-gather.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_course.fsdp.common import RegisterPostBackward, ShardedState, TrainingState
from fsdp_course.fsdp.flat_param import FlatParamHandle
from fsdp_course.fsdp.policy import MixedPrecision
from fsdp_course.hooks import weak_method

__all__ = ["CommContext", "FSDPUnit", "Observer", "Span"]


@dataclass(frozen=True)
class Span:
    """One unit's compute in one pass, in time.perf_counter() seconds: from the end of its pre-forward (pre-backward)
    hook to the start of its post-forward hook (to its gradient being ready). With the ledger's records, which carry
    the start and end of every collective, it draws the overlap of communication and compute."""

    unit: str
    phase: str  # "forward" | "backward"
    start: float
    end: float


class Observer:
    """What a unit reports as it runs, for measurement only: the algorithm never reads it back. These methods do
    nothing; FSDP records through its own observer (api.py: `fsdp.timeline` and `fsdp.trace`)."""

    def event(self, label: str) -> None:
        """A point on the memory timeline, e.g. "pre_backward: unshard layers.0"."""

    def compute_begins(self, unit: FSDPUnit) -> None:
        """`unit`'s pre-forward (pre-backward) hook is done, prefetches issued: its compute starts now."""

    def compute_ends(self, unit: FSDPUnit, phase: str) -> None:
        """`unit`'s compute in `phase` ("forward" | "backward") ends now: a `Span` since `compute_begins`, if any."""


def in_backward() -> bool:
    """Autograd is running a backward now (torch's `_fsdp_common.is_bw`)."""
    return torch._C._current_graph_task_id() != -1


class CommContext:
    """What the units of one FSDP share: the reduce-scatters in flight (FSDP2's `FSDPCommContext`).

    `reduce_in_flight=0` waits for each reduce-scatter at once; 1 leaves it running while autograd computes the next
    unit's gradients, and waits for it when the next one is issued or when the backward ends."""

    def __init__(self, reduce_in_flight: int = 0) -> None:
        self.reduce_in_flight = reduce_in_flight
        self._reduces: deque[tuple[Callable[[], None], torch.Tensor]] = deque()

    def reduce_issued(self, finish: Callable[[], None], grad: torch.Tensor) -> None:
        """A reduce-scatter of `grad` was issued; `finish()` waits for it and adds the result to the shard's .grad."""
        self._reduces.append((finish, grad))
        while len(self._reduces) > self.reduce_in_flight:
            self._reduces.popleft()[0]()

    def wait_reduces(self) -> None:
        while self._reduces:
            self._reduces.popleft()[0]()

    def in_flight(self) -> list[torch.Tensor]:
        """The unsharded gradients whose reduce-scatter has not been waited for: still alive (memory)."""
        return [grad for _, grad in self._reduces]


class FSDPUnit:
    """One unit's state machine over its flat parameters (`handles`: the trainable one, then a frozen one).

    `ctx` issues the collectives; `observer` receives the points of the memory timeline and the compute spans
    (`records_spans=False`: none of this unit's own, e.g. FSDP's root unit, whose passes enclose every other unit's).
    """

    def __init__(self, name: str, module: nn.Module, handles: list[FlatParamHandle], ctx: Any, *,
                 reshard_after_forward: bool = True, mp_policy: MixedPrecision | None = None,
                 comm: CommContext | None = None, replicate: Any = None, observer: Observer | None = None,
                 records_spans: bool = True) -> None:
        self.name = name  # module path, "" for the root
        self.label = name or "root"
        self.module = module
        self.handles = handles
        self.ctx = ctx
        self.replicate = replicate  # HSDP: the replicate group's context, which all-reduces the reduced shard
        self.reshard_after_forward = reshard_after_forward  # False: stay gathered from forward to backward
        self.reduce_grads = True  # False: keep unsharded gradients (set_requires_gradient_sync(False))
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.observer = observer or Observer()
        self.records_spans = records_spans
        self.mp_policy = mp_policy or MixedPrecision()
        self.comm = comm or CommContext()
        self._pending: list[Any] = []  # all-gathers issued with async_op=True (a prefetch), not waited for yet
        self._reduced: set[int] = set()  # indices of the handles reduced in this backward
        post_backward = weak_method(self.post_backward)  # the hook must not keep this unit (and its group) alive
        for i, h in enumerate(handles):
            h.set_attributes(h.placeholders)
            if h.requires_grad:  # fires once per backward, when all of the flat parameter's grads are summed
                h.unsharded.register_post_accumulate_grad_hook(lambda t, i=i: post_backward(i))

    # -- the two primitives ---------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """All-gather every flat parameter that is not gathered yet (in the compute dtype: mixed precision).

        `async_op=True` (a prefetch) only issues the all-gathers: the buffers are allocated now, and the next
        `unshard()` waits for them. Without it, returns once every flat parameter is gathered."""
        gathered = False
        for h in self.handles:
            if not h.is_unsharded:
                work = self.ctx.all_gather(h.all_gather_input(), out=h.alloc(), async_op=async_op)  # (padded_numel,)
                if async_op:
                    self._pending.append(work)
                gathered = True
        if not async_op:
            self.wait_for_unshard()
        self.sharded_state = ShardedState.UNSHARDED
        if gathered:
            self._event("unshard")

    def prefetch(self, phase: str) -> None:
        """Issue this unit's all-gather now, without waiting (another unit's hook calls it, `phase` names the pass)."""
        if self.sharded_state is ShardedState.SHARDED and not self._pending:
            self.unshard(async_op=True)
            self._event("prefetch", phase)

    def wait_for_unshard(self) -> None:
        for work in self._pending:
            work.wait()
        self._pending.clear()

    def reshard(self, handles: list[FlatParamHandle] | None = None) -> None:
        """Free the given flat parameters (default: all); the module's attributes become placeholders."""
        self.wait_for_unshard()  # never free a buffer an all-gather still writes into
        for h in self.handles if handles is None else handles:
            h.free()
        if not any(h.is_unsharded for h in self.handles):
            self.sharded_state = ShardedState.SHARDED
        self._event("reshard")

    def use_unsharded_views(self) -> None:
        """Point the module at fresh views of the unsharded buffers (their grad_fn leads to `h.unsharded`'s .grad)."""
        for h in self.handles:
            h.use_unsharded_views()

    def _event(self, what: str, phase: str | None = None) -> None:
        """A point on the memory timeline, e.g. "pre_backward: unshard layers.0"."""
        self.observer.event(f"{phase or self.training_state.name.lower()}: {what} {self.label}")

    def compute_begins(self) -> None:
        """The pre-forward (pre-backward) hook is done, prefetches issued: the unit's compute starts now."""
        if self.records_spans:
            self.observer.compute_begins(self)

    # -- forward --------------------------------------------------------------------------------
    @property
    def recomputing(self) -> bool:
        """A forward now is a recomputation during this unit's backward (activation checkpointing): FSDP's hooks then
        skip pre_forward / post_forward (api.py)."""
        return self.training_state is TrainingState.PRE_BACKWARD

    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.use_unsharded_views()  # fresh views each forward

    def post_forward(self) -> None:
        self.observer.compute_ends(self, "forward")
        if in_backward():
            # a forward recomputed during backward by a checkpoint that spans this unit, before this unit's own
            # backward: stay gathered until that backward (FSDP2's post_forward: `if not is_bw(): reshard()`), which
            # costs memory, not another all-gather
            self.training_state = TrainingState.IDLE
            return
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.reshard()
        # else: stay gathered for backward, which needs the unit next (FSDP2 does so for its root unit:
        # the last to run forward is the first to run backward); saves one all-gather per step
        self.training_state = TrainingState.IDLE

    def register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Route the unit's inputs that require grad through `RegisterPostBackward` (FSDP2 does the same)."""
        if not torch.is_grad_enabled():
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
        self.observer.compute_ends(self, "backward")
        self.training_state = TrainingState.POST_BACKWARD
        self._event("grads ready")
        if self.reduce_grads:
            self.reduce_grad(index)
        else:
            self._keep_unreduced(h)
        self.reshard([h])

    def _keep_unreduced(self, h: FlatParamHandle) -> None:
        """No reduction this backward: with a reduce dtype wider than the compute dtype, the gradient accumulates in
        the reduce dtype (as FSDP2 does), else it stays in `.unsharded.grad`, where autograd adds the next one."""
        grad, reduce_dtype = h.unsharded.grad, self.mp_policy.grad_reduce_dtype(h.layout.dtype)
        if grad is None or grad.dtype == reduce_dtype:
            return
        h.accumulated = grad.to(reduce_dtype) if h.accumulated is None else h.accumulated.add_(grad)
        h.unsharded.grad = None

    def _inputs_grad_ready(self) -> None:
        """The unit's backward is over: the frozen flat parameter (no gradient hook of its own) is freed too."""
        self.observer.compute_ends(self, "backward")
        frozen = [h for h in self.handles if not h.requires_grad and h.is_unsharded]
        if frozen:
            self.reshard(frozen)

    def reduce_grad(self, index: int) -> None:
        """Mean over ranks of the unsharded gradient (in the reduce dtype), keeping this rank's chunk, added to the
        shard's `.grad` in the shard's dtype. With `comm.reduce_in_flight` > 0 the reduce-scatter runs on while
        backward goes on, and the addition happens when it is waited for."""
        h = self.handles[index]
        grad, reduce_dtype = h.unsharded.grad, self.mp_policy.grad_reduce_dtype(h.layout.dtype)
        if h.accumulated is not None:  # what no_sync backwards accumulated in the reduce dtype
            grad = h.accumulated if grad is None else h.accumulated.add_(grad)
            h.accumulated = None
        unused_here = grad is None  # the unit took no part in this backward on this rank
        if unused_here:  # still take part in the collective (other ranks may have used it)
            grad = torch.zeros(h.layout.padded_numel, dtype=reduce_dtype, device=h.shard.device)
        elif grad.dtype != reduce_dtype:
            grad = grad.to(reduce_dtype)
        async_op, phase = self.comm.reduce_in_flight > 0, self.training_state.name.lower()
        work = self.ctx.reduce_scatter(grad, op="mean", async_op=async_op)  # (padded_numel // N,)
        h.unsharded.grad = None  # the unsharded gradient lives on only as the reduce-scatter's input
        self._reduced.add(index)

        def finish() -> None:
            local = work.wait() if async_op else work
            if self.replicate is not None:  # HSDP: mean across the replicas of this shard (FSDP2's order)
                self.replicate.all_reduce(local, op="mean")
            local = h.grad_to_host(local)  # CPU offload: a host copy, beside the shard (else `local` itself)
            if local.dtype != h.shard.dtype:
                local = local.to(h.shard.dtype)
            if unused_here and not local.any():
                pass  # unused here, and a zero chunk (unused everywhere): leave .grad None, as one process
            elif h.shard.grad is None:
                h.shard.grad = local
            else:
                h.shard.grad += local
            self._event("reduce_scatter", phase)

        if async_op:
            self.comm.reduce_issued(finish, grad)
        else:
            finish()

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
        self.wait_for_unshard()
        for h in self.handles:
            if h.requires_grad and self.reduce_grads:
                h.unsharded.grad = None
                h.accumulated = None
            h.free()
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self._reduced.clear()
